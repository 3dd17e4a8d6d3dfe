"""Small-M linear y = x @ W^T (M <= GEMV_MAX_M decode rows), in Triton, SM80-safe.

The a16 path of kernels.linear.gemm pads M to a BM = 16 MMA tile and splits K over programs with an
FP32
workspace and an atomic counter; at batch 1 its launches sit on a ~6-7 µs floor. Here
one program = BN weight rows x the whole K x all M rows: no split-K, no workspace, no atomics,
each weight byte read once from DRAM (x, M·K·2 B, is re-read from L2 by every program):
  y[m, n] = Σ_g s[n, g] · Σ_{k in g} q[n, k] · x[m, k]    (int8_g128; FP32, as the a16 kernel)
Two variants (config key "variant"):
  cuda  CUDA cores: a [BN, G, 128] weight tile per K step (G = BK/128, 16 B+ per thread and
        load) turned into FP32 once; for each of the M rows (unrolled, MP = M padded to a power
        of two) the group sums Σ w·x times the group scale. MAGIC: int8 -> FP32 as
        bits(1.5·2^23) + q - 1.5·2^23 (exact, no I2F). V8, PREFETCH: see _gemv_kernel.
  fma   CUDA cores, no reduction inside the K loop: per-thread FP32 accumulators [BN, G, 128] for
        each row (up to 8), FMAs of (q·s in FP32, the reference's dequantized weight) times x,
        one cross-thread sum per row at the end; x and W tiles in one register layout.
(A third, tensor-core variant, acc[BN, 16] += W[BN, 128] · x[16, 128]^T per scale group, no split-K,
ran 1.5-4x slower than the a16 path on the H200 at every shape and M = 1..8: removed.)
Products of a BF16 x with an int8 q or a BF16 w are exact in FP32, so only the FP32 summation
order differs from kernels.ref; it is fixed per config (deterministic run to run). The grid is
cdiv(N, BN) programs from shapes only: no host sync, CUDA-graph safe.
Measured (H200, GEMV_TABLE): faster than a16 at M = 1 on 8 of the 9 decode shapes (1.1-2.3x;
18-63 % of copy bandwidth, so the ~1.5 µs + bytes / (0.8 · BW) target is not met), at M = 2 on 6;
at M >= 4 slower on the int8 linears (x re-read from L2 per program and per row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backfit.formats import INT8_GROUP
from backfit.runtime.kernels.linear.gemv_tiles import GEMV_CANDIDATES, GEMV_TABLE
from backfit.runtime.streams import stream_counters

__all__ = ["GEMV_CANDIDATES", "GEMV_MAX_M", "GEMV_TABLE", "check_linear", "gemv", "gemv_config",
           "gemv_grouped", "gemv_lookup", "launch", "norm_fold"]

GEMV_MAX_M = 8                 # rows handled in one program (M <= 8: decode at small batch)
_MAGIC_I = tl.constexpr(0x4B400000)            # bits of 1.5·2^23
_MAGIC_F = tl.constexpr(12582912.0)            # 1.5·2^23

@triton.jit
def _group_offset(pid, K, BN: tl.constexpr, GROUP_N: tl.constexpr):
    """The x offset of program pid's rows: group (pid·BN) // GROUP_N's K inputs (0 ungrouped)."""
    off = pid.to(tl.int64) * 0
    if GROUP_N > 0:
        off = ((pid * BN) // GROUP_N).to(tl.int64) * K
    return off


@triton.jit
def _gemv_kernel(X, W, S, Y, M, N, K, stride_xm,
                 QUANT: tl.constexpr, MAGIC: tl.constexpr, EVEN_K: tl.constexpr,
                 MP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 V8: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                 STAGES: tl.constexpr = 1, GROUP_N: tl.constexpr = 0, NW=None, eps=0.0,
                 NORM: tl.constexpr = False, ONW=None, ONY=None, CNT=None, on_n=0, on_eps=0.0,
                 ONORM: tl.constexpr = False, ONB: tl.constexpr = 16):
    """Rows [pid·BN, +BN) of y [M, N] = x [M, K] @ W [N, K]^T over all K, all M (<= MP) rows.
    V8: 8-element column runs (x and an int8 W tile in one layout, no shared-memory layout
    change; 8 B int8 loads). PREFETCH (EVEN_K only): the next K step's weights are loaded
    before this step's math (a register double buffer). GROUP_N > 0 (block-diagonal W, see
    gemv_grouped): rows n read x's K inputs of group n // GROUP_N. NORM: x's rows RMS-normalised
    first, x·rsqrt(mean(x²) + eps)·NW rounded to bf16 (rope_norm._rms_kernel's ops; its Σx² in
    another order, from a first pass over K: the form that reduced the loaded tile of a one-step
    K loop instead lost too, model.attention). ONORM: the last program to arrive (CNT, acq_rel;
    reset to 0) RMS-normalises the first on_n (<= ONB) outputs of each row of y into ONY [M,
    on_n] with weight ONW, as rope_norm._rms_kernel does (its ops on one [ONB] tile)."""
    G: tl.constexpr = BK // 128
    pid = tl.program_id(0)
    X = X + _group_offset(pid, K, BN, GROUP_N)
    rn = pid * BN + tl.arange(0, BN)
    n_ok = rn < N
    rn_c = tl.minimum(rn, N - 1).to(tl.int64)    # rows past N re-read row N-1: unmasked loads
    rg = tl.arange(0, G)
    rc = tl.arange(0, 128)
    if V8:
        rc = (rc // 8) * 8 + rc % 8              # = rc, but contiguity 8 for the axis analysis
    kofs = rg[:, None] * 128 + rc[None, :]                                   # [G, 128]
    w_ptr = W + rn_c[:, None, None] * K + kofs[None, :, :]                   # [BN, G, 128]
    rm = tl.arange(0, MP)
    acc = tl.zeros((MP, BN), dtype=tl.float32)
    inv = tl.zeros((MP,), dtype=tl.float32)            # NORM: each row's rsqrt(mean(x²) + eps)
    if NORM:
        for m in tl.static_range(MP):
            ss = tl.zeros((G, 128), dtype=tl.float32)
            for k0 in range(0, K, BK):
                xm = tl.load(X + tl.minimum(m, M - 1) * stride_xm + k0 + kofs,
                             mask=(k0 + kofs) < K, other=0.0).to(tl.float32)
                ss += xm * xm
            inv = tl.where(rm == m, tl.math.rsqrt(tl.sum(tl.sum(ss, 1), 0) / K + eps), inv)
    q_next = tl.load(w_ptr) if PREFETCH else None   # step 0 (PREFETCH implies EVEN_K)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        k_ok = (k0 + kofs) < K                                               # [G, 128]
        if PREFETCH:                     # the last step re-loads itself (an L1 hit), unused
            q = q_next
            q_next = tl.load(w_ptr + tl.minimum(k0 + BK, K - BK))
        elif EVEN_K:
            q = tl.load(w_ptr + k0)
        else:
            q = tl.load(w_ptr + k0, mask=k_ok[None, :, :], other=0)
        if MAGIC:                        # 1.5·2^23 + q (|q| <= 127) is exact; minus it: q exact
            wf = (q.to(tl.int32) + _MAGIC_I).to(tl.float32, bitcast=True) - _MAGIC_F
        else:
            wf = q.to(tl.float32)                                            # [BN, G, 128]
        if QUANT:                        # K % 128 == 0: groups past K masked, scale 0
            g_ok = (k0 // 128 + rg) < K // 128
            s = tl.load(S + rn_c[:, None] * (K // 128) + k0 // 128 + rg[None, :],
                        mask=g_ok[None, :], other=0.0)                       # [BN, G] fp32
        for m in tl.static_range(MP):
            x_ptr = X + tl.minimum(m, M - 1) * stride_xm + k0 + kofs   # rows past M: row M-1
            if EVEN_K:
                xm = tl.load(x_ptr)                                          # [G, 128] bf16
            else:
                xm = tl.load(x_ptr, mask=k_ok, other=0.0)
            xf = xm.to(tl.float32)
            if NORM:
                inv_m = tl.sum(tl.where(rm == m, inv, 0.0), axis=0)
                nw = tl.load(NW + k0 + kofs, mask=k_ok, other=0.0)           # [G, 128] fp32
                xf = (xf * inv_m * nw).to(tl.bfloat16).to(tl.float32)
            part = tl.sum(wf * xf[None, :, :], axis=2)                       # [BN, G] group sums
            if QUANT:
                part = part * s
            part = tl.sum(part, axis=1)                                      # [BN]
            acc = tl.where(rm[:, None] == m, acc + part[None, :], acc)       # row m of [MP, BN]
    mask = (rm < M)[:, None] & n_ok[None, :]
    tl.store(Y + rm[:, None] * N + rn[None, :], acc.to(Y.dtype.element_ty), mask=mask)
    if ONORM:
        tl.debug_barrier()                                  # every thread's y stored
        if tl.atomic_add(CNT, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            tl.store(CNT, 0)                                # ready for the next launch
            c = tl.arange(0, ONB)
            for m in tl.static_range(MP):
                ok = (c < on_n) & (tl.full([ONB], m, tl.int32) < M)
                xo = tl.load(Y + m * N + c, mask=ok, other=0.0,
                             cache_modifier=".cg").to(tl.float32)     # other programs' rows
                inv_o = tl.math.rsqrt(tl.sum(xo * xo, axis=0) / on_n + on_eps)
                yo = xo * inv_o
                yo = yo * tl.load(ONW + c, mask=ok, other=0.0)
                tl.store(ONY + m * on_n + c, yo.to(ONY.dtype.element_ty), mask=ok)


@triton.jit
def _fma_row(acc, wf, x_ptr, k_ok, EVEN_K: tl.constexpr):
    """acc [BN, G, 128] + wf · x_row (x_ptr, k_ok [G, 128]): per-element FP32 FMAs, no reduction."""
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
    pid = tl.program_id(0)
    X = X + _group_offset(pid, K, BN, GROUP_N)
    rn = pid * BN + tl.arange(0, BN)
    n_ok = rn < N
    rn_c = tl.minimum(rn, N - 1).to(tl.int64)    # rows past N re-read row N-1: unmasked loads
    rg = tl.arange(0, G)
    rc = tl.arange(0, 128)
    rc = (rc // 8) * 8 + rc % 8                  # = rc, but contiguity 8 for the axis analysis
    kofs = rg[:, None] * 128 + rc[None, :]                                   # [G, 128]
    w_ptr = W + rn_c[:, None, None] * K + kofs[None, :, :]                   # [BN, G, 128]
    x_ptr = X + kofs
    a0 = tl.zeros((BN, G, 128), dtype=tl.float32)
    a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0   # rows >= MP: dead, dropped
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        k_ok = (k0 + kofs) < K
        if EVEN_K:
            q = tl.load(w_ptr + k0)
        else:
            q = tl.load(w_ptr + k0, mask=k_ok[None, :, :], other=0)
        if MAGIC:                        # 1.5·2^23 + q (|q| <= 127) is exact; minus it: q exact
            wf = (q.to(tl.int32) + _MAGIC_I).to(tl.float32, bitcast=True) - _MAGIC_F
        else:
            wf = q.to(tl.float32)                                            # [BN, G, 128]
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


def gemv_lookup(M: int, N: int, K: int, quant: bool, grouped: bool = False) -> dict | None:
    """The first GEMV_TABLE entry for this shape (a measured win over the a16 path, or for
    grouped, kind "bf16g", over the einsum), or None."""
    kind = "bf16g" if grouped else "int8" if quant else "bf16"
    for k, (n0, n1), (k0, k1), (m0, m1), cfg in GEMV_TABLE:
        if k == kind and n0 <= N <= n1 and k0 <= K <= k1 and m0 <= M <= m1:
            return dict(cfg)
    return None


def gemv_config(M: int, N: int, K: int, quant: bool) -> dict:
    """Launch config for an [M, K] x [N, K]^T GEMV: gemv_lookup's, else the default (the best
    M = 1 config over the decode shapes of the first H200 sweeps; BK is capped at K)."""
    cfg = gemv_lookup(M, N, K, quant)
    if cfg is not None:
        return cfg
    if quant:
        return dict(variant="cuda", BN=4, BK=2048, MAGIC=True, num_warps=4, num_stages=1)
    return dict(variant="cuda", BN=1, BK=4096, MAGIC=False, num_warps=8, num_stages=1)


def check_linear(who: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                 scheme: str, out_dtype: torch.dtype, fp32_weight: bool = False) -> bool:
    """The argument checks of a linear kernel (gemm.linear, gemv), one-line errors prefixed by
    `who`; fp32_weight: bf16/copy may also be FP32 weights (not with an FP32 output: that is the
    torch path, the kernel would round the weight). -> whether the scheme is int8_g128."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"{who}: activations must be bfloat16, got {x.dtype}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{who}: out_dtype must be bfloat16 or float32, got {out_dtype}")
    if weight.dim() != 2:
        raise ValueError(f"{who}: weight must be [N, K], got {list(weight.shape)}")
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"{who}: x has {x.shape[-1]} inputs, weight {list(weight.shape)}")
    if x.device != weight.device:
        raise ValueError(f"{who}: x on {x.device}, weight on {weight.device}")
    if scheme == "int8_g128":
        if weight.dtype != torch.int8 or scale is None or scale.dtype != torch.float32 \
                or K % INT8_GROUP or tuple(scale.shape) != (N, K // INT8_GROUP):
            raise ValueError(f"{who}: int8_g128 needs int8 [N, K] (K % 128 == 0), fp32 [N, K/128] "
                             f"scales, got {weight.dtype}{list(weight.shape)} / "
                             f"{None if scale is None else (scale.dtype, list(scale.shape))}")
        return True
    if scheme not in ("bf16", "copy"):
        raise ValueError(f"{who}: scheme {scheme!r} not supported")
    dtypes = (torch.bfloat16, torch.float32) if fp32_weight else (torch.bfloat16,)
    if weight.dtype not in dtypes or scale is not None:
        raise ValueError(f"{who}: {scheme} needs a {'bf16/fp32' if fp32_weight else 'bf16'} "
                         f"weight and no scale, got {weight.dtype}, scale "
                         f"{None if scale is None else scale.dtype}")
    if out_dtype == torch.float32 and weight.dtype == torch.float32:
        raise ValueError(f"{who}: FP32 output with an FP32 weight is the torch path "
                         "(the kernel would round the weight to BF16)")
    return False


def gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, scheme: str,
         config: dict | None = None, out_dtype: torch.dtype = torch.bfloat16,
         norm: tuple | None = None, out_norm: tuple | None = None):
    """x [..., K] bf16 (M = prod(...) <= GEMV_MAX_M rows) @ weight [N, K]^T -> [..., N] out_dtype,
    for scheme int8_g128 | bf16 | copy (bf16 weight); the semantics of gemm.linear's a16 path.
    config: overrides of gemv_config (variant, BN, BK, MAGIC, num_warps, num_stages, STAGES: the
    K loop's cp.async depth, 1 = none; cuda: V8, PREFETCH); BK is capped at K rounded up to a
    power of two. norm: launch's (RMSNorm(x) first, in the launch). out_norm: launch's; then
    -> (y, RMSNorm of y's first n outputs [..., n])."""
    quant = check_linear("gemv", x, weight, scale, scheme, out_dtype)
    K = weight.shape[1]
    x2 = x.reshape(-1, K)
    out = launch(x2 if x2.stride(1) == 1 else x2.contiguous(), weight.contiguous(),
                 scale.contiguous() if quant else None, quant, out_dtype,
                 config, norm=norm, out_norm=out_norm)
    if out_norm is None:
        return out.reshape(*x.shape[:-1], weight.shape[0])
    return out[0].reshape(*x.shape[:-1], weight.shape[0]), out[1].reshape(*x.shape[:-1], -1)


