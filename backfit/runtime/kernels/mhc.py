"""mHC (runtime.model.hyper) in Triton: hc_pre, hc_post, hc_head with the torch functions'
signatures and results, FP32 math on CUDA cores, SM80-safe, no host syncs (CUDA-graph safe).

X [T, S, d] bf16 streams (S = hc_mult = 4), fn [n_out, S*d] FP32, n_out = (2+S)·S (pre, post,
comb) or S (head). Launches at T < MIX_TORCH_T: hc_pre 2, hc_head 2, hc_post 1 (torch ~140).
  _mix_partial_kernel  program (token t, K split i): over flattened K range i of x = X[t]
                       the n_out dots fn·x and Σx², FP32, to PART[t, i, :NP] (dots at 0..n_out-1,
                       Σx² at n_out), >= ~2 programs per SM streaming fn (1.5 MB) at T = 1.
  _collapse_kernel     program (t, d block): the gates (_pre_gates) and (SINKHORN) post and M
                       (_post_comb, _sinkhorn: hyper.hc_pre's order; shared with mhc_decode),
                       u[t, block] = Σ_s pre_s X_s (bf16); d block 0 writes post and M.
  _post_kernel         out[t, k, block] = post[t,k]·f[t, block] + Σ_j M[t,j,k]·X[t,j, block].
Prefill (T >= MIX_TORCH_T): PREFILL = "torch" (FP32 matmul partials) or "tiled" (default):
  _mix_tile_kernel     program (BT tokens, K split): X read once in bf16, the [BK, NP] fnᵀ tile
                       from L2, dots and Σx² to PART. MMA3: fn = b1 + b2 + b3 (exact bf16
                       pieces) through the bf16 mma; else FP32 FMA dots. H200, T 8192: post / M
                       3.9e-6 / 3.7e-6 from the torch reference, u bit-identical on >= 99.9 %.
  _collapse_tile_kernel  program (BTU tokens): gates and Sinkhorn once a token, u over d.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backfit.runtime.kernels.gemm import _num_sms, dot_bf16, interpreted

__all__ = ["hc_pre", "hc_post", "hc_head", "MIX_TORCH_T", "MAX_SPLIT", "mix_split", "PREFILL",
           "tile_config", "check_pre", "check_post"]

MIX_TORCH_T = 64        # tokens from which the prefill path (PREFILL) replaces the split kernel
_BK = 128               # flattened-K step of the partial kernel: [NP, 128] FP32 fn tile
_BD = 256               # d block of the collapse / post kernels
MAX_SPLIT = 256         # K splits at most (the collapse kernel gathers them as one [SP, .] tile)
PREFILL = "tiled"       # T >= MIX_TORCH_T: "torch" (FP32 matmul logits) or "tiled" (two kernels)


@triton.jit
def _mix_partial_kernel(X, FN, PART, K, K_SPLIT, SPLIT,
                        NOUT: tl.constexpr, NP: tl.constexpr, BK: tl.constexpr):
    """PART[t, i, :NOUT] = fn[:, ks] · x[t, ks], PART[t, i, NOUT] = Σ x[t, ks]², ks = split i."""
    t, i = tl.program_id(0).to(tl.int64), tl.program_id(1)
    rn = tl.arange(0, NP)
    rk = tl.arange(0, BK)
    n_ok = rn < NOUT
    acc = tl.zeros((NP,), dtype=tl.float32)
    sq = tl.zeros((BK,), dtype=tl.float32)
    k_lo = i * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + rk
        k_ok = kk < k_hi
        x = tl.load(X + t * K + kk, mask=k_ok, other=0.0).to(tl.float32)          # [BK]
        w = tl.load(FN + rn[:, None] * K + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)                                                    # [NP, BK]
        acc += tl.sum(w * x[None, :], axis=1)
        sq += x * x
    acc = tl.where(rn == NOUT, tl.sum(sq, axis=0), acc)          # slot NOUT carries Σx²
    tl.store(PART + (t * SPLIT + i) * NP + rn, acc)


@triton.jit
def _pre_gates(part, i_ok, rs, SCALE, BASE, K, hc_eps, norm_eps, NOUT: tl.constexpr):
    """The split rows part [SP] (live where i_ok) -> (pre [S], r): one gather per logit group,
    summed over the splits by a fixed-shape tree (deterministic); r = rsqrt(mean(x²) + eps)."""
    lp = tl.sum(tl.load(part[:, None] + rs[None, :], mask=i_ok[:, None], other=0.0), axis=0)
    sq = tl.sum(tl.load(part + NOUT, mask=i_ok, other=0.0), axis=0)
    r = 1.0 / tl.sqrt_rn(sq / K + norm_eps)
    return tl.sigmoid(lp * r * tl.load(SCALE) + tl.load(BASE + rs)) + hc_eps, r


@triton.jit
def _post_comb(part, i_ok, rs, r, SCALE, BASE, S: tl.constexpr):
    """-> (post [S], C [S(j), S(k)]); the S x S comb block is read [j, k] at logit index
    2S + S·j + k (hyper.hc_pre's view)."""
    cjk = 2 * S + rs[:, None] * S + rs[None, :]
    lq = tl.sum(tl.load(part[:, None] + S + rs[None, :], mask=i_ok[:, None], other=0.0), 0)
    lc = tl.sum(tl.load(part[:, None, None] + cjk[None, :, :], mask=i_ok[:, None, None],
                        other=0.0), axis=0)
    post = 2.0 * tl.sigmoid(lq * r * tl.load(SCALE + 1) + tl.load(BASE + S + rs))
    return post, lc * r * tl.load(SCALE + 2) + tl.load(BASE + cjk)


@triton.jit
def _sinkhorn(c, iters, hc_eps):
    """C [S, S] -> M: row softmax + eps, column normalise, iters - 1 (row, column) passes."""
    e = tl.exp(c - tl.max(c, axis=1)[:, None])
    m = e / tl.sum(e, axis=1)[:, None] + hc_eps                          # row softmax (over k)
    m = m / (tl.sum(m, axis=0)[None, :] + hc_eps)                        # column normalise
    for _ in range(iters - 1):
        m = m / (tl.sum(m, axis=1)[:, None] + hc_eps)
        m = m / (tl.sum(m, axis=0)[None, :] + hc_eps)
    return m


@triton.jit
def _collapse_kernel(PART, X, SCALE, BASE, U, POST, MOUT, SPLIT, D, K, iters, hc_eps, norm_eps,
                     S: tl.constexpr, NOUT: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr,
                     BD: tl.constexpr, SINKHORN: tl.constexpr):
    """Token t, d block b: gates (and Sinkhorn M) from PART, u[t, block] = Σ_s pre_s X[t, s]."""
    t, b = tl.program_id(0).to(tl.int64), tl.program_id(1)
    rs = tl.arange(0, S)
    ri = tl.arange(0, SP)                                        # splits, padded to SP
    i_ok = ri < SPLIT
    part = PART + t * SPLIT * NP + ri * NP                       # [SP] split rows
    pre, r = _pre_gates(part, i_ok, rs, SCALE, BASE, K, hc_eps, norm_eps, NOUT)
    if SINKHORN:
        post, c = _post_comb(part, i_ok, rs, r, SCALE, BASE, S)
        m = _sinkhorn(c, iters, hc_eps)
        first = (tl.zeros((S,), dtype=tl.int32) + b) == 0               # d block 0 writes them
        tl.store(POST + t * S + rs, post, mask=first)
        tl.store(MOUT + t * S * S + rs[:, None] * S + rs[None, :], m, mask=first[:, None])
    rd = b * BD + tl.arange(0, BD)
    d_ok = rd < D
    x = tl.load(X + (t * S + rs[:, None]) * D + rd[None, :], mask=d_ok[None, :],
                other=0.0).to(tl.float32)                                # [S, BD]
    u = tl.sum(pre[:, None] * x, axis=0)
    tl.store(U + t * D + rd, u.to(U.dtype.element_ty), mask=d_ok)


@triton.jit
def _post_inputs(F, X, D, S: tl.constexpr, BD: tl.constexpr):
    """Program (t, d block) -> (t, rs, rd, d_ok, X[t, :, block] [S, BD], f[t, block] [BD] FP32)."""
    t, b = tl.program_id(0).to(tl.int64), tl.program_id(1)
    rs = tl.arange(0, S)
    rd = b * BD + tl.arange(0, BD)
    d_ok = rd < D
    x = tl.load(X + (t * S + rs[:, None]) * D + rd[None, :], mask=d_ok[None, :],
                other=0.0).to(tl.float32)
    f = tl.load(F + t * D + rd, mask=d_ok, other=0.0).to(tl.float32)
    return t, rs, rd, d_ok, x, f


@triton.jit
def _post_kernel(F, X, POST, MIX, OUT, D, S: tl.constexpr, BD: tl.constexpr):
    """out[t, k, block] = post[t, k]·f[t, block] + Σ_j M[t, j, k]·X[t, j, block], FP32 math."""
    t, rs, rd, d_ok, x, f = _post_inputs(F, X, D, S, BD)
    m = tl.load(MIX + t * S * S + rs[:, None] * S + rs[None, :])         # [S(j), S(k)]
    post = tl.load(POST + t * S + rs)                                    # [S(k)]
    mixed = tl.sum(m[:, :, None] * x[:, None, :], axis=0)               # [S(k), BD]
    out = post[:, None] * f[None, :] + mixed
    tl.store(OUT + (t * S + rs[:, None]) * D + rd[None, :], out.to(OUT.dtype.element_ty),
             mask=d_ok[None, :])


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


def mix_split(T: int, K: int, sms: int) -> int:
    """K splits of the partial kernel: >= ~2 programs per SM in all, at most one per BK step."""
    steps = triton.cdiv(K, _BK)
    split = max(1, min(steps, MAX_SPLIT, triton.cdiv(2 * sms, max(T, 1))))
    return triton.cdiv(steps, triton.cdiv(steps, split))       # no empty split


def _check(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           n_out: int, n_scale: int, name: str) -> None:
    if X.dim() != 3 or X.dtype != torch.bfloat16 or X.shape[1] & (X.shape[1] - 1):
        raise ValueError(f"{name}: X must be bf16 [T, S, d] with S a power of 2, "
                         f"got {X.dtype}{list(X.shape)}")
    _, S, d = X.shape
    if fn.dtype != torch.float32 or tuple(fn.shape) != (n_out, S * d):
        raise ValueError(f"{name}: fn must be fp32 [{n_out}, {S * d}], "
                         f"got {fn.dtype}{list(fn.shape)}")
    if base.dtype != torch.float32 or base.numel() != n_out or scale.dtype != torch.float32 \
            or scale.numel() < n_scale:
        raise ValueError(f"{name}: base fp32 [{n_out}] and scale fp32 [{n_scale}] expected, got "
                         f"{base.dtype}{list(base.shape)} / {scale.dtype}{list(scale.shape)}")
    if not (X.device == fn.device == scale.device == base.device):
        raise ValueError(f"{name}: X, fn, scale, base on different devices")


def check_pre(X, fn, scale, base, iters: int) -> None:   # hc_pre's inputs (and mhc_decode's)
    S = X.shape[1] if X.dim() == 3 else 0
    _check(X, fn, scale, base, (2 + S) * S, 3, "hc_pre")
    if iters < 1:
        raise ValueError(f"hc_pre: iters must be >= 1, got {iters}")


def _partials(X: torch.Tensor, fn: torch.Tensor, NP: int, split: int | None) -> torch.Tensor:
    """PART [T, SPLIT, NP] FP32: per split the n_out dots (0..n_out-1) and Σx² (slot n_out)."""
    T = X.shape[0]
    n_out, K = fn.shape
    x = X.reshape(T, K)
    if split is None and T >= MIX_TORCH_T:                     # prefill: one FP32 matmul
        xf = x.float()
        part = torch.empty(T, 1, NP, dtype=torch.float32, device=X.device)   # pad never read
        part[:, 0, :n_out] = xf @ fn.T
        part[:, 0, n_out] = xf.square().sum(-1)
        return part
    if split is None:
        split = mix_split(T, K, _num_sms(X.device))
    if not 1 <= split <= MAX_SPLIT:
        raise ValueError(f"mhc: split must be in 1..{MAX_SPLIT}, got {split}")
    k_split = triton.cdiv(triton.cdiv(K, _BK), split) * _BK
    split = triton.cdiv(K, k_split)
    part = torch.empty(T, split, NP, dtype=torch.float32, device=X.device)
    _mix_partial_kernel[(T, split)](x, fn, part, K, k_split, split, NOUT=n_out, NP=NP, BK=_BK,
                                    num_warps=4)
    return part


def tile_config(T: int, K: int, sms: int) -> dict:
    """Tiled prefill launch config: partials BT tokens x BK a step, K split for ~2 programs an SM
    but >= 8 BK steps a split; collapse BTU tokens a program. H200 (bench_mhc.py), hc_pre /
    hc_head: T 8192 192-216 / 173-208 us at split 5 (torch path 2507 / 2240); T 1024 35 / 27."""
    BT, BK = 128, 64
    split = max(1, min(triton.cdiv(K, BK) // 8, triton.cdiv(2 * sms, triton.cdiv(T, BT))))
    return dict(BT=BT, BK=BK, split=split, warps=8, MMA3=True, BTU=2, BD=1024, warps_u=4)


def _collapse_tiled(X, fn, scale, base, iters, hc_eps, norm_eps, sinkhorn, tile):
    """Prefill: _mix_tile_kernel partials [T, split, NP] then _collapse_tile_kernel (2 launches)."""
    T, S, d = X.shape
    n_out, K = fn.shape
    NP = max(16, triton.next_power_of_2(n_out + 1))            # tl.dot needs N >= 16
    cfg = tile_config(T, K, _num_sms(X.device))
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


def _collapse(X, fn, scale, base, iters, hc_eps, norm_eps, sinkhorn, split, prefill, tile):
    T, S, d = X.shape
    prefill = PREFILL if prefill is None else prefill
    if prefill not in ("torch", "tiled"):
        raise ValueError(f"mhc: prefill must be 'torch' or 'tiled', got {prefill!r}")
    if split is None and T >= MIX_TORCH_T and prefill == "tiled":
        return _collapse_tiled(X, fn, scale, base, iters, hc_eps, norm_eps, sinkhorn, tile)
    n_out = fn.shape[0]
    NP = triton.next_power_of_2(n_out + 1)
    u = torch.empty(T, d, dtype=X.dtype, device=X.device)
    post = torch.empty(T, S, dtype=torch.float32, device=X.device)
    M = torch.empty(T, S, S, dtype=torch.float32, device=X.device)
    if T == 0:
        return u, post, M
    part = _partials(X, fn.contiguous(), NP, split)
    BD = min(_BD, triton.next_power_of_2(d))
    _collapse_kernel[(T, triton.cdiv(d, BD))](
        part, X, scale.contiguous(), base.contiguous(), u, post, M, part.shape[1], d, S * d,
        iters, float(hc_eps), float(norm_eps), S=S, NOUT=n_out, NP=NP,
        SP=triton.next_power_of_2(part.shape[1]), BD=BD, SINKHORN=sinkhorn, num_warps=4)
    return u, post, M


def hc_pre(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           iters: int, hc_eps: float, norm_eps: float, split: int | None = None,
           prefill: str | None = None, tile: dict | None = None):
    """X [T, S, d] bf16 -> (u [T, d] bf16, post [T, S] fp32, M [T, S, S] fp32), as hyper.hc_pre.
    split (tests) forces the K-split kernel with that many splits, at any T. prefill (default
    PREFILL) picks the T >= MIX_TORCH_T path; tile overrides tile_config() keys of "tiled"."""
    check_pre(X, fn, scale, base, iters)
    return _collapse(X.contiguous(), fn, scale, base, int(iters), hc_eps, norm_eps, True, split,
                     prefill, tile)


def hc_head(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            hc_eps: float, norm_eps: float, split: int | None = None,
            prefill: str | None = None, tile: dict | None = None) -> torch.Tensor:
    """X [T, S, d] bf16 -> h [T, d] bf16, as hyper.hc_head (logits kernel with n_out = S);
    split, prefill, tile as for hc_pre."""
    S = X.shape[1] if X.dim() == 3 else 0
    _check(X, fn, scale, base, S, 1, "hc_head")
    return _collapse(X.contiguous(), fn, scale, base, 1, hc_eps, norm_eps, False, split, prefill,
                     tile)[0]


def check_post(f, X, post, M) -> None:                  # hc_post's inputs (and mhc_decode's)
    if X.dim() != 3 or X.dtype != torch.bfloat16 or X.shape[1] & (X.shape[1] - 1):
        raise ValueError(f"hc_post: X must be bf16 [T, S, d] with S a power of 2, "
                         f"got {X.dtype}{list(X.shape)}")
    T, S, d = X.shape
    if tuple(f.shape) != (T, d) or tuple(post.shape) != (T, S) or tuple(M.shape) != (T, S, S) \
            or post.dtype != torch.float32 or M.dtype != torch.float32:
        raise ValueError(f"hc_post: need f [{T}, {d}], post fp32 [{T}, {S}], M fp32 "
                         f"[{T}, {S}, {S}], got {list(f.shape)}, {post.dtype}{list(post.shape)}, "
                         f"{M.dtype}{list(M.shape)}")
    if not (f.device == X.device == post.device == M.device):
        raise ValueError("hc_post: f, X, post, M on different devices")


def hc_post(f: torch.Tensor, X: torch.Tensor, post: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """f [T, d], X [T, S, d] bf16, post [T, S], M [T, S, S] fp32 -> [T, S, d] bf16 (hc_post)."""
    check_post(f, X, post, M)
    T, S, d = X.shape
    out = torch.empty(T, S, d, dtype=X.dtype, device=X.device)
    if T == 0:
        return out
    BD = min(_BD, triton.next_power_of_2(d))
    _post_kernel[(T, triton.cdiv(d, BD))](f.contiguous(), X.contiguous(), post.contiguous(),
                                          M.contiguous(), out, d, S=S, BD=BD, num_warps=4)
    return out
