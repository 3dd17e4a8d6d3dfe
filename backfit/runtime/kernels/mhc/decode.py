"""mHC at decode (T < core.MIX_TORCH_T): 2 launches per hc_post + hc_pre pair instead of 4.

Today's kernel path (runtime.kernels.mhc.core) runs, around every sub-layer of a decode step,
_post_kernel (previous hc_post) -> _mix_partial_kernel -> _collapse_kernel -> the Block's
RMSNorm (kernels.rope_norm._rms_kernel): ~16.5 us for a few KB. Here:
  _post_mix_kernel       program (token t, d block b): hc_post's out[t, :, block] (bf16, as
                         core._post_kernel) and, from the bf16-rounded out (what the next hc_pre
                         reads), the next hc_pre's partials: PART[t, b, :NOUT] = Σ_s fn_next[:,
                         s·d + block] · out[t, s, block], PART[t, b, NOUT] = Σ out², FP32 (the
                         [T, SPLIT, NP] layout core._partials writes, SPLIT = d blocks), so
                         the next hc_pre skips _mix_partial_kernel. Each program streams its
                         [NOUT, S·BD] slice of fn_next (24 x 16384 FP32 = 1.5 MB in all),
                         loaded first, and sums all S streams' dots in ONE reduction (a
                         reduction a stream: 27 bar.syncs before the tail in the sm_80 PTX;
                         this: 3).
                         Given the MoE's unsummed pairs (pointwise.PairSum, POST_COMBINE), it
                         first sums them as pointwise.moe_combine would: one launch less.
  _collapse_norm_kernel  program t: the splits summed, gates and (SINKHORN) Sinkhorn ONCE per
                         token (core._collapse_kernel's op order: same u, post, M for the same
                         PART), then u = Σ_s pre_s X_s over d blocks rounded to bf16 (hyper.
                         hc_pre's u.to(X.dtype)); NORM: the following RMSNorm in the same
                         launch (layers.RMSNorm / rope_norm._rms_kernel: FP32 u·rsqrt(mean(u²)
                         + eps)·w, cast to bf16), u recomputed in a second pass over X (no
                         scratch, no barrier). COLLAPSE: warps, u block, and the Sinkhorn on
                         16 per-thread scalars (S = 4) or on [S, S] tensors. The first hc_pre of
                         a step (and hc_head of rows other than hidden()'s streams) gets its
                         PART from core._partials (one more launch).
hc_pre_async (the Block's): the same kernel as two launches on one PART, gates + u + RMSNorm on
the critical path and post + M (the Sinkhorn chain) on a side stream, joined by the hc_post
after the sub-layer (the only reader of post / M).
hc_post(pre=) (PRE_FOLD, 2026-12-02): the last of token t's _post_mix_kernel programs to arrive
(an acq_rel counter) runs that critical launch for t itself; hc_pre_async(u=) then launches the
Sinkhorn only. Per decode step of L layers: 2L + 3 launches on the critical path for mHC and the
RMSNorms after it (4L + 2 without the fold), + 2L Sinkhorn launches beside it (before this
module 8L + 3: 6L + 2 mHC, 2L + 1 RMSNorm). The Block's attention / MoE take the normed u
directly (model.transformer).
No host syncs; grids from shapes only (CUDA-graph safe). DECODE_FUSED = False: hyper.
decode_kernels returns None and the model runs today's path (4 launches per pair).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from backfit.runtime.kernels.mhc import core
from backfit.runtime.kernels.mhc.core import _ld, _post_block, _post_comb, _post_coords, \
    _pre_gates, _sinkhorn, _sinkhorn4
from backfit.runtime.kernels.pointwise import _pair_acc
from backfit.runtime.streams import stream_counters

__all__ = ["COLLAPSE", "COLLAPSE_U", "DECODE_FUSED", "FOLD", "FOLD_MAX_T", "NextPre",
           "POST_COMBINE", "PRE_FOLD", "SINKHORN_LAST", "SINKHORN_STREAM", "collapse_config",
           "hc_head", "hc_post", "hc_pre", "hc_pre_async", "join", "post_bd"]

DECODE_FUSED = True     # False: the model's decode path falls back to mhc's 4 launches
POST_COMBINE = True     # the decode Block's MoE combine summed inside its hc_post (False: its
                        # own launch, pointwise.moe_combine)
SINKHORN_STREAM = True  # hc_pre_async on CUDA: post / M on a side stream (False: in order)
# With it: the Sinkhorn launch queued by the hc_post that joins it (after the sub-layer's
# launches), still waiting for PART only (streams.mark): the sub-layer's first launch, on the
# critical path, goes first (queued first, the Sinkhorn's one program started before the router
# or wq_a|wkv and delayed them ~0.7 µs: the H100 trace of the TP-4 slice, 2026-12-07)
SINKHORN_LAST = True
# the decode Block's hc_pre ("attn": a layer's first, "ffn": its second) whose critical launch
# the hc_post before it runs in its last programs (hc_post(pre=)); the others: their own launch
PRE_FOLD = ("attn", "ffn")
# hc_post(pre=)'s tail: the d block of its u passes and the post-mix launch's warps (4 without
# pre), up to FOLD_MAX_T tokens (past it pre is ignored: u None). H200, `bench_mhc.py --decode`
# (2026-12-02, the main part then reduced once a stream), µs per pair as the model runs it
# (hc_post + hc_pre_async, Sinkhorn beside) without -> with the fold at bd_u 4096 / 8 warps:
# T = 1 7.78 -> 7.01 (bd_u 1024: 9.90), T = 8 9.67 -> 8.37, T = 63 29.68 -> 36.44 (a loss).
# With one reduction a program (2026-12-06, H200, hc_post(pre=) alone, graph-timed over 20
# inputs, 8 -> 4 warps): T = 1 5.27 -> 5.19 (an FP32 pair 5.50 -> 5.30), T = 2 5.96 -> 5.66,
# T = 8 9.07 -> 7.28 µs; the 43-layer TP-4 slice (bench_ab.py, GPU time of the replay) -1.6 µs at
# batch 1, -140.1 µs at batch 8
# one_pass_max_t: up to that many tokens a tail with bd_u >= d loads out[t] and the norm weight
# with the gates' rows (EARLY: one round trip, not five). Beyond it the early form lost (our
# reading: the registers that hold those loads, reserved by every program; 43-layer TP-4
# slice, bench_ab.py, GPU time of the replay, H100, 2026-12-06: batch 1 -80 to -82 µs, batch 8
# +45 to +50 µs with the loads early)
FOLD = dict(bd_u=4096, warps=4, one_pass_max_t=1)
FOLD_MAX_T = 8


class NextPre(NamedTuple):
    """The next hc_pre (with its RMSNorm) that hc_post(pre=) runs the critical part of: its
    fn is hc_post's next_fn; scale [3], base [n_out] FP32, RMSNorm weight [d] FP32 and eps."""
    scale: torch.Tensor
    base: torch.Tensor
    norm_w: torch.Tensor
    rms_eps: float
    hc_eps: float
    norm_eps: float


