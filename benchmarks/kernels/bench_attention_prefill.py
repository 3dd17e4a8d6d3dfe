"""Time the chunked-prefill attention kernels at DeepSeek-V4-Flash dims on one GPU (issue 9).

64 heads x D 512 (MQA latent, K = V), window 128 (ring of 136 rows), per-head sink, bf16 pools
with 128-token blocks; one sequence's 2048-token chunk starting at 0 and at 6144, each mode:
window, CSA (ratio 4: the top-512 of random scores over j < (p+1)//4 per query) and HCA (ratio
128: every j < (p+1)//128). Per case: attention.sparse_attention (the current kernel) and
attention_prefill.sparse_attention_prefill per candidate config ((BQ, BH, BN, warps, stages)
for the plain kernel, or a config dict: CD 1 the column-chunked one): median µs of `reps` calls (CUDA events, after a warm-up call that compiles), TFLOP/s of the
useful work (per query and head: 4·D FLOPs per visible key, q·k and p·V once; the hi/lo split of
p and masked keys not counted), its share of the BF16 matmul peak measured in the same run
(8192^3 torch.matmul), and the error vs the current kernel: max over (query, head) of
|o - o_cur| / |o_cur| (row norms) and the global relative norm.
Usage: python benchmarks/kernels/bench_attention_prefill.py [--out bench_attention_prefill.json]
       [--configs '[[1,16,16,4,3], {"CD": 1, ...}, ...]'] [--modes window,csa,hca]
       [--starts 0,6144] [--T 2048]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from backfit.runtime.kernels.attention.decode import sparse_attention
from backfit.runtime.kernels.attention.prefill import PREFILL_CONFIGS, sparse_attention_prefill
from harness import cuda_time  # noqa: E402

H, D, W, RB, BLOCK, TOPK, T = 64, 512, 128, 8, 128, 512, 2048
RATIO = {"window": 0, "csa": 4, "hca": 128}
# (BQ, BH, BN, num_warps, num_stages): the plain kernel, M = BQ·BH rows per program, its
# [M, 512] FP32 accumulator the register budget (M = 16-32 with 4 warps)
CANDIDATES = {
    "window": [(1, 16, 16, 4, 3), (2, 16, 16, 4, 2), (1, 16, 32, 4, 3)],
    "csa": [(1, 32, 16, 4, 3), (1, 32, 16, 4, 2), (1, 32, 32, 8, 2), (1, 16, 16, 4, 3)],
}
CANDIDATES["hca"] = list(CANDIDATES["window"])
# CD=1: kernels.attention.prefill_cd (eight column chunks, warps along the rows, M = BQ·BH >= 64)
for _m in CANDIDATES:
    CANDIDATES[_m] += [dict(CD=1, BQ=1, BH=64, BN=16, num_warps=4, num_stages=2),
                       dict(CD=1, BQ=1, BH=64, BN=32, num_warps=4, num_stages=2),
                       dict(CD=1, BQ=1, BH=64, BN=32, num_warps=4, num_stages=3)]
    if _m != "csa":
        CANDIDATES[_m] += [dict(CD=1, BQ=4, BH=16, BN=32, num_warps=4, num_stages=2),
                           dict(CD=1, BQ=2, BH=64, BN=32, num_warps=8, num_stages=2)]


def as_config(c) -> dict:
    """A candidate: (BQ, BH, BN, warps, stages) or a config dict as it is."""
    if isinstance(c, dict):
        return c
    return dict(CD=0, BQ=c[0], BH=c[1], BN=c[2], num_warps=c[3], num_stages=c[4])


def matmul_peak() -> float:
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn_like(x)
    t = cuda_time(lambda: x @ y, 10)
    return 2 * 8192 ** 3 / t


def case(mode: str, st: int, gen: torch.Generator) -> tuple[dict, float]:
    """sparse_attention's inputs for the chunk [st, st + T) of one sequence; -> (args, FLOPs)."""
    ratio = RATIO[mode]
    dev = "cuda"
    pos = torch.arange(st, st + T, device=dev)
    nblk = (st + T + BLOCK - 1) // BLOCK
    args = dict(q=torch.randn(T, H, D, device=dev, generator=gen).bfloat16(),
                kv=torch.randn(T, D, device=dev, generator=gen).bfloat16(), pos=pos,
                sink=torch.randn(H, device=dev, generator=gen),
                ring=torch.randn(2, W + RB, D, device=dev, generator=gen).bfloat16(),
                ring_scale=None, slots=torch.tensor([1], dtype=torch.int32, device=dev),
                window=W, mode=mode, seq=torch.zeros(T, dtype=torch.int32, device=dev),
                start=torch.full((T,), st, dtype=torch.int32, device=dev))
    keys = torch.clamp(pos + 1, max=W).float()                        # window keys per query
    if ratio:
        nb = 2 * nblk                                                  # pool of shuffled blocks
        args.update(entries=torch.randn(nb, BLOCK // ratio, D, device=dev,
                                        generator=gen).bfloat16(), ratio=ratio,
                    tables=torch.randperm(nb, device=dev, generator=gen)[:nblk].int()[None])
        nc = (pos + 1) // ratio                                        # valid entries per query
        if mode == "hca":
            keys += nc
        else:
            NC = nblk * BLOCK // ratio
            sc = torch.rand(T, NC, device=dev, generator=gen)
            sc = sc.masked_fill(torch.arange(NC, device=dev)[None] >= nc[:, None], float("-inf"))
            v, i = sc.topk(min(TOPK, NC), dim=-1)
            sel = torch.where(torch.isinf(v), -1, i).int()
            args["sel"] = sel
            keys += (sel >= 0).sum(-1)
    return args, float(keys.sum()) * H * D * 4


