"""Time the Triton decode attention and indexer kernels at DeepSeek-V4-Flash dims on one GPU.

64 heads x D 512, window 128, CSA (ratio 4, indexer 64 x 128, top-512) and HCA (ratio 128)
layers, bf16 and int8 pools with 128-token blocks, contexts 1K / 8K / 64K, batch 1 / 8 / 64.
Each figure is the median time of one call, from CUDA-graph replays of `rot` calls that read
disjoint slots and blocks (so the working set exceeds L2), against the bytes the call must read:
  attention  per sequence: window (W-1 ring rows) + selected/all entries, each D·e bytes
             (e = 2 bf16, 1 + 4/D int8), + q (H·D·2) + o (H·D·4)
  indexer    per sequence: the L/4 keys (128·2 bytes) + scores written and read (L/4·4·2)
and the copy bandwidth measured in the same run (read + write of a 2 GiB copy).
Usage: python benchmarks/kernels/bench_attention.py [--out bench_attention.json]
       python benchmarks/kernels/bench_attention.py --merge --contexts 512,32768 --batches 1,8  (the
       decode step's merge + inverse RoPE launch: split count x attention.MERGE_PAIRS)
"""

from __future__ import annotations

import argparse
import json

import torch

from backfit.runtime.kernels.attention.decode import decode_attention
from backfit.runtime.kernels.attention.indexer import indexer_scores, topk_select
from harness import copy_bandwidth, graph_time  # noqa: E402

H, D, W, RB, BLOCK, TOPK, HI, DI = 64, 512, 128, 8, 128, 512, 64, 128
L2_BYTES = 200 << 20                        # working set per graph: well past the 50 MB L2


def store(n, rows, int8, gen):
    if int8:
        return (torch.randint(-127, 128, (n, rows, D), dtype=torch.int8, device="cuda"),
                torch.rand(n, rows, device="cuda") * 0.02 + 1e-3)
    return torch.randn(n, rows, D, device="cuda").bfloat16(), None