_FT = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}     # a PairSum's sum dtype
# _collapse_norm_kernel's launch by token count: (largest T, warps, d block of the u passes
# (capped at d), scalar Sinkhorn (S = 4 only: 16 per-thread values instead of [S, S] tensor
# reductions)). One warp: no barriers in the Sinkhorn chain, but the u passes' loads are not
# pipelined; more warps: larger blocks, fewer round trips, a bar.sync per reduction.
# H200, bench_mhc --decode (2026-12-01), µs per mHC pair: T = 1: 4 warps / 1024 12.9 (scalar
# 13.0, 8 / 4096 14.0-14.4, 1 warp 17-18; today's 4 launches 14.1); T = 8: 8 / 4096 16.0
# (4 / 1024 17.7-18.2; 4 launches 22.0); T = 63 (post_bd 256): 8 / 4096 68.7, 4 / 1024 70.2.
COLLAPSE = ((4, dict(warps=4, bd=1024, scalar=False)),
            (None, dict(warps=8, bd=4096, scalar=False)))


# hc_pre_async's critical launch (gates + u + RMSNorm, no Sinkhorn) by token count: (largest T,
# warps, d block); bd >= d runs one pass (ONE_PASS: X[t] loaded once). H200, `bench_mhc.py
# --collapse` (2026-12-01; the Sinkhorn chain, whose barriers made more warps lose, is on the
# side launch), µs at T = 1 / 2 / 4 / 8: COLLAPSE's 4 warps / 1024 5.65 / 5.87 / 6.01 / 5.70;
# one pass 8 warps 3.68 / 3.75 / 3.03 / 2.86, 16 warps 3.42 / 3.43 / 3.34 / 3.06 (prediction
# for 8 warps at T = 1 was ~4.5).
COLLAPSE_U = ((2, dict(warps=16, bd=4096)),
              (None, dict(warps=8, bd=4096)))