def err(o, ref) -> tuple[float, float]:
    row = ((o - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max().item()
    return row, ((o - ref).norm() / ref.norm()).item()


def main():
    global T
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", default=None,
                    help="JSON [[BQ, BH, BN, warps, stages] or {config}, ...]")
    ap.add_argument("--T", type=int, default=2048, help="chunk length (default %(default)s)")
    ap.add_argument("--modes", default="window,csa,hca")
    ap.add_argument("--starts", default="0,6144")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    T = a.T
    t_start = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    peak = matmul_peak()
    print(f"device {torch.cuda.get_device_name()}  BF16 matmul peak {peak / 1e12:.0f} TFLOP/s  "
          f"(defaults {json.dumps(PREFILL_CONFIGS)})", flush=True)
    print("| mode | start | kernel | config | µs | TFLOP/s | % peak | "
          "max row err | rel err |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for mode in a.modes.split(","):
        cands = ([c if isinstance(c, dict) else tuple(c) for c in json.loads(a.configs)]
                 if a.configs else CANDIDATES[mode])
        for st in (int(s) for s in a.starts.split(",")):
            args, flops = case(mode, st, gen)
            ref = sparse_attention(**args)
            variants = [("current", None, lambda: sparse_attention(**args))]
            for c in cands:
                cfg = as_config(c)
                variants.append(("blocked", c, lambda cfg=cfg: sparse_attention_prefill(
                    **args, config=cfg)))
            for name, c, fn in variants:
                try:
                    o = fn()
                    t = cuda_time(fn, a.reps)
                except Exception as e:                                 # noqa: BLE001
                    print(f"| {mode} | {st} | {name} | {c} | failed: {str(e)[:120]} |",
                          flush=True)
                    rows.append(dict(mode=mode, start=st, kernel=name, config=c,
                                     error=str(e)[:500]))
                    continue
                e_row, e_rel = err(o, ref)
                r = dict(mode=mode, start=st, kernel=name, config=c, us=t * 1e6, flops=flops,
                         tflops=flops / t / 1e12, peak_frac=flops / t / peak,
                         max_row_err=e_row, rel_err=e_rel)
                rows.append(r)
                print(f"| {mode} | {st} | {name} | {c} | {r['us']:.0f} | {r['tflops']:.1f} | "
                      f"{100 * r['peak_frac']:.1f} % | {e_row:.1e} | {e_rel:.1e} |", flush=True)
            ref = None
            torch.cuda.empty_cache()
    best = {}
    for r in rows:
        if r["kernel"] == "blocked" and "us" in r and r["max_row_err"] < 1e-3:
            k = r["mode"]
            got = [x["us"] for x in rows if x["mode"] == k and x["config"] == r["config"]
                   and "us" in x and x["max_row_err"] < 1e-3]
            tot = sum(got)
            if len(got) == len(a.starts.split(",")) and (k not in best or tot < best[k][1]):
                best[k] = (r["config"], tot)
    cur = {m: sum(x["us"] for x in rows if x["mode"] == m and x["kernel"] == "current")
           for m in best}
    for m, (c, tot) in best.items():
        print(f"best {m}: {c}  {tot:.0f} µs over the starts (current {cur[m]:.0f} µs)")
    print(f"wall {time.time() - t_start:.0f} s")
    if a.out:
        json.dump(dict(device=torch.cuda.get_device_name(), matmul_peak=peak, rows=rows,
                       best={m: c for m, (c, _) in best.items()}), open(a.out, "w"),
                  indent=1)


if __name__ == "__main__":
    main()