def gemv_grouped(x: torch.Tensor, weight: torch.Tensor, group: int,
                 config: dict | None = None) -> torch.Tensor:
    """Block-diagonal y = x @ blockdiag(W_0 .. W_{G-1})^T: x [M, G·K] bf16 (M <= GEMV_MAX_M),
    weight [G·group, K] bf16 (W_g = rows g·group..) -> [M, G·group] bf16, i.e. y[:, g·group + o]
    = Σ_k W[g·group + o, k] · x[:, g·K + k] in FP32: the einsum "tgi,goi->tgo" of the grouped
    output projection (model.attention's wo_a) in one launch. config: as gemv's; its table rows
    are kind "bf16g" (gemv_lookup grouped=True)."""
    if weight.dim() != 2 or group < 1 or weight.shape[0] % group:
        raise ValueError(f"gemv_grouped: weight [G*{group}, K], got {list(weight.shape)}")
    G, K = weight.shape[0] // group, weight.shape[1]
    check_linear("gemv_grouped", x[..., :K], weight, None, "bf16", torch.bfloat16)
    if x.shape[-1] != G * K:
        raise ValueError(f"gemv_grouped: x has {x.shape[-1]} inputs, {G} groups of {K} expected")
    x2 = x.reshape(-1, G * K)
    cfg = {**(gemv_lookup(x2.shape[0], weight.shape[0], K, False, grouped=True) or {}),
           **(config or {})}
    return launch(x2 if x2.stride(1) == 1 else x2.contiguous(), weight.contiguous(), None,
                  False, torch.bfloat16, cfg or None, group=group)


