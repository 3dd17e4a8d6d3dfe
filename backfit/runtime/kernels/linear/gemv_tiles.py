"""kernels.linear.gemv's tile tables: GEMV_TABLE, the measured wins over the a16 path (or, kind
"bf16g",
over the grouped einsum) that gemv_lookup routes to the GEMV, and GEMV_CANDIDATES, what
benchmarks/kernels/bench_gemv.py sweeps and tests/runtime/kernels/test_sm80_gemv.py compiles. Plain
data
(no triton import); kernels.linear.gemv re-exports both (tests monkeypatch gemv.GEMV_TABLE).
"""

from __future__ import annotations

__all__ = ["GEMV_CANDIDATES", "GEMV_TABLE"]

# Winners of benchmarks/kernels/bench_gemv.py on the H200 that beat the a16 path, by (kind, N range,
# K range,
# M range) -> config; first match wins (gemv_lookup); no match -> gemv_config's default. kind
# "int8" (int8_g128, BF16 out) or "bf16" (FP32 out). Bounds inclusive. Measured 2026-12-01 (copy
# bandwidth 4.19 TB/s), `python3 benchmarks/kernels/bench_gemv.py`; comments: µs gemv vs a16 per
# timed M.


def _cfg(variant: str, bn: int, bk: int, warps: int, magic: bool = False) -> dict:
    return dict(variant=variant, BN=bn, BK=bk, num_warps=warps, MAGIC=magic, num_stages=1)


GEMV_TABLE: list[tuple[str, tuple[int, int], tuple[int, int], tuple[int, int], dict]] = [
    # M=1 2.8 vs 6.3, M=2 3.1 vs 6.4, M=4 3.6 vs 6.4
    ("bf16", (256, 256), (4096, 4096), (1, 4), _cfg("fma", 1, 4096, 8)),
    ("bf16", (256, 256), (4096, 4096), (5, 8), _cfg("fma", 1, 2048, 4)),  # M=8 6.3 vs 6.4
    ("bf16", (1024, 1024), (4096, 4096), (1, 1), _cfg("cuda", 1, 4096, 8)),  # M=1 4.2 vs 8.1
    # M=2 4.9 vs 8.2, M=4 6.1 vs 8.2
    ("bf16", (1024, 1024), (4096, 4096), (2, 4), _cfg("fma", 1, 1024, 4)),
    ("bf16", (2624, 2624), (4096, 4096), (1, 1), _cfg("cuda", 1, 4096, 4)),  # M=1 8.1 vs 10.9
    ("bf16", (2624, 2624), (4096, 4096), (2, 2), _cfg("fma", 1, 1024, 4)),  # M=2 9.0 vs 11.0
    ("int8", (1536, 1536), (4096, 4096), (1, 1), _cfg("cuda", 1, 4096, 4, False)),  # M=1 4.6 vs 7.8
    ("int8", (1536, 1536), (4096, 4096), (2, 2), _cfg("cuda", 4, 2048, 4, True)),  # M=2 6.1 vs 7.6
    ("int8", (4096, 4096), (2048, 2048), (1, 1), _cfg("cuda", 4, 2048, 4, True)),  # M=1 5.3 vs 7.8
    ("int8", (4096, 4096), (2048, 2048), (2, 2), _cfg("cuda", 8, 1024, 4, True)),  # M=2 6.8 vs 7.8
    ("int8", (4096, 4096), (4096, 4096), (1, 1), _cfg("cuda", 4, 2048, 4, True)),  # M=1 8.3 vs 10.5
    # M=1 14.9 vs 16.8
    ("int8", (4096, 4096), (8192, 8192), (1, 1), _cfg("cuda", 4, 2048, 4, True)),
    ("int8", (8192, 8192), (1024, 1024), (1, 1), _cfg("cuda", 8, 1024, 4, True)),  # M=1 4.9 vs 7.4
    ("int8", (8192, 8192), (1024, 1024), (2, 2), _cfg("cuda", 16, 512, 4, True)),  # M=2 6.4 vs 7.4
    # one TP-4 rank's shapes (`bench_gemv.py --tp 4`, H200, 2026-12-02, copy 4.2 TB/s; its wq_b
    # and wo_b are the 8192 x 1024 and 4096 x 2048 rows above, re-measured within 0.1 µs):
    # shared w1|w3, M=1 3.86 vs a16 7.05, M=2 4.65 vs 7.08
    ("int8", (1024, 1024), (4096, 4096), (1, 1), _cfg("cuda", 1, 4096, 4, False)),
    ("int8", (1024, 1024), (4096, 4096), (2, 2), _cfg("fma", 1, 1024, 4, False)),
    # indexer wq_b, M=1 2.73 vs 5.80, M=2 3.31 vs 5.75 (M=8: 5.65 vs 5.79, left to a16)
    ("int8", (2048, 2048), (1024, 1024), (1, 2), _cfg("cuda", 4, 2048, 4, True)),
    # the CSA layer's FP32 fused projection (compressor wkv|wgate, indexer's, weights_proj split
    # by head: 2,576 rows; `bench_gemv.py --tp 4 --only "compressor CSA"`, H100, 2026-12-06)
    ("bf16", (2576, 2576), (4096, 4096), (1, 1), _cfg("cuda", 1, 4096, 8)),  # M=1 9.29 vs 13.89
    ("bf16", (2576, 2576), (4096, 4096), (2, 2), _cfg("fma", 1, 1024, 4)),  # M=2 10.14 vs 12.57
    # shared w2, M=1 2.62 vs 5.41, M=2 3.21 vs 5.46
    ("int8", (4096, 4096), (512, 512), (1, 1), _cfg("cuda", 4, 2048, 4, True)),
    ("int8", (4096, 4096), (512, 512), (2, 2), _cfg("cuda", 4, 1024, 4, False)),
    # gemv_grouped (kind "bf16g", against model.attention's einsum): wo_a of one TP-4 rank, 2
    # groups x 1024 rows x 4096 (`bench_gemv.py --only wo_a --tp 4`, 2026-12-02; M = 8: einsum
    # 11.47 vs 19.87 best, left to it). At tp 1 (8192 rows) the einsum (cuBLAS) is at 84 % of
    # copy BW and the best gemv within 2 % of it (18.84 vs 19.18 us at M = 1): no entry.
    ("bf16g", (2048, 2048), (4096, 4096), (1, 1), _cfg("cuda", 1, 4096, 4)),  # M=1 6.77 vs 9.39
    # M=2 8.08 vs 11.37, M=4 10.25 vs 11.50
    ("bf16g", (2048, 2048), (4096, 4096), (2, 4), _cfg("fma", 1, 1024, 4)),
]

