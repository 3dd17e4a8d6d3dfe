"""Alternative kernel tables for benchmarks/bench_ab.py's `--switch MODULE:NAME=@ab_tables:NAME`
(bench_ab.py runs from this folder, so `ab_tables` imports). Each is the shipped table with one
row changed, a candidate that the kernel's sweep compiles (gemv_tiles.GEMV_CANDIDATES).

  CSA_PROJ_BN4, CSA_PROJ_BN8  gemv.GEMV_TABLE with the CSA layer's FP32 projection at M = 1
      (2,576 rows x 4,096, one TP-4 rank) on 4 rows a program and 8 warps (644 programs, 1.2
      waves of an H100's resident blocks) or 8 rows on 4 warps (322 programs, one wave), for
      `--switch backfit.runtime.kernels.linear.gemv:GEMV_TABLE=@ab_tables:CSA_PROJ_BN4`.
"""

from __future__ import annotations

from backfit.runtime.kernels.linear.gemv_tiles import GEMV_TABLE

CSA_PROJ = ("bf16", (2576, 2576), (1, 1))           # (kind, N range, M range) of the row


def with_row(key: tuple, cfg: dict) -> list:
    """GEMV_TABLE with the config of the row (kind, N range, M range) = key replaced by cfg."""
    if not any((k, n, m) == key for k, n, _, m, _ in GEMV_TABLE):
        raise KeyError(f"GEMV_TABLE has no row {key}")
    return [(k, n, kk, m, dict(cfg, num_stages=1) if (k, n, m) == key else c)
            for k, n, kk, m, c in GEMV_TABLE]


CSA_PROJ_BN4 = with_row(CSA_PROJ, dict(variant="cuda", BN=4, BK=4096, num_warps=8))
CSA_PROJ_BN8 = with_row(CSA_PROJ, dict(variant="cuda", BN=8, BK=4096, num_warps=4))
