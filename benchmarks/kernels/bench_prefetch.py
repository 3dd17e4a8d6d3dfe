"""Does a side-stream L2 prefetch of a layer's weights speed its chain of dependent decode GEMVs?
(on the lent GPU; docs/PERFORMANCE.md "The TP-4 slice"):

    python benchmarks/kernels/bench_prefetch.py [--out prefetch.json]

bench_persistent.py's chain (six dependent int8 GEMVs at a TP-4 rank's batch-1 shapes, 46 MB),
a launch a phase, CUDA-graph timed with the weights COLD: SETS chains with weights of their own
are replayed in turn (SETS x 46 MB > L2), µs per chain. Rows:
  cold        the chain alone
  +pf a-b     and, forked at the chain's start on a side stream, one kernels.prefetch launch
              (a program a CH-byte chunk) that asks for phases a..b's weights with
              `prefetch.global.L2` in the order the chain reads them, joined at the chain's end
  +pf next    before each phase's launch, a side-stream prefetch of the next phase's weights
  warm        one chain replayed alone (its weights in L2 where they fit): the floor a
              prefetch can approach
The prediction: a GEMV reading its weights from L2 is ~1.5 µs faster (bench_persistent's wq_b
5.60 cold / 4.10 in L2), so phases 1-5 prefetched while phase 0 runs: ≈ -6 µs of ≈ 59.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_persistent import CHAIN, Chain, _chain_kernel  # noqa: E402
from harness import copy_bandwidth, graph_us  # noqa: E402

from backfit.runtime.kernels.prefetch import L2Plan  # noqa: E402

SETS = 6                        # chains replayed in turn: 6 x 46 MB evicts a 50 MB L2


def plan(c: Chain, a: int, b: int, ch: int) -> L2Plan:
    """Phases a..b's weights of chain c (contiguous in c.W) as one kernels.prefetch plan."""
    lo = c.rows[a][0]
    return L2Plan([c.W[lo:c.rows[b][0] + c.chain[b][0] * c.chain[b][1]]], ch)


def with_prefetch(c: Chain, p: L2Plan, launch_kw: dict):
    """c's chain on the current stream, plan p launched beside it on a side stream."""
    side = torch.cuda.Stream()

    def run():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            p.launch()
        c.launched(**launch_kw)
        main.wait_stream(side)
    return run


def stepwise(c: Chain, ch: int, launch_kw: dict):
    """Each phase p of c's chain launched after a side-stream prefetch of phase p+1's weights
    (forked just before phase p: one GEMV's bytes in flight at a time, not the chain's)."""
    side = torch.cuda.Stream()
    plans = [plan(c, p, p, ch) for p in range(1, len(c.chain))]
    bn, bk, warps = launch_kw["bn"], launch_kw["bk"], launch_kw["warps"]

    def run():
        main = torch.cuda.current_stream()
        for p, (n, _) in enumerate(c.chain):
            if p < len(plans):
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    plans[p].launch()
            _chain_kernel[(triton.cdiv(n, bn),)](c.W, c.S, c.act, c.tab, c.cnt, p, p + 1, BN=bn,
                                                 BK=bk, PERSIST=False, L2=False, num_warps=warps)
        main.wait_stream(side)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_prefetch.json")
    a = ap.parse_args()
    bw = copy_bandwidth()
    chains = [Chain(seed=i) for i in range(SETS)]
    byts = sum(n * k + 4 * n for n, k in CHAIN)
    res = dict(device=torch.cuda.get_device_name(), copy_TBps=bw / 1e12, chain_bytes=byts,
               bytes_us=byts / bw * 1e6, rows={})
    print(f"device {res['device']}  copy {bw / 1e12:.2f} TB/s  chain {byts / 1e6:.1f} MB = "
          f"{byts / bw * 1e6:.2f} us at copy bandwidth; {SETS} sets in turn", flush=True)
    for kw in (dict(bn=8, bk=512, warps=4), dict(bn=4, bk=1024, warps=4)):
        tag = f"BN {kw['bn']} BK {kw['bk']} w{kw['warps']}"
        base = chains[0].outputs(lambda: chains[0].launched(**kw))
        rows = {"cold": [lambda c=c: c.launched(**kw) for c in chains],
                "warm": [lambda: chains[0].launched(**kw)]}
        for lo, hi in ((1, 5), (0, 5), (2, 5)):
            for ch in (1 << 16, 1 << 18, 1 << 20):
                rows[f"+pf {lo}-{hi} CH {ch >> 10} KiB"] = [
                    with_prefetch(c, plan(c, lo, hi, ch), kw) for c in chains]
        for ch in (1 << 16, 1 << 18):
            rows[f"+pf next phase CH {ch >> 10} KiB"] = [stepwise(c, ch, kw) for c in chains]
        for name, calls in rows.items():
            same = all(torch.equal(o, b) for o, b in zip(chains[0].outputs(calls[0]), base))
            us = graph_us(calls)
            res["rows"][f"{tag} {name}"] = dict(us=us, same=same)
            print(f"{tag} {name:22s} {us:7.2f} us  {byts / bw * 1e6 / us:6.1%} of copy bandwidth"
                  f"  bits = cold: {same}", flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