def collapse_config(T: int, table=COLLAPSE) -> dict:
    """COLLAPSE's (or `table`'s) row for T tokens."""
    return next(c for t, c in table if t is None or T <= t)


@triton.jit
def _post_mix_kernel(F, X, POST, MIX, OUT, FN, PART, D, K, S: tl.constexpr, NOUT: tl.constexpr,
                     NP: tl.constexpr, BD: tl.constexpr, HAS_FN: tl.constexpr,
                     SH=None, KC: tl.constexpr = 0, HAS_SH: tl.constexpr = False,
                     FT: tl.constexpr = tl.bfloat16, CNT=None, SCALE=None, BASE=None, NW=None,
                     U=None, hc_eps=0.0, norm_eps=0.0, rms_eps=0.0, SP: tl.constexpr = 1,
                     BDU: tl.constexpr = 16, PRE: tl.constexpr = False,
                     ONE_PASS: tl.constexpr = False, EARLY: tl.constexpr = False):
    """out[t, k, block] = post[t, k]·f[t, block] + Σ_j M[t, j, k]·X[t, j, block] (bf16); HAS_FN:
    PART[t, b] = fn·out[t, :, block] (NOUT dots) and Σ out² from the bf16-rounded out. KC > 0:
    F holds the MoE's KC pairs a token (and SH its shared output): f is their combine, by
    moe_combine's own sum (pointwise._pair_acc), rounded to FT: the launch it would have been.
    PRE (with HAS_FN): the last of token t's programs to arrive (CNT[t], acq_rel; reset to 0
    for the next launch) runs the next hc_pre's critical launch for t from PART and out, read
    from L2: the gates, U[t] = rmsnorm(u)·NW in d blocks of BDU (_collapse_norm_kernel's ops;
    ONE_PASS: BDU >= D, one block; EARLY, with it: out[t], NW and the gates' scale / base loaded
    with PART's rows, one round trip, not five)."""
    t, b, rs, rd, d_ok = _post_coords(D, S, BD)
    if HAS_FN:           # fn_next's [NP, S, BD] slice first: its loads wait on nothing
        rn = tl.arange(0, NP)[:, None, None]
        w = tl.load(FN + rn * K + rs[None, :, None] * D + rd[None, None, :],
                    mask=(rn < NOUT) & d_ok[None, None, :], other=0.0)
    if KC > 0:
        f = _pair_acc(F, SH, t, rd, d_ok, D, KC, HAS_SH).to(FT).to(tl.float32)
    else:
        f = tl.load(F + t * D + rd, mask=d_ok, other=0.0).to(tl.float32)
    ob = _post_block(X, POST, MIX, f, t, rs, rd, d_ok, D, S).to(OUT.dtype.element_ty)
    tl.store(OUT + (t * S + rs[:, None]) * D + rd[None, :], ob, mask=d_ok[None, :])
    if HAS_FN:
        # every stream's dots in ONE reduction over [S, BD] (one a stream cost a shared-memory
        # round trip and bar.syncs each); row NOUT holds out itself: that slot sums out²
        y = ob.to(tl.float32)[None, :, :]                                # [1, S, BD]
        acc = tl.sum(tl.sum(tl.where(rn == NOUT, y, w) * y, axis=2), axis=1)   # [NP]
        tl.store(PART + (t * tl.num_programs(1) + b) * NP + tl.arange(0, NP), acc)
    if PRE:
        tl.debug_barrier()                                  # every thread's out / PART stored
        if tl.atomic_add(CNT + t, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) - 1:
            tl.store(CNT + t, 0)                            # ready for the next launch
            split = tl.num_programs(1)
            ri = tl.arange(0, SP)
            if EARLY:             # BDU >= D: out[t] and NW loaded with PART's rows, one trip
                xu, wu = _u_load(OUT, NW, t, D, S, BDU, True, True)
            pre, _ = _pre_gates(PART + t * split * NP + ri * NP, ri < split, rs, SCALE, BASE, K,
                                hc_eps, norm_eps, NOUT, CG=True, EARLY=EARLY)
            if EARLY:
                _u_store(xu, wu, U, t, pre, D, rms_eps, BDU, True)
            else:
                _u_norm(OUT, NW, U, t, pre, D, rms_eps, S, BDU, True, ONE_PASS, True)


