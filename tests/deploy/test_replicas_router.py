"""Two `backfit serve` replicas behind the Shepherd Model Gateway (smg), as real processes on
loopback, started by scripts/replicas.py (docs/DEPLOY.md): each SDK and protocol through the one
URL, a conversation kept on the replica that caches it (read from the replicas' own /metrics),
and a replica killed mid-load. `make test-deploy` (marker `deploy`; not in `make test`: the
router wheel is ~37 MB and this file takes ~1 min after the tiny checkpoint is built)."""

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import anthropic
import openai
import pytest

pytest.importorskip("smg", reason="the router: pip install 'backfit[deploy]'")
pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parents[2]
MODEL = "deepseek-v4-flash"
MSG = [{"role": "user", "content": "Tell me about the harbour."}]
WORDS = "alpha beta gamma delta river stone cloud paper seven green quick slow".split()
SERVE = ["--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "8",
         "--block-size", "16", "--cpu-kv-cache-gib", "0.25"]


def _free_ports(n: int) -> int:
    """A port p with p .. p+n-1 free a moment ago (replica i listens on base + i)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = [socket.socket() for _ in range(n)]
            for k, s in enumerate(socks):
                s.bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port run")


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name, value in re.findall(r"^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})? (\S+)$", text, re.M):
        out[name] = out.get(name, 0.0) + float(value)
    return out


@dataclass
class Cluster:
    url: str
    replicas: list[str]
    pids: list[int]
    proc: subprocess.Popen
    lines: queue.Queue
    log_dir: Path

    def output(self) -> str:
        out = []
        while not self.lines.empty():
            out.append(self.lines.get())
        return "".join(out)


@pytest.fixture(scope="module")
def cluster(tiny_converted, tmp_path_factory):
    """scripts/replicas.py over three tiny replicas (one torch thread each: 2 cores), its
    "ready on" line parsed; at the end Ctrl-C (SIGINT) must stop everything. The last two
    tests drain replica 2 and kill replica 1; replica 0 survives."""
    base = _free_ports(3)
    front, metrics_port = _free_ports(1), _free_ports(1)
    log_dir = tmp_path_factory.mktemp("replicas")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts/replicas.py"), str(tiny_converted(1, "int8")),
         "--replicas", "3", "--port", str(front), "--replica-base-port", str(base),
         "--router-metrics-port", str(metrics_port), "--shutdown-timeout", "300",
         "--log-dir", str(log_dir), "--ready-timeout", "300", "--", *SERVE],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
    seen, end = [], time.monotonic() + 400
    while not any("ready on" in ln for ln in seen):
        assert proc.poll() is None and time.monotonic() < end, "".join(seen)
        try:
            seen.append(lines.get(timeout=1))
        except queue.Empty:
            pass
    ready = seen[-1]
    urls = re.findall(r"(http://127\.0\.0\.1:\d+) pid (\d+)", ready)
    assert f"ready on http://127.0.0.1:{front} -> 3 replicas" in ready and len(urls) == 3, ready
    c = Cluster(f"http://127.0.0.1:{front}", [u for u, _ in urls], [int(p) for _, p in urls],
                proc, lines, log_dir)
    yield c
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
    assert "replicas: stopped" in c.output()
    for pid in c.pids:                              # every replica (and its ranks) is gone
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)


def _openai(c: Cluster, timeout=120.0):
    return openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=timeout)


def test_each_sdk_and_protocol_through_the_router(cluster):
    """Chat, Responses and Messages, plain and streamed, through the one URL; the caller's
    x-request-id comes back through the router and is in the serving replica's log."""
    o = _openai(cluster)
    r = o.chat.completions.with_raw_response.create(
        model=MODEL, messages=MSG, max_tokens=8, reasoning_effort="none",
        extra_headers={"x-request-id": "deploy-chat-1"})
    chat = r.parse()
    assert r.headers["x-request-id"] == "deploy-chat-1"
    assert r.headers["x-smg-routed-worker-id"] in cluster.replicas
    assert chat.usage.completion_tokens == 8 and chat.choices[0].finish_reason == "length"
    chunks = list(o.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 8
    assert [k.choices[0].finish_reason for k in chunks if k.choices][-1] == "length"
    resp = o.responses.create(model=MODEL, input="Tell me about the harbour.",
                              max_output_tokens=8, reasoning={"effort": "none"})
    assert resp.status == "incomplete" and resp.usage.output_tokens == 8
    types = [e.type for e in o.responses.create(model=MODEL, input="Hello.", stream=True,
                                                 max_output_tokens=8)]
    assert types[0] == "response.created" and types[-1] == "response.incomplete", types
    a = anthropic.Anthropic(base_url=cluster.url, api_key="x", max_retries=0, timeout=120)
    m = a.messages.create(model=MODEL, max_tokens=8, messages=MSG,
                          thinking={"type": "disabled"})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 8
    with a.messages.stream(model=MODEL, max_tokens=8, messages=MSG) as s:
        final = s.get_final_message()
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    logs = "".join(p.read_text() for p in cluster.log_dir.glob("replica-*.log"))
    assert re.search(rf"POST /v1/chat/completions 200 \S+ s request_id=deploy-chat-1 "
                     rf"id={chat.id}", logs), logs[-2000:]


def test_a_conversation_stays_on_the_replica_that_caches_it(cluster):
    """Four three-turn conversations, each with its own long system prompt: every turn of a
    conversation runs on one replica (the one whose prompt-token counter moved), turns 2-3 read
    most of their prompt from that replica's prefix cache, and the conversations spread over
    the replicas. A round-robin router fails all three."""
    o = _openai(cluster)
    placed: dict[int, list[tuple[str, float, int]]] = {}
    for c in range(4):
        system = f"Conversation {c}. " + " ".join(WORDS[(c * 5 + k) % 12] for k in range(90))
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": "First."}]
        for turn in range(3):
            before = {u: metrics(u) for u in cluster.replicas}
            r = o.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8,
                                          reasoning_effort="none")
            after = {u: metrics(u) for u in cluster.replicas}
            ran = [u for u in cluster.replicas if after[u]["vllm:prompt_tokens_total"]
                   > before[u]["vllm:prompt_tokens_total"]]
            assert len(ran) == 1, (c, turn, ran)
            hits = after[ran[0]]["vllm:prefix_cache_hits_total"] - \
                before[ran[0]]["vllm:prefix_cache_hits_total"]
            placed.setdefault(c, []).append((ran[0], hits, r.usage.prompt_tokens))
            msgs += [{"role": "assistant", "content": r.choices[0].message.content or "."},
                     {"role": "user", "content": f"Follow-up {turn}."}]
    for c, turns in placed.items():
        assert len({u for u, _, _ in turns}) == 1, (c, turns)
        assert all(h >= 0.5 * n for _, h, n in turns[1:]), (c, turns)
    assert len({turns[0][0] for turns in placed.values()}) >= 2, placed