def norm_fold(M: int, N: int, K: int, quant: bool) -> bool:
    """Whether gemv takes this shape (a GEMV_TABLE row) on the variant that can RMS-normalise
    its input in the launch (cuda): launch(norm=) applies."""
    cfg = gemv_lookup(M, N, K, quant)
    return cfg is not None and cfg.get("variant", "cuda") == "cuda"


def launch(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, quant: bool,
           out_dtype: torch.dtype, config: dict | None = None, group: int = 0,
           norm: tuple | None = None, out_norm: tuple | None = None):
    """gemv on checked arguments (check_linear; gemm.linear's route here): x2 [M, K] with unit
    stride in K, contiguous weight (and scale) -> [M, N]. group > 0: gemv_grouped's (x2 [M,
    N/group·K], each program's BN rows inside one group). norm = (weight [K] fp32, eps), cuda
    variant only: y = RMSNorm(x2) @ W^T, the norm (layers.RMSNorm, bf16 out) in the launch.
    out_norm = (weight [n] fp32, eps), n <= N, cuda variant, bf16 y: -> (y, RMSNorm(y[:, :n])
    [M, n] bf16), the norm run by the launch's last program (an attention's q_norm after its
    wq_a|wkv)."""
    M, (N, K) = x2.shape[0], weight.shape
    if M > GEMV_MAX_M:
        raise ValueError(f"gemv: at most {GEMV_MAX_M} rows, got {M} (use gemm.linear)")
    y = torch.empty(M, N, dtype=out_dtype, device=x2.device)
    cfg = {**gemv_config(M, N, K, quant), **(config or {})}
    variant = cfg.get("variant", "cuda")
    onorm = {}
    if out_norm is not None:
        w, eps = out_norm
        n = w.shape[0] if w.dim() == 1 else -1
        if variant != "cuda" or group or w.dtype != torch.float32 or not 0 < n <= N \
                or out_dtype != torch.bfloat16 or w.device != x2.device:
            raise ValueError(f"gemv: out_norm= needs the cuda variant, no group, bf16 output and "
                             f"an fp32 [n <= {N}] weight on {x2.device}")
        ony = torch.empty(M, n, dtype=out_dtype, device=x2.device)
        onorm = dict(ONW=w.contiguous(), ONY=ony, CNT=stream_counters(x2.device, 1), on_n=n,
                     on_eps=float(eps), ONORM=True, ONB=triton.next_power_of_2(n))
    if M == 0 or N == 0:
        return y if out_norm is None else (y, ony)
    opts = dict(num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 1))
    grid = (triton.cdiv(N, cfg["BN"]),)
    s_arg = scale if quant else weight
    if variant not in ("cuda", "fma"):
        raise ValueError(f"gemv: unknown variant {variant!r} (cuda or fma)")
    bk = cfg["BK"]
    if bk < 128 or bk & (bk - 1):
        raise ValueError(f"gemv: BK must be a power of two >= 128, got {bk}")
    bk = min(bk, max(128, triton.next_power_of_2(K)))     # a tile past K would be all masks
    if cfg.get("MAGIC") and not quant:
        raise ValueError("gemv: MAGIC is the int8 conversion (int8_g128 weights only)")
    if group and group % cfg["BN"]:
        raise ValueError(f"gemv_grouped: BN {cfg['BN']} must divide the group's {group} rows")
    const = dict(QUANT=quant, MAGIC=bool(cfg.get("MAGIC", False)), EVEN_K=K % bk == 0,
                 MP=triton.next_power_of_2(M), BN=cfg["BN"], BK=bk,
                 STAGES=cfg.get("STAGES", 1), GROUP_N=group)
    if norm is not None and (variant != "cuda" or group or norm[0].dtype != torch.float32
                             or tuple(norm[0].shape) != (K,) or norm[0].device != x2.device):
        raise ValueError(f"gemv: norm= needs the cuda variant, no group and an fp32 [{K}] weight "
                         f"on {x2.device}")
    if variant == "cuda":                # PREFETCH needs whole K steps (no masks)
        nrm = {} if norm is None else dict(NW=norm[0], eps=float(norm[1]), NORM=True)
        _gemv_kernel[grid](x2, weight, s_arg, y, M, N, K, x2.stride(0), **const,
                           V8=bool(cfg.get("V8", False)),
                           PREFETCH=bool(cfg.get("PREFETCH", False)) and K % bk == 0, **opts,
                           **nrm, **onorm)
    else:
        _gemv_fma_kernel[grid](x2, weight, s_arg, y, M, N, K, x2.stride(0), **const, **opts)
    return y if out_norm is None else (y, ony)