@triton.jit
def _collapse_norm_kernel(PART, X, SCALE, BASE, W, U, POST, MOUT, SPLIT, D, K, iters, hc_eps,
                          norm_eps, rms_eps, S: tl.constexpr, NOUT: tl.constexpr,
                          NP: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr,
                          SINKHORN: tl.constexpr, NORM: tl.constexpr, SCALAR: tl.constexpr,
                          UOUT: tl.constexpr = True, ONE_PASS: tl.constexpr = False):
    """Token t: gates (and Sinkhorn M) from PART once, u[t] = Σ_s pre_s X[t, s] (bf16) over d;
    NORM: U = rmsnorm(u)·W instead of u. SCALAR (S = 4): the Sinkhorn on 16 per-thread scalars
    (_sinkhorn4) instead of [S, S] tensor reductions. ONE_PASS (BD >= D): X[t] is one tile,
    loaded once and kept for the output (the same ops as the two passes at that BD, so the same
    bits; the second pass's loads were a dependent round trip on the critical path)."""
    t = tl.program_id(0).to(tl.int64)
    rs = tl.arange(0, S)
    ri = tl.arange(0, SP)                                        # splits, padded to SP
    i_ok = ri < SPLIT
    part = PART + t * SPLIT * NP + ri * NP                       # [SP] split rows
    pre, r = _pre_gates(part, i_ok, rs, SCALE, BASE, K, hc_eps, norm_eps, NOUT)  # as mhc's
    if SINKHORN:
        post, c = _post_comb(part, i_ok, rs, r, SCALE, BASE, S)
        tl.store(POST + t * S + rs, post)
        if SCALAR:
            tl.static_assert(S == 4, "SCALAR needs S = 4")
            m = _sinkhorn4(c, iters, hc_eps)
            for i in tl.static_range(16):
                tl.store(MOUT + t * 16 + i, m[i])
        else:
            m = _sinkhorn(c, iters, hc_eps)
            tl.store(MOUT + t * S * S + rs[:, None] * S + rs[None, :], m)
    if UOUT:                                                     # False: post and M only
        _u_norm(X, W, U, t, pre, D, rms_eps, S, BD, NORM, ONE_PASS, False)


@triton.jit
def _u_load(X, W, t, D, S: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr, CG: tl.constexpr):
    """X[t] as one [S, BD] FP32 tile (BD >= D) and (NORM) the weight W [BD] (else zeros): the
    one-pass u's loads (post_mix's EARLY tail issues them before the gates' sums, so that they
    share one round trip). CG: X read from L2 (this launch wrote it)."""
    rs = tl.arange(0, S)
    rd = tl.arange(0, BD)
    d_ok = rd < D
    x = _ld(X + (t * S + rs[:, None]) * D + rd[None, :], d_ok[None, :], CG)
    w = tl.zeros((BD,), dtype=tl.float32)
    if NORM:
        w = tl.load(W + rd, mask=d_ok, other=0.0)
    return x, w


