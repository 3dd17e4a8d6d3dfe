"""The MoE router at decode in ONE launch: logits = x·Gᵀ (BF16 G [E, d], FP32 sums) and the
route after it (kernels.pointwise.route: s = sqrt(softplus(logits)), the top-k of s + bias or
tid2eid[token], or of s + bias_vl for a Vision-Exp image-block row, weights s[ids] / Σ ·
routed_scaling_factor), SM80-safe, no host sync.

The decode step ran them as two launches (the GEMV, then pointwise's route: ~3.6 + 2.1 µs at
tp 1 on the H200, 4.3 + 2.9 µs in a TP-4 rank's trace, each a latency-bound launch). Here:
  program     (n, t): rows [n·BN, +BN) of token t's logits (t < M <= ROUTER_MAX_M), FP32,
              stored in a [M, E] scratch, then a CTA barrier and token t's acq_rel counter (the
              current stream's, runtime.streams.stream_counters);
  the last    of token t's programs to arrive resets its counter to 0 (ready for the next
              launch, and for a CUDA graph's replay) and runs pointwise's _route_row for t,
              reading the logits from L2 (.cg: other programs wrote them).
The logits' FP32 sums are in another order than the separate GEMV's (gemv's fma / cuda
variants), so the two paths agree to FP32 rounding, and a top-k can differ only between scores
equal to that rounding (as kernels.pointwise says of its own top-k against torch's).
FUSED = False: model.moe's Gate runs the two launches (the A/B switch of benchmarks/bench_ab.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backfit.runtime.kernels.pointwise import _route_row
from backfit.runtime.streams import stream_counters

__all__ = ["CONFIG", "FUSED", "FUSED_MAX_M", "ROUTER_MAX_M", "router", "router_config"]

FUSED = True            # model.moe.Gate: the fused launch for decode batches (False: two launches)
ROUTER_MAX_M = 8        # tokens one launch routes (decode batches; prefill keeps two launches)
FUSED_MAX_M = 8         # model.moe.Gate takes it up to this batch


# BN rows a program, BK inputs a K step, warps (a program per (BN rows, token)): gemv's measured
# bf16 M = 1 row for the router shape (256 x 4096: BN 1, BK 4096, 8 warps). H100 (2026-12-06, the
# whole launch graph-timed over 16 weights in turn, M = 1): 9 of 10 tiles of BN 1-8 on 1-8 warps
# within 5.4-6.4 us a call (this one 5.6; BN 8 7.8); the best, BN 2 on 4 warps, in the TP-4
# slice's step (bench_ab.py, GPU time of the replay) +18.3 us at batch 1, -22.3 at batch 8:
# noise, not taken
CONFIG = dict(BN=1, BK=4096, num_warps=8)


def router_config(M: int) -> dict:
    """The launch's tile (CONFIG) for M tokens."""
    return dict(CONFIG)


@triton.jit
def _router_kernel(X, G, LOGITS, CNT, BIAS, TID2EID, TOKENS, IDX, WOUT, E, D, stride_xm, scale,
                   BIAS_VL, V, K: tl.constexpr, HASH: tl.constexpr, BE: tl.constexpr,
                   KP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, VL: tl.constexpr):
    """Program (n, t): logits[t, rows n·BN..+BN) = x[t] · G[rows]ᵀ; the last of token t's
    programs to arrive routes token t (ids IDX [M, K] int64, weights WOUT [M, K] FP32), so the
    tokens' routes run in parallel (one program routing all 8 of a batch cost +11 µs a layer)."""
    pid, t = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rn = pid * BN + tl.arange(0, BN)
    n_ok = rn < E
    rn_c = tl.minimum(rn, E - 1).to(tl.int64)          # rows past E re-read row E-1, unstored
    rk = tl.arange(0, BK)
    acc = tl.zeros((BN,), dtype=tl.float32)
    for k0 in range(0, D, BK):
        k_ok = (k0 + rk) < D
        w = tl.load(G + rn_c[:, None] * D + k0 + rk[None, :], mask=k_ok[None, :],
                    other=0.0).to(tl.float32)                                   # [BN, BK]
        x = tl.load(X + t * stride_xm + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)                                   # [BN]
    tl.store(LOGITS + t * E + rn, acc, mask=n_ok)
    tl.debug_barrier()                                  # every thread's logits stored
    if tl.atomic_add(CNT + t, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(CNT + t, 0)                            # ready for the next launch
        _route_row(LOGITS, BIAS, TID2EID, TOKENS, IDX, WOUT, E, scale, t, K, HASH, BE, KP, True,
                   BIAS_VL, V, VL)


def router(x: torch.Tensor, weight: torch.Tensor, k: int, scale: float,
           bias: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
           tokens: torch.Tensor | None = None, config: dict | None = None,
           bias_vl: torch.Tensor | None = None, vocab: int = 0):
    """x [T, d] bf16 (T <= ROUTER_MAX_M), weight [E, d] bf16 -> (ids [T, k] int64, weights
    [T, k] FP32) = pointwise.route(x·weightᵀ in FP32, ...): bias [E] FP32 (scored routing) or
    tid2eid [vocab, k] with tokens [T] (hash routing); bias_vl [E] FP32 with tokens: rows whose
    token is >= vocab (Vision-Exp image blocks) select with it. config: router_config's
    overrides."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[0] > ROUTER_MAX_M \
            or (x.shape[0] > 1 and x.stride(1) != 1):
        raise ValueError(f"router: bf16 x [T <= {ROUTER_MAX_M}, d] with unit stride, got "
                         f"{x.dtype}{list(x.shape)}")
    T, D = x.shape
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] != D \
            or not weight.is_contiguous():
        raise ValueError(f"router: contiguous bf16 weight [E, {D}], got {weight.dtype}"
                         f"{list(weight.shape)}")
    E = weight.shape[0]
    hashed = tid2eid is not None
    if (bias is None) != hashed or (hashed and (tokens is None or tokens.shape != (T,)
                                                or tid2eid.shape[1] != k)) \
            or (bias is not None and (bias.shape != (E,) or bias.dtype != torch.float32)) \
            or (bias_vl is not None and (tokens is None or tokens.shape != (T,) or vocab < 1
                                         or bias_vl.shape != (E,)
                                         or bias_vl.dtype != torch.float32)):
        raise ValueError("router: either FP32 bias [E] or tid2eid [vocab, k] with tokens [T] "
                         "(bias_vl: FP32 [E] with tokens [T] and vocab)")
    vl = bias_vl is not None
    ids = torch.empty(T, k, dtype=torch.int64, device=x.device)
    w = torch.empty(T, k, dtype=torch.float32, device=x.device)
    if T == 0:
        return ids, w
    cfg = {**router_config(T), **(config or {})}
    BK = min(cfg["BK"], triton.next_power_of_2(D))
    logits = torch.empty(T, E, dtype=torch.float32, device=x.device)
    _router_kernel[(triton.cdiv(E, cfg["BN"]), T)](
        x, weight, logits, stream_counters(x.device, T),
        logits if hashed else bias, tid2eid.contiguous() if hashed else ids,
        tokens.contiguous() if hashed or vl else ids, ids, w, E, D, x.stride(0) if T > 1 else D,
        float(scale), bias_vl if vl else logits, int(vocab), K=k, HASH=hashed,
        BE=triton.next_power_of_2(E), KP=triton.next_power_of_2(k), BN=cfg["BN"], BK=BK,
        VL=vl, num_warps=cfg["num_warps"])
    return ids, w
