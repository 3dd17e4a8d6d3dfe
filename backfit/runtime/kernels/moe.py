"""Fused MoE for stacked int8_mx32 experts (docs/FORMAT.md), in Triton, SM80-safe; mx4_e2m1
stacks (uint8 codes) are dispatched to kernels.moe_mx4 by the same fused_moe.

Experts of a layer as stacked tensors: w1/w3 (gate/up) [E, I, K] int8 with exponent bytes
[E, I, K/32], w2 (down) [E, D, I] int8 with [E, D, I/32]; value = q · 2^(e - 128). Per (token t,
slot j) pair p = t·k + j with expert idx[t, j] and routing weight w[t, j] (dsv4-model.md 5.5):

  h_p   = silu(min(g, L)) · clamp(u, ±L) · w_p,  g = bf16(x_t W1ᵀ), u = bf16(x_t W3ᵀ)   FP32
  out_p = bf16(bf16(h_p) W2ᵀ);   y_t = Σ_j out_{t·k+j}  (FP32)

the torch path's roundings (runtime/model/moe.py). Weights are dequantized in registers to BF16,
exactly (|q| <= 12 needs 4 mantissa bits), and multiplied with BF16 activations on the BF16 tensor
cores with FP32 accumulation; no INT8 activations. Two launches, gate+up and down, for all
active experts, and no host sync (the decode step can be captured in a CUDA graph):
  decode   (P = T·k <= DECODE_PAIRS): one program per (pair, N-block), a GEMV on CUDA cores
           (its variants: kernels.moe_decode).
  sorted   otherwise: pairs sorted by expert on the device (`align`), each expert's run padded to
           BM rows; a program computes a [BM, BN] tile of one expert with tl.dot. The grid is the
           upper bound cdiv(P, BM) + min(E, P) blocks; blocks past the real count exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backfit.formats import MX_GROUP
from backfit.runtime.kernels.gemm import dot_bf16, interpreted
from backfit.runtime.kernels.moe_decode import _dequant_bf16, _dequant_mx, \
    _moe_gemv_group_kernel, _moe_gemv_kernel, _swiglu

__all__ = ["DECODE_PAIRS", "DECODE_TABLE", "DECODE_VARIANTS", "align", "fused_moe",
           "stack_experts"]

DECODE_PAIRS = 64        # up to this many (token, expert) pairs: per-pair GEMV path
MX_BIAS = 128            # int8_mx32 exponent bias (2·e2m1 absorbs one factor 2)
SORTED_DEQ = 2           # the sorted kernels' dequantization (their DEQ; int8 and mx4)


@triton.jit
def _sorted_tile(q, S, s_off, k0, rg, n_ok, BN: tl.constexpr, BK: tl.constexpr,
                 DEQ: tl.constexpr, F32: tl.constexpr):
    """int8 codes q [BN, BK] at K offset k0 -> BF16 q·2^(e-128) (exact), exponents [BN, BK/32]
    from S (DEQ: see _moe_sorted_kernel; F32: the interpreter, which has no inline PTX)."""
    s = tl.load(S + s_off + k0 // 32 + rg[None, :], mask=n_ok[:, None], other=0)
    if DEQ == 0:
        return _dequant_mx(q, s, BN, BK).to(tl.bfloat16)
    return _dequant_bf16(q, s, BN, BK, F32)


@triton.jit
def _moe_sorted_kernel(A, SORTED, BLOCK_E, RW, W1, S1, W3, S3, OUT, N, K, TOPK, P, E,
                       GATED: tl.constexpr, LIMIT: tl.constexpr, F32: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       DEQ: tl.constexpr = 0):
    """Block b (BM slots of one expert) x rows [pid_n·BN, +BN). GATED: x rows by pair // k ->
    h [slots, N] at the slot; else h rows by slot -> out [P, N] at the pair. DEQ (the same BF16
    weights, bit for bit): 0, codes to FP32 (I2F), times the group's 2^(e-128), to BF16 (F2F);
    2 (the default, SORTED_DEQ), no int -> float conversion: _dequant_bf16's BF16 bit trick, 4
    codes a step in PTX. (A DEQ 1, exponents loaded per weight, lost in session 14 and went in
    session 22.)"""
    b, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(BLOCK_E + b)
    if e >= E:
        return                                               # past the real block count
    e = e.to(tl.int64)
    slots = b * BM + tl.arange(0, BM)
    pair = tl.load(SORTED + slots)
    valid = pair < P                                         # padding slots hold P
    arow = pair // TOPK if GATED else slots
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rg = tl.arange(0, BK // 32)
    n_ok = rn < N
    KG = K // 32
    w_off = e * N * K + rn[:, None] * K
    s_off = e * N * KG + rn[:, None] * KG
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc3 = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(A + arow[:, None].to(tl.int64) * K + k0 + rk[None, :], mask=valid[:, None],
                    other=0.0)
        q = tl.load(W1 + w_off + k0 + rk[None, :], mask=n_ok[:, None], other=0)
        acc1 = dot_bf16(a, tl.trans(_sorted_tile(q, S1, s_off, k0, rg, n_ok, BN, BK, DEQ, F32)),
                        acc1, F32)
        if GATED:
            q = tl.load(W3 + w_off + k0 + rk[None, :], mask=n_ok[:, None], other=0)
            acc3 = dot_bf16(a, tl.trans(_sorted_tile(q, S3, s_off, k0, rg, n_ok, BN, BK, DEQ,
                                                     F32)), acc3, F32)
    mask = valid[:, None] & n_ok[None, :]
    if GATED:
        wr = tl.load(RW + pair, mask=valid, other=0.0)
        h = _swiglu(acc1, acc3, wr[:, None], LIMIT)
        tl.store(OUT + slots[:, None].to(tl.int64) * N + rn[None, :], h.to(tl.bfloat16), mask=mask)
    else:
        tl.store(OUT + pair[:, None].to(tl.int64) * N + rn[None, :], acc1.to(tl.bfloat16),
                 mask=mask)


def align(idx: torch.Tensor, n_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """idx [T, k] -> (sorted [NB·bm] int32 pair ids by expert, P = padding; block_expert [NB]
    int32, n_experts past the end). NB = cdiv(P, bm) + min(E, P) is known on the host; the rest
    stays on the device (no .item(), no bincount: both would sync)."""
    dev, P = idx.device, idx.numel()
    nb = triton.cdiv(P, bm) + min(n_experts, P)
    flat = idx.reshape(-1).long()
    counts = torch.zeros(n_experts, dtype=torch.long, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))                                       # [E] pairs per expert
    nblk = (counts + bm - 1) // bm
    blk_end = torch.cumsum(nblk, 0)                                           # [E] inclusive
    order = torch.argsort(flat, stable=True)                                  # pairs by expert
    se = flat[order]
    rank = torch.arange(P, device=dev) - (torch.cumsum(counts, 0) - counts)[se]
    dest = (blk_end - nblk)[se] * bm + rank                                   # slot of each pair
    sorted_ids = torch.full((nb * bm,), P, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    block_e = torch.searchsorted(blk_end, torch.arange(nb, device=dev), right=True)
    return sorted_ids, block_e.to(torch.int32)


def _fit_bk(K: int, bk: int) -> int:
    """Largest BK <= bk that divides K (K % 64 == 0 is checked): the kernels have no K mask."""
    while K % bk:
        bk //= 2
    return bk


# tile configs: best of an H200 sweep at V4-Flash shapes (scripts/bench_kernels.py --sweep).
# Decode: (max pairs P, config) rows, the first with P <= max pairs applies (a "down" dict in a
# config: the down projection's own tile/variant); the lead pastes the table printed by
# `bench_kernels.py --moe-decode-sweep` here (variants: DECODE_VARIANTS, see above).
# best per pair count of `bench_kernels.py --moe-decode-sweep` on the H200 (2026-12-01, commit
# 16bc670; docs/KERNELS.md): M=1 60.6 us (was 83.6 with base BN16 BK512 for both projections).
# Session 14 (H200, .whl probes, graph-timed over 4 routings): gate/up magic BN 8 BK 256 on 2
# warps 36.2 us at M = 1 (BN 16 BK 256 4 warps: 37.5), 213.9 at M = 8 (BN 8 BK 512 4 warps: 219.0);
# the step (bench_ab.py, replay GPU time, same process): -10.0 us at batch 1, -28.8 at batch 8.
# Rows with a third field bound I, the experts' intermediate size on this rank: at TP 4 (I = 512)
# the tp-1 tile gives gate/up only 192-384 programs of 16 K steps (23.8 us at M = 1 for 6.2 us of
# bytes); BN 2 BK 1024 on 2 warps 11.8 us, BN 2 BK 512 on 1 warp 57.5 at M = 8 (66.7); the down
# tile stays (8.5 / 35.2 us; the best of 8 others within 0.4 / 1.3). TP 8 (I = 256) takes the
# TP-4 rows, not measured.
_DOWN = dict(variant="base", BN=16, BK=512, num_warps=4, num_stages=2)
DECODE_TABLE = ((6, 512, dict(variant="magic", BN=2, BK=1024, num_warps=2, num_stages=2,
                              down=_DOWN)),
                (DECODE_PAIRS, 512, dict(variant="magic", BN=2, BK=512, num_warps=1,
                                         num_stages=2, down=_DOWN)),
                (DECODE_PAIRS, dict(variant="magic", BN=8, BK=256, num_warps=2, num_stages=2,
                                    down=_DOWN)))
DECODE_VARIANTS = ("base", "group", "magic", "fma", "prefetch")


def _decode_config(K: int, P: int = 1, table=None, down: bool = False,
                   I: int | None = None) -> dict:
    """Decode GEMV config for K inputs and P pairs, BK fitted to K: the first table row (as
    DECODE_TABLE: (max pairs, config) or (max pairs, max I, config)) with P <= max pairs and I
    <= max I (I: the experts' intermediate size; None matches any row), else the last; a
    row's "down" dict overrides it for the down projection (`down`)."""
    rows = [r if len(r) == 3 else (r[0], None, r[1]) for r in (table or DECODE_TABLE)]
    cfg = dict(next((c for n, i_max, c in rows
                     if P <= n and (i_max is None or (I is not None and I <= i_max))),
                    rows[-1][2]))
    sub = cfg.pop("down", {})
    cfg.update(sub if down else {})
    return dict(cfg, BK=_fit_bk(K, cfg["BK"]))


def _decode_pair(K: int, I: int, P: int, config: dict | None, table=None) -> tuple[dict, dict]:
    """(gate/up, down) decode configs for K inputs, I intermediate and P pairs: table row, then
    `config` (its "down" dict: down only)."""
    over = dict(config or {})
    over_down = over.pop("down", {})
    return ({**_decode_config(K, P, table, I=I), **over},
            {**_decode_config(I, P, table, down=True, I=I), **over, **over_down})


def _launch_decode(kernels: dict, grid_p: int, N: int, K: int, cfg: dict, args: tuple,
                   **consts) -> None:
    """One decode GEMV launch; cfg["variant"] picks the kernel of `kernels` (base or a group
    kernel, the latter told MAGIC), BK fitted to K (the kernels have no K mask)."""
    cfg = dict(cfg)
    variant = cfg.pop("variant", "base")
    if variant not in kernels:
        raise ValueError(f"fused_moe: unknown decode variant {variant!r}, "
                         f"expected one of {sorted(kernels)}")
    kern, extra = kernels[variant]
    cfg["BK"] = _fit_bk(K, cfg["BK"])
    kern[(grid_p, triton.cdiv(N, cfg["BN"]))](*args, **consts, **extra, **cfg)


def _sorted_config(P: int, down: bool = True) -> dict:
    """Tiles of the sorted path for P pairs; down True: int8_mx32 (the largest row has the down
    launch's own BN), False: mx4_e2m1 (the int8 tiles but past 32K pairs its own). DEQ =
    SORTED_DEQ for both (their sorted kernels' dequantization: 0 FP32, 2 BF16 PTX). H200:
    session 8 (.whl/moe_prefill.py, events): T = 2048 (P = 12288) 7.07 ms -> 5.42 with BM 64 x
    BN 128, 4 stages; T = 8192 (P = 49152) 14.9 -> 12.8 ms with BM 256 x BN 64, 8 warps (it
    loses at T = 2048: 10.6 ms). Session 9 (scripts/sweep_moe_sorted.py --m 8192 --proj up /
    down, one layer, ms): down BN 128 x BK 64, 8 warps, 3 stages 11.3 (BN 64: 12.9, 4 stages
    11.8, BN 256 24); gate/up stays (3 stages 12.4-12.6; 4 stages 12.2 needs 128 KB of shared
    memory on sm_80, past the 99 KB that keeps two blocks an SM; BN 128 13.6-19.6). Session 22
    (sweep_moe_sorted.py --deq 0,2, one layer): DEQ 2 at every P, int8 tp 1 M = 64 2.13 -> 1.61
    ms, M = 8192 11.45 -> 10.19, a TP-4 rank's M = 2048 -10 %, its M = 512 -7 %; mx4 -8 to -26 %.
    mx4 past 32K pairs (--experts mx4 --m 8192, DEQ 2, one repeat): BM 64 x BN 64 x BK 64, 4
    warps, 4 stages 11.90 ms against 13.13 for the int8 tile, the best of 14 (session 20's sweep
    at M = 2048 on a TP-4 rank, DEQ 0, picked it too: 1.58 vs 1.69 ms; not changed there)."""
    if P <= 1024:
        return dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=3, DEQ=SORTED_DEQ)
    if P <= 8192:
        return dict(BM=32, BN=128, BK=64, num_warps=4, num_stages=3, DEQ=SORTED_DEQ)
    if P <= 32768:
        return dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=4, DEQ=SORTED_DEQ)
    if down:
        return dict(BM=256, BN=64, BK=64, num_warps=8, num_stages=3, DEQ=SORTED_DEQ,
                    down=dict(BN=128))
    return dict(BM=64, BN=64, BK=64, num_warps=4, num_stages=4, DEQ=SORTED_DEQ)   # mx4