@triton.jit
def _u_store(x, w, U, t, pre, D, rms_eps, BD: tl.constexpr, NORM: tl.constexpr):
    """U[t] = u = Σ_s pre_s x_s from _u_load's tile, rounded to bf16 (NORM: rmsnorm(u)·w)."""
    rd = tl.arange(0, BD)
    d_ok = rd < D
    u = tl.sum(pre[:, None] * x, axis=0)                         # [BD] from [S, BD]
    if NORM:
        u = u.to(U.dtype.element_ty).to(tl.float32)
        u = u * tl.math.rsqrt(tl.sum(u * u, axis=0) / D + rms_eps)
        u = u * w
    tl.store(U + t * D + rd, u.to(U.dtype.element_ty), mask=d_ok)


@triton.jit
def _u_norm(X, W, U, t, pre, D, rms_eps, S: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr,
            ONE_PASS: tl.constexpr, CG: tl.constexpr):
    """U[t] = u = Σ_s pre_s X[t, s] rounded to bf16 (NORM: rmsnorm(u)·W instead), in d blocks of
    BD (ONE_PASS, BD >= D: one tile, _u_load then _u_store; else two passes with NORM, Σ u²
    first; the same ops, so the same bits); CG: X read from L2 (this launch wrote it)."""
    if ONE_PASS:
        x, w = _u_load(X, W, t, D, S, BD, NORM, CG)
        _u_store(x, w, U, t, pre, D, rms_eps, BD, NORM)
    else:
        rs = tl.arange(0, S)
        xrow = X + (t * S + rs[:, None]) * D                         # [S] stream rows
        inv = 1.0
        if NORM:                                                     # pass 1: Σ u² of the bf16 u
            ss = tl.zeros((BD,), dtype=tl.float32)
            for d0 in range(0, D, BD):
                rd = d0 + tl.arange(0, BD)
                x = _ld(xrow + rd[None, :], (rd < D)[None, :], CG)
                u = tl.sum(pre[:, None] * x, axis=0).to(U.dtype.element_ty).to(tl.float32)
                ss += u * u
            inv = tl.math.rsqrt(tl.sum(ss, axis=0) / D + rms_eps)
        for d0 in range(0, D, BD):
            rd = d0 + tl.arange(0, BD)
            d_ok = rd < D
            x = _ld(xrow + rd[None, :], d_ok[None, :], CG)
            u = tl.sum(pre[:, None] * x, axis=0)                     # [BD] from [S, BD]
            if NORM:
                u = u.to(U.dtype.element_ty).to(tl.float32) * inv
                u = u * tl.load(W + rd, mask=d_ok, other=0.0)
            tl.store(U + t * D + rd, u.to(U.dtype.element_ty), mask=d_ok)


def post_bd(T: int, d: int) -> int:
    """d block of _post_mix_kernel (its grid: T x d / BD programs, each streaming a [NP, S·BD]
    fn_next slice). H200, bench_mhc --decode, µs per mHC pair: T = 1: 32 12.9 (16 13.5, 64
    16.8, 128 17.2); T = 8: 64 16.0 (16 17.3); T = 63: 64 37.1 (16 49.1, 128 44.3, 256 70.2)."""
    return min(32 if T <= 4 else 64, triton.next_power_of_2(d))


def _check_norm(norm, d: int, device) -> None:
    w = norm[0]
    if w.dtype != torch.float32 or tuple(w.shape) != (d,) or w.device != device:
        raise ValueError(f"mhc.decode: norm weight must be fp32 [{d}] on {device}, "
                         f"got {w.dtype}{list(w.shape)} on {w.device}")


