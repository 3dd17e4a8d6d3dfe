"""The cache updates of a step: the compressors' pooling into entries and the window-ring /
entry stores, in decode (one token a sequence) and in prefill (chunks of many sequences at once,
the same pooling token by token, bit for bit).

  decode   compress_decode, compress_decode_fused (pool + RMSNorm + RoPE + store), store_decode
  prefill  compress_prefill (every entry a step's chunks complete), store_rows (ring rows)
"""

from backfit.runtime.kernels.cache.decode import compress_decode, compress_decode_fused, \
    store_decode
from backfit.runtime.kernels.cache.prefill import compress_prefill, store_rows

__all__ = ["compress_decode", "compress_decode_fused", "compress_prefill", "store_decode",
           "store_rows"]