def _sorted_pair(P: int, config: dict | None, down: bool = True) -> tuple[dict, dict]:
    """(gate/up, down) tiles of the sorted path: _sorted_config(P, down), then `config`; a
    "down" dict (in either) overrides BN, BK, warps, stages, DEQ of the down launch only (BM is
    the alignment of both launches, so it cannot differ)."""
    base = _sorted_config(P, down)
    over = dict(config or {})
    down = {**base.pop("down", {}), **over.pop("down", {})}
    if "BM" in down:
        raise ValueError("fused_moe: the down projection shares BM with gate/up (the alignment)")
    up = {**base, **over}
    return up, {**up, **down}


_GEMV = dict(base=(_moe_gemv_kernel, {}),
             group=(_moe_gemv_group_kernel, dict(MODE=0, PREFETCH=False)),
             magic=(_moe_gemv_group_kernel, dict(MODE=1, PREFETCH=False)),
             fma=(_moe_gemv_group_kernel, dict(MODE=2, PREFETCH=False)),
             prefetch=(_moe_gemv_group_kernel, dict(MODE=1, PREFETCH=True)))


def fused_moe(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w1: torch.Tensor,
              s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor, w2: torch.Tensor,
              s2: torch.Tensor, limit: float, path: str | None = None,
              config: dict | None = None, shared: torch.Tensor | None = None,
              dtype: torch.dtype = torch.float32,
              shared_ready: torch.cuda.Event | None = None, pairs: bool = False):
    """x [T, K] bf16, idx [T, k], w [T, k] -> routed-expert sum [T, D] (+ shared [T, D], the
    shared expert's output) in `dtype` (FP32 sum either way: pointwise.moe_combine); path
    "decode"/"sorted" and config (tile overrides) replace the automatic choice (tests,
    benchmarks). shared_ready: an event after which `shared` is written (it was computed on a
    side stream): the current stream waits for it only before the combine, so the routed
    launches overlap it. uint8 w1 [E, I, K/2] = mx4_e2m1 stacks: kernels.moe_mx4 runs.
    pairs: return the combine's inputs unsummed (pointwise.PairSum, for mhc_decode.hc_post)."""
    if w1.dtype == torch.uint8:
        from backfit.runtime.kernels.moe_mx4 import fused_moe_mx4
        return fused_moe_mx4(x, idx, w, w1, s1, w3, s3, w2, s2, limit, path, config, shared,
                             dtype, shared_ready, pairs)
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ValueError(f"fused_moe: x must be bf16 [T, K], got {x.dtype}{list(x.shape)}")
    E, I, K = w1.shape
    D = w2.shape[1]
    for name, t, shape, dt in (("w1", w1, (E, I, K), torch.int8), ("w3", w3, (E, I, K), torch.int8),
                               ("s1", s1, (E, I, K // MX_GROUP), torch.uint8),
                               ("s3", s3, (E, I, K // MX_GROUP), torch.uint8),
                               ("w2", w2, (E, D, I), torch.int8),
                               ("s2", s2, (E, D, I // MX_GROUP), torch.uint8)):
        if tuple(t.shape) != shape or t.dtype != dt or not t.is_contiguous():
            raise ValueError(f"fused_moe: {name} must be contiguous {dt}{list(shape)}, "
                             f"got {t.dtype}{list(t.shape)}")
    return run_moe(x, idx, w, (w1, s1, w3, s3, w2, s2), (E, I, K, D), limit, path, config,
                   _GEMV, DECODE_TABLE, _moe_sorted_kernel, ({}, {}), shared, dtype,
                   shared_ready, pairs=pairs)


def run_moe(x, idx, w, stacks, dims, limit, path, config, gemv, table, sorted_kernel,
            sorted_kw, shared=None, dtype=torch.float32, shared_ready=None,
            down_tile: bool = True, pairs: bool = False):
    """The launch sequence both expert schemes share (their launchers check the stacks first):
    stacks (w1, s1, w3, s3, w2, s2), dims (E, I, K, D); gemv / table: the decode variants and
    DECODE_TABLE of the scheme, sorted_kernel with its extra constexprs for (gate/up, down);
    the pairs' outputs summed (+ shared, after shared_ready) in FP32 by one combine launch,
    stored in `dtype` (pairs: that launch left to the caller, a PairSum). down_tile: the
    sorted down launch's own tile (_sorted_config)."""
    from backfit.runtime.kernels.pointwise import combine_later, moe_combine
    combine = combine_later if pairs else moe_combine
    E, I, K, D = dims
    w1, s1, w3, s3, w2, s2 = stacks
    if x.shape[1] != K or K % 64 or I % 64:
        raise ValueError(f"fused_moe: x has {x.shape[1]} inputs, experts {K}; K and I must be "
                         f"multiples of 64")
    if idx.shape != w.shape or idx.dim() != 2 or idx.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: idx {list(idx.shape)} / w {list(w.shape)} "
                         f"for {x.shape[0]} tokens")
    T, k = idx.shape
    P = T * k
    x = x.contiguous()
    rw = w.reshape(-1).float().contiguous()                                  # [P]
    out = torch.empty(P, D, dtype=torch.bfloat16, device=x.device)
    if P == 0:
        if shared_ready is not None:
            torch.cuda.current_stream(x.device).wait_event(shared_ready)
        return combine(out, k, shared, dtype)
    lim = float(limit)
    if path is None:
        path = "decode" if P <= DECODE_PAIRS else "sorted"
    if path == "decode":
        ids = idx.reshape(-1).contiguous()             # int64 from the router: no cast launch
        h = torch.empty(P, I, dtype=torch.bfloat16, device=x.device)
        c1, c2 = _decode_pair(K, I, P, config, table)
        _launch_decode(gemv, P, I, K, c1, (x, ids, rw, w1, s1, w3, s3, h, I, K, k),
                       GATED=True, LIMIT=lim)
        _launch_decode(gemv, P, D, I, c2, (h, ids, rw, w2, s2, w2, s2, out, D, I, k),
                       GATED=False, LIMIT=lim)
    elif path == "sorted":
        cfg, c_down = _sorted_pair(P, config, down_tile)
        sorted_ids, block_e = align(idx, E, cfg["BM"])
        nb = block_e.numel()
        h = torch.empty(nb * cfg["BM"], I, dtype=torch.bfloat16, device=x.device)
        f32 = interpreted()
        sorted_kernel[(nb, triton.cdiv(I, cfg["BN"]))](
            x, sorted_ids, block_e, rw, w1, s1, w3, s3, h, I, K, k, P, E, GATED=True,
            LIMIT=lim, F32=f32, **sorted_kw[0], **dict(cfg, BK=_fit_bk(K, cfg["BK"])))
        sorted_kernel[(nb, triton.cdiv(D, c_down["BN"]))](
            h, sorted_ids, block_e, rw, w2, s2, w2, s2, out, D, I, k, P, E, GATED=False,
            LIMIT=lim, F32=f32, **sorted_kw[1], **dict(c_down, BK=_fit_bk(I, c_down["BK"])))
    else:
        raise ValueError(f"fused_moe: unknown path {path!r}")
    if shared_ready is not None:                                # the side stream's shared expert
        torch.cuda.current_stream(x.device).wait_event(shared_ready)
    return combine(out, k, shared, dtype)                       # FP32 sum over top-k (+ shared)


def stack_experts(experts) -> tuple[torch.Tensor, ...]:
    """Routed Expert modules, all int8_mx32 or all mx4_e2m1 -> stacked (w1, s1, w3, s3, w2, s2)
    [E, ...] (mx4: codes [E, N, K/2], exponents [E, N, K/32]); each expert's weight and scale
    become views into the stacks (one copy while stacking, no second copy stays alive)."""
    schemes = {str(getattr(ex, lin).scheme) for ex in experts for lin in ("w1", "w3", "w2")}
    if len(schemes) != 1 or not schemes <= {"int8_mx32", "mx4_e2m1"}:
        raise ValueError(f"stack_experts: every expert linear must be int8_mx32, or every one "
                         f"mx4_e2m1, got {sorted(schemes)}")
    out = []
    for lin in ("w1", "w3", "w2"):
        mods = [getattr(ex, lin) for ex in experts]
        wq = torch.stack([m.weight for m in mods])
        sc = torch.stack([m.scale for m in mods])
        for i, m in enumerate(mods):
            m.weight, m.scale = wq[i], sc[i]
        out += [wq, sc]
    return tuple(out)