# What bench_gemv.py sweeps and test_sm80_gemv.py compiles, by kind. cuda: BN·BK weights per K
# step held as FP32 in registers, <= 8K per 128 threads; fma: plus BN·BK/threads accumulators per
# row (M = 8: 8 x 16 at BN·BK = 2048, 4 warps). Large BN cuts the x re-reads from L2
# (N/BN · M · K · 2 B: at M = 8, BN = 1 that is 16x the weight bytes).
_C, _F = "cuda", "fma"
GEMV_CANDIDATES = {
    "int8": [dict(variant=_C, BN=1, BK=4096, num_warps=4, MAGIC=False),
             dict(variant=_C, BN=4, BK=2048, num_warps=4, MAGIC=True),
             dict(variant=_C, BN=4, BK=1024, num_warps=4, MAGIC=False),
             dict(variant=_C, BN=8, BK=1024, num_warps=4, MAGIC=True),
             dict(variant=_C, BN=16, BK=512, num_warps=4, MAGIC=True),
             dict(variant=_F, BN=1, BK=1024, num_warps=4, MAGIC=False),
             dict(variant=_F, BN=8, BK=256, num_warps=4, MAGIC=True),
             # not yet timed on a GPU: V8 / PREFETCH forms of the M = 1 winners
             dict(variant=_C, BN=4, BK=2048, num_warps=4, MAGIC=True, V8=True),
             dict(variant=_C, BN=4, BK=1024, num_warps=4, MAGIC=True, PREFETCH=True),
             dict(variant=_C, BN=8, BK=1024, num_warps=4, MAGIC=True, V8=True, PREFETCH=True),
             # the K loop as a cp.async pipeline STAGES deep over more, shorter steps
             # (bench_gemv.py --pipe): H200, 2026-12-01, slower than the shipped tile on all
             # 9 shapes at M = 1 (e.g. wo_b 15.6-18.5 vs 14.7 us): kept for the next sweep
             *(dict(variant=v, BN=bn, BK=bk, num_warps=4, MAGIC=True, STAGES=st)
               for v, bn, bk, st in ((_C, 4, 512, 3), (_C, 4, 512, 4), (_C, 4, 1024, 3),
                                     (_C, 8, 512, 3), (_C, 2, 1024, 3), (_C, 16, 256, 4),
                                     (_F, 8, 256, 4)))],
    "bf16": [dict(variant=_C, BN=1, BK=4096, num_warps=4),
             dict(variant=_C, BN=1, BK=4096, num_warps=8),
             dict(variant=_C, BN=8, BK=512, num_warps=4),
             dict(variant=_F, BN=1, BK=2048, num_warps=4),
             dict(variant=_F, BN=1, BK=1024, num_warps=4),
             dict(variant=_F, BN=1, BK=4096, num_warps=8),
             dict(variant=_F, BN=8, BK=256, num_warps=4),
             dict(variant=_C, BN=1, BK=2048, num_warps=8, PREFETCH=True),        # not yet timed
             # fewer programs for the CSA layer's 2,576-row FP32 projection, so that a later small
             # launch need not wait for its last blocks' dispatch (sm_80 ptxas: 64 registers, 4
             # blocks an SM, 644 programs in 1.2 waves of an H100's 528; 168 registers, 3 an SM,
             # 322 programs in one wave of 396); not yet timed
             dict(variant=_C, BN=4, BK=4096, num_warps=8),
             dict(variant=_C, BN=8, BK=4096, num_warps=4),
             *(dict(variant=v, BN=bn, BK=bk, num_warps=4, STAGES=st)         # (as above)
               for v, bn, bk, st in ((_C, 1, 1024, 3), (_C, 1, 512, 4), (_C, 2, 512, 4),
                                     (_F, 1, 512, 4), (_F, 1, 1024, 3)))],
}