@dataclass
class Outcome:
    t0: float
    t1: float
    kind: str
    started: bool          # a stream that had delivered an event
    error: str | None      # the exception's class and message, None: success
    status: int | None     # the HTTP status of an APIStatusError


def _one(o, a, kind: str, k: int, i: int) -> Outcome:
    system = f"Client {k}. " + " ".join(WORDS[(k * 7 + j) % 12] for j in range(40))
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"Turn {i}."}]
    t0, started = time.monotonic(), False
    try:
        if kind == "chat":
            o.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24)
        elif kind == "chat-stream":
            for _ in o.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24,
                                               stream=True):
                started = True
        elif kind == "responses-stream":
            for _ in o.responses.create(model=MODEL, instructions=system, input=f"Turn {i}.",
                                        max_output_tokens=24, stream=True):
                started = True
        else:
            a.messages.create(model=MODEL, max_tokens=24, system=system, messages=msgs[1:])
        return Outcome(t0, time.monotonic(), kind, started, None, None)
    except Exception as e:                          # noqa: BLE001 - every failure is recorded
        return Outcome(t0, time.monotonic(), kind, started, f"{type(e).__name__}: {e}"[:300],
                       getattr(e, "status_code", None))


def _load(cluster: Cluster, target: int, hit) -> tuple[list[Outcome], float]:
    """Six clients, each with its own prefix (so all replicas get some), one request after
    another, until each has sent two after `hit()` (called once the target replica runs a
    request) -> (every outcome, when hit). Bounded in count and time; a client still running
    after that has hung."""
    o = _openai(cluster, timeout=120)
    a = anthropic.Anthropic(base_url=cluster.url, api_key="x", max_retries=0, timeout=120)
    kinds = ("chat-stream", "chat", "responses-stream", "messages")
    outcomes: list[Outcome] = []
    t_hit: list[float] = []

    def client(k: int) -> None:
        i = n_after = 0
        while n_after < 2 and i < 100 and not (t_hit and time.monotonic() > t_hit[0] + 120):
            n_after += bool(t_hit)
            outcomes.append(_one(o, a, kinds[(k + i) % 4], k, i))
            i += 1
    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(6)]
    for t in threads:
        t.start()
    end = time.monotonic() + 120
    while metrics(cluster.replicas[target])["vllm:num_requests_running"] < 1:
        assert time.monotonic() < end, "the load never reached the replica"
        time.sleep(0.05)
    hit()
    t_hit.append(time.monotonic())
    for t in threads:
        t.join(300)
    assert not [t for t in threads if t.is_alive()], "a client hung"
    return outcomes, t_hit[0]


