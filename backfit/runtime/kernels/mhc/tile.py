"""mHC's tiled prefill path (kernels.mhc.core's hc_pre / hc_head at T >= MIX_TORCH_T with PREFILL
"tiled"): the partials of many tokens per program, then the collapse, 2 launches, SM80-safe.

  _mix_tile_kernel     program (BT tokens, K split): X read once in bf16, the [BK, NP] fnᵀ tile
                       from L2, dots and Σx² to PART. MMA3: fn = b1 + b2 + b3 (exact bf16
                       pieces) through the bf16 mma; else FP32 FMA dots. H200, T 8192: post / M
                       3.9e-6 / 3.7e-6 from the torch reference, u bit-identical on >= 99.9 %.
  _collapse_tile_kernel  program (BTU tokens): gates and Sinkhorn once a token (kernels.mhc.core's
                       _collapse_kernel's op order), u over d.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backfit.runtime.kernels.common import dot_bf16, interpreted, num_sms

__all__ = ["collapse_tiled", "tile_config"]


@triton.jit
def _mix_tile_kernel(X, FN, PART, T, K, K_SPLIT, SPLIT, NOUT: tl.constexpr, NP: tl.constexpr,
                     BT: tl.constexpr, BK: tl.constexpr, MMA3: tl.constexpr,
                     F32: tl.constexpr):
    """Prefill partials, program (token block p, K split i): PART[t, i, :NOUT] = x[t, ks] · fn[:,
    ks] and PART[t, i, NOUT] = Σ x[t, ks]² for the BT tokens of block p. X is read once (bf16);
    the [BK, NP] fn tile comes from L2 and serves BT tokens. MMA3: fn = b1 + b2 + b3 (three
    bf16 pieces, exact) through bf16 mma.sync, exact products, FP32 accumulate; else FP32 FMA
    dots (input_precision "ieee", no tensor cores). F32: gemm.dot_bf16's interpreter switch."""
    p, i = tl.program_id(0), tl.program_id(1)
    rt = (p * BT + tl.arange(0, BT)).to(tl.int64)
    t_ok = rt < T
    rn = tl.arange(0, NP)
    n_ok = rn < NOUT
    rk = tl.arange(0, BK)
    acc = tl.zeros((BT, NP), dtype=tl.float32)
    sq = tl.zeros((BT, BK), dtype=tl.float32)
    k_lo = i * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + rk
        k_ok = kk < k_hi
        x = tl.load(X + rt[:, None] * K + kk[None, :], mask=t_ok[:, None] & k_ok[None, :],
                    other=0.0)                                            # [BT, BK] bf16
        w = tl.load(FN + rn[None, :] * K + kk[:, None], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)                                            # [BK, NP] fp32 = fnᵀ
        xf = x.to(tl.float32)
        if MMA3:
            w1 = w.to(tl.bfloat16)
            r1 = w - w1.to(tl.float32)                                    # exact in fp32
            w2 = r1.to(tl.bfloat16)
            w3 = (r1 - w2.to(tl.float32)).to(tl.bfloat16)                 # the last <= 8 bits
            # the mma accumulates one BK step only (its adds truncate, not IEEE round to
            # nearest); the sum over steps is an FP32 add in registers
            step = dot_bf16(x, w3, tl.zeros((BT, NP), dtype=tl.float32), F32)
            step = dot_bf16(x, w2, step, F32)                             # small pieces first
            acc += dot_bf16(x, w1, step, F32)
        else:
            acc = tl.dot(xf, w, acc, input_precision="ieee")
        sq += xf * xf
    acc = tl.where(rn[None, :] == NOUT, tl.sum(sq, axis=1)[:, None], acc)  # slot NOUT: Σx²
    tl.store(PART + (rt[:, None] * SPLIT + i) * NP + rn[None, :], acc, mask=t_ok[:, None])


