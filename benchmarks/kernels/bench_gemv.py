"""Small-M GEMV (kernels.linear.gemv) candidates against the a16 path of gemm.linear at the decode
step's linear shapes (DeepSeek-V4-Flash, tp 1; --tp K: the shapes one rank of TP K runs that
differ from tp 1's), on CUDA.

    python benchmarks/kernels/bench_gemv.py [--out results.json] [--ms 1,2,4,8] [--quick] [--tp 1]
                                 [--only wo_a,router]

Copy bandwidth first (bench_kernels.ceilings, same process), then per shape, M and variant:
µs per call (bench_kernels.graph_us: median over CUDA-graph replays of calls on rotating weight
copies, >= ~400 MB of them, so small weights are not served from L2), % of copy bandwidth for
the bytes moved (weights + scales + x + y), the issue-9 target 1.5 µs + bytes / (0.8 · copy BW),
and the max error vs an FP64 reference of the dequantized weight, max|y - ref| / max|ref|.
Ends with the winners as GEMV_TABLE entries (kernels/gemv.py) and the JSON rows in --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ceilings, graph_us  # noqa: E402

from backfit.runtime.kernels.linear import gemm, gemv  # noqa: E402

DEV = "cuda"
# name, N, K, kind (int8: int8_g128 -> bf16 out; bf16: bf16 weight -> fp32 out; bf16g: the
# block-diagonal wo_a, gemv_grouped against the model's einsum, bf16 out), how TP splits
# it (runtime.layers: "col" the output dim, "row" the input dim, "rep" replicated, "csa" the CSA
# layer's fused FP32 projection: replicated but for the indexer's weights_proj, split by head)
SHAPES = [
    ("wq_a|wkv", 1536, 4096, "int8", "rep"),
    ("wq_b", 32768, 1024, "int8", "col"),
    ("wo_b", 4096, 8192, "int8", "row"),
    ("shared w1|w3", 4096, 4096, "int8", "col"),
    ("shared w2", 4096, 2048, "int8", "row"),
    ("indexer wq_b", 8192, 1024, "int8", "col"),
    ("router", 256, 4096, "bf16", "rep"),
    ("compressor CSA", 2624, 4096, "bf16", "csa"),  # wkv|wgate 2·1024 + indexer 2·256 + weights_proj 64
    #                                                 (weights_proj split by head: 2576 at tp 4)
    ("compressor HCA", 1024, 4096, "bf16", "rep"),  # wkv|wgate 2·512
    ("wo_a", 8192, 4096, "bf16g", "col"),           # 8 groups of 1024 rows (gemv_grouped)
]
O_LORA = 1024                                       # wo_a's rows a group


def rank_shapes(tp: int) -> list[tuple[str, int, int, str]]:
    """SHAPES as one rank of TP tp holds them; tp > 1: only the split ones (the replicated ones
    are tp 1's), named with the degree."""
    if tp == 1:
        return [s[:4] for s in SHAPES]
    n_of = {"col": lambda N: N // tp, "csa": lambda N: N - 64 + 64 // tp}
    return [(f"{n} tp{tp}", n_of.get(how, lambda N: N)(N), K // tp if how == "row" else K, kind)
            for n, N, K, kind, how in SHAPES if how != "rep"]


def make_weights(N: int, K: int, kind: str, copies: int) -> list:
    """Random weights: int8 codes in ±127 with row-group scales ~1e-2, or BF16 ~N(0, 1)."""
    if kind == "int8":
        return [(torch.randint(-127, 128, (N, K), dtype=torch.int8, device=DEV),
                 torch.rand(N, K // 128, device=DEV).mul_(0.02).add_(1e-3)) for _ in range(copies)]
    return [(torch.randn(N, K, device=DEV).bfloat16(), None) for _ in range(copies)]


def reference(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None,
              grouped: bool = False) -> torch.Tensor:
    """FP64 x @ dequant(W)^T (q·s per (row, 128) group, or the BF16 weight); grouped: the
    block-diagonal product of gemv_grouped (x [M, G·K], W [G·O_LORA, K])."""
    wd = w.double()
    if grouped:
        G, K = w.shape[0] // O_LORA, w.shape[1]
        return torch.einsum("tgi,goi->tgo", x.double().view(-1, G, K),
                            wd.view(G, O_LORA, K)).flatten(1)
    if s is not None:
        wd = (wd.view(w.shape[0], -1, 128) * s.double()[:, :, None]).view(w.shape)
    return x.double() @ wd.T


def max_err(y: torch.Tensor, want: torch.Tensor) -> float:
    return ((y.double() - want).abs().max() / want.abs().max()).item()


def label(c: dict) -> str:
    """e.g. cuda_BN4_BK2048_w4_magic (_S3: STAGES)"""
    return f"{c['variant']}_BN{c['BN']}_BK{c['BK']}_w{c['num_warps']}" + (
        "_magic" if c.get("MAGIC") else "") + (f"_S{c['STAGES']}" if c.get("STAGES", 1) > 1
                                                else "")


def bench_shape(name: str, N: int, K: int, kind: str, Ms, cands, bw: float, rows: list) -> None:
    scheme, out = ("int8_g128", torch.bfloat16) if kind == "int8" else ("bf16", torch.float32)
    grouped = kind == "bf16g"
    out = torch.bfloat16 if grouped else out
    wbytes = N * K * (1 if kind == "int8" else 2) + (N * K // 128 * 4 if kind == "int8" else 0)
    copies = max(2, min(64, math.ceil(400e6 / wbytes)))
    ws = make_weights(N, K, kind, copies)
    KX = K * (N // O_LORA) if grouped else K                          # x's inputs
    for M in Ms:
        x = torch.randn(M, KX, device=DEV).bfloat16()
        want = reference(x, *ws[0], grouped=grouped)
        byts = wbytes + M * KX * 2 + M * N * out.itemsize
        ideal = byts / bw * 1e6                                       # µs at copy bandwidth
        target = 1.5 + ideal / 0.8
        variants = [("einsum" if grouped else "a16", None)] + [(label(c), c) for c in cands]
        for vname, cfg in variants:
            if cfg is None and grouped:                               # model.attention's einsum
                def call(w, s, x=x):
                    G = w.shape[0] // O_LORA
                    return torch.einsum("tgi,goi->tgo", x.view(-1, G, w.shape[1]),
                                        w.view(G, O_LORA, -1)).flatten(1)
            elif cfg is None:
                def call(w, s, x=x):
                    return gemm.linear(x, w, s, scheme, path="a16", out_dtype=out)
            elif grouped:
                def call(w, s, x=x, cfg=cfg):
                    return gemv.gemv_grouped(x, w, O_LORA, config=cfg)
            else:
                def call(w, s, x=x, cfg=cfg):
                    return gemv.gemv(x, w, s, scheme, config=cfg, out_dtype=out)
            try:
                err = max_err(call(*ws[0]), want)
                det = torch.equal(call(*ws[0]), call(*ws[0]))
                t = graph_us([lambda w=w, s=s, call=call: call(w, s) for w, s in ws])
            except (ValueError, RuntimeError) as e:       # e.g. a BK the shape cannot take
                print(f"{name:15s} N={N:6d} K={K:5d} M={M} {vname:26s} skipped: "
                      f"{type(e).__name__}: {str(e)[:80]}", flush=True)
                continue
            rows.append(dict(name=name, N=N, K=K, kind=kind, M=M, variant=vname, config=cfg,
                             us=t, ideal_us=ideal, target_us=target, frac_bw=ideal / t,
                             max_err=err, deterministic=det))
            print(f"{name:15s} N={N:6d} K={K:5d} M={M} {vname:26s} {t:7.2f} us  "
                  f"{ideal / t:6.1%} of copy BW  target {target:6.2f}  "
                  f"{'ok ' if t <= target else 'MISS'} err {err:.1e}{'' if det else ' NONDET'}",
                  flush=True)
    del ws


def winners(rows: list) -> list:
    """Best variant per (shape, M) -> GEMV_TABLE entries where a gemv config beats a16 (bf16g:
    the einsum; else no entry: that path stays). A timed M covers the untimed M below it down to the previous
    timed one (M = 3 pads like 4); equal neighbours are merged."""
    best: dict = {}
    for r in rows:
        key = (r["kind"], r["N"], r["K"], r["M"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    table, prev = [], {}
    for (kind, N, K, M), r in sorted(best.items()):
        lo, prev[(kind, N, K)] = prev.get((kind, N, K), 0) + 1, M
        if r["config"] is None:                                      # a16 was fastest
            continue
        last = table[-1] if table else None
        same = last is not None and last[:3] == (kind, (N, N), (K, K)) and last[3][1] == lo - 1
        if same and last[4] == r["config"]:
            table[-1] = (kind, (N, N), (K, K), (last[3][0], M), r["config"])
        else:
            table.append((kind, (N, N), (K, K), (lo, M), r["config"]))
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the rows and winners as JSON")
    ap.add_argument("--ms", default="1,2,4,8", help="rows M to time (<= 8)")
    ap.add_argument("--quick", action="store_true", help="M = 1 only, first two candidates")
    ap.add_argument("--tp", type=int, default=1, help="the shapes of one rank of TP K")
    ap.add_argument("--only", default="", metavar="NAMES",
                    help="comma-separated shape names to time (e.g. wo_a); default all")
    ap.add_argument("--pipe", action="store_true",
                    help="the shipped config and the cp.async-pipelined candidates only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gemv: needs CUDA")
    t0 = time.time()
    Ms = [1] if args.quick else [int(m) for m in args.ms.split(",")]
    if any(not 1 <= m <= gemv.GEMV_MAX_M for m in Ms):
        sys.exit(f"bench_gemv: --ms must lie in 1..{gemv.GEMV_MAX_M}")
    bw = ceilings()["copy_TBps"] * 1e12                               # bytes / s
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s ({torch.cuda.get_device_name()})", flush=True)
    rows: list = []
    only = [n for n in args.only.split(",") if n]
    for name, N, K, kind in rank_shapes(args.tp):
        if only and not any(name.startswith(n) for n in only):
            continue
        ck = "bf16" if kind == "bf16g" else kind                     # gemv_grouped: bf16 tiles
        cands = gemv.GEMV_CANDIDATES[ck][:2 if args.quick else None]
        if args.pipe:       # the shipped config per timed M (once each), then STAGES > 1 ones
            cands = []
            for c in [gemv.gemv_config(m, N, K, kind == "int8") for m in Ms]:
                if c not in cands:
                    cands.append(c)
            cands += [c for c in gemv.GEMV_CANDIDATES[ck] if c.get("STAGES", 1) > 1]
        bench_shape(name, N, K, kind, Ms, cands, bw, rows)
    table = winners(rows)
    print("\nGEMV_TABLE = [")
    for e in table:
        at = [r for r in rows if r["N"] == e[1][0] and r["K"] == e[2][0] and r["kind"] == e[0]
              and e[3][0] <= r["M"] <= e[3][1]]
        note = "  ".join(
            f"M={m}: {min(r['us'] for r in at if r['M'] == m):.2f} vs "
            f"{'einsum' if e[0] == 'bf16g' else 'a16'} "
            f"{next(r['us'] for r in at if r['M'] == m and not r['config']):.2f}"
            for m in sorted({r["M"] for r in at}))
        print(f"    {e!r},  # {note} us")
    print("]")
    print(f"total {time.time() - t0:.0f} s", flush=True)
    if args.out:
        args.out.write_text(json.dumps(dict(copy_TBps=bw / 1e12, rows=rows, table=table),
                                       indent=1))


if __name__ == "__main__":
    main()