def attention_case(mode, L, B, int8, bw):
    ratio = {"window": 0, "hca": 128, "csa": 4}[mode]
    e = 1 + 4 / D if int8 else 2
    n_comp = 0 if mode == "window" else TOPK if mode == "csa" else L // 128
    per_seq = ((W - 1) + min(n_comp, L // max(ratio, 1) if ratio else 0)) * D * e + H * D * 6
    rot = max(1, min(256, round(L2_BYTES / (per_seq * B))))
    nblk = (L + BLOCK - 1) // BLOCK
    ring, rsc = store(rot * B, W + RB, int8, None)
    ent = esc = tabs = None
    if ratio:
        ent, esc = store(rot * B * nblk, BLOCK // ratio, int8, None)
        tabs = torch.randperm(rot * B * nblk, device="cuda").int().view(rot, B, nblk)
    slots = torch.randperm(rot * B, device="cuda").int().view(rot, B)
    q = torch.randn(B, H, D, device="cuda").bfloat16()
    kv = torch.randn(B, D, device="cuda").bfloat16()
    pos = torch.full((B,), L - 1, dtype=torch.int64, device="cuda")
    sink = torch.randn(H, device="cuda")
    sels = [None] * rot
    if mode == "csa":
        k = min(TOPK, L // 4)
        sels = [torch.rand(B, L // 4, device="cuda").topk(k).indices.int() for _ in range(rot)]

    def run():
        for r in range(rot):
            decode_attention(q, kv, pos, sink, ring, rsc, slots[r], W, mode, ent, esc,
                             None if tabs is None else tabs[r], ratio, sels[r])
    t = graph_time(run) / rot
    nbytes = per_seq * B
    return dict(kind="attention", mode=mode, context=L, batch=B, kv="int8" if int8 else "bf16",
                us=t * 1e6, bytes=nbytes, floor_us=nbytes / bw * 1e6, roofline=nbytes / bw / t,
                rot=rot)


def merge_case(mode, L, B, split, pairs):
    """decode_attention with out_rope (the decode step's call: split KV, merge + inverse RoPE in
    one launch) at one split count and attention.MERGE_PAIRS -> µs a call (graph replays)."""
    from backfit.runtime.kernels.attention import decode as A
    ratio = {"window": 0, "hca": 128, "csa": 4}[mode]
    nblk = (L + BLOCK - 1) // BLOCK
    ring, _ = store(1, W + RB, False, None)
    ent = tabs = sel = None
    if ratio:
        ent, _ = store(nblk, BLOCK // ratio, False, None)
        tabs = torch.arange(nblk, device="cuda").int().view(1, nblk).expand(B, nblk)
    if mode == "csa":
        k = min(TOPK, L // 4)
        sel = torch.full((B, TOPK), -1, dtype=torch.int32, device="cuda")
        sel[:, :k] = torch.rand(B, L // 4, device="cuda").topk(k).indices.int()
    slots = torch.zeros(B, dtype=torch.int32, device="cuda")
    q = torch.randn(B, H, D, device="cuda").bfloat16()
    kv = torch.randn(B, D, device="cuda").bfloat16()
    pos = torch.full((B,), L - 1, dtype=torch.int64, device="cuda")
    sink = torch.randn(H, device="cuda")
    f = 1.0 / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float64, device="cuda") / 64)
    old, A.MERGE_PAIRS = A.MERGE_PAIRS, pairs
    try:
        t = graph_time(lambda: decode_attention(q, kv, pos, sink, ring, None, slots, W, mode,
                                                ent, None, tabs, ratio, sel, split=split,
                                                out_rope=(f, 64, torch.bfloat16)))
    finally:
        A.MERGE_PAIRS = old
    return dict(kind="merge", mode=mode, context=L, batch=B, split=split, pairs=pairs,
                us=t * 1e6)


def merge_sweep(contexts, batches):
    """--merge: decode + merge/inverse-RoPE at the auto split and at forced ones, by pairs."""
    rows = []
    for mode in ("window", "hca", "csa"):
        for L in contexts:
            for B in batches:
                for split in (None, 1, 2, 4, 8, 16):
                    for pairs in (16, 64, 256):
                        if split == 1 and pairs != 64:
                            continue                # one split: no merge launch
                        rows.append(merge_case(mode, L, B, split, pairs))
                        r = rows[-1]
                        print(f"merge {mode:6s} L {L:6d} B {B:2d} split {str(split):4s} "
                              f"pairs {pairs:3d}: {r['us']:7.1f} us", flush=True)
    return rows


def indexer_case(L, B, bw):
    nc = L // 4
    per_seq = nc * (DI * 2 + 8) + HI * (DI + 1) * 4
    rot = max(1, min(256, round(L2_BYTES / (per_seq * B))))
    nblk = (L + BLOCK - 1) // BLOCK
    keys = torch.randn(rot * B * nblk, BLOCK // 4, DI, device="cuda").bfloat16()
    tabs = torch.randperm(rot * B * nblk, device="cuda").int().view(rot, B, nblk)
    qI = torch.randn(B, HI, DI, device="cuda").bfloat16().float()
    w = torch.randn(B, HI, device="cuda") / 8
    pos = torch.full((B,), L - 1, dtype=torch.int64, device="cuda")
    out = {}
    for part in ("scores", "scores+topk"):
        def run():
            for r in range(rot):
                s = indexer_scores(qI, w, keys, tabs[r], pos)
                if part != "scores":
                    topk_select(s, TOPK)
        out[part] = graph_time(run) / rot
    nbytes = per_seq * B
    return dict(kind="indexer", mode="csa", context=L, batch=B, kv="bf16",
                us=out["scores+topk"] * 1e6, scores_us=out["scores"] * 1e6, bytes=nbytes,
                floor_us=nbytes / bw * 1e6, roofline=nbytes / bw / out["scores+topk"], rot=rot)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--contexts", default="1024,8192,65536")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--merge", action="store_true",
                    help="only the decode merge sweep (split count x MERGE_PAIRS)")
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.merge:
        rows = merge_sweep([int(x) for x in a.contexts.split(",")],
                           [int(x) for x in a.batches.split(",")])
        if a.out:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(a.out, "w"),
                      indent=1)
        return
    bw = copy_bandwidth()
    rows = []
    ctxs = [int(x) for x in a.contexts.split(",")]
    bats = [int(x) for x in a.batches.split(",")]
    for B in bats:
        for int8 in (False, True):
            rows.append(attention_case("window", ctxs[0], B, int8, bw))
    for mode in ("csa", "hca"):
        for L in ctxs:
            for B in bats:
                for int8 in (False, True):
                    rows.append(attention_case(mode, L, B, int8, bw))
                    torch.cuda.empty_cache()
    for L in ctxs:
        for B in bats:
            rows.append(indexer_case(L, B, bw))
            torch.cuda.empty_cache()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| kernel | layer | context | batch | KV | µs | bytes read | floor µs | % roofline |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        extra = f" (scores {r['scores_us']:.1f})" if "scores_us" in r else ""
        print(f"| {r['kind']} | {r['mode']} | {r['context']} | {r['batch']} | {r['kv']} | "
              f"{r['us']:.1f}{extra} | {r['bytes'] / 1e6:.2f} MB | {r['floor_us']:.1f} | "
              f"{100 * r['roofline']:.0f} % |")
    if a.out:
        json.dump(dict(device=torch.cuda.get_device_name(), copy_bw=bw, rows=rows),
                  open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
