"""Where the decode step prefetches weights into L2 (kernels.prefetch), on the side stream "l2"
(runtime/streams.py) beside the launches that read almost nothing, before the GEMVs that read
those weights. Triton path on CUDA, decode batches up to L2_MAX_T rows; a layer's points:

  "o"    after wq_a|wkv is queued: wo_a and wo_b (24 MB at TP 4) during q_norm, wq_b (8.4 MB in
         ~6 µs: 40 % of copy bandwidth), the query RoPE, decode attention and the merge
         (model.attention_decode, ≈ 20 µs); joined after wo_b is queued
  "ffn"  after the attention sub-layer (wo_b) is queued: the router and the shared expert
         (≈ 5 MB) during the hc_post + hc_pre launch (model.block); joined after the MoE's
  "down" after the router is queued: the routed experts' down projections (w2 and its scales
         of the ids the router wrote, ≈ 6.4 MB at TP 4 with 4-bit experts) beside their gate/up
         launch, which reads at ~1.3 TB/s (model.moe); joined after the MoE's launches; up to
         DOWN_MAX_T rows (8 rows' ≈ 40 experts would not fit L2)
  "q"    after the MoE's launches are queued: the NEXT layer's wq_a|wkv and wq_b (21 MB) during
         the last hc_post + the next hc_pre (model.block, the weights from Transformer.hidden's
         carry); joined after that layer's attention is queued

A join makes the main stream wait for the prefetch after the GEMV that reads the weights is
queued, so no launch on the chain waits for it before then; a CUDA graph captures each as a
branch. The prefetch reads weights only (never freed): none of streams.py's allocator rules
apply. Not yet timed on a GPU: off as shipped until the slice's A/B says which points win.
"""

from __future__ import annotations

import torch

from backfit.runtime.kernels import kernel_path
from backfit.runtime.streams import beside

__all__ = ["DOWN_MAX_T", "L2_MAX_T", "L2_PREFETCH", "attn_in_weights", "attn_out_weights",
           "ffn_in_weights", "join", "start", "start_rows"]

L2_PREFETCH: tuple = ()         # the points above that run ("o", "ffn", "down", "q"); () = none
L2_MAX_T = 8                    # decode batches up to this many rows
DOWN_MAX_T = 2                  # "down": up to this many rows


def start(point: str, x: torch.Tensor, tensors: list) -> torch.cuda.Event | None:
    """Queue the prefetch of `tensors` on "l2" after what the current stream has queued, where
    `point` is on for x's batch (L2_PREFETCH, L2_MAX_T, kernel path on CUDA) -> its event for
    join, else None."""
    if point not in L2_PREFETCH or not tensors or not x.is_cuda or x.shape[0] > L2_MAX_T \
            or not kernel_path(x):
        return None
    from backfit.runtime.kernels.prefetch import l2_prefetch
    return beside(x.device, "l2", lambda: l2_prefetch(tensors))[1]


def start_rows(point: str, x: torch.Tensor, stacks: list, ids: torch.Tensor
               ) -> torch.cuda.Event | None:
    """start's for rows `ids` (device-side, int64) of [E, ...] stacks (kernels.prefetch.
    l2_prefetch_rows), up to DOWN_MAX_T rows of x."""
    if point not in L2_PREFETCH or not x.is_cuda or x.shape[0] > DOWN_MAX_T \
            or not kernel_path(x):
        return None
    from backfit.runtime.kernels.prefetch import l2_prefetch_rows
    return beside(x.device, "l2", lambda: l2_prefetch_rows(stacks, ids))[1]


def join(x: torch.Tensor, ev: torch.cuda.Event | None) -> None:
    """The current stream waits for start's prefetch (ev None: nothing)."""
    if ev is not None:
        torch.cuda.current_stream(x.device).wait_event(ev)


def _linear(lin) -> list:
    """A Linear's or FusedProjection's weight and scale (None skipped by l2_prefetch)."""
    return [lin.weight, lin.scale] if lin is not None else []


def attn_in_weights(attn) -> list:
    """What the attention's query path reads first: wq_a|wkv (fused) and wq_b."""
    return _linear(attn.fused_a if attn.fused_a is not None else attn.wq_a) + _linear(attn.wq_b)


def attn_out_weights(attn) -> list:
    """The output projection: wo_a (grouped, bf16) and wo_b."""
    return _linear(attn.wo_a) + _linear(attn.wo_b)


def ffn_in_weights(moe) -> list:
    """The router's weight and the shared expert's gate|up (fused) and down."""
    sh = moe.shared_experts
    return [moe.gate.weight] + _linear(sh.w13 if sh.w13 is not None else sh.w1) + _linear(sh.w2)