def _collapse_norm(X, fn, scale, base, iters, hc_eps, norm_eps, sinkhorn, norm, part, warps,
                   bd, scalar=None, uout=True, outs=None):
    """One _collapse_norm_kernel launch -> (u, post, M); outs: those tensors to write into
    (hc_pre_async's two launches share them), uout False: post and M only."""
    T, S, d = X.shape
    n_out = fn.shape[0]
    NP = triton.next_power_of_2(n_out + 1)
    if part is None:
        part = core._partials(X, fn.contiguous(), NP, None)
    elif part.dtype != torch.float32 or part.dim() != 3 or tuple(part.shape[::2]) != (T, NP) \
            or not 1 <= part.shape[1] <= core.MAX_SPLIT or not part.is_contiguous():
        raise ValueError(f"mhc.decode: part must be contiguous fp32 [{T}, 1..{core.MAX_SPLIT}, "
                         f"{NP}], got {part.dtype}{list(part.shape)}")
    if norm is not None:
        _check_norm(norm, d, X.device)
    u, post, M = outs or (torch.empty(T, d, dtype=X.dtype, device=X.device),
                          torch.empty(T, S, dtype=torch.float32, device=X.device),
                          torch.empty(T, S, S, dtype=torch.float32, device=X.device))
    if T == 0:
        return u, post, M
    w, eps = norm if norm is not None else (scale, 0.0)          # W unread without NORM
    split = part.shape[1]
    cfg = collapse_config(T)
    warps = cfg["warps"] if warps is None else warps
    scalar = cfg["scalar"] if scalar is None else scalar
    bd = min(cfg["bd"] if bd is None else bd, triton.next_power_of_2(d))
    if bd & (bd - 1) or bd < 16 or warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"mhc.decode: bd must be a power of 2 >= 16, warps 1..16, got {bd}, "
                         f"{warps}")
    _collapse_norm_kernel[(T,)](
        part, X, scale.contiguous(), base.contiguous(), w, u, post, M, split, d, S * d, iters,
        float(hc_eps), float(norm_eps), float(eps), S=S, NOUT=n_out, NP=NP,
        SP=triton.next_power_of_2(split), BD=bd,
        SINKHORN=sinkhorn, NORM=norm is not None, SCALAR=scalar and S == 4, UOUT=uout,
        ONE_PASS=bd >= d, num_warps=warps)
    return u, post, M


def hc_pre_async(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                 iters: int, hc_eps: float, norm_eps: float, norm: tuple | None = None,
                 part: torch.Tensor | None = None, u: torch.Tensor | None = None):
    """hc_pre with the Sinkhorn off the critical path -> (u, post, M, pending). Two launches of
    _collapse_norm_kernel on the same PART: gates + u (+ RMSNorm) on the current stream, what
    the sub-layer needs next, and post + M (the 20-pass Sinkhorn chain, ~4-5 µs of latency at
    T = 1) on the "mhc" side stream (runtime/streams.py) when SINKHORN_STREAM and X is on
    CUDA; only the hc_post after the sub-layer reads post / M: hc_post(..., wait=pending)
    joins there (join(pending) elsewhere; with SINKHORN_LAST pending holds the Sinkhorn's
    launch, which the join queues: post and M stay unwritten until it). Each output comes from
    the same ops as hc_pre's (bit for bit). Elsewhere (CPU, the interpreter) the two launches
    run in order and pending is None. u: the first launch's output already made by
    hc_post(pre=) (with part): only post + M are launched."""
    core.check_pre(X, fn, scale, base, iters)
    X = X.contiguous()
    T, S, d = X.shape
    if part is None:                                            # both launches read it
        part = core._partials(X, fn.contiguous(), triton.next_power_of_2(fn.shape[0] + 1), None)
    if u is not None and (tuple(u.shape) != (T, d) or u.dtype != X.dtype):
        raise ValueError(f"hc_pre_async: u must be {X.dtype}[{T}, {d}], got {u.dtype}"
                         f"{list(u.shape)}")
    outs = (u if u is not None else torch.empty(T, d, dtype=X.dtype, device=X.device),
            torch.empty(T, S, dtype=torch.float32, device=X.device),
            torch.empty(T, S, S, dtype=torch.float32, device=X.device))
    args = (X, fn, scale, base, int(iters), hc_eps, norm_eps)
    start = None
    if SINKHORN_STREAM and X.is_cuda and T:
        from backfit.runtime.streams import fork, mark
        start = mark(X.device)                                  # PART is queued
    if u is None:
        cu = collapse_config(T, COLLAPSE_U)
        _collapse_norm(*args, False, norm, part, cu["warps"], cu["bd"], outs=outs)  # gates + u
    if start is None:
        _collapse_norm(*args, True, None, part, None, None, uout=False, outs=outs)
        return (*outs, None)

    def sinkhorn():             # on "mhc" after PART; part, post, M referenced until the join
        with torch.cuda.stream(fork(X.device, "mhc", after=start)):
            _collapse_norm(*args, True, None, part, None, None, uout=False, outs=outs)
            done = torch.cuda.Event()
            done.record()
        return done, part
    return (*outs, _Deferred(sinkhorn) if SINKHORN_LAST else sinkhorn())


