"""Small-M linear y = x @ W^T (M <= GEMV_MAX_M decode rows), in Triton, SM80-safe.

The a16 path of kernels.linear.gemm pads M to a BM = 16 MMA tile and splits K over programs with
an FP32 workspace and an atomic counter; at batch 1 its launches sit on a ~6-7 µs floor. Here
one program = BN weight rows x the whole K x all M rows: no split-K, no workspace, no atomics,
each weight byte read once from DRAM (x, M·K·2 B, is re-read from L2 by every program):
  y[m, n] = Σ_g s[n, g] · Σ_{k in g} q[n, k] · x[m, k]    (int8_g128; FP32, as the a16 kernel)
Two variants (config key "variant"):
  cuda  CUDA cores: a [BN, G, 128] weight tile per K step (G = BK/128, 16 B+ per thread and
        load) turned into FP32 once; for each of the M rows (unrolled, MP = M padded to a power
        of two) the group sums Σ w·x times the group scale. MAGIC: int8 -> FP32 as
        bits(1.5·2^23) + q - 1.5·2^23 (exact, no I2F). V8, PREFETCH: see _gemv_kernel.
  fma   (gemv_fma.py) CUDA cores, no reduction inside the K loop: per-thread FP32 accumulators
        [BN, G, 128] for each row (up to 8), FMAs of (q·s in FP32, the reference's dequantized
        weight) times x, one cross-thread sum per row at the end; x and W tiles in one layout.
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
from backfit.runtime.kernels.linear.gemv_fma import _gemv_fma_kernel, _tile, _to_f32
from backfit.runtime.kernels.linear.gemv_tiles import GEMV_CANDIDATES, GEMV_TABLE

__all__ = ["GEMV_CANDIDATES", "GEMV_MAX_M", "GEMV_TABLE", "check_linear", "gemv", "gemv_config",
           "gemv_grouped", "gemv_lookup", "launch", "norm_fold"]

GEMV_MAX_M = 8                 # rows handled in one program (M <= 8: decode at small batch)


@triton.jit
def _gemv_kernel(X, W, S, Y, M, N, K, stride_xm,
                 QUANT: tl.constexpr, MAGIC: tl.constexpr, EVEN_K: tl.constexpr,
                 MP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 V8: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                 STAGES: tl.constexpr = 1, GROUP_N: tl.constexpr = 0, NW=None, eps=0.0,
                 NORM: tl.constexpr = False):
    """Rows [pid·BN, +BN) of y [M, N] = x [M, K] @ W [N, K]^T over all K, all M (<= MP) rows.
    V8: 8-element column runs (x and an int8 W tile in one layout, no shared-memory layout
    change; 8 B int8 loads). PREFETCH (EVEN_K only): the next K step's weights are loaded
    before this step's math (a register double buffer). GROUP_N > 0 (block-diagonal W, see
    gemv_grouped): rows n read x's K inputs of group n // GROUP_N. NORM: x's rows RMS-normalised
    first, x·rsqrt(mean(x²) + eps)·NW rounded to bf16 (rope_norm._rms_kernel's ops; its Σx² in
    another order, from a first pass over K: the form that reduced the loaded tile of a one-step
    K loop instead lost too, model.attention)."""
    G: tl.constexpr = BK // 128
    pid = tl.program_id(0)
    X, rn, n_ok, rn_c, rg, kofs, w_ptr = _tile(X, W, pid, N, K, BN, BK, GROUP_N, V8)
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
        wf = _to_f32(q, MAGIC)                                               # [BN, G, 128]
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
         norm: tuple | None = None) -> torch.Tensor:
    """x [..., K] bf16 (M = prod(...) <= GEMV_MAX_M rows) @ weight [N, K]^T -> [..., N] out_dtype,
    for scheme int8_g128 | bf16 | copy (bf16 weight); the semantics of gemm.linear's a16 path.
    config: overrides of gemv_config (variant, BN, BK, MAGIC, num_warps, num_stages, STAGES: the
    K loop's cp.async depth, 1 = none; cuda: V8, PREFETCH); BK is capped at K rounded up to a
    power of two. norm: launch's (RMSNorm(x) first, in the launch)."""
    quant = check_linear("gemv", x, weight, scale, scheme, out_dtype)
    K = weight.shape[1]
    x2 = x.reshape(-1, K)
    return launch(x2 if x2.stride(1) == 1 else x2.contiguous(), weight.contiguous(),
                  scale.contiguous() if quant else None, quant, out_dtype,
                  config, norm=norm).reshape(*x.shape[:-1], weight.shape[0])


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
           norm: tuple | None = None) -> torch.Tensor:
    """gemv on checked arguments (check_linear; gemm.linear's route here): x2 [M, K] with unit
    stride in K, contiguous weight (and scale) -> [M, N]. group > 0: gemv_grouped's (x2 [M,
    N/group·K], each program's BN rows inside one group). norm = (weight [K] fp32, eps), cuda
    variant only: y = RMSNorm(x2) @ W^T, the norm (layers.RMSNorm, bf16 out) in the launch."""
    M, (N, K) = x2.shape[0], weight.shape
    if M > GEMV_MAX_M:
        raise ValueError(f"gemv: at most {GEMV_MAX_M} rows, got {M} (use gemm.linear)")
    y = torch.empty(M, N, dtype=out_dtype, device=x2.device)
    if M == 0 or N == 0:
        return y
    cfg = {**gemv_config(M, N, K, quant), **(config or {})}
    variant = cfg.get("variant", "cuda")
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
                           **nrm)
    else:
        _gemv_fma_kernel[grid](x2, weight, s_arg, y, M, N, K, x2.stride(0), **const, **opts)
    return y
