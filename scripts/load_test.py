"""Bounded loopback load generator for `backfit serve` (server issue item 8).

N workers each keep one streaming request open for T seconds, rotating over the three
protocols (/v1/chat/completions, /v1/responses, /v1/messages); a fraction of the requests is
cancelled mid-stream (the connection is closed after a few deltas). Prompts share a few system
prefixes, so the prefix cache is exercised. Reports p50/p95 TTFT and TPOT (per request:
(t_last - t_first) / (output tokens - 1), tokens from each protocol's final usage), throughput,
error counts by kind, and the pool counters from /metrics before and after; after the run it
waits for the server to go idle and checks that every cache block and sequence slot came back.
Exit status 1 on any error or a block not returned.

    python scripts/load_test.py --url http://127.0.0.1:8000 --concurrency 32 --duration 300
    python scripts/load_test.py --serve /path/to/converted --concurrency 32 --duration 300 \\
        --serve-args "--dtype float32 --max-model-len 1024 --max-num-seqs 32"
    python scripts/load_test.py --url http://127.0.0.1:8000 --model deepseek-v4-flash \\
        --metrics-url http://127.0.0.1:8001 --metrics-url http://127.0.0.1:8002   # a router

Behind a router (docs/DEPLOY.md) --metrics-url names each replica: the pool counters are summed
over them, and the report gives each one's share of the prompt and generated tokens.

Only loopback addresses are accepted; every loop is bounded by --duration and --timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from urllib.parse import urlparse

import aiohttp

PROTOCOLS = ("chat", "responses", "messages")
# a shared preamble longer than one cache block (64 tokens by default), so the prefix cache hits
_PRE = ("You are an assistant running on backfit. Follow the user's instructions carefully, keep "
        "answers short, and say so when you do not know something. ")
SYSTEMS = [_PRE + "You are a helpful assistant.", _PRE + "Review code; answer in one line.",
           _PRE + "Reply in French, briefly, and never use lists."]
WORDS = "alpha beta gamma delta river stone cloud paper seven green quick slow".split()
POOL = ("backfit:num_blocks", "backfit:num_free_blocks", "backfit:num_free_slots",
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total", "backfit:client_disconnects_total")


def loopback_only(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        sys.exit(f"load_test: refusing {url!r}: only loopback addresses (127.0.0.0/8, ::1)")


def request_for(proto: str, rng: random.Random, max_tokens: int,
                model: str | None = None) -> tuple[str, dict]:
    system = rng.choice(SYSTEMS)
    user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 24)))
    think = rng.random() < 0.5
    if proto == "chat":
        return "/v1/chat/completions", {
            "model": model or "deepseek-v4-flash", "stream": True, "max_tokens": max_tokens,
            "stream_options": {"include_usage": True}, "reasoning_effort": None if think
            else "none", "messages": [{"role": "system", "content": system},
                                      {"role": "user", "content": user}]}
    if proto == "responses":
        return "/v1/responses", {
            "model": model or "deepseek-v4-flash", "stream": True,
            "max_output_tokens": max_tokens,
            "instructions": system, "input": user,
            "reasoning": {"effort": "high" if think else "none"}}
    return "/v1/messages", {
        "model": model or "claude-haiku-4-5", "stream": True, "max_tokens": max_tokens,
        "system": system,
        # thinking is on by default; {"type": "enabled"} without budget_tokens is not valid
        # Anthropic, and a router that checks the spec (smg) refuses it
        **({} if think else {"thinking": {"type": "disabled"}}),
        "messages": [{"role": "user", "content": user}]}


def classify(proto: str, event: str | None,
             data: dict) -> tuple[bool, int | None, bool, str | None]:
    """-> (is a token delta, output tokens if this frame carries the final usage,
    is the terminal frame, error text)."""
    if proto == "chat":
        if "error" in data:
            return False, None, False, str(data["error"].get("message"))[:200]
        if data.get("usage") and not data.get("choices"):
            return False, data["usage"]["completion_tokens"], False, None
        d = (data.get("choices") or [{}])[0].get("delta") or {}
        return bool(d.get("content") or d.get("reasoning_content") or d.get("tool_calls")), \
            None, False, None
    if proto == "responses":
        t = data.get("type", "")
        if t in ("response.completed", "response.incomplete"):
            return False, data["response"]["usage"]["output_tokens"], True, None
        if t in ("response.failed", "error"):
            return False, None, True, str(data.get("response", {}).get("error") or data)[:200]
        return t.endswith(".delta"), None, False, None
    t = data.get("type")
    if t == "error":
        return False, None, True, str(data.get("error"))[:200]
    if t == "message_delta":
        return False, data["usage"]["output_tokens"], False, None
    return t == "content_block_delta", None, t == "message_stop", None


async def one_request(session, url, proto, rng, args, stats) -> None:
    path, body = request_for(proto, rng, args.max_tokens, args.model)
    cancel_after = rng.randint(1, 5) if rng.random() < args.cancel_frac else None
    t0 = time.monotonic()
    t_first = t_last = None
    n_deltas, n_out, terminal = 0, None, False
    try:
        async with session.post(url + path, json=body,
                                timeout=aiohttp.ClientTimeout(total=args.timeout)) as r:
            if r.status != 200:
                stats["errors"][f"http {r.status}"] += 1
                stats["samples"].append(f"{proto} {r.status}: {(await r.text())[:200]}")
                return
            event = None
            async for raw in r.content:
                line = raw.decode("utf-8").rstrip("\n")
                if line.startswith("event: "):
                    event = line[7:]
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    terminal = proto == "chat"
                    break
                delta, usage, end, err = classify(proto, event, json.loads(line[6:]))
                if err is not None:
                    stats["errors"]["error event"] += 1
                    stats["samples"].append(f"{proto}: {err}")
                    return
                if delta:
                    now = time.monotonic()
                    t_first = t_first or now
                    t_last = now
                    n_deltas += 1
                    if cancel_after is not None and n_deltas >= cancel_after:
                        stats["cancelled"] += 1       # leaving the block closes the connection
                        stats["ttft"].append(t_first - t0)
                        return
                n_out = usage if usage is not None else n_out
                terminal = terminal or end
        if not terminal:
            stats["errors"]["no terminal event"] += 1
            return
    except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError, ValueError,
            KeyError) as e:
        stats["errors"][type(e).__name__] += 1
        stats["samples"].append(f"{proto}: {e!r}"[:200])
        return
    stats["ok"][proto] += 1
    stats["tokens"] += n_out or 0
    if t_first is not None:
        stats["ttft"].append(t_first - t0)
        if n_out and n_out > 1:
            stats["tpot"].append((t_last - t_first) / (n_out - 1))


async def scrape_one(session, url) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+\d.eE]+|NaN)$", line)
        if m and m.group(1) in POOL:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


async def scrape(session, urls: list[str]) -> tuple[dict[str, float], list[dict[str, float]]]:
    """The pool counters summed over the replicas, and each replica's."""
    each = [await scrape_one(session, u) for u in urls]
    return {k: sum(e.get(k, 0.0) for e in each) for k in POOL if any(k in e for e in each)}, each


