"""Same-process A/B on the decode and speculative steps, on the lent GPU: the runtime as shipped
(A) against it with switches set and / or GEMV table entries added (B), on one random model at
the real dimensions with its drafter.

    python3 benchmarks/bench_spec_ab.py [--switch module:NAME=value ..] [--gemv-table T.json ..]
        [--layers 43] [--tp-shard 4] [--experts mx4] [--method dspark] [--k 5] [--batches 1,8]
        [--ctx 512] [--rounds 4] [--reps 20] [--out ab.json]

--switch: a module-level flag read while a step is captured (bench_ab.py's form), e.g.
backfit.runtime.model.compressor:ROWS_KERNEL=False. --gemv-table: bench_gemv.py --out files;
their "table" entries are appended to GEMV_TABLE with M ranges cut to M >= --min-m (default 3),
so the shipped M = 1-2 entries keep deciding there (first match wins). Each (step, batch) is
captured once with A and once with B (kernel choices are made while capturing) and the rounds
alternate A, B, A, B: replay ms by CUDA events, the median of --reps replays a round, then the
median of the rounds. Steps: plain (the decode graph, no drafter) and spec (runtime/graphs/
spec.py: draft + verify). Processes move step figures by 5-10 % on the lent machine; a
same-process A/B does not.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_model import median_ms, rank_runner, raw_config, use_backend  # noqa: E402
from bench_spec import captured, seqs_for  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_ab import parse_switch  # noqa: E402

from backfit.runtime.kernels.linear import gemv  # noqa: E402


def extra_entries(files: list[str], min_m: int) -> list[tuple]:
    """The "table" entries of bench_gemv.py JSON files, M ranges cut to >= min_m."""
    out = []
    for f in files:
        for kind, n, k, (m0, m1), cfg in json.loads(Path(f).read_text())["table"]:
            if m1 >= min_m:
                out.append((kind, tuple(n), tuple(k), (max(m0, min_m), m1), cfg))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--switch", action="append", default=[], metavar="MODULE:NAME=VALUE")
    ap.add_argument("--gemv-table", action="append", default=[], metavar="JSON",
                    help="bench_gemv.py --out file whose entries B adds")
    ap.add_argument("--min-m", type=int, default=3)
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--tp-shard", type=int, default=4)
    ap.add_argument("--experts", choices=("int8", "mx4"), default="mx4")
    ap.add_argument("--method", choices=("mtp", "dspark"), default="dspark")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from backfit.runtime.drafting import Drafting
    extra = extra_entries(a.gemv_table, a.min_m)
    switches = [parse_switch(x) for x in a.switch]
    if not extra and not switches:
        raise SystemExit("bench_spec_ab: nothing to compare (--switch or --gemv-table)")
    print(f"B: {a.switch}, GEMV_TABLE + {len(extra)} entries:", *extra, sep="\n  ", flush=True)
    shipped = list(gemv.GEMV_TABLE)
    as_shipped = [getattr(m, n) for m, n, _ in switches]
    batches = [int(x) for x in a.batches.split(",")]
    raw = raw_config(a.layers, False, "flash" if a.method == "mtp" else "0731")
    r = rank_runner(raw, "cuda", max(batches), a.ctx + 16, tp_shard=a.tp_shard, mtp=True,
                    experts=a.experts)
    use_backend(r, "triton")
    nblk = math.ceil(r.rc.max_model_len / r.block_size)
    r.drafting = Drafting(r.model, r.cache, r.num_slots, a.k)
    steps = {}
    for side, table in (("A", shipped), ("B", shipped + extra)):
        gemv.GEMV_TABLE[:] = table
        for (m, n, v), v0 in zip(switches, as_shipped):
            setattr(m, n, v if side == "B" else v0)
        g, sg = captured(r, batches, nblk)
        for b in batches:
            seqs = seqs_for(r, b, a.ctx)
            g.run(seqs)
            sg.run(seqs, [0.0] * b, 0)
            steps[("plain", b, side)] = g.graphs[b][0].replay
            steps[("spec", b, side)] = sg.graphs[b][0].replay
    gemv.GEMV_TABLE[:] = shipped
    for (m, n, _), v0 in zip(switches, as_shipped):
        setattr(m, n, v0)
    times: dict = {key: [] for key in steps}
    for _ in range(a.rounds):
        for key, fn in steps.items():
            times[key].append(median_ms(fn, a.reps, True))
    rows = []
    print(f"\n{torch.cuda.get_device_name()}, {a.layers} layers, slice of tp {a.tp_shard}, "
          f"{a.experts} experts, {a.method} k {a.k}: replay ms, median of {a.rounds} rounds")
    print(f"{'step':6} {'b':>3} {'A':>8} {'B':>8} {'B-A':>8}")
    for step in ("plain", "spec"):
        for b in batches:
            ta, tb = (statistics.median(times[(step, b, s)]) for s in "AB")
            rows.append(dict(step=step, batch=b, a_ms=ta, b_ms=tb, rounds_a=times[(step, b, "A")],
                             rounds_b=times[(step, b, "B")]))
            print(f"{step:6} {b:>3} {ta:8.3f} {tb:8.3f} {tb - ta:+8.3f}")
    if a.out:
        Path(a.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), args=vars(a),
                                               extra=extra, rows=rows), indent=1))


if __name__ == "__main__":
    main()
