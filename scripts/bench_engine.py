"""Offline engine benchmark: throughput, TTFT and step latency at a given concurrency.

  python scripts/bench_engine.py [--model CONVERTED] [--concurrency 1,8,32] [--num-requests N]
         [--prompt-len 128] [--output-len 64] [--device cpu] [--dtype bfloat16] [--tp 1]

Without --model a tiny checkpoint is generated and converted (INT8, tp 1) in a temp dir. Each
concurrency level keeps exactly C requests in flight (a new one is added when one finishes)
until --num-requests (default 2*C) are done; prompts are random ids (no prefix sharing:
prefix caching off), outputs run to --output-len (ignore_eos). Figures: output tokens/s
(decode throughput incl. prefill time), mean/p50/p95 TTFT (from add to the first token), and
mean step time split into steps with and without a prefill chunk, and the engine's host part of
a decode step (step time minus the runner's forward: scheduling, block bookkeeping, building the
step, sampling, detokenizing), which a GPU step does not hide.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backfit.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from backfit.engine.sampling_params import SamplingParams  # noqa: E402


def tiny_model(root: Path) -> Path:
    from backfit.convert.run import convert
    from backfit.synthetic import write_checkpoint
    src = write_checkpoint(root / "orig", "flash", seed=0, small_vocab=True)
    convert(src, root / "int8", tp=1, progress=False)
    return root / "int8"


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_level(engine: LLMEngine, C: int, n: int, plen: int, olen: int, vocab: int, seed: int):
    r = random.Random(seed)
    sp = SamplingParams(max_tokens=olen, temperature=0, ignore_eos=True)
    added, first, t_add, done = 0, {}, {}, 0
    step_t = {"prefill": [], "decode": []}
    out_tokens = 0

    def add():
        nonlocal added
        rid = engine.add_request([r.randrange(3, vocab) for _ in range(plen)], sp)
        t_add[rid] = time.perf_counter()
        added += 1

    fwd = []                                   # runner forward time of the current step
    real_forward = engine.ranks.forward

    def timed_forward(step):
        t = time.perf_counter()
        out = real_forward(step)
        fwd.append(time.perf_counter() - t)
        return out
    engine.ranks.forward = timed_forward
    host = []                                  # decode steps: step time - forward time
    t0 = time.perf_counter()
    while added < min(C, n):
        add()
    while done < n:
        has_prefill = any(s.num_computed < s.num_prompt for s in engine.scheduler.running) or \
            bool(engine.scheduler.waiting)
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        step_t["prefill" if has_prefill else "decode"].append(dt)
        if not has_prefill and fwd:
            host.append(dt - fwd[-1])
        fwd.clear()
        for o in outs:
            out_tokens += len(o.token_ids)
            first.setdefault(o.request_id, time.perf_counter() - t_add[o.request_id])
            if o.finished:
                done += 1
                if added < n:
                    add()
    wall = time.perf_counter() - t0
    engine.ranks.forward = real_forward
    ttft = list(first.values())
    mean = lambda xs: statistics.mean(xs) if xs else float("nan")    # noqa: E731
    return {"concurrency": C, "requests": n, "tokens_per_s": out_tokens / wall,
            "ttft_mean_ms": 1e3 * mean(ttft), "ttft_p50_ms": 1e3 * pct(ttft, 0.5),
            "ttft_p95_ms": 1e3 * pct(ttft, 0.95), "decode_step_ms": 1e3 * mean(step_t["decode"]),
            "prefill_step_ms": 1e3 * mean(step_t["prefill"]),
            "engine_host_ms": 1e3 * mean(host),       # scheduling, sampling, detokenizing
            "steps": sum(map(len, step_t.values()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    levels = [int(c) for c in a.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(a.model) if a.model else tiny_model(Path(tmp))
        engine = LLMEngine(EngineConfig(str(model), tp=a.tp, dtype=a.dtype, device=a.device,
                                        max_num_seqs=max(levels),
                                        max_num_batched_tokens=a.max_num_batched_tokens,
                                        max_model_len=a.prompt_len + a.output_len + 64,
                                        enable_prefix_caching=False))
        try:
            rows = [run_level(engine, C, a.num_requests or 2 * C, a.prompt_len, a.output_len,
                              engine.model_cfg.vocab_size, seed=C) for C in levels]
        finally:
            engine.close()
    print(f"\nengine benchmark: {model.name}, {a.device}, {a.dtype}, tp {a.tp}, threads "
          f"{torch.get_num_threads()}, prompt {a.prompt_len}, output {a.output_len}")
    print(f"{'conc':>5} {'reqs':>5} {'tok/s':>8} {'TTFT mean':>10} {'p50':>8} {'p95':>8} "
          f"{'decode step':>12} {'prefill step':>13} {'engine host':>12}")
    for r in rows:
        print(f"{r['concurrency']:>5} {r['requests']:>5} {r['tokens_per_s']:>8.1f} "
              f"{r['ttft_mean_ms']:>8.0f}ms {r['ttft_p50_ms']:>6.0f}ms {r['ttft_p95_ms']:>6.0f}ms "
              f"{r['decode_step_ms']:>10.1f}ms {r['prefill_step_ms']:>11.1f}ms "
              f"{r['engine_host_ms']:>10.2f}ms")


if __name__ == "__main__":
    main()