async def run(args) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    conn = aiohttp.TCPConnector(limit=args.concurrency + 4)
    stats = {"ok": Counter(), "errors": Counter(), "samples": [], "cancelled": 0, "tokens": 0,
             "ttft": [], "tpot": []}
    async with aiohttp.ClientSession(headers=headers, connector=conn) as s:
        before, each0 = await scrape(s, args.metrics_url)
        t_end = time.monotonic() + args.duration

        async def worker(k: int):
            rng = random.Random(args.seed * 1000 + k)
            i = k
            while time.monotonic() < t_end:
                await one_request(s, args.url, PROTOCOLS[i % len(PROTOCOLS)], rng, args, stats)
                i += 1
        t0 = time.monotonic()
        await asyncio.gather(*(worker(k) for k in range(args.concurrency)))
        wall = time.monotonic() - t0
        (after, each1), idle_s = await scrape(s, args.metrics_url), 0.0
        while idle_s < args.idle_timeout and not (
                after.get("vllm:num_requests_running", 1) == 0
                and after.get("backfit:num_free_blocks") == after.get("backfit:num_blocks")):
            await asyncio.sleep(0.5)
            idle_s += 0.5
            after, each1 = await scrape(s, args.metrics_url)
    returned = (after.get("backfit:num_free_blocks") == after.get("backfit:num_blocks")
                == before.get("backfit:num_blocks")
                and after.get("backfit:num_free_slots") == before.get("backfit:num_free_slots"))
    pct = lambda xs, q: (statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1     # noqa: E731
                         else (xs[0] if xs else float("nan")))
    n_ok = sum(stats["ok"].values())
    report = {
        "concurrency": args.concurrency, "duration_s": round(wall, 1),
        "requests_ok": dict(stats["ok"]), "requests_cancelled": stats["cancelled"],
        "errors": dict(stats["errors"]), "error_samples": stats["samples"][:5],
        "ttft_p50_s": pct(stats["ttft"], 50), "ttft_p95_s": pct(stats["ttft"], 95),
        "tpot_p50_s": pct(stats["tpot"], 50), "tpot_p95_s": pct(stats["tpot"], 95),
        "output_tokens": stats["tokens"], "output_tok_per_s": stats["tokens"] / wall,
        "requests_per_s": (n_ok + stats["cancelled"]) / wall,
        "pool_before": before, "pool_after": after, "every_block_returned": returned}
    if len(args.metrics_url) > 1:
        report["replicas"] = {u: {k: b[k] - a.get(k, 0.0) for k in ("vllm:prompt_tokens_total",
                                                                    "vllm:generation_tokens_total")}
                              for u, a, b in zip(args.metrics_url, each0, each1)}
    print(json.dumps(report, indent=2, default=lambda x: round(x, 4)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if returned and not stats["errors"] else 1


def spawn(args) -> subprocess.Popen:
    port = urlparse(args.url).port or 8000
    cmd = [sys.executable, "-m", "backfit.cli", "serve", args.serve, "--port", str(port),
           *shlex.split(args.serve_args)]
    print("load_test: starting", " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=sys.stderr)     # stdout stays the JSON report
    end = time.monotonic() + args.ready_timeout
    import urllib.request
    while time.monotonic() < end and proc.poll() is None:
        try:
            with urllib.request.urlopen(args.url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(1)
    proc.terminate()
    sys.exit("load_test: the server did not become ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--cancel-frac", type=float, default=0.15,
                    help="fraction of requests closed after 1-5 deltas")
    ap.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    ap.add_argument("--idle-timeout", type=float, default=30.0,
                    help="seconds to wait after the run for the pool to drain")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None, help="the model every request names (default: "
                    "deepseek-v4-flash, claude-haiku-4-5 on /v1/messages); behind a router: the "
                    "served name")
    ap.add_argument("--metrics-url", action="append", default=None,
                    help="a replica whose /metrics to read (repeatable; default: --url)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the report here")
    ap.add_argument("--serve", default=None, help="start `backfit serve CONVERTED` first")
    ap.add_argument("--serve-args", default="", help="extra flags for backfit serve")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    args = ap.parse_args()
    args.metrics_url = args.metrics_url or [args.url]
    for u in (args.url, *args.metrics_url):
        loopback_only(u)
    if not (1 <= args.concurrency <= 1024 and 0 < args.duration <= 3600):
        sys.exit("load_test: --concurrency must be 1..1024 and --duration 0..3600 s")
    proc = spawn(args) if args.serve else None
    try:
        rc = asyncio.run(run(args))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    sys.exit(rc)


if __name__ == "__main__":
    main()