class _Deferred(NamedTuple):
    """hc_pre_async's pending with SINKHORN_LAST: the Sinkhorn's launch, queued by join."""
    launch: object


def join(pending, device: torch.device | None = None) -> None:
    """The current stream (of `device`) waits for hc_pre_async's pending (post and M written),
    queuing its deferred Sinkhorn launch first (SINKHORN_LAST); None: nothing to wait for."""
    if isinstance(pending, _Deferred):
        pending = pending.launch()
    if pending is not None:
        torch.cuda.current_stream(device).wait_event(pending[0])


def hc_pre(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           iters: int, hc_eps: float, norm_eps: float, norm: tuple | None = None,
           part: torch.Tensor | None = None, warps: int | None = None, bd: int | None = None,
           scalar: bool | None = None):
    """As core.hc_pre -> (u [T, d] bf16, post, M); norm = (weight [d] fp32, eps): u replaced by
    RMSNorm(u) (layers.RMSNorm) in the same launch. part: PART [T, SPLIT, NP] from hc_post(...,
    next_fn=fn) (else core._partials computes it, one more launch). warps, bd, scalar: override
    COLLAPSE."""
    core.check_pre(X, fn, scale, base, iters)
    return _collapse_norm(X.contiguous(), fn, scale, base, int(iters), hc_eps, norm_eps, True,
                          norm, part, warps, bd, scalar)


def hc_head(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            hc_eps: float, norm_eps: float, norm: tuple | None = None,
            part: torch.Tensor | None = None, warps: int | None = None,
            bd: int | None = None) -> torch.Tensor:
    """As core.hc_head -> h [T, d] bf16 (RMSNorm(h) with norm); part, warps, bd as for hc_pre."""
    S = X.shape[1] if X.dim() == 3 else 0
    core._check(X, fn, scale, base, S, 1, "hc_head")
    return _collapse_norm(X.contiguous(), fn, scale, base, 1, hc_eps, norm_eps, False, norm,
                          part, warps, bd)[0]


