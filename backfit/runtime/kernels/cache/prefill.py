"""Prefill-chunk cache kernels (many tokens of several sequences at once), Triton, SM80-safe,
no host sync: the chunk form of kernels.cache.decode' decode kernels.

  compress_prefill  a compressor's update for every sequence of a prefill or mixed batch
                    (runtime.model.compressor.Compressor.prefill_update): for each row t whose
                    position p completes a block ((p+1) % m == 0, the rows listed in `rows`),
                    pools the m (CSA: 2m) rows ending at p, reading positions >= its chunk's
                    start from the chunk's c, z [T, width] and the older ones from its slot's
                    ring, then cast, RMSNorm, RoPE at (p // m)·m and the entry store, as
                    compress_decode_fused does for one token (its _softmax_slots and
                    _entry_tail: the same operations, so the same entries bit for bit as the
                    decode kernel would write token by token)
  store_rows        the compressor ring rows of the listed chunk rows (each sequence's last R
                    rows: what the next chunk and a rollback read), after compress_prefill has
                    read the old ones
Replaces Compressor.update's torch ops per compressor and sequence with two launches per
compressor and batch (a 512-token step of the 43-layer TP-4 slice: 5,297 -> 3,995 launches
eagerly, docs/PERFORMANCE.md 2026-12-03). Entries agree with the torch update to FP32 rounding
(Triton's exp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backfit.runtime.kernels.common import interpreted
from backfit.runtime.kernels.cache.decode import (_last_runs_tail, _softmax_slots,
                                               check_tail_args, pool_launch)

__all__ = ["compress_prefill", "store_rows"]


@triton.jit
def _pool_chunk(C, Z, sc_b, sz_b, t, p, st, slot, dd, RC, RZ, R, D, WIDTH, M: tl.constexpr,
                OVERLAP: tl.constexpr, N: tl.constexpr, NP: tl.constexpr):
    """Channels dd [BD] of the entry ending at row t (position p, chunk start st): slot i holds
    position q = p - N + 1 + i, from the chunk (row t - (p - q)) when q >= st, else from the
    ring at q % R -> E [BD] FP32 (_pool's slots, columns and virtual block -1)."""
    d_ok = dd < D
    i = tl.arange(0, NP)
    i_ok = i < N
    q = p - N + 1 + i
    col = dd[None, :]
    if OVERLAP:
        col = col + tl.where(i >= M, D, 0)[:, None]                   # second half: block j
    ok = i_ok[:, None] & d_ok[None, :]
    mine = (q >= st)[:, None]
    trow = (t - (p - q)).to(tl.int64)[:, None]
    ring = slot * R * WIDTH + (((q % R) + R) % R)[:, None] * WIDTH + col
    sc = tl.where(mine, tl.load(C + trow * sc_b + col, mask=ok & mine, other=0.0),
                  tl.load(RC + ring, mask=ok & ~mine, other=0.0))
    sz = tl.where(mine, tl.load(Z + trow * sz_b + col, mask=ok & mine, other=0.0),
                  tl.load(RZ + ring, mask=ok & ~mine, other=0.0))
    return _softmax_slots(sc, sz, i, i_ok, p, M, OVERLAP)


@triton.jit
def _compress_prefill_kernel(C, Z, sc_b, sz_b, ROWS, POS, SEQ, START, SLOTS, RC, RZ, EBUF, CNT,
                             NW, eps, F, TABLES, stride_tb, DATA, SCALE, scratch, R, D, WIDTH,
                             M: tl.constexpr, OVERLAP: tl.constexpr, N: tl.constexpr,
                             NP: tl.constexpr, BD: tl.constexpr, NBLK: tl.constexpr,
                             DP: tl.constexpr, RR: tl.constexpr, BH: tl.constexpr,
                             PB: tl.constexpr, INT8: tl.constexpr, BF16: tl.constexpr,
                             RN: tl.constexpr):
    """Program (k, channel block): entry row t = ROWS[k] (< 0: nothing, a padded list), pooled
    into EBUF[k]; the last of its NBLK programs (an acq_rel counter, reset by it) runs the entry
    tail into the blocks of its sequence's table row."""
    k, db = tl.program_id(0).to(tl.int64), tl.program_id(1)
    t = tl.load(ROWS + k).to(tl.int64)
    if t >= 0:
        p = tl.load(POS + t)
        s = tl.load(SEQ + t).to(tl.int64)
        st = tl.load(START + t)
        slot = tl.load(SLOTS + s).to(tl.int64)
        dd = db * BD + tl.arange(0, BD)
        e = _pool_chunk(C, Z, sc_b, sz_b, t, p, st, slot, dd, RC, RZ, R, D, WIDTH, M, OVERLAP,
                        N, NP)
        _last_runs_tail(e, dd, EBUF, CNT, k, s, p, NW, eps, F, TABLES, stride_tb, DATA, SCALE,
                        scratch, D, M, NBLK, DP, RR, BH, PB, INT8, BF16, RN)


@triton.jit
def _rows_kernel(C, Z, sc_b, sz_b, ROWS, RPOS, RSLOT, RC, RZ, R, WIDTH, APE, M,
                 BW: tl.constexpr, IDENT: tl.constexpr, HAS_APE: tl.constexpr):
    """Program (k, column block): row t -> ring row RPOS[k] % R of slot RSLOT[k], t = ROWS[k]
    (IDENT: t = k); HAS_APE: z + APE[RPOS[k] % M] (FP32, the torch add's one rounding)."""
    k, cb = tl.program_id(0), tl.program_id(1)
    t = k.to(tl.int64) if IDENT else tl.load(ROWS + k).to(tl.int64)
    p = tl.load(RPOS + k).to(tl.int64)
    at = (tl.load(RSLOT + k).to(tl.int64) * R + p % R) * WIDTH
    cc = cb * BW + tl.arange(0, BW)
    ok = cc < WIDTH
    z = tl.load(Z + t * sz_b + cc, mask=ok)
    if HAS_APE:
        z = z + tl.load(APE + (p % M) * WIDTH + cc, mask=ok)
    tl.store(RC + at + cc, tl.load(C + t * sc_b + cc, mask=ok), mask=ok)
    tl.store(RZ + at + cc, z, mask=ok)


def _check_rows(c, z, pos, seq, start, slots, ring_c, ring_z, width: int):
    T = c.shape[0]
    if z.shape != c.shape or c.dtype != torch.float32 or z.dtype != torch.float32 \
            or c.stride(1) != 1 or z.stride(1) != 1 or c.shape[1] != width:
        raise ValueError(f"compress_prefill: c, z [T, {width}] FP32, unit stride in a row; got "
                         f"{c.dtype}{list(c.shape)}")
    if pos.shape != (T,) or seq.shape != (T,) or start.shape != (T,) or slots.dim() != 1:
        raise ValueError(f"compress_prefill: pos, seq, start [T={T}], slots [NS]; got "
                         f"{list(pos.shape)}, {list(seq.shape)}, {list(start.shape)}, "
                         f"{list(slots.shape)}")
    if ring_c.shape != ring_z.shape or ring_c.dim() != 3 or ring_c.shape[2] != width \
            or not ring_c.is_contiguous() or not ring_z.is_contiguous():
        raise ValueError(f"compress_prefill: rings [S, R, {width}] contiguous, got "
                         f"{list(ring_c.shape)}")


def compress_prefill(c: torch.Tensor, z: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                     seq: torch.Tensor, start: torch.Tensor, slots: torch.Tensor,
                     ring_c: torch.Tensor, ring_z: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float, inv_freq: torch.Tensor, rope_dim: int, data: torch.Tensor,
                     scale: torch.Tensor | None, tables: torch.Tensor, scratch: int, ratio: int,
                     overlap: bool, D: int, dtype: torch.dtype) -> None:
    """The entries a batch of chunks completes (module docstring): c, z [T, width] FP32 (z with
    its ape row), rows [K] int32 (the rows t whose position completes a block; -1: padding),
    pos / seq / start [T] int32 (position, sequence, chunk start of each row), slots [NS] int32,
    rings [S, R, width] FP32 (read only), norm_weight [D] FP32, inv_freq FP64 [rope_dim / 2],
    data [NB, PB, D] (+ scale iff INT8), tables [NS, nblk] int32. The rings are not written:
    store_rows after it."""
    width = (2 if overlap else 1) * D
    _check_rows(c, z, pos, seq, start, slots, ring_c, ring_z, width)
    int8 = check_tail_args("compress_prefill", dtype, norm_weight, inv_freq, rope_dim, D, data,
                           scale, tables, slots.shape[0])
    if rows.dim() != 1 or rows.dtype != torch.int32:
        raise ValueError(f"compress_prefill: rows [K] int32, got {rows.dtype}{list(rows.shape)}")
    K = rows.shape[0]
    if not K:
        return
    n, NP, BD, nblk, ebuf, cnt = pool_launch(ratio, overlap, D, K, c.device)
    tables = tables.contiguous()
    _compress_prefill_kernel[(K, nblk)](
        c, z, c.stride(0), z.stride(0), rows, pos.contiguous(), seq.contiguous(),
        start.contiguous(), slots.contiguous(), ring_c, ring_z, ebuf, cnt, norm_weight,
        float(eps), inv_freq, tables, tables.stride(0), data, scale if int8 else data, scratch,
        ring_c.shape[1], D, width, M=ratio, OVERLAP=overlap, N=n, NP=NP, BD=BD, NBLK=nblk,
        DP=triton.next_power_of_2(D), RR=rope_dim,
        BH=triton.next_power_of_2(max(D - rope_dim, 1)), PB=data.shape[1], INT8=int8,
        BF16=dtype == torch.bfloat16, RN=not interpreted(), num_warps=4)


def store_rows(c: torch.Tensor, z: torch.Tensor, rows: torch.Tensor | None, rpos: torch.Tensor,
               rslots: torch.Tensor, ring_c: torch.Tensor, ring_z: torch.Tensor,
               ape: torch.Tensor | None = None) -> None:
    """Rows c[rows[k]], z[rows[k]] [width] FP32 -> ring row rpos[k] % R of slot rslots[k]
    (rows, rpos, rslots [K] int32; PagedCache's chunk_rows: each sequence's last <= R rows, so
    one writer a ring row). rows None: row k itself (K = c's rows; rpos may be int64: a decode
    batch's positions); ape [m, width] FP32: z + ape[rpos % m] is stored (Compressor's ape
    row, as with_ape adds it)."""
    K = c.shape[0] if rows is None else rows.shape[0]
    if z.shape != c.shape or c.dtype != torch.float32 or z.dtype != torch.float32 \
            or c.stride(1) != 1 or z.stride(1) != 1 or ring_c.shape != ring_z.shape \
            or ring_c.dim() != 3 or ring_c.shape[2] != c.shape[1] \
            or not ring_c.is_contiguous() or not ring_z.is_contiguous():
        raise ValueError(f"store_rows: c, z [T, width] FP32 with unit stride in a row, rings "
                         f"[S, R, width] contiguous; got {c.dtype}{list(c.shape)}, "
                         f"{list(ring_c.shape)}")
    ids = (rpos, rslots) if rows is None else (rows, rpos, rslots)
    if any(t.shape != (K,) or t.dtype not in (torch.int32, torch.int64) for t in ids) \
            or (rows is not None and any(t.dtype != torch.int32 for t in ids)):
        raise ValueError(f"store_rows: rows, rpos, rslots [K] int32 (rpos int64 without rows); "
                         f"got {[(t.dtype, list(t.shape)) for t in ids]}")
    if ape is not None and (ape.dtype != torch.float32 or ape.dim() != 2
                            or ape.shape[1] != c.shape[1] or not ape.is_contiguous()):
        raise ValueError(f"store_rows: ape [m, {c.shape[1]}] FP32 contiguous, got "
                         f"{ape.dtype}{list(ape.shape)}")
    if K:
        width = c.shape[1]
        BW = min(1024, triton.next_power_of_2(width))
        _rows_kernel[(K, triton.cdiv(width, BW))](
            c, z, c.stride(0), z.stride(0), rpos if rows is None else rows, rpos.contiguous(),
            rslots.contiguous(), ring_c, ring_z, ring_c.shape[1], width,
            z if ape is None else ape, 1 if ape is None else ape.shape[0],
            BW=BW, IDENT=rows is None, HAS_APE=ape is not None, num_warps=4)
