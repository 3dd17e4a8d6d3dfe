"""Speculative decoding at the REAL dimensions on the lent GPU: what a draft, a verify and a whole
speculative step cost against a plain decode step, and the tokens/s they give at a controlled
acceptance.

    python3 scripts/bench_spec.py [--layers 4] [--tp-shard 1] [--methods mtp,dspark]
                                  [--k 1,3,5,7] [--batches 1,8] [--experts int8|mx4]
                                  [--ctx 512] [--reps 30] [--out bench_spec.json] [--tiny]

A random converted model (scripts/bench_model.py: layers 0..N-1 of the real schedule, TP rank 0
of --tp-shard K, collectives counted no-ops) WITH its drafter (Flash: the MTP block; 0731: the
three DSpark stages) on the triton kernels, pools of random contents at --ctx tokens. All rows
are CUDA-graph replays timed with events (median of --reps):

  plain      the decode graph of b sequences without a drafter (what runs with speculation off)
  plain+ctx  the same with the drafter's context in the graph (speculation configured)
  draft      the drafter alone for b sequences, k tokens (MTP: k block steps; DSpark: the
             block's three stages and the Markov loop)
  spec       the whole speculative step (runtime/graphs/spec.py): draft + verify of b·(1+k)
             rows + context, one replay

A random model accepts nothing, so acceptance is an input: a step emits AL tokens per sequence
on average (AL = accepted drafts + the bonus, <= k + 1), and tokens/s = b · AL / spec. The table
gives AL 1.5 / 2.5 / 3.5 / 4.5 (capped at k + 1) beside plain's b / plain. Host work per step
(the engine's scheduling, acceptance read-back) is not in these figures. --tiny: small dims on
CPU (the torch path, eager timing): a dry run of the script.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench_model import (median_ms, rank_runner, raw_config, step_input,  # noqa: E402
                         use_backend)

from backfit.runtime.drafting import Drafting  # noqa: E402

ALS = (1.5, 2.5, 3.5, 4.5)


def seqs_for(r, b: int, ctx: int):
    """b sequences at position ctx: (token, position, slot, table) as the graphs take them."""
    step = step_input(r, b, ctx)
    return [(s.tokens[0], s.start, s.slot, s.block_table) for s in step.seqs]


def graph_of(fn, cuda: bool):
    """fn captured in a CUDA graph -> its replay (eager fn on CPU)."""
    if not cuda:
        return fn
    from backfit.runtime.graphs.decode import capture_graph, warm_up
    warm_up(fn, torch.device("cuda"))
    g, _ = capture_graph(fn, None, "a benchmark graph", "")
    return g.replay


def captured(r, batches: list[int], nblk: int, drafting=None):
    """r's decode graphs (with the drafter's context when `drafting` is given) and speculative
    graphs (r.drafting's) for `batches` sequences, captured -> (DecodeGraphs, SpecGraphs)."""
    from backfit.runtime.graphs import DecodeGraphs, SpecGraphs
    g = DecodeGraphs(r.model, r.cache, max(batches), nblk, drafting)
    g.sizes = batches
    g.capture()
    sg = SpecGraphs(r.model, r.cache, r.drafting, max(batches), nblk, sizes=batches)
    sg.capture()
    return g, sg


def bench_method(args, method: str) -> list[dict]:
    from backfit.runtime.graphs import DecodeGraphs
    cuda = not args.tiny
    dev = "cuda" if cuda else "cpu"
    raw = raw_config(args.layers, args.tiny, "flash" if method == "mtp" else "0731")
    batches = [int(x) for x in args.batches.split(",")]
    r = rank_runner(raw, dev, max(batches), args.ctx + 16, tp_shard=args.tp_shard, mtp=True,
                    experts=args.experts)    # mx4 built as such: INT8 slice + drafter ~76 GB
    use_backend(r, "triton" if cuda else "torch")
    nblk = math.ceil(r.rc.max_model_len / r.block_size)
    rows = []
    plain = {}
    if cuda:
        g = DecodeGraphs(r.model, r.cache, max(batches), nblk)
        g.sizes = batches
        g.capture()
    for b in batches:
        run = (lambda b=b: g.run(seqs_for(r, b, args.ctx))) if cuda else \
            (lambda b=b: r.forward(step_input(r, b, args.ctx)))
        run()
        plain[b] = median_ms(g.graphs[b][0].replay if cuda else run, args.reps, cuda)
    for k in [int(x) for x in args.k.split(",")]:
        most = 7 if method == "mtp" else 5
        if k > most:
            continue
        r.drafting = Drafting(r.model, r.cache, r.num_slots, k)
        if cuda:
            gc, sg = captured(r, batches, nblk, r.drafting)
        for b in batches:
            seqs = seqs_for(r, b, args.ctx)
            if cuda:
                gc.run(seqs)
                ctx_ms = median_ms(gc.graphs[b][0].replay, args.reps, cuda)
                sg.run(seqs, [0.0] * b, 0)
                spec_ms = median_ms(sg.graphs[b][0].replay, args.reps, cuda)
            else:
                ctx_ms = plain[b]
                spec_ms = median_ms(lambda: r.forward(_spec_step(r, b, args.ctx, k)), args.reps,
                                    cuda)
            dstep = _spec_step(r, b, args.ctx, k)
            draft_fn = graph_of(lambda: r.drafting.draft(list(dstep.seqs), 0), cuda)
            draft_ms = median_ms(draft_fn, args.reps, cuda)
            row = dict(method=method, k=k, batch=b, layers=args.layers, tp_shard=args.tp_shard,
                       experts=args.experts, plain_ms=plain[b], plain_ctx_ms=ctx_ms,
                       draft_ms=draft_ms, spec_ms=spec_ms, spec_over_plain=spec_ms / plain[b],
                       plain_tok_s=1e3 * b / plain[b],
                       tok_s={str(al): 1e3 * b * min(al, k + 1) / spec_ms for al in ALS})
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _spec_step(r, b: int, ctx: int, k: int):
    """The StepInput of b sequences each verifying k drafts at position ctx."""
    import dataclasses
    step = step_input(r, b, ctx)
    return dataclasses.replace(step, seqs=tuple(dataclasses.replace(s, draft=k)
                                                for s in step.seqs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tp-shard", type=int, default=1)
    ap.add_argument("--methods", default="mtp,dspark")
    ap.add_argument("--k", default="1,3,5,7")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--experts", choices=("int8", "mx4"), default="int8")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="bench_spec.json")
    ap.add_argument("--tiny", action="store_true", help="small dims on CPU (dry run)")
    args = ap.parse_args()
    if args.tiny:
        args.layers, args.reps = min(args.layers, 6), 2
    rows = []
    for m in args.methods.split(","):
        rows += bench_method(args, m)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name()
                                          if torch.cuda.is_available() else "cpu",
                                          "rows": rows}, indent=1))
    print(f"{'method':7} {'k':>2} {'b':>3} {'plain':>7} {'+ctx':>7} {'draft':>7} {'spec':>7} "
          f"{'x':>5}  tok/s plain | AL " + " ".join(f"{a:>6}" for a in ALS))
    for x in rows:
        print(f"{x['method']:7} {x['k']:>2} {x['batch']:>3} {x['plain_ms']:7.3f} "
              f"{x['plain_ctx_ms']:7.3f} {x['draft_ms']:7.3f} {x['spec_ms']:7.3f} "
              f"{x['spec_over_plain']:5.2f}  {x['plain_tok_s']:9.0f} | " +
              " ".join(f"{x['tok_s'][str(a)]:6.0f}" for a in ALS))


if __name__ == "__main__":
    main()
