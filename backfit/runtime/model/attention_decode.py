"""The paged decode step of one attention layer on the Triton kernels (Attention.forward calls
decode_step for a batch of one token per sequence on the engine's pools): the query chain on the
current stream, and beside it (runtime/streams.py) the FP32 projections + compressor update
("comp"), the CSA indexer chain ("index") and the token's kv store ("kv"); decode attention
joins them. The switches below are read at each step (benchmarks/bench_ab.py flips them).
"""

from __future__ import annotations

import torch

from backfit.runtime.batch import ForwardBatch
from backfit.runtime.kernels import kernel_path
from backfit.runtime.model.compressor import HeadWeights
from backfit.runtime.streams import beside, mark

__all__ = ["INDEX_COMPRESS_BESIDE", "INDEX_ROPE_IN_SCORES", "KV_BESIDE", "QUERY_FIRST",
           "Q_NORM_IN_WQ_B", "SIDE_STREAMS", "decode_step"]

# The paged decode step on CUDA (triton path): the compressor update and the CSA indexer chain
# run on side streams beside the query path (runtime/streams.py); False: all in order.
SIDE_STREAMS = True
# The paged decode step on CUDA (any layer): kv_norm + RoPE of the token's kv and its ring store on
# a side stream ("kv") beside q_norm / wq_b / the query RoPE; decode attention joins it.
KV_BESIDE = True
# The paged decode step on the triton path, at these batch sizes: q_norm inside wq_b's GEMV launch
# where kernels.linear.gemv takes wq_b's shape (a TP-4 rank at batch 1-2; Linear.norm_folds); the
# CSA indexer's qr is normed on its own side chain. Elsewhere q_norm's own launch, then wq_b. H200,
# 43-layer TP-4 slice, bench_ab.py (2026-12-02, GPU time of the replay): batch 2 -74.9 us; batch 1
# +39.2 us with the norm from the one loaded K tile in each of wq_b's 1,024 programs (the cross-warp
# Σx² on every program's path; that form is deleted), +51.6 us with the first pass (the form
# kept). A scale-free form (wq_b on x ⊙ w, the 1/rms in the query's RMS + RoPE launch; code at
# e2655d5) read -20.3 / -3.2 us at batch 1 on the H200 (2026-12-07): noise, for a q rounded
# differently from the torch path's; removed.
Q_NORM_IN_WQ_B = (2,)
# The paged decode step on the triton path, up to this batch size: the CSA indexer's query RoPE
# inside its score kernel (kernels.attention.indexer_scores q_rope), not a launch of its own
# before it; 0: off. H200, 43-layer TP-4 slice, mx4 experts, bench_ab.py (2026-12-07, GPU time of
# the replay): -42.8 / -54.1 us at batch 1, -53.5 / -56.3 at batch 8 (two processes), +42.8 us at
# batch 64 (each score program rotates its query again: 64 rows of them). (The main query's norm
# + RoPE inside decode attention lost twice: docs/KERNELS.md "Attention".)
INDEX_ROPE_IN_SCORES = 8
# The paged decode step on CUDA (triton path): the CSA indexer's compressor update on a side stream
# of its own ("icomp") beside the indexer's q_norm and wq_b (it reads the FP32 projections only),
# forked from "comp" right after them and launched before the compressor's own update (which only
# decode attention reads, later); the scores wait for both. False: on the indexer chain, after
# wq_b.
INDEX_COMPRESS_BESIDE = True
# The paged decode step on CUDA, at these batch sizes: the query path's launches queued before the
# side chains that start with them, which wait for their inputs only (streams.mark): wq_a|wkv
# before the "comp" chain (SIDE_STREAMS, a layer with a compressor), q_norm before the "kv" chain
# (KV_BESIDE). wq_a|wkv and the "comp" projections read ~34 MB at TP 4 (12.6 and 21.1) as soon as
# the hc_pre before them ends; the one launched first takes the SMs, and the "comp" projections,
# queued first, held wq_a|wkv back ~5-9 µs a layer (the H100 trace of the slice, 2026-12-07).
# H100, 43-layer TP-4 slice, bench_ab.py (2026-12-07, GPU time of the replay, three processes):
# batch 1 -29.3 / -40.5 / -40.8 us, batch 8 +36.1 / -1.8 / +60.9 us. Elsewhere the side chains
# are queued first.
QUERY_FIRST = (1,)


