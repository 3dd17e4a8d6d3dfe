"""The fused MoE: routed experts (gate+up+SwiGLU, down with the routing weight, the top-k sum
and the shared expert's add) in two launches plus a combine, for either expert scheme (a
scheme's DOWN_SUM: the down launch does the combine's sum too).

  common        what both schemes share: pair alignment, tile choices, the launch sequence
  int8          int8_mx32 stacks (INT8 codes + exponent byte per 32): sorted tensor-core kernel
  int8_decode   its decode GEMVs (one program per (pair, rows))
  mx4           mx4_e2m1 stacks (two e2m1 codes a byte): the same launches, codes decoded in
                registers; mx4_decode its decode GEMVs

The model calls `fused_moe` (dispatching on the stacks' dtype) and `stack_experts`.
"""

from __future__ import annotations

import torch

from backfit.runtime.kernels.moe.common import stack_experts
from backfit.runtime.kernels.moe.int8 import fused_moe_int8
from backfit.runtime.kernels.moe.mx4 import fused_moe_mx4

__all__ = ["fused_moe", "stack_experts"]


def fused_moe(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w1: torch.Tensor,
              s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor, w2: torch.Tensor,
              s2: torch.Tensor, limit: float, path: str | None = None,
              config: dict | None = None, shared: torch.Tensor | None = None,
              dtype: torch.dtype = torch.float32,
              shared_ready: torch.cuda.Event | None = None, pairs: bool = False):
    """x [T, K] bf16, idx [T, k], w [T, k] -> routed-expert sum [T, D] (+ shared [T, D]) in
    `dtype`: fused_moe_mx4 for uint8 w1 (mx4_e2m1 stacks), else fused_moe_int8 (their
    docstrings hold the arguments)."""
    run = fused_moe_mx4 if w1.dtype == torch.uint8 else fused_moe_int8
    return run(x, idx, w, w1, s1, w3, s3, w2, s2, limit, path, config, shared, dtype,
               shared_ready, pairs)
