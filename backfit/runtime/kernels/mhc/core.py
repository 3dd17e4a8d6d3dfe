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
Prefill (T >= MIX_TORCH_T): PREFILL = "torch" (FP32 matmul partials) or "tiled" (default: the
two kernels of kernels.mhc.tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backfit.runtime.kernels.common import num_sms
from backfit.runtime.kernels.mhc.tile import collapse_tiled, tile_config

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
def _ld(ptrs, mask, CG: tl.constexpr):
    """A masked load (0 outside) as FP32; CG: from L2 (.cg: other programs of this launch wrote
    it, so L1 may hold nothing valid)."""
    if CG:
        return tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _pre_gates(part, i_ok, rs, SCALE, BASE, K, hc_eps, norm_eps, NOUT: tl.constexpr,
               CG: tl.constexpr = False, EARLY: tl.constexpr = False):
    """The split rows part [SP] (live where i_ok) -> (pre [S], r): one gather per logit group,
    summed over the splits by a fixed-shape tree (deterministic); r = rsqrt(mean(x²) + eps).
    CG: the rows are read from L2 (.cg: other programs of this launch wrote them). EARLY: every
    load before the first sum, one round trip (a load after a cross-warp sum waits for it),
    at the cost of the registers that hold them (hc_post's FOLD["one_pass_max_t"])."""
    lg = _ld(part[:, None] + rs[None, :], i_ok[:, None], CG)
    if EARLY:
        sqs = _ld(part + NOUT, i_ok, CG)
        scale, base = tl.load(SCALE), tl.load(BASE + rs)
    lp = tl.sum(lg, axis=0)
    if not EARLY:
        sqs = _ld(part + NOUT, i_ok, CG)
    sq = tl.sum(sqs, axis=0)
    r = 1.0 / tl.sqrt_rn(sq / K + norm_eps)
    if not EARLY:
        scale, base = tl.load(SCALE), tl.load(BASE + rs)
    return tl.sigmoid(lp * r * scale + base) + hc_eps, r


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
def _quarters(v):
    """v [4] -> its four elements as scalars (per-thread values)."""
    e, o = tl.split(tl.reshape(v, (2, 2)))                      # (v0, v2), (v1, v3)
    a, c = tl.split(e)
    b, d = tl.split(o)
    return a, b, c, d


@triton.jit
def _softmax4(a, b, c, d, eps):
    mx = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    a, b, c, d = tl.exp(a - mx), tl.exp(b - mx), tl.exp(c - mx), tl.exp(d - mx)
    s = a + b + c + d
    return a / s + eps, b / s + eps, c / s + eps, d / s + eps


@triton.jit
def _norm4(a, b, c, d, eps):
    s = a + b + c + d + eps
    return a / s, b / s, c / s, d / s


@triton.jit
def _sinkhorn4(c, iters, hc_eps):
    """C [4, 4] (j, k) -> M as 16 scalars m_jk (row-major tuple): hyper.hc_pre's row softmax +
    eps, column normalise, iters - 1 (row, column) passes, every thread on its own copy (no
    cross-thread reductions in the chain)."""
    ce, co = tl.split(tl.reshape(c, (4, 2, 2)))                 # columns (0, 2), (1, 3)
    k0, k2 = tl.split(ce)
    k1, k3 = tl.split(co)                                        # [4(j)] each
    a0, b0, c0, d0 = _quarters(k0)                               # a, b, c, d: rows j 0..3
    a1, b1, c1, d1 = _quarters(k1)
    a2, b2, c2, d2 = _quarters(k2)
    a3, b3, c3, d3 = _quarters(k3)
    a0, a1, a2, a3 = _softmax4(a0, a1, a2, a3, hc_eps)           # row softmax (over k)
    b0, b1, b2, b3 = _softmax4(b0, b1, b2, b3, hc_eps)
    c0, c1, c2, c3 = _softmax4(c0, c1, c2, c3, hc_eps)
    d0, d1, d2, d3 = _softmax4(d0, d1, d2, d3, hc_eps)
    a0, b0, c0, d0 = _norm4(a0, b0, c0, d0, hc_eps)              # column normalise (over j)
    a1, b1, c1, d1 = _norm4(a1, b1, c1, d1, hc_eps)
    a2, b2, c2, d2 = _norm4(a2, b2, c2, d2, hc_eps)
    a3, b3, c3, d3 = _norm4(a3, b3, c3, d3, hc_eps)
    for _ in range(iters - 1):
        a0, a1, a2, a3 = _norm4(a0, a1, a2, a3, hc_eps)
        b0, b1, b2, b3 = _norm4(b0, b1, b2, b3, hc_eps)
        c0, c1, c2, c3 = _norm4(c0, c1, c2, c3, hc_eps)
        d0, d1, d2, d3 = _norm4(d0, d1, d2, d3, hc_eps)
        a0, b0, c0, d0 = _norm4(a0, b0, c0, d0, hc_eps)
        a1, b1, c1, d1 = _norm4(a1, b1, c1, d1, hc_eps)
        a2, b2, c2, d2 = _norm4(a2, b2, c2, d2, hc_eps)
        a3, b3, c3, d3 = _norm4(a3, b3, c3, d3, hc_eps)
    return (a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3)


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
def _post_coords(D, S: tl.constexpr, BD: tl.constexpr):
    """Program (token t, d block b) of a post-mix grid -> (t, b, rs [S], rd [BD], d_ok)."""
    t, b = tl.program_id(0).to(tl.int64), tl.program_id(1)
    rd = b * BD + tl.arange(0, BD)
    return t, b, tl.arange(0, S), rd, rd < D


@triton.jit
def _post_block(X, POST, MIX, f, t, rs, rd, d_ok, D, S: tl.constexpr):
    """out[t, :, block] in FP32 [S(k), BD]: post[t, k]·f + Σ_j M[t, j, k]·X[t, j, block], j in
    order, elementwise (a tensor sum over j would reduce across warps: a shared-memory round
    trip and bar.syncs a launch); f [BD] FP32. Each term an explicit fma: with `o += M·x` the
    sm_80 code rounded M₀·x₀ alone in one of the two copies the fold computes, and the next
    hc_pre's M from the partials was 1.2-3.2e-5 off FP64 at T > 1 (H100); with the fma within
    test_mhc_precision.py's 2e-6 at every d block (H200, 2026-12-07)."""
    o = tl.load(POST + t * S + rs)[:, None] * f[None, :]
    for j in tl.static_range(S):
        xj = tl.load(X + (t * S + j) * D + rd, mask=d_ok, other=0.0).to(tl.float32)
        o = tl.fma(tl.load(MIX + (t * S + j) * S + rs)[:, None], xj[None, :], o)
    return o


@triton.jit
def _post_kernel(F, X, POST, MIX, OUT, D, S: tl.constexpr, BD: tl.constexpr):
    """out[t, k, block] = post[t, k]·f[t, block] + Σ_j M[t, j, k]·X[t, j, block], FP32 math."""
    t, _, rs, rd, d_ok = _post_coords(D, S, BD)
    f = tl.load(F + t * D + rd, mask=d_ok, other=0.0).to(tl.float32)
    out = _post_block(X, POST, MIX, f, t, rs, rd, d_ok, D, S)
    tl.store(OUT + (t * S + rs[:, None]) * D + rd[None, :], out.to(OUT.dtype.element_ty),
             mask=d_ok[None, :])


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
        split = mix_split(T, K, num_sms(X.device))
    if not 1 <= split <= MAX_SPLIT:
        raise ValueError(f"mhc: split must be in 1..{MAX_SPLIT}, got {split}")
    k_split = triton.cdiv(triton.cdiv(K, _BK), split) * _BK
    split = triton.cdiv(K, k_split)
    part = torch.empty(T, split, NP, dtype=torch.float32, device=X.device)
    _mix_partial_kernel[(T, split)](x, fn, part, K, k_split, split, NOUT=n_out, NP=NP, BK=_BK,
                                    num_warps=4)
    return part


def _collapse(X, fn, scale, base, iters, hc_eps, norm_eps, sinkhorn, split, prefill, tile):
    T, S, d = X.shape
    prefill = PREFILL if prefill is None else prefill
    if prefill not in ("torch", "tiled"):
        raise ValueError(f"mhc: prefill must be 'torch' or 'tiled', got {prefill!r}")
    if split is None and T >= MIX_TORCH_T and prefill == "tiled":
        return collapse_tiled(X, fn, scale, base, iters, hc_eps, norm_eps, sinkhorn, tile)
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