def decode_step(attn, x: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
    """The paged decode step on the triton backend: the compressor update, the CSA indexer
    chain and the kv store on side streams beside the query path where on CUDA (SIDE_STREAMS,
    KV_BESIDE); q_norm folded into wq_b at Q_NORM_IN_WQ_B's batch sizes."""
    T, pos = x.shape[0], batch.positions
    Hl, D = attn.local_heads, attn.cfg.head_dim
    side = None                     # (events, sel) of the chains queued beside the q path
    if SIDE_STREAMS and attn.compressor is not None and x.is_cuda \
            and kernel_path(x):    # the FP32 projections + the compressor on "comp"
        start = mark(x.device) if T in QUERY_FIRST else None
        if start is not None:                                     # the critical launch first
            qa, kvx = attn._project_a(x)
        (comp, icomp, wraw, proj, iready), ev = beside(x.device, "comp", lambda: _comp_chain(
            attn, x, pos, cache), after=start)
        if start is None:
            qa, kvx = attn._project_a(x)
        side = ([ev], None)
    else:
        qa, kvx, comp, icomp, wraw = attn._project(x, pos, True)
    kv = kv_ready = None            # kv_ready: the event of the kv chain queued beside
    kv_side = KV_BESIDE and x.is_cuda and kernel_path(x)
    projected = mark(x.device) if kv_side and T in QUERY_FIRST else None  # qa, kvx queued
    if kv_side and projected is None:
        kv, kv_ready = beside(x.device, "kv", lambda: _kv_stored(attn, kvx, pos, cache))
    fold = T in Q_NORM_IN_WQ_B and attn.wq_b.norm_folds(qa)          # q_norm in wq_b
    indexed = attn.indexer is not None
    qr = None if fold and (side is not None or not indexed) else attn.q_norm(qa)
    if projected is not None:       # the kv chain after the query's q_norm (QUERY_FIRST)
        kv, kv_ready = beside(x.device, "kv", lambda: _kv_stored(attn, kvx, pos, cache),
                              after=projected)
    if side is not None and indexed:                              # from qa on, beside wq_b
        sel, ev = beside(x.device, "index", lambda: _decode_select(
            attn, qa, qr, wraw, icomp, pos, cache, x.dtype, proj, iready))
        side = (side[0] + [ev], sel)
    q = (attn.wq_b.forward_normed(qa, attn.q_norm) if fold else attn.wq_b(qr)).view(T, Hl, D)
    q, kv = attn._q_kv(q, kvx, pos, kv)
    index = None
    if attn.indexer is not None and side is None:
        index = (*attn.indexer.queries(qr, wraw, pos), icomp)
    o = attn._kernels(q, kv, pos, batch, cache, comp, index, side, kv_ready)
    return attn.post(o, pos, x.dtype)


def _kv_stored(attn, kvx: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:
    """Decode step (kernels, paged pools): _kv_rope, stored in the rings at pos right away.
    The row it replaces holds position p - R, no key of p's window (R >= W) nor of a
    rollback's, and decode attention reads p's own kv from the returned tensor."""
    kv = attn._kv_rope(kvx, pos)
    cache.write_window_tokens(pos, kv)
    return kv


def _comp_chain(attn, x, pos, cache):
    """The "comp" side chain of the decode step: the FP32 projections, (CSA, INDEX_COMPRESS_BESIDE)
    the indexer's compressor update forked on "icomp", then the compressor update -> (comp,
    icomp, wraw, an event after the projections: the indexer chain's start, the "icomp" event
    or None)."""
    comp, icomp, wraw = attn._project_f32(x, pos, True)
    proj = torch.cuda.Event()
    proj.record()
    iready = None
    if attn.indexer is not None and INDEX_COMPRESS_BESIDE:       # the scores wait for it first
        _, iready = beside(x.device, "icomp", lambda: _index_compress(attn, icomp, wraw, cache,
                                                                     pos, x.dtype))
    attn._decode_compress(attn.compressor, "comp", comp, None, cache, pos, x.dtype)
    return comp, icomp, wraw, proj, iready


def _index_compress(attn, icomp, wraw, cache, pos, dtype) -> None:
    """The CSA indexer's compressor update of a decode step: reads the projections only."""
    attn._decode_compress(attn.indexer.compressor, "index", icomp,
                          wraw if isinstance(wraw, HeadWeights) else None, cache, pos, dtype)


def _decode_select(attn, qa, qr, wraw, icomp, pos, cache, dtype, after=None, ready=None
                   ) -> torch.Tensor:
    """The decode step's CSA indexer chain: queries, its compressor update (ready: the event of
    that update, queued beside by _comp_chain; None: here, after the queries), scores, top-k
    (after: an event to wait for first, the projections of its rows and weights). qa: wq_a's
    output, qr = q_norm(qa) or None (made here). Up to INDEX_ROPE_IN_SCORES tokens (kernel
    path): the score kernel rotates the queries."""
    if after is not None:
        torch.cuda.current_stream(qa.device).wait_event(after)
    idx = attn.indexer
    raw = qa.shape[0] <= INDEX_ROPE_IN_SCORES and kernel_path(qa)
    qI, wI = idx.queries(attn.q_norm(qa) if qr is None else qr, wraw, pos, rotate=not raw)
    if ready is None:               # reads icomp and wraw (the projections) only
        _index_compress(attn, icomp, wraw, cache, pos, dtype)
    else:                           # the scores read the pool it updated, and its head weights
        torch.cuda.current_stream(qa.device).wait_event(ready)
    return attn._select(qI, wI, cache, pos, q_rope=(idx.rope.inv_freq, idx.rope.rope_dim)
                        if raw else None)