def hc_post(f, X: torch.Tensor, post: torch.Tensor, M: torch.Tensor,
            next_fn: torch.Tensor | None = None, bd: int | None = None, wait=None,
            pre: NextPre | None = None, bd_u: int | None = None, warps: int | None = None):
    """As core.hc_post -> out [T, S, d] bf16; next_fn [n_out, S·d] fp32 (the next hc_pre's or
    hc_head's fn): -> (out, PART [T, cdiv(d, BD), NP] for that call's part=), one launch.
    f: [T, d], or a pointwise.PairSum (the MoE's pairs, summed here as moe_combine would; at
    tp > 1 one FP32 "pair", the all-reduced MoE output, rounded here as its .to(bf16) would).
    bd: d block (default post_bd). wait: hc_pre_async's pending (post / M from the side
    stream; join): the current stream waits for it first. pre (with next_fn, a NextPre of the next
    hc_pre with its RMSNorm): -> (out, PART, u), u = what that hc_pre's critical launch gives
    at d block bd_u (hc_pre_async(..., u=u) skips that launch); bd_u, warps: FOLD's defaults;
    past FOLD_MAX_T tokens u is None (the caller's hc_pre_async makes it)."""
    if wait is not None:
        join(wait, X.device)
    # a pointwise.PairSum (a NamedTuple; tested as a tuple, not by class: the tests re-import
    # kernel modules, and a re-imported pointwise makes a PairSum class of its own)
    pairs = f if isinstance(f, tuple) else None
    if pairs is not None:                # f = moe_combine(*pairs), summed in this launch
        if pairs.out.dtype not in _FT or pairs.dtype not in _FT \
                or (pairs.shared is not None and pairs.shared.dtype != torch.bfloat16):
            raise ValueError(f"hc_post: PairSum of bf16 / fp32 pairs (and bf16 shared) summed to "
                             f"bf16 or fp32, got {pairs.out.dtype} -> {pairs.dtype}")
        f = pairs.out[::pairs.k]         # [T, d]: the shapes check_post expects
    core.check_post(f, X, post, M)
    T, S, d = X.shape
    n_out = next_fn.shape[0] if next_fn is not None else 1
    if next_fn is not None and (next_fn.dtype != torch.float32 or next_fn.dim() != 2
                                or next_fn.shape[1] != S * d or next_fn.device != X.device):
        raise ValueError(f"hc_post: next_fn must be fp32 [n_out, {S * d}] on {X.device}, "
                         f"got {next_fn.dtype}{list(next_fn.shape)}")
    BD = bd or post_bd(T, d)
    if BD & (BD - 1) or not 16 <= BD or triton.cdiv(d, BD) > core.MAX_SPLIT:
        raise ValueError(f"hc_post: bd must be a power of 2 >= 16 with d/bd <= {core.MAX_SPLIT}, "
                         f"got {BD} for d {d}")
    NP = triton.next_power_of_2(n_out + 1)
    out = torch.empty(T, S, d, dtype=X.dtype, device=X.device)
    blocks = triton.cdiv(d, BD)
    part = torch.empty(T, blocks, NP, dtype=torch.float32, device=X.device) \
        if next_fn is not None else out
    extra = {} if pairs is None else dict(
        SH=pairs.shared if pairs.shared is not None else pairs.out, KC=pairs.k,
        HAS_SH=pairs.shared is not None, FT=_FT[pairs.dtype])
    u = None
    fold = pre is not None and T <= FOLD_MAX_T          # else (out, part, None)
    if fold:
        if next_fn is None or n_out != (2 + S) * S:
            raise ValueError(f"hc_post: pre= needs the next hc_pre's next_fn [{(2 + S) * S}, "
                             f"{S * d}]")
        _check_norm((pre.norm_w,), d, X.device)
        bd_u = min(bd_u or FOLD["bd_u"], triton.next_power_of_2(d))
        if bd_u & (bd_u - 1) or bd_u < 16:
            raise ValueError(f"hc_post: bd_u must be a power of 2 >= 16, got {bd_u}")
        u = torch.empty(T, d, dtype=X.dtype, device=X.device)
        extra.update(CNT=stream_counters(X.device, T), SCALE=pre.scale.contiguous(),
                     BASE=pre.base.contiguous(), NW=pre.norm_w, U=u, hc_eps=float(pre.hc_eps),
                     norm_eps=float(pre.norm_eps), rms_eps=float(pre.rms_eps),
                     SP=triton.next_power_of_2(blocks), BDU=bd_u, PRE=True, ONE_PASS=bd_u >= d,
                     EARLY=bd_u >= d and T <= FOLD["one_pass_max_t"])    # EARLY: one pass too
    if T:
        _post_mix_kernel[(T, blocks)](
            f.contiguous() if pairs is None else pairs.out, X.contiguous(), post.contiguous(),
            M.contiguous(), out, next_fn.contiguous() if next_fn is not None else post, part, d,
            S * d, S=S, NOUT=n_out, NP=NP, BD=BD, HAS_FN=next_fn is not None,
            num_warps=(warps or FOLD["warps"]) if fold else 4, **extra)
    if pre is not None:
        return out, part, u
    return (out, part) if next_fn is not None else out
