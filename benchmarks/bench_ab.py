"""Same-process A/B of the runtime's switches on the decode step (4 real DeepSeek-V4-Flash
layers by default, triton kernels, CUDA graphs), on the lent GPU:

    python3 benchmarks/bench_ab.py --switch backfit.runtime.model.attention_decode:KV_BESIDE=False \
        [--switch module:NAME=value ...] [--switch module:NAME=@module:NAME] [--batches 1,8]
        [--switch "module:NAME=value;module:OTHER=value"]  (set together: one B)
        [--ctx 512] [--rounds 4] [--out ab.json] [--layers 4] [--tp-shard 1] [--experts int8|mx4]

Step-level figures move ±5 % between processes on the lent machine (2026-12-01: the same code
timed 1.06, 1.11 and 1.16 ms at batch 1 in three calls), more than most single changes are
worth, so each switch is judged inside one process: the runner's graphs are captured once with
every switch as shipped (A) and once with the switch set (B); the rounds then alternate A, B, A,
B, ... and each round times both the step (ModelRunner.forward + sync, what bench_decode.py
reports) and the replay's GPU time (CUDA events around replay(), no host part). Reported per
switch, batch and context: medians of A and B and B - A. A module-level flag read while the step
is captured (attention_decode.SIDE_STREAMS, KV_BESIDE, MAX_SPLIT, moe.SHARED_STREAM, ...) changes
the captured graph; flags read only outside the capture do nothing here. --tiny: small dims on the
CPU, torch backend, eager (a dry run of this script). --layers / --tp-shard: bench_decode.py's
(e.g. --layers 43 --tp-shard 4: one TP-4 rank's slice, collectives counted no-ops; between
processes that slice's step moved by up to ~10 % on 2026-12-02, so its A/B belongs here too);
--experts mx4: the routed experts built as mx4_e2m1 (bench_model.fill_linear; the INT8 slice
would fill an 80 GB card).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_model as bd  # noqa: E402
from bench_decode import time_forward  # noqa: E402



def parse_switch(spec: str) -> tuple[object, str, object]:
    """'package.module:NAME=value' -> (module, NAME, value); value a Python literal, or
    '@package.module:NAME' for that object (another kernel of the same signature, say)."""
    try:
        where, value = spec.split("=", 1)
        mod, name = where.split(":")
        m = importlib.import_module(mod)
        getattr(m, name)
        if value.startswith("@"):
            vmod, vname = value[1:].split(":")
            return m, name, getattr(importlib.import_module(vmod), vname)
        return m, name, ast.literal_eval(value)
    except (ValueError, ImportError, AttributeError, SyntaxError) as e:
        raise SystemExit(f"--switch {spec!r}: expected an existing module:NAME=literal or "
                         f"=@module:NAME ({e})")


def parse_switches(spec: str) -> list[tuple[object, str, object]]:
    """'a;b;...': parse_switch of each part, set together as one B."""
    return [parse_switch(part) for part in spec.split(";")]


def timed(r, graphs, mk, n: int, gpu: bool) -> tuple[float, float | None]:
    """bench_decode's step ms (forward + sync, median; n reps) and, on CUDA, the median GPU ms
    of n replays."""
    r.graphs = graphs
    step_ms = time_forward(r, mk, 2, n)
    g_ms = None
    if gpu and graphs is not None:
        size = graphs.size_for(len(mk(0).seqs))
        g, _ = graphs.graphs[size]
        e0, e1, gs = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), []
        for _ in range(n):
            e0.record()
            g.replay()
            e1.record()
            torch.cuda.synchronize()
            gs.append(e0.elapsed_time(e1))
        g_ms = statistics.median(gs)
    r.graphs = None
    return step_ms, g_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--switch", action="append", required=True, metavar="MODULE:NAME=VALUE")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tp-shard", type=int, default=1, help="TP rank 0 of K (bench_decode's)")
    ap.add_argument("--experts", choices=("int8", "mx4"), default="int8")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=4, help="A/B alternations per case")
    ap.add_argument("--steps", type=int, default=5,
                    help="timed steps per round and variant (bench_decode's reps: x4 under 50 ms)")
    ap.add_argument("--tiny", action="store_true", help="small dims on CPU (dry run)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    switches = [parse_switches(s) for s in a.switch]
    dev = "cpu" if a.tiny else "cuda"
    batches = [int(x) for x in a.batches.split(",")]
    raw = bd.raw_config(a.layers, a.tiny)
    r = bd.rank_runner(raw, dev, max(batches), a.ctx + 4, tp_shard=a.tp_shard,
                       experts=a.experts)
    bd.use_backend(r, "torch" if a.tiny else "triton")
    gpu = dev == "cuda"
    rows = []
    for sw in switches:                         # one or more (module, NAME, value) set together
        shipped = [getattr(m, n) for m, n, _ in sw]
        name = ";".join(n for _, n, _ in sw)
        value = tuple(v for *_, v in sw) if len(sw) > 1 else sw[0][2]
        ship = tuple(shipped) if len(sw) > 1 else shipped[0]

        def put(b: bool, sw=sw, shipped=shipped) -> None:       # B's values, else A's
            for (m, n, v), old in zip(sw, shipped):
                setattr(m, n, v if b else old)
        graphs_a = bd.capture_graphs(r)
        put(True)
        try:
            graphs_b = bd.capture_graphs(r)
            for B in batches:
                mk = lambda i, B=B: bd.step_input(r, B, a.ctx + i % 4, seed=i)  # noqa: E731
                res = {"A": [], "B": []}
                for _ in range(a.rounds):
                    for tag, g in (("A", graphs_a), ("B", graphs_b)):
                        put(tag == "B")                                      # eager steps too
                        res[tag].append(timed(r, g, mk, a.steps, gpu))
                row = dict(switch=";".join(f"{m.__name__}:{n}" for m, n, _ in sw),
                           shipped=repr(ship), value=repr(value), batch=B, ctx=a.ctx)
                for tag in ("A", "B"):
                    row[f"step_ms_{tag}"] = statistics.median(s for s, _ in res[tag])
                    gs = [g for _, g in res[tag] if g is not None]
                    row[f"gpu_ms_{tag}"] = statistics.median(gs) if gs else None
                row["step_delta_ms"] = row["step_ms_B"] - row["step_ms_A"]
                if row["gpu_ms_A"] is not None:
                    row["gpu_delta_ms"] = row["gpu_ms_B"] - row["gpu_ms_A"]
                rows.append(row)
                gpu_txt = ("" if row["gpu_ms_A"] is None else
                           f"  GPU {row['gpu_ms_A']:.4f} -> {row['gpu_ms_B']:.4f} ms "
                           f"({row['gpu_delta_ms'] * 1e3:+.1f} us)")
                print(f"{name}={value!r} (shipped {ship!r}) batch {B} ctx {a.ctx}: step "
                      f"{row['step_ms_A']:.4f} -> {row['step_ms_B']:.4f} ms "
                      f"({row['step_delta_ms'] * 1e3:+.1f} us){gpu_txt}", flush=True)
            del graphs_b
        finally:
            put(False)
        del graphs_a
        if gpu:
            torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text(json.dumps(dict(
            device=torch.cuda.get_device_name() if gpu else "cpu", args=vars(a), rows=rows),
            indent=1))


if __name__ == "__main__":
    main()
