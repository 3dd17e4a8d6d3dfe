"""mHC (hyper-connections, dsv4-model.md 5.2) in Triton, FP32 math, no host sync.

  core    hc_pre / hc_post / hc_head with the torch functions' signatures and results (split-K
          partials + collapse; from MIX_TORCH_T tokens the tiled path of `tile`)
  decode  the decode form: each hc_post fused with the next hc_pre's partials (2 launches a
          pair), the Sinkhorn on a side stream, the MoE combine summed inside hc_post
  tile    the tiled prefill partials and collapse

runtime.model.hyper calls `core` (any T) or `decode` (T < MIX_TORCH_T while DECODE_FUSED) as a
namespace of hc_pre / hc_post / hc_head.
"""

from backfit.runtime.kernels.mhc import core, decode
from backfit.runtime.kernels.mhc.core import MIX_TORCH_T

__all__ = ["MIX_TORCH_T", "core", "decode"]
