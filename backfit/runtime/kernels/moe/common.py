"""What the two expert schemes' fused MoE (kernels.moe.int8, kernels.moe.mx4) share: the device-side
alignment of (token, expert) pairs, the decode and sorted tile choices, the launch sequence
(`run_moe`), the GEMV programs' pair bookkeeping and SwiGLU, and stacking the experts.

The math (dsv4-model.md 5.5), per (token t, slot j) pair p = t·k + j with expert idx[t, j] and
routing weight w[t, j]:

  h_p   = silu(min(g, L)) · clamp(u, ±L) · w_p,  g = bf16(x_t W1ᵀ), u = bf16(x_t W3ᵀ)   FP32
  out_p = bf16(bf16(h_p) W2ᵀ);   y_t = Σ_j out_{t·k+j}  (FP32)

the torch path's roundings (runtime/model/moe.py). Two launches, gate+up and down, for all
active experts, and no host sync (the decode step can be captured in a CUDA graph):
  decode   (P = T·k <= DECODE_PAIRS): one program per (pair, N-block), a GEMV on CUDA cores.
  sorted   otherwise: pairs sorted by expert on the device (`align`), each expert's run padded to
           BM rows; a program computes a [BM, BN] tile of one expert with tl.dot. The grid is the
           upper bound cdiv(P, BM) + min(E, P) blocks; blocks past the real count exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backfit.runtime.kernels.common import interpreted

__all__ = ["DECODE_PAIRS", "SORTED_DEQ", "align", "run_moe", "stack_experts"]

DECODE_PAIRS = 64        # up to this many (token, expert) pairs: per-pair GEMV path
SORTED_DEQ = 2           # the sorted kernels' dequantization (their DEQ; int8 and mx4)


@triton.jit
def _swiglu(g, u, wr, LIMIT: tl.constexpr):
    """BF16-rounded g, u as the torch path (bf16 linears), clamps, silu(g)·u·w in FP32."""
    g = tl.minimum(g.to(tl.bfloat16).to(tl.float32), LIMIT)                  # gate: upper only
    u = u.to(tl.bfloat16).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)                              # up: both sides
    return g * tl.sigmoid(g) * u * wr


@triton.jit
def _pair_program(IDX, N, TOPK, GATED: tl.constexpr, BN: tl.constexpr):
    """A decode GEMV program (pair p, row block) -> (p, expert idx[p] as int64, its activation
    row (gate/up: x[p // TOPK], down: h[p]), output rows rn [BN], rn < N)."""
    p, pid_n = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    return p, tl.load(IDX + p).to(tl.int64), p // TOPK if GATED else p, rn, rn < N


@triton.jit
def _pair_store(OUT, RW, p, N, rn, n_ok, r1, r3, GATED: tl.constexpr, LIMIT: tl.constexpr):
    """Row sums r1 [BN] (GATED: _swiglu of r1, r3 with pair p's routing weight) -> OUT[p, rn]
    as bf16."""
    out = _swiglu(r1, r3, tl.load(RW + p), LIMIT) if GATED else r1
    tl.store(OUT + p * N + rn, out.to(tl.bfloat16), mask=n_ok)


@triton.jit
def _down_sum_kernel(H, IDX, W2, S2, SH, Y, N, K, ROWS: tl.constexpr, TOPK: tl.constexpr,
                     SHARED: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     STAGES: tl.constexpr = 1):
    """The down projection and the combine in one launch (a scheme's DOWN_SUM): program (token t,
    rows [pid_n·BN, +BN)) -> Y[t, rows] = (SH[t] +) Σ_j bf16(h[t·TOPK + j] · W2_e(j)ᵀ), the row
    sums by ROWS (a decode variant's rows function: its down launch's sums, bit for bit), added
    in FP32 in j order with pair 0 starting the sum (pointwise._pair_acc's order: no 0 + r,
    which would turn -0 into +0), then the shared expert's row: = the down launch and
    pointwise.moe_combine."""
    t, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    tot = tl.zeros((BN,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        p = t * TOPK + j
        e = tl.load(IDX + p).to(tl.int64)
        r, _ = ROWS(H, p, W2, S2, W2, S2, e, rn, n_ok, N, K, False, BN, BK, STAGES)
        r = r.to(tl.bfloat16).to(tl.float32)              # as _pair_store stores a pair's row
        if j > 0:
            r = tot + r
        tot = r
    if SHARED:
        tot = tl.load(SH + t * N + rn, mask=n_ok, other=0.0).to(tl.float32) + tot
    tl.store(Y + t * N + rn, tot.to(Y.dtype.element_ty), mask=n_ok)


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


def fit_bk(K: int, bk: int) -> int:
    """Largest BK <= bk that divides K (K % 64 == 0 is checked): the kernels have no K mask."""
    while K % bk:
        bk //= 2
    return bk


def decode_config(K: int, P: int, table, down: bool = False,
                   I: int | None = None) -> dict:
    """Decode GEMV config for K inputs and P pairs, BK fitted to K: the first table row (as
    DECODE_TABLE: (max pairs, config) or (max pairs, max I, config)) with P <= max pairs and I
    <= max I (I: the experts' intermediate size; None matches any row), else the last; a
    row's "down" dict overrides it for the down projection (`down`)."""
    rows = [r if len(r) == 3 else (r[0], None, r[1]) for r in table]
    cfg = dict(next((c for n, i_max, c in rows
                     if P <= n and (i_max is None or (I is not None and I <= i_max))),
                    rows[-1][2]))
    sub = cfg.pop("down", {})
    cfg.update(sub if down else {})
    return dict(cfg, BK=fit_bk(K, cfg["BK"]))


def decode_pair(K: int, I: int, P: int, config: dict | None, table) -> tuple[dict, dict]:
    """(gate/up, down) decode configs for K inputs, I intermediate and P pairs: table row, then
    `config` (its "down" dict: down only)."""
    over = dict(config or {})
    over_down = over.pop("down", {})
    return ({**decode_config(K, P, table, I=I), **over},
            {**decode_config(I, P, table, down=True, I=I), **over, **over_down})


def launch_decode(kernels: dict, grid_p: int, N: int, K: int, cfg: dict, args: tuple,
                   **consts) -> None:
    """One decode GEMV launch; cfg["variant"] picks the kernel of `kernels` (base or a group
    kernel, the latter told MAGIC), BK fitted to K (the kernels have no K mask)."""
    cfg = dict(cfg)
    variant = cfg.pop("variant", "base")
    if variant not in kernels:
        raise ValueError(f"fused_moe: unknown decode variant {variant!r}, "
                         f"expected one of {sorted(kernels)}")
    kern, extra = kernels[variant]
    cfg["BK"] = fit_bk(K, cfg["BK"])
    kern[(grid_p, triton.cdiv(N, cfg["BN"]))](*args, **consts, **extra, **cfg)


def down_sum_config(down_sum: dict | None, P: int, pairs: bool) -> dict | None:
    """The summed down's tile (a scheme's DOWN_SUM: its variant, tile and "max_pairs") where it
    applies: a decode launch of <= max_pairs pairs whose sum is not left to the caller."""
    if down_sum is None or pairs or P > down_sum.get("max_pairs", DECODE_PAIRS):
        return None
    return {k: v for k, v in down_sum.items() if k != "max_pairs"}


def launch_down_sum(rows: dict, cfg: dict, h, ids, w2, s2, shared, y, k: int) -> None:
    """The down projection and the combine as one launch (_down_sum_kernel with the rows function
    rows[cfg["variant"]], a program per (token, BN rows)): y [T, D] = (shared +) Σ_j bf16(pair
    t·k + j's down rows), FP32 sums."""
    cfg = dict(cfg)
    variant = cfg.pop("variant")
    if variant not in rows:
        raise ValueError(f"fused_moe: no summed down for variant {variant!r}, expected one of "
                         f"{sorted(rows)}")
    (T, D), I = y.shape, h.shape[1]
    cfg["BK"] = fit_bk(I, cfg["BK"])
    _down_sum_kernel[(T, triton.cdiv(D, cfg["BN"]))](
        h, ids, w2, s2, shared if shared is not None else h, y, D, I, ROWS=rows[variant], TOPK=k,
        SHARED=shared is not None, **cfg)


def sorted_config(P: int, down: bool = True) -> dict:
    """Tiles of the sorted path for P pairs; down True: int8_mx32 (the largest row has the down
    launch's own BN), False: mx4_e2m1 (the int8 tiles but past 32K pairs its own). DEQ =
    SORTED_DEQ for both (their sorted kernels' dequantization: 0 FP32, 2 BF16 PTX). H200:
    2026-12-01 (.whl/moe_prefill.py, events): T = 2048 (P = 12288) 7.07 ms -> 5.42 with BM 64 x
    BN 128, 4 stages; T = 8192 (P = 49152) 14.9 -> 12.8 ms with BM 256 x BN 64, 8 warps (it
    loses at T = 2048: 10.6 ms). 2026-12-01 (benchmarks/kernels/sweep_moe_sorted.py --m 8192 --proj
    up /
    down, one layer, ms): down BN 128 x BK 64, 8 warps, 3 stages 11.3 (BN 64: 12.9, 4 stages
    11.8, BN 256 24); gate/up stays (3 stages 12.4-12.6; 4 stages 12.2 needs 128 KB of shared
    memory on sm_80, past the 99 KB that keeps two blocks an SM; BN 128 13.6-19.6). 2026-12-04
    (sweep_moe_sorted.py --deq 0,2, one layer): DEQ 2 at every P, int8 tp 1 M = 64 2.13 -> 1.61
    ms, M = 8192 11.45 -> 10.19, a TP-4 rank's M = 2048 -10 %, its M = 512 -7 %; mx4 -8 to -26 %.
    mx4 past 32K pairs (--experts mx4 --m 8192, DEQ 2, one repeat): BM 64 x BN 64 x BK 64, 4
    warps, 4 stages 11.90 ms against 13.13 for the int8 tile, the best of 14 (the 2026-12-03 sweep
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


def sorted_pair(P: int, config: dict | None, down: bool = True) -> tuple[dict, dict]:
    """(gate/up, down) tiles of the sorted path: sorted_config(P, down), then `config`; a
    "down" dict (in either) overrides BN, BK, warps, stages, DEQ of the down launch only (BM is
    the alignment of both launches, so it cannot differ)."""
    base = sorted_config(P, down)
    over = dict(config or {})
    down = {**base.pop("down", {}), **over.pop("down", {})}
    if "BM" in down:
        raise ValueError("fused_moe: the down projection shares BM with gate/up (the alignment)")
    up = {**base, **over}
    return up, {**up, **down}


def run_moe(x, idx, w, stacks, dims, limit, path, config, gemv, table, sorted_kernel,
            sorted_kw, shared=None, dtype=torch.float32, shared_ready=None,
            down_tile: bool = True, pairs: bool = False, down_sum: tuple = ({}, None)):
    """The launch sequence both expert schemes share (their launchers check the stacks first):
    stacks (w1, s1, w3, s3, w2, s2), dims (E, I, K, D); gemv / table: the decode variants and
    DECODE_TABLE of the scheme, sorted_kernel with its extra constexprs for (gate/up, down);
    the pairs' outputs summed (+ shared, after shared_ready) in FP32 by one combine launch,
    stored in `dtype` (pairs: that launch left to the caller, a PairSum). down_tile: the
    sorted down launch's own tile (_sorted_config). down_sum: (the scheme's decode rows
    functions by variant, its DOWN_SUM tile or None): where down_sum_config applies, the down
    launch sums each token's pairs itself (no combine launch; it waits for the shared expert
    first)."""
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
    # the pairs' outputs [P, D], summed by the combine (not made where the down launch sums)
    def new_out() -> torch.Tensor:
        return torch.empty(P, D, dtype=torch.bfloat16, device=x.device)
    if P == 0:
        out = new_out()
        if shared_ready is not None:
            torch.cuda.current_stream(x.device).wait_event(shared_ready)
        return combine(out, k, shared, dtype)
    lim = float(limit)
    if path is None:
        path = "decode" if P <= DECODE_PAIRS else "sorted"
    if path == "decode":
        ids = idx.reshape(-1).contiguous()             # int64 from the router: no cast launch
        h = torch.empty(P, I, dtype=torch.bfloat16, device=x.device)
        c1, c2 = decode_pair(K, I, P, config, table)
        launch_decode(gemv, P, I, K, c1, (x, ids, rw, w1, s1, w3, s3, h, I, K, k),
                       GATED=True, LIMIT=lim)
        c_sum = down_sum_config(down_sum[1], P, pairs)
        if c_sum is not None:
            if shared_ready is not None:                        # the shared expert's output
                torch.cuda.current_stream(x.device).wait_event(shared_ready)
            y = torch.empty(T, D, dtype=dtype, device=x.device)
            launch_down_sum(down_sum[0], c_sum, h, ids, w2, s2, shared, y, k)
            return y
        out = new_out()
        launch_decode(gemv, P, D, I, c2, (h, ids, rw, w2, s2, w2, s2, out, D, I, k),
                       GATED=False, LIMIT=lim)
    elif path == "sorted":
        cfg, c_down = sorted_pair(P, config, down_tile)
        sorted_ids, block_e = align(idx, E, cfg["BM"])
        nb = block_e.numel()
        h = torch.empty(nb * cfg["BM"], I, dtype=torch.bfloat16, device=x.device)
        out = new_out()
        f32 = interpreted()
        sorted_kernel[(nb, triton.cdiv(I, cfg["BN"]))](
            x, sorted_ids, block_e, rw, w1, s1, w3, s3, h, I, K, k, P, E, GATED=True,
            LIMIT=lim, F32=f32, **sorted_kw[0], **dict(cfg, BK=fit_bk(K, cfg["BK"])))
        sorted_kernel[(nb, triton.cdiv(D, c_down["BN"]))](
            h, sorted_ids, block_e, rw, w2, s2, w2, s2, out, D, I, k, P, E, GATED=False,
            LIMIT=lim, F32=f32, **sorted_kw[1], **dict(c_down, BK=fit_bk(I, c_down["BK"])))
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
