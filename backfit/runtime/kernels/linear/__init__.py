"""Quantized linears y = x @ Wᵀ for the converted schemes (int8_g128, bf16, copy).

  gemm        the general launcher `linear`: a16 (W8A16, BF16 MMA, split-K at small M) and w8a8
              (INT8 MMA at M >= PREFILL_M), BF16 or FP32 output
  gemv        small-M (decode) GEMVs where gemv_tiles' table measured them faster than a16;
              with the RMSNorm folded in (`norm_fold`) and the grouped BF16 einsum (`gemv_grouped`)
  gemv_fma    the GEMV's fma variant and the tile set-up both variants share
  gemv_tiles  that table and the sweep's candidates
"""

from backfit.runtime.kernels.linear.gemm import PREFILL_M, act_quant, linear
from backfit.runtime.kernels.linear.gemv import GEMV_MAX_M, gemv_grouped, gemv_lookup, norm_fold
from backfit.runtime.kernels.linear.gemv import gemv as gemv_linear   # (the module keeps its name)

__all__ = ["GEMV_MAX_M", "PREFILL_M", "act_quant", "gemv_grouped", "gemv_linear", "gemv_lookup",
           "linear", "norm_fold"]