def _wait_draining(url: str) -> None:
    end = time.monotonic() + 10
    while urllib.request.urlopen(url + "/health/live", timeout=5).read() != \
            b'{"status":"draining"}':
        assert time.monotonic() < end, "the replica did not start draining"
        time.sleep(0.01)


def _gone(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _prefix_on(cluster: Cluster, replica: int) -> str:
    """A system prompt the router places on `replica` (its x-smg-routed-worker-id)."""
    o = _openai(cluster)
    for n in range(40):
        system = f"Pinned {n}. " + " ".join(WORDS[(n + j) % 12] for j in range(60))
        r = o.chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=1, messages=[{"role": "system", "content": system},
                                                 {"role": "user", "content": "Hi."}])
        if r.headers["x-smg-routed-worker-id"] == cluster.replicas[replica]:
            return system
    raise AssertionError(f"no prefix was placed on {cluster.replicas[replica]}")


def test_a_replica_drained_mid_load(cluster):
    """SIGTERM to replica 2 (--shutdown-timeout) while six clients keep requests in flight on
    every replica, and at once three requests whose prefix the router keeps on replica 2: not
    one request fails — the drained replica's running requests finish (its log: drained,
    nothing aborted), the requests it refused with a 503 are retried by the router on the
    others, and so is everything sent later — and it exits 0."""
    pid = cluster.pids[2]
    pinned = [{"role": "system", "content": _prefix_on(cluster, 2)}]
    late: list[Outcome] = []

    def term_then_send():
        os.kill(pid, signal.SIGTERM)
        _wait_draining(cluster.replicas[2])
        o = _openai(cluster)
        for i in range(3):
            t0 = time.monotonic()
            try:
                o.chat.completions.create(model=MODEL, max_tokens=4, messages=pinned + [
                    {"role": "user", "content": f"Late {i}."}])
                late.append(Outcome(t0, time.monotonic(), "chat", False, None, None))
            except openai.APIError as e:
                late.append(Outcome(t0, time.monotonic(), "chat", False, repr(e)[:300],
                                    getattr(e, "status_code", None)))
    outcomes, t_term = _load(cluster, 2, term_then_send)
    assert [x for x in outcomes + late if x.error is not None] == []
    assert len([x for x in outcomes if x.t0 > t_term]) == 12
    assert _gone(pid, 30)
    log = (cluster.log_dir / "replica-2.log").read_text()
    assert re.search(r"draining \d+ requests", log) and \
        "shutting down (0 open streams end with an error event)" in log, log[-2000:]
    assert re.search(r"POST /v1/chat/completions 503 ", log), log[-2000:]   # refused, retried
    time.sleep(1.5)                                 # the script polls its children twice a second
    assert "replica-2 exited (0)" in cluster.output()


def test_a_replica_killed_mid_load(cluster):
    """SIGKILL replica 1 (and its process group) while six clients keep requests in flight:
    no client hangs, the only failures are streams that were already flowing (each ends with
    an error), no request gets a 5xx (nothing the router could have retried: the non-streamed
    requests in flight on it are retried elsewhere), everything sent after the kill succeeds,
    and replica 0's pools come back to empty. Runs last: the replica stays dead."""
    victim, survivor = cluster.pids[1], cluster.replicas[0]
    idle = metrics(survivor)
    outcomes, t_kill = _load(cluster, 1, lambda: os.killpg(victim, signal.SIGKILL))
    failed = [x for x in outcomes if x.error is not None]
    assert not [x for x in failed if x.status is not None and x.status >= 500], failed
    assert all(x.started and x.kind.endswith("-stream") and x.t0 < t_kill for x in failed), \
        failed
    after = [x for x in outcomes if x.t0 > t_kill]
    assert after and all(x.error is None for x in after), after
    assert len(after) == 12, outcomes
    end = time.monotonic() + 60
    while (m := metrics(survivor))["vllm:num_requests_running"] or m["vllm:num_requests_waiting"]:
        assert time.monotonic() < end, m
        time.sleep(0.2)
    assert m["backfit:num_free_blocks"] == m["backfit:num_blocks"] == idle["backfit:num_blocks"]
    assert m["backfit:num_free_slots"] == idle["backfit:num_free_slots"]
    assert m["vllm:prompt_tokens_total"] > idle["vllm:prompt_tokens_total"]
    time.sleep(1.5)                                 # the script polls its children twice a second
    assert re.search(r"replica-1 exited \(-9\)", cluster.output())
