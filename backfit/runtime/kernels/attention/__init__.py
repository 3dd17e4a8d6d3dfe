"""Sparse attention over the paged pools (dsv4-model.md 5.4.4-5.4.8) and the lightning indexer.

  decode      one query token per sequence: window ring + compressed entries (HCA all, CSA the
              indexer's top-k), sink, split over KV; merge: the splits merged (with the output
              de-rotation) in a launch of their own
  prefill     the query-blocked kernel of chunked prefill and mixed steps; prefill_cd its
              column-chunked form (D in eight chunks) where its table says so; tiles their loads
  indexer     the indexer's scores over the paged keys and the exact top-k
"""

from backfit.runtime.kernels.attention.decode import decode_attention
from backfit.runtime.kernels.attention.indexer import indexer_scores, topk_select
from backfit.runtime.kernels.attention.prefill import sparse_attention_prefill

__all__ = ["decode_attention", "indexer_scores", "sparse_attention_prefill", "topk_select"]
