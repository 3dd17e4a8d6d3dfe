"""Quantized linear y = x @ W^T for the converted schemes (docs/FORMAT.md), in Triton, SM80-safe.

Paths (chosen by the launcher `linear` from M = tokens and the scheme):
  a16    x BF16 [M, K] times W [N, K] (int8_g128 or bf16/copy), FP32 accumulate, BF16 MMA.
         int8_g128: each 128-wide K step does dot(x, q) with q exact in BF16 and adds it times
         the (row, 128) scale in FP32, so no weight element is rounded. M < 128 (decode; still
         memory-bound): BM 16-64 and split-K so the weight is streamed once by >= ~2 programs
         per SM; the splits are summed in split order by the last program of each tile, in the
         same launch (deterministic). bf16/copy weights use this path at any M, and so does
         every FP32-output call (out_dtype=torch.float32: the FP32 accumulator is stored).
  w8a8   int8_g128 at M >= 128 (prefill): x quantized per (token, 128) to INT8 (absmax/127, round
         half to even, clamp ±127: the same rule as quant.quantize_int8_groups) by `act_quant`,
         then an INT8 MMA (int32 per 128-K step) scaled by x_scale[m] · w_scale[n] in FP32.
Shared memory of every shipped config stays <= 99 KB on sm_80 (tests/runtime/kernels/test_sm80.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backfit.formats import INT8_GROUP
from backfit.runtime.kernels.common import dot_bf16, interpreted, num_sms
from backfit.runtime.kernels.linear import gemv
from backfit.runtime.streams import stream_key

__all__ = ["PREFILL_M", "act_quant", "linear", "a16_config", "w8a8_config"]

PREFILL_M = 128         # int8_g128 at M >= PREFILL_M takes the W8A8 tensor-core path


@triton.jit
def _a16_kernel(X, W, S, Y, WS, LOCK, M, N, K, stride_xm, K_SPLIT,
                QUANT: tl.constexpr, SPLIT: tl.constexpr, F32: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One [BM, BN] tile of x @ W^T over K range [pid_k·K_SPLIT, +K_SPLIT) (pid_k < SPLIT)."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok, n_ok = rm < M, rn < N
    xrow = rm.to(tl.int64)[:, None]                  # int64 rows: M·N may pass 2^31 in prefill
    x_rows = X + xrow * stride_xm
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + rk
        k_ok = kk < k_hi
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        w = tl.load(W + rn[:, None] * K + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0)                                                      # [BN, BK]
        if QUANT:
            # BK == 128 == the scale group: q (|q| <= 127) is exact in BF16, scale applied in FP32
            part = dot_bf16(x, tl.trans(w), tl.zeros((BM, BN), dtype=tl.float32), F32)
            s = tl.load(S + rn * (K // 128) + k0 // 128, mask=n_ok, other=0.0)   # [BN] fp32
            acc += part * s[None, :]
        else:
            acc = dot_bf16(x, tl.trans(w), acc, F32)
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT == 1:
        tl.store(Y + xrow * N + rn[None, :], acc.to(Y.dtype.element_ty), mask=mask)
    else:
        # split-K in one launch: each split stores its FP32 tile in the workspace, then bumps the
        # tile's counter; the last to arrive sums the SPLIT tiles in split order (deterministic),
        # writes the output and resets the counter to 0 for the next launch
        tile = pid_m * tl.num_programs(1) + pid_n
        offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        tl.store(WS + (tile * SPLIT + pid_k) * (BM * BN) + offs, acc)
        tl.debug_barrier()                                   # all threads' stores before release
        if tl.atomic_add(LOCK + tile, 1, sem="acq_rel") == SPLIT - 1:
            tot = tl.zeros((BM, BN), dtype=tl.float32)
            for i in range(SPLIT):
                tot += tl.load(WS + (tile * SPLIT + i) * (BM * BN) + offs, cache_modifier=".cg")
            tl.store(Y + xrow * N + rn[None, :], tot.to(Y.dtype.element_ty), mask=mask)
            tl.atomic_xchg(LOCK + tile, 0)


@triton.jit
def _act_quant_kernel(X, Q, S, K, stride_xm, G: tl.constexpr, GP: tl.constexpr):
    """Row m of x [M, K] -> q int8 [M, K], scale fp32 [M, K/128]; G = K/128 groups (GP padded)."""
    m = tl.program_id(0).to(tl.int64)
    rg = tl.arange(0, GP)
    rc = tl.arange(0, 128)
    g_ok = rg < G
    offs = rg[:, None] * 128 + rc[None, :]                                   # [GP, 128]
    x = tl.load(X + m * stride_xm + offs, mask=g_ok[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)                                         # [GP]
    scale = tl.math.div_rn(amax, tl.full((GP,), 127.0, tl.float32))          # IEEE, as torch
    safe = tl.where(scale > 0, scale, 1.0)
    y = tl.math.div_rn(x, tl.broadcast_to(safe[:, None], (GP, 128)))
    y = (y + 12582912.0) - 12582912.0      # ± 1.5·2^23: round half to even for |y| < 2^22
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    tl.store(Q + m * K + offs, y.to(tl.int8), mask=g_ok[:, None])
    tl.store(S + m * G + rg, scale, mask=g_ok)


@triton.jit
def _w8a8_kernel(A, AS, W, WS, Y, M, N, K,
                 BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile of (q_x·s_x) @ (q_w·s_w)^T: int32 MMA per 128-K step, scaled and summed in FP32."""
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    width = GROUP_M * grid_n                     # grouped order: GROUP_M row tiles share W tiles
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, 128)
    m_ok, n_ok = rm < M, rn < N
    G = K // 128
    row = rm.to(tl.int64)[:, None]                   # int64 rows: M·N may pass 2^31 in prefill
    a_rows = A + row * K
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g in range(0, G):
        a = tl.load(a_rows + g * 128 + rk[None, :], mask=m_ok[:, None], other=0)
        w = tl.load(W + rn[:, None] * K + g * 128 + rk[None, :], mask=n_ok[:, None], other=0)
        part = tl.dot(a, tl.trans(w))                                        # int32 [BM, BN]
        sa = tl.load(AS + rm * G + g, mask=m_ok, other=0.0)
        sw = tl.load(WS + rn * G + g, mask=n_ok, other=0.0)
        acc += part.to(tl.float32) * sa[:, None] * sw[None, :]
    tl.store(Y + row * N + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def a16_config(M: int, N: int, K: int, quant: bool, sms: int, split_k: int | None = None) -> dict:
    """Tile sizes, split-K and launch options of the a16 path for an [M, K] x [N, K]^T problem."""
    BK = 128 if quant else 64
    if M < PREFILL_M:                                          # memory-bound: split K to fill SMs
        BM = 16 if M <= 16 else 32 if M <= 32 else 64
        BN, warps, stages = 64, 4, 3                          # H200 sweep (docs/KERNELS.md)
    elif quant:        # FP32-output linears at M >= 128 (int8 [BN, 128] tiles: 96 KB shared)
        BM, BN, warps, stages = 64, 128, 4, 3
    else:
        BM, BN, warps, stages = 128, 128, 8, 3
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    steps = triton.cdiv(K, BK)
    if split_k is None:
        split_k = 1 if M >= PREFILL_M else max(1, min(steps, 16, triton.cdiv(2 * sms, tiles)))
    k_split = triton.cdiv(steps, split_k) * BK                 # whole BK steps per split
    return dict(BM=BM, BN=BN, BK=BK, SPLIT=triton.cdiv(K, k_split), K_SPLIT=k_split,
                num_warps=warps, num_stages=stages)


_WORKSPACE: dict = {}        # (device, stream) -> (fp32 split-K tiles, int32 tile counters)
_RETIRED: list = []          # outgrown workspaces stay alive: a captured CUDA graph may use them


def _workspace(device: torch.device, floats: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K workspace of the current stream, grown on demand. One per stream: launches
    on side streams (runtime/streams.py: the shared expert beside the router) run concurrently
    with the main stream's, and a shared buffer would mix their partial tiles and counters."""
    key = (device, stream_key(device))
    ws, lock = _WORKSPACE.get(key, (None, None))
    if ws is None or ws.numel() < floats or lock.numel() < tiles:
        if ws is not None:
            _RETIRED.append((ws, lock))
        ws = torch.empty(max(floats, 1 << 20), dtype=torch.float32, device=device)
        lock = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)   # counters: 0
        _WORKSPACE[key] = (ws, lock)
    return ws, lock


def w8a8_config(M: int, N: int) -> dict:
    """Tile sizes of the W8A8 path: 64x128x128 INT8, 4 stages, 4 warps (best of an H200 sweep,
    1.3-1.5x faster than 128x128/8 warps; 72 KB shared on sm_80)."""
    return dict(BM=64, BN=128, GROUP_M=8, num_warps=4, num_stages=4)


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bf16/fp32, K % 128 == 0 -> q int8 [M, K], scale fp32 [M, K/128] per (token, 128)."""
    if x.dim() != 2 or x.shape[1] % INT8_GROUP or x.stride(1) != 1:
        raise ValueError(f"act_quant: need [M, K] with K % {INT8_GROUP} == 0 and unit stride, "
                         f"got {list(x.shape)} strides {x.stride()}")
    M, K = x.shape
    G = K // INT8_GROUP
    q = torch.empty(M, K, dtype=torch.int8, device=x.device)
    s = torch.empty(M, G, dtype=torch.float32, device=x.device)
    if M:
        _act_quant_kernel[(M,)](x, q, s, K, x.stride(0), G=G, GP=triton.next_power_of_2(G))
    return q, s


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, scheme: str,
           path: str | None = None, split_k: int | None = None,
           config: dict | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [..., K] bf16 @ weight[N, K]^T -> [..., N] out_dtype for scheme int8_g128 | bf16 | copy.

    out_dtype float32 (head, router, compressors): the FP32 accumulator is stored as is, and the
    automatic path is a16 at every M (BF16 x BF16 and BF16 x INT8 products are exact in FP32, so
    the result is F.linear(x.float(), W.float()) up to summation order; W8A8 would round x).
    path "a16"/"w8a8", split_k and config (tile overrides) replace the automatic choice (tests,
    benchmarks). Split-K uses a per-stream workspace (_workspace). M <= 8 rows at a
    shape of kernels.linear.gemv's GEMV_TABLE (measured faster than a16 on the H200) go to
    kernels.linear.gemv.
    """
    quant = gemv.check_linear("linear kernel", x, weight, scale, scheme, out_dtype,
                              fp32_weight=True)
    N, K = weight.shape
    scale = scale.contiguous() if quant else scale
    weight = weight.contiguous()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if path is None and config is None and split_k is None and 0 < M <= gemv.GEMV_MAX_M \
            and weight.dtype in (torch.int8, torch.bfloat16) \
            and gemv.gemv_lookup(M, N, K, quant) is not None:     # a measured win (H200 sweep)
        return gemv.launch(x2, weight, scale, quant, out_dtype).reshape(*lead, N)
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return y.reshape(*lead, N)
    if path is None:
        path = "w8a8" if quant and M >= PREFILL_M and out_dtype == torch.bfloat16 else "a16"
    if path == "w8a8":
        if not quant:
            raise ValueError("linear kernel: the w8a8 path needs int8_g128 weights")
        qx, sx = act_quant(x2)
        cfg = {**w8a8_config(M, N), **(config or {})}
        grid = (triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"]),)
        _w8a8_kernel[grid](qx, sx, weight, scale, y, M, N, K, **cfg)
        return y.reshape(*lead, N)
    if path != "a16":
        raise ValueError(f"linear kernel: unknown path {path!r}")
    cfg = {**a16_config(M, N, K, quant, num_sms(x.device), split_k), **(config or {})}
    grid = (triton.cdiv(M, cfg["BM"]), triton.cdiv(N, cfg["BN"]), cfg["SPLIT"])
    tiles = grid[0] * grid[1]
    ws, lock = _workspace(x.device, tiles * cfg["SPLIT"] * cfg["BM"] * cfg["BN"], tiles) \
        if cfg["SPLIT"] > 1 else (y, y)
    _a16_kernel[grid](x2, weight, scale if quant else weight, y, ws, lock, M, N, K, x2.stride(0),
                      QUANT=quant, F32=interpreted(), **cfg)
    return y.reshape(*lead, N)
