"""The fma variant of kernels.linear.gemv (its config key "variant": "fma"): per-thread FP32
accumulators [BN, G, 128] for each row (up to 8), FMAs of (q·s in FP32, the reference's
dequantized weight) times x, one cross-thread sum per row at the end; x and W tiles in one
register layout. gemv.launch launches it; the helpers both variants share live here."""

from __future__ import annotations

import triton
import triton.language as tl

from backfit.runtime.kernels.common import MAGIC_F, MAGIC_I


@triton.jit
def _group_offset(pid, K, BN: tl.constexpr, GROUP_N: tl.constexpr):
    """The x offset of program pid's rows: group (pid·BN) // GROUP_N's K inputs (0 ungrouped)."""
    off = pid.to(tl.int64) * 0
    if GROUP_N > 0:
        off = ((pid * BN) // GROUP_N).to(tl.int64) * K
    return off


@triton.jit
def _tile(X, W, pid, N, K, BN: tl.constexpr, BK: tl.constexpr, GROUP_N: tl.constexpr,
          V8: tl.constexpr):
    """Program pid's tile, both variants: (X at its rows' inputs (GROUP_N), rn [BN] its rows,
    n_ok, rn_c (rows past N re-read row N-1: unmasked loads), rg [G], kofs [G, 128] the K
    offsets of a step, w_ptr [BN, G, 128] at step 0). V8: the 128 columns as 8-element runs
    (= rc, but contiguity 8 for the axis analysis)."""
    G: tl.constexpr = BK // 128
    X = X + _group_offset(pid, K, BN, GROUP_N)
    rn = pid * BN + tl.arange(0, BN)
    n_ok = rn < N
    rn_c = tl.minimum(rn, N - 1).to(tl.int64)
    rg = tl.arange(0, G)
    rc = tl.arange(0, 128)
    if V8:
        rc = (rc // 8) * 8 + rc % 8
    kofs = rg[:, None] * 128 + rc[None, :]                                   # [G, 128]
    return X, rn, n_ok, rn_c, rg, kofs, W + rn_c[:, None, None] * K + kofs[None, :, :]


@triton.jit
def _to_f32(q, MAGIC: tl.constexpr):
    """An int8 (or bf16) weight tile in FP32. MAGIC: 1.5·2^23 + q (|q| <= 127) is exact, minus
    it q exact, without an int -> float conversion."""
    if MAGIC:
        return (q.to(tl.int32) + MAGIC_I).to(tl.float32, bitcast=True) - MAGIC_F
    return q.to(tl.float32)


@triton.jit
def _fma_row(acc, wf, x_ptr, k_ok, EVEN_K: tl.constexpr):
    """acc [BN, G, 128] + wf · x_row (x_ptr, k_ok [G, 128]): per-element FP32 FMAs, no
    reduction."""
    if EVEN_K:
        xm = tl.load(x_ptr)
    else:
        xm = tl.load(x_ptr, mask=k_ok, other=0.0)
    return acc + wf * xm.to(tl.float32)[None, :, :]


@triton.jit
def _row_out(Y, acc, m: tl.constexpr, M, N, rn, n_ok):
    """y[m, rn] = Σ acc (one cross-thread reduction per row, after the K loop)."""
    tl.store(Y + m * N + rn, tl.sum(tl.sum(acc, axis=2), axis=1).to(Y.dtype.element_ty),
             mask=n_ok & (tl.full(rn.shape, m, tl.int32) < M))


@triton.jit
def _gemv_fma_kernel(X, W, S, Y, M, N, K, stride_xm,
                     QUANT: tl.constexpr, MAGIC: tl.constexpr, EVEN_K: tl.constexpr,
                     MP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     STAGES: tl.constexpr = 1, GROUP_N: tl.constexpr = 0):
    """_gemv_kernel's contract; per-thread accumulators [BN, G, 128] per row (MP <= 8), reduced
    once after the K loop: no shuffles, barriers or layout changes inside it. The 128 columns
    are 8-element runs (8 B int8 / 16 B bf16 loads) so x and W tiles share one layout."""
    G: tl.constexpr = BK // 128
    X, rn, n_ok, rn_c, rg, kofs, w_ptr = _tile(X, W, tl.program_id(0), N, K, BN, BK, GROUP_N,
                                               True)
    x_ptr = X + kofs
    a0 = tl.zeros((BN, G, 128), dtype=tl.float32)
    a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0   # rows >= MP: dead, dropped
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        k_ok = (k0 + kofs) < K
        if EVEN_K:
            q = tl.load(w_ptr + k0)
        else:
            q = tl.load(w_ptr + k0, mask=k_ok[None, :, :], other=0)
        wf = _to_f32(q, MAGIC)                                               # [BN, G, 128]
        if QUANT:                        # q·s in FP32: the reference's dequantized weight
            g_ok = (k0 // 128 + rg) < K // 128
            sc = tl.load(S + rn_c[:, None] * (K // 128) + k0 // 128 + rg[None, :],
                         mask=g_ok[None, :], other=0.0)                      # [BN, G] fp32
            wf = wf * sc[:, :, None]
        xk = x_ptr + k0                  # x rows past M: row M-1 again (never stored)
        a0 = _fma_row(a0, wf, xk, k_ok, EVEN_K)
        if MP > 1:
            a1 = _fma_row(a1, wf, xk + tl.minimum(1, M - 1) * stride_xm, k_ok, EVEN_K)
        if MP > 2:
            a2 = _fma_row(a2, wf, xk + tl.minimum(2, M - 1) * stride_xm, k_ok, EVEN_K)
            a3 = _fma_row(a3, wf, xk + tl.minimum(3, M - 1) * stride_xm, k_ok, EVEN_K)
        if MP > 4:
            a4 = _fma_row(a4, wf, xk + tl.minimum(4, M - 1) * stride_xm, k_ok, EVEN_K)
            a5 = _fma_row(a5, wf, xk + tl.minimum(5, M - 1) * stride_xm, k_ok, EVEN_K)
            a6 = _fma_row(a6, wf, xk + tl.minimum(6, M - 1) * stride_xm, k_ok, EVEN_K)
            a7 = _fma_row(a7, wf, xk + tl.minimum(7, M - 1) * stride_xm, k_ok, EVEN_K)
    _row_out(Y, a0, 0, M, N, rn, n_ok)
    if MP > 1:
        _row_out(Y, a1, 1, M, N, rn, n_ok)
    if MP > 2:
        _row_out(Y, a2, 2, M, N, rn, n_ok)
        _row_out(Y, a3, 3, M, N, rn, n_ok)
    if MP > 4:
        _row_out(Y, a4, 4, M, N, rn, n_ok)
        _row_out(Y, a5, 5, M, N, rn, n_ok)
        _row_out(Y, a6, 6, M, N, rn, n_ok)
        _row_out(Y, a7, 7, M, N, rn, n_ok)