@triton.jit
def _collapse_tile_kernel(PART, X, SCALE, BASE, U, POST, MOUT, T, SPLIT, D, K, iters, hc_eps,
                          norm_eps, S: tl.constexpr, NOUT: tl.constexpr, NP: tl.constexpr,
                          BT: tl.constexpr, BD: tl.constexpr, SINKHORN: tl.constexpr):
    """Prefill collapse, program = BT tokens: the splits summed in split order, the gates and
    (SINKHORN) M once per token, in _collapse_kernel's op order, then u[t] = Σ_s pre_s X[t, s]
    streamed over d in BD blocks."""
    p = tl.program_id(0)
    rt = (p * BT + tl.arange(0, BT)).to(tl.int64)
    t_ok = rt < T
    rs = tl.arange(0, S)
    cjk = 2 * S + rs[:, None] * S + rs[None, :]                 # comb logit of C[j, k]
    row = PART + rt * SPLIT * NP                                 # [BT] first split rows
    lp = tl.zeros((BT, S), dtype=tl.float32)
    sq = tl.zeros((BT,), dtype=tl.float32)
    lq = tl.zeros((BT, S), dtype=tl.float32)
    lc = tl.zeros((BT, S, S), dtype=tl.float32)
    for i in range(SPLIT):
        r_i = row + i * NP
        lp += tl.load(r_i[:, None] + rs[None, :], mask=t_ok[:, None], other=0.0)
        sq += tl.load(r_i + NOUT, mask=t_ok, other=0.0)
        if SINKHORN:
            lq += tl.load(r_i[:, None] + S + rs[None, :], mask=t_ok[:, None], other=0.0)
            lc += tl.load(r_i[:, None, None] + cjk[None, :, :], mask=t_ok[:, None, None],
                          other=0.0)
    r = 1.0 / tl.sqrt_rn(sq / K + norm_eps)                     # [BT] rsqrt(mean(x²) + eps)
    pre = tl.sigmoid(lp * r[:, None] * tl.load(SCALE) + tl.load(BASE + rs)[None, :]) + hc_eps
    if SINKHORN:
        post = 2.0 * tl.sigmoid(lq * r[:, None] * tl.load(SCALE + 1)
                                + tl.load(BASE + S + rs)[None, :])
        c = lc * r[:, None, None] * tl.load(SCALE + 2) + tl.load(BASE + cjk)[None, :, :]
        e = tl.exp(c - tl.max(c, axis=2)[:, :, None])
        m = e / tl.sum(e, axis=2)[:, :, None] + hc_eps                   # row softmax (over k)
        m = m / (tl.sum(m, axis=1)[:, None, :] + hc_eps)                 # column normalise
        for _ in range(iters - 1):
            m = m / (tl.sum(m, axis=2)[:, :, None] + hc_eps)
            m = m / (tl.sum(m, axis=1)[:, None, :] + hc_eps)
        tl.store(POST + rt[:, None] * S + rs[None, :], post, mask=t_ok[:, None])
        tl.store(MOUT + rt[:, None, None] * (S * S) + rs[None, :, None] * S + rs[None, None, :],
                 m, mask=t_ok[:, None, None])
    xrow = X + (rt[:, None] * S + rs[None, :]) * D               # [BT, S] stream rows
    for d0 in range(0, D, BD):
        rd = d0 + tl.arange(0, BD)
        d_ok = rd < D
        x = tl.load(xrow[:, :, None] + rd[None, None, :], mask=t_ok[:, None, None]
                    & d_ok[None, None, :], other=0.0).to(tl.float32)      # [BT, S, BD]
        u = tl.sum(pre[:, :, None] * x, axis=1)
        tl.store(U + rt[:, None] * D + rd[None, :], u.to(U.dtype.element_ty),
                 mask=t_ok[:, None] & d_ok[None, :])


def tile_config(T: int, K: int, sms: int) -> dict:
    """Tiled prefill launch config: partials BT tokens x BK a step, K split for ~2 programs an SM
    but >= 8 BK steps a split; collapse BTU tokens a program. H200 (bench_mhc.py), hc_pre /
    hc_head: T 8192 192-216 / 173-208 us at split 5 (torch path 2507 / 2240); T 1024 35 / 27."""
    BT, BK = 128, 64
    split = max(1, min(triton.cdiv(K, BK) // 8, triton.cdiv(2 * sms, triton.cdiv(T, BT))))
    return dict(BT=BT, BK=BK, split=split, warps=8, MMA3=True, BTU=2, BD=1024, warps_u=4)


def collapse_tiled(X, fn, scale, base, iters, hc_eps, norm_eps, sinkhorn, tile):
    """Prefill: _mix_tile_kernel partials [T, split, NP] then _collapse_tile_kernel (2 launches)."""
    T, S, d = X.shape
    n_out, K = fn.shape
    NP = max(16, triton.next_power_of_2(n_out + 1))            # tl.dot needs N >= 16
    cfg = tile_config(T, K, num_sms(X.device))
    if set(tile or {}) - set(cfg):
        raise ValueError(f"mhc: unknown tile keys {sorted(set(tile) - set(cfg))}")
    cfg.update(tile or {})
    BT, BK, BTU = cfg["BT"], cfg["BK"], cfg["BTU"]
    if BT < 16 or BK < 16 or BT & (BT - 1) or BK & (BK - 1) or BTU & (BTU - 1):
        raise ValueError(f"mhc: BT, BK must be powers of 2 >= 16, BTU a power of 2, got {cfg}")
    u = torch.empty(T, d, dtype=X.dtype, device=X.device)
    post = torch.empty(T, S, dtype=torch.float32, device=X.device)
    M = torch.empty(T, S, S, dtype=torch.float32, device=X.device)
    if T == 0:
        return u, post, M
    steps = triton.cdiv(K, BK)
    k_split = triton.cdiv(steps, max(1, min(cfg["split"], steps))) * BK
    split = triton.cdiv(K, k_split)                            # no empty split
    part = torch.empty(T, split, NP, dtype=torch.float32, device=X.device)
    _mix_tile_kernel[(triton.cdiv(T, BT), split)](
        X.view(T, K), fn.contiguous(), part, T, K, k_split, split, NOUT=n_out, NP=NP, BT=BT,
        BK=BK, MMA3=bool(cfg["MMA3"]), F32=interpreted(), num_warps=cfg["warps"])
    _collapse_tile_kernel[(triton.cdiv(T, BTU),)](
        part, X, scale.contiguous(), base.contiguous(), u, post, M, T, split, d, K, iters,
        float(hc_eps), float(norm_eps), S=S, NOUT=n_out, NP=NP, BT=BTU,
        BD=min(cfg["BD"], triton.next_power_of_2(d)), SINKHORN=sinkhorn,
        num_warps=cfg["warps_u"])
    return u, post, M
