"""Time the compressor decode update, old chain vs one fused launch, on one GPU.

Compressor.decode_update at DeepSeek-V4-Flash dims: (ratio 4 overlap, D 512) the CSA layer's
compressor, (ratio 4 overlap, D 128) its indexer's, (ratio 128, D 512) the HCA layer's; batch
1 / 8 / 64, bf16 entries and (D 512) int8 entries, 128-token blocks, positions at and between
block ends; the indexer's case also forms the 64 head weights (Indexer.queries: round, upcast,
scale; 3 launches old, inside the kernel new). Per case, CUDA-graph replays
(benchmarks/kernels/harness.graph_time: what the decode graph
pays, node gaps included) and eager calls of
  old  compressor.FUSED_DECODE = False: with_ape (3 launches), compress_decode, cast, rms_norm,
       rope, store_decode
  new  compressor.FUSED_DECODE = True: kernels.cache.decode.compress_decode_fused, one launch
on twin caches from the same state: the rows and entry pools must agree bit for bit (max
difference of the dequantized entries and the number of differing bytes are printed), and the
bytes the update must move (N - 1 ring rows of c and z read, this token's rows written, the
entry) against the copy bandwidth measured in the same run.
Usage: python benchmarks/kernels/bench_compress.py [--out bench_compress.json] [--batches 1,8,64]
       TRITON_INTERPRET=1 python benchmarks/kernels/bench_compress.py --dry --batches 1,3  (CPU
       check)
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch

from backfit.runtime.kernels import set_kernel_backend
from backfit.runtime.kernels.cache.decode import store_decode
from backfit.runtime.layers import Rotary
from backfit.runtime.model import compressor as cm
from harness import copy_bandwidth, cuda_time, graph_time  # noqa: E402

BLOCK, ROLLBACK, ROPE = 128, 8, 64
W_SCALE = 128 ** -0.5 * 64 ** -0.5       # Indexer.weight_scale
CASES = [(4, True, 512), (4, True, 128), (128, False, 512)]
DEV = "cuda"             # --dry: "cpu" under TRITON_INTERPRET (no timings: a check of the script)


class Cache:
    """The layer-cache accessors decode_update uses, over B slots and B·nblk shuffled blocks."""

    def __init__(self, B, ratio, overlap, D, int8, nblk=4):
        width = (2 if overlap else 1) * D
        rows = (2 * 4 if ratio == 4 else ratio) + ROLLBACK
        self.c = torch.randn(B + 1, rows, width, device=DEV)
        self.z = torch.randn(B + 1, rows, width, device=DEV)
        self.ratio, PB, NB = ratio, BLOCK // ratio, B * nblk + 1
        self.data = (torch.zeros(NB, PB, D, dtype=torch.int8, device=DEV) if int8 else
                     torch.zeros(NB, PB, D, dtype=torch.bfloat16, device=DEV))
        self.scale = torch.ones(NB, PB, device=DEV) if int8 else None
        self.slots = torch.randperm(B, device=DEV).int()
        self.tables = torch.randperm(B * nblk, device=DEV).int().view(B, nblk)
        self.bound = SimpleNamespace(cache=SimpleNamespace(scratch_block=NB - 1))

    def clone(self):
        other = object.__new__(Cache)
        other.__dict__ = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                          for k, v in self.__dict__.items()}
        return other

    def slot_ids(self):
        return self.slots

    def block_table(self):
        return self.tables

    def rows_pool(self, kind):
        return self.c, self.z

    def entry_pool(self, kind):
        return self.data, self.scale

    def write_entries_tokens(self, kind, pos, E):
        store_decode(E, pos, self.data, self.scale, tables=self.tables, ratio=self.ratio,
                     scratch=self.bound.cache.scratch_block)


def case(ratio, overlap, D, B, int8, bw):
    width = (2 if overlap else 1) * D
    comp = cm.Compressor(16, D, ratio, overlap, 1e-6, Rotary(ROPE, 160000.0, None)).to(DEV)
    comp.ape.normal_()
    comp.norm.weight.copy_(1 + 0.1 * torch.randn(D))
    base = Cache(B, ratio, overlap, D, int8)
    c, z = torch.randn(B, width, device=DEV), torch.randn(B, width, device=DEV)
    nblk = base.tables.shape[1]
    pos = torch.randint(ratio, nblk * BLOCK - 1, (B,), device=DEV)
    pos[::2] = (pos[::2] // ratio + 1) * ratio - 1                      # half complete a block
    caches = {"old": base.clone(), "new": base.clone()}
    hw = torch.randn(B, 64, device=DEV) if D == 128 else None           # the indexer's case

    def run(name):
        cache = caches[name]

        def fn():
            cm.FUSED_DECODE = name == "new"
            if name == "old":                                          # ape added by torch
                comp.decode_update(cache, "comp", *comp.with_ape(c, z, pos), pos, torch.bfloat16)
                if hw is not None:                                     # Indexer.queries' w
                    cache.w = hw.to(torch.bfloat16).float() * W_SCALE
            else:
                h = cm.HeadWeights(hw, torch.bfloat16, W_SCALE) if hw is not None else None
                comp.decode_update(cache, "comp", c, z, pos, torch.bfloat16, ape_added=False,
                                   head_w=h)
                cache.w = h and h.tensor()
        return fn
    row = dict(ratio=ratio, overlap=overlap, D=D, batch=B, kv="int8" if int8 else "bf16")
    for name in ("old", "new"):                                       # results, then timings
        run(name)()
    o, n = caches["old"], caches["new"]
    deq = (lambda k: k.data.float() * k.scale[..., None]) if int8 else (lambda k: k.data.float())
    row["max_diff"] = (deq(o) - deq(n)).abs().max().item()
    if hw is not None:
        row["w_equal"] = bool(torch.equal(o.w, n.w))
    row["entries_written"] = int(n.data.flatten(2).any(-1).sum().item())   # non-zero entries
    row["bytes_differ"] = int((o.data != n.data).sum().item()
                              + (o.c != n.c).sum().item() + (o.z != n.z).sum().item())
    for name in ("old", "new"):
        fn = run(name)
        row[f"{name}_graph_us"] = graph_time(fn, reps=20) * 1e6 if DEV == "cuda" else 1.0
        row[f"{name}_eager_us"] = cuda_time(fn, reps=20) * 1e6 if DEV == "cuda" else 1.0
    cm.FUSED_DECODE = True
    n_slots = 2 * ratio if overlap else ratio
    nbytes = B * ((n_slots - 1) * D * 2 * 4 + width * 2 * 4 * 2 + D * (1 if int8 else 2))
    row["bytes"] = nbytes
    row["roofline_new"] = nbytes / bw / (row["new_graph_us"] * 1e-6)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--dry", action="store_true", help="CPU, TRITON_INTERPRET=1: results only")
    a = ap.parse_args()
    global DEV
    set_kernel_backend("triton")
    if a.dry:
        import backfit.runtime.kernels as kpkg
        DEV, kpkg._ANY_DEVICE = "cpu", True
    torch.manual_seed(0)
    bw = copy_bandwidth() if DEV == "cuda" else 1e12
    rows = []
    for ratio, overlap, D in CASES:
        for B in [int(x) for x in a.batches.split(",")]:
            for int8 in ((False, True) if D == 512 else (False,)):
                rows.append(case(ratio, overlap, D, B, int8, bw))
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)"
    print(f"device {name}  copy bandwidth {bw / 1e12:.2f} TB/s")
    bad = [r for r in rows if r["bytes_differ"] or not r.get("w_equal", True)]
    print(f"bit-equal old vs new: {'yes' if not bad else 'NO, ' + str(len(bad)) + ' cases'}")
    print("| ratio | D | batch | KV | old graph µs | new graph µs | old eager µs | new eager µs "
          "| % roofline (new) | max diff | bytes differ |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ratio']}{' ov' if r['overlap'] else ''} | {r['D']} | {r['batch']} | "
              f"{r['kv']} | {r['old_graph_us']:.1f} | {r['new_graph_us']:.1f} | "
              f"{r['old_eager_us']:.1f} | {r['new_eager_us']:.1f} | "
              f"{100 * r['roofline_new']:.1f} % | {r['max_diff']:.3g} | {r['bytes_differ']} |")
    if a.out:
        json.dump(dict(device=name, copy_bw=bw, rows=rows),
                  open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
