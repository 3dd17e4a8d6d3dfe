"""Decode-step cache kernels (one token per sequence), Triton, SM80-safe, no host sync:

  compress_decode   the compressor's decode update (runtime.model.compressor.decode_update):
                    writes this token's rows c, z [B, width] FP32 into the slot's ring at
                    pos % R, and pools the m (CSA: 2m) rows ending at pos with a softmax over
                    the slots per channel -> E [B, D] FP32 (before norm and RoPE). CSA: slots
                    0..m-1 read the first D channels of block j-1 (0 and -inf for the virtual
                    block -1), slots m..2m-1 the last D of block j.
  store_decode      one D-vector per sequence into a pool [N, rows, D] (+ FP32 scales when
                    INT8: absmax/127, round half to even, as runtime/cache/paged.py's _Store):
                    "ring"  -> (slot[b], pos[b] % R)                  (the window ring)
                    "entry" -> (table[b, j // PB], j % PB), j = pos[b] // m, where the block
                               completes ((pos+1) % m == 0); the scratch block otherwise
  compress_decode_fused  the whole decode update of a compressor in one launch: the ape add,
                    compress_decode, the cast to the act dtype, RMSNorm, RoPE at the block start
                    (pos // m)·m and the entry store ("entry" above), each with the operations
                    of the kernel it replaces (rope_norm's _rms_kernel, _rope_kernel; RoPE's
                    products explicitly rounded), so the same entries bit for bit; optionally the
                    indexer head weights. Grid (B, D / BD) as compress_decode; the last program
                    of a row (an acq_rel counter) runs the tail on the pooled row.
Replaces ~35 small torch ops per compressor and ~5 per ring store. The pooling uses Triton's exp
(not torch's), so entries agree with the torch path to FP32 rounding, not bit for bit; the store
is exact (the same quantization arithmetic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from backfit.runtime.kernels.common import interpreted
from backfit.runtime.streams import stream_counters

__all__ = ["compress_decode", "compress_decode_fused", "store_decode"]


@triton.jit
def _pool(C, Z, sc_b, sz_b, APE, b, p, slot, dd, RC, RZ, R, D, WIDTH, M: tl.constexpr,
          OVERLAP: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, HAS_APE: tl.constexpr):
    """Channels dd [BD] of row b: this token's ring rows (z + ape[p % M] if HAS_APE) at p % R,
    then the softmax pooling over the N slots ending at p -> E [BD] FP32 (both kernels)."""
    d_ok = dd < D
    ring = slot * R * WIDTH                                           # this slot's ring rows
    own = ring + (p % R) * WIDTH
    c0 = tl.load(C + b * sc_b + dd, mask=d_ok, other=0.0)            # this token, first D
    z0 = tl.load(Z + b * sz_b + dd, mask=d_ok, other=0.0)
    if HAS_APE:                                                       # Compressor.with_ape
        z0 = z0 + tl.load(APE + (p % M) * WIDTH + dd, mask=d_ok, other=0.0)
    tl.store(RC + own + dd, c0, mask=d_ok)
    tl.store(RZ + own + dd, z0, mask=d_ok)
    if OVERLAP:                                                       # rows are 2D wide
        c1 = tl.load(C + b * sc_b + D + dd, mask=d_ok, other=0.0)
        z1 = tl.load(Z + b * sz_b + D + dd, mask=d_ok, other=0.0)
        if HAS_APE:
            z1 = z1 + tl.load(APE + (p % M) * WIDTH + D + dd, mask=d_ok, other=0.0)
        tl.store(RC + own + D + dd, c1, mask=d_ok)
        tl.store(RZ + own + D + dd, z1, mask=d_ok)
    else:
        c1, z1 = c0, z0
    i = tl.arange(0, NP)                                              # slot i: position p-N+1+i
    i_ok = i < N
    q = p - N + 1 + i
    row = ((q % R) + R) % R                                           # q < 0: any row (masked)
    col = dd[None, :]
    if OVERLAP:
        col = col + tl.where(i >= M, D, 0)[:, None]                   # second half: block j
    offs = ring + row[:, None] * WIDTH + col
    last = (i == N - 1)[:, None]
    ok = i_ok[:, None] & d_ok[None, :] & ~last                        # the own row: registers
    sc = tl.load(RC + offs, mask=ok, other=0.0)
    sz = tl.load(RZ + offs, mask=ok, other=0.0)
    sc = tl.where(last, c1[None, :], sc)
    sz = tl.where(last, z1[None, :], sz)
    return _softmax_slots(sc, sz, i, i_ok, p, M, OVERLAP)


@triton.jit
def _softmax_slots(sc, sz, i, i_ok, p, M: tl.constexpr, OVERLAP: tl.constexpr):
    """Rows c, z [NP, BD] of slots i (i_ok; the others masked) of the entry ending at position
    p -> Σ softmax_slots(z) ⊙ c [BD] FP32, CSA's virtual block -1 (c 0, z -inf) applied: the
    pooling of _pool and of kernels.cache.prefill, the same operations."""
    if OVERLAP:                                                       # virtual block -1
        virt = ((p < M) & (i < M))[:, None]
        sc = tl.where(virt, 0.0, sc)
        sz = tl.where(virt, float("-inf"), sz)
    sz = tl.where(i_ok[:, None], sz, float("-inf"))
    mx = tl.max(sz, axis=0)
    e = tl.exp(sz - mx[None, :])
    w = e / tl.sum(e, axis=0)[None, :]                                # softmax over the slots
    return tl.sum(w * sc, axis=0)


@triton.jit
def _compress_kernel(C, Z, sc_b, sz_b, POS, SLOTS, RC, RZ, E, R, D, WIDTH,
                     M: tl.constexpr, OVERLAP: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
                     BD: tl.constexpr):
    """Program (b, channel block): ring rows of this token, then E[b, block] over N slots
    (N = 2M for CSA, M for HCA; NP = N rounded up to a power of two)."""
    b, db = tl.program_id(0).to(tl.int64), tl.program_id(1)
    dd = db * BD + tl.arange(0, BD)
    p = tl.load(POS + b)
    slot = tl.load(SLOTS + b).to(tl.int64)
    e = _pool(C, Z, sc_b, sz_b, C, b, p, slot, dd, RC, RZ, R, D, WIDTH, M, OVERLAP, N, NP, False)
    tl.store(E + b * D + dd, e, mask=dd < D)


@triton.jit
def _round_bf16(x):
    """FP32 -> the nearest BF16 value (ties to even) as FP32, torch's .to(bfloat16) (= cvt.rn
    on a GPU; the interpreter's own cast truncates, so it is spelled out)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _entry_tail(EBUF, b, tb, p, NW, eps, F, TABLES, stride_tb, DATA, SCALE, scratch, D,
                M: tl.constexpr, DP: tl.constexpr, RR: tl.constexpr, BH: tl.constexpr,
                PB: tl.constexpr, INT8: tl.constexpr, BF16: tl.constexpr, RN: tl.constexpr):
    """Row b's pooled E [D] FP32 (EBUF) -> cast to the act dtype, RMSNorm, RoPE at (p // M)·M,
    entry store into the blocks of table row tb: the ops of _rms_kernel, _rope_kernel and
    _store_kernel in their order."""
    row = EBUF + b * D
    full = tl.arange(0, DP)
    hh = tl.arange(0, BH)                                             # the unrotated head
    h_ok = hh < D - RR
    i = tl.arange(0, RR // 2)
    ev = D - RR + 2 * i                                               # rotated pairs (ev, ev+1)
    j = p // M                                                        # _store_kernel, "entry"
    done = (p + 1) % M == 0
    # every load before the first cross-warp sum (a load after it waits for it): one trip
    x = tl.load(row + full, mask=full < D, other=0.0, cache_modifier=".cg")   # other blocks' E
    xh = tl.load(row + hh, mask=h_ok, other=0.0, cache_modifier=".cg")
    xa = tl.load(row + ev, cache_modifier=".cg")
    xb = tl.load(row + ev + 1, cache_modifier=".cg")
    wh = tl.load(NW + hh, mask=h_ok, other=0.0)
    wa = tl.load(NW + ev)
    wb = tl.load(NW + ev + 1)
    f = tl.load(F + i)
    blk = tl.load(TABLES + tb * stride_tb + tl.where(done, j // PB, 0))
    if BF16:
        x = _round_bf16(x)                                            # E.to(dtype)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)              # _rms_kernel
    if BF16:
        xh, xa, xb = _round_bf16(xh), _round_bf16(xa), _round_bf16(xb)
    yh = xh * inv
    yh = yh * wh
    a = xa * inv
    a = a * wa
    bb = xb * inv
    bb = bb * wb
    if BF16:                                                          # the norm's output dtype
        yh = yh.to(tl.bfloat16).to(tl.float32)
        a = a.to(tl.bfloat16).to(tl.float32)
        bb = bb.to(tl.bfloat16).to(tl.float32)
    ang = ((p // M) * M).to(tl.float64) * f                           # _rope_kernel, FP64 angles
    cos = tl.cos(ang).to(tl.float32)
    sin = tl.sin(ang).to(tl.float32)
    if RN:                                                            # no FMA contraction
        ra = libdevice.sub_rn(libdevice.mul_rn(a, cos), libdevice.mul_rn(bb, sin))
        rb = libdevice.add_rn(libdevice.mul_rn(a, sin), libdevice.mul_rn(bb, cos))
    else:                                                             # interpreter: numpy rounds
        ra = a * cos - bb * sin
        rb = a * sin + bb * cos
    if BF16:
        ra = ra.to(tl.bfloat16).to(tl.float32)
        rb = rb.to(tl.bfloat16).to(tl.float32)
    i0 = tl.where(done, blk, scratch).to(tl.int64)
    at = (i0 * PB + j % PB) * D
    if INT8:
        amax = tl.maximum(tl.max(tl.abs(yh), axis=0),
                          tl.maximum(tl.max(tl.abs(ra), axis=0), tl.max(tl.abs(rb), axis=0)))
        s = tl.math.div_rn(tl.maximum(amax, 1e-30), 127.0)
        qh = tl.math.div_rn(yh, tl.full((BH,), 1.0, tl.float32) * s)
        qa = tl.math.div_rn(ra, tl.full((RR // 2,), 1.0, tl.float32) * s)
        qb = tl.math.div_rn(rb, tl.full((RR // 2,), 1.0, tl.float32) * s)
        qh = (qh + 12582912.0) - 12582912.0                           # round half to even
        qa = (qa + 12582912.0) - 12582912.0
        qb = (qb + 12582912.0) - 12582912.0
        tl.store(DATA + at + hh, qh.to(tl.int8), mask=h_ok)
        tl.store(DATA + at + ev, qa.to(tl.int8))
        tl.store(DATA + at + ev + 1, qb.to(tl.int8))
        tl.store(SCALE + i0 * PB + j % PB, s)
    else:
        tl.store(DATA + at + hh, yh.to(DATA.dtype.element_ty), mask=h_ok)
        tl.store(DATA + at + ev, ra.to(DATA.dtype.element_ty))
        tl.store(DATA + at + ev + 1, rb.to(DATA.dtype.element_ty))


@triton.jit
def _fused_kernel(C, Z, sc_b, sz_b, APE, POS, SLOTS, RC, RZ, EBUF, CNT, NW, eps, F, TABLES,
                  stride_tb, DATA, SCALE, scratch, R, D, WIDTH, WRAW, sw_b, WI, H, w_scale,
                  M: tl.constexpr, OVERLAP: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
                  BD: tl.constexpr, NBLK: tl.constexpr, HAS_APE: tl.constexpr,
                  DP: tl.constexpr, RR: tl.constexpr, BH: tl.constexpr, PB: tl.constexpr,
                  INT8: tl.constexpr, BF16: tl.constexpr, RN: tl.constexpr,
                  HAS_W: tl.constexpr = False, BHW: tl.constexpr = 16):
    """Program (b, channel block), the grid of _compress_kernel: rows + pooling of the block
    -> EBUF; the last of row b's NBLK programs (an acq_rel counter, reset to 0 by it) runs the
    entry tail on the whole row. HAS_W (the indexer's compressor): program (b, 0) also forms
    the indexer head weights WI[b] = WRAW[b].to(act dtype).float() · w_scale [H] FP32."""
    b, db = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if HAS_W:
        if db == 0:                                                   # Indexer.queries' w
            hw = tl.arange(0, BHW)
            w_ok = hw < H
            w = tl.load(WRAW + b * sw_b + hw, mask=w_ok, other=0.0)
            if BF16:
                w = _round_bf16(w)                                    # weights_proj's rounding
            tl.store(WI + b * H + hw, w * w_scale, mask=w_ok)
    dd = db * BD + tl.arange(0, BD)
    p = tl.load(POS + b)
    slot = tl.load(SLOTS + b).to(tl.int64)
    e = _pool(C, Z, sc_b, sz_b, APE, b, p, slot, dd, RC, RZ, R, D, WIDTH, M, OVERLAP, N, NP,
              HAS_APE)
    _last_runs_tail(e, dd, EBUF, CNT, b, b, p, NW, eps, F, TABLES, stride_tb, DATA, SCALE,
                    scratch, D, M, NBLK, DP, RR, BH, PB, INT8, BF16, RN)


@triton.jit
def _last_runs_tail(e, dd, EBUF, CNT, b, tb, p, NW, eps, F, TABLES, stride_tb, DATA, SCALE,
                    scratch, D, M: tl.constexpr, NBLK: tl.constexpr, DP: tl.constexpr,
                    RR: tl.constexpr, BH: tl.constexpr, PB: tl.constexpr, INT8: tl.constexpr,
                    BF16: tl.constexpr, RN: tl.constexpr):
    """This program's pooled channels e [BD] at dd -> EBUF row b; the last of the row's NBLK
    programs (an acq_rel counter CNT[b], reset to 0 by it) runs _entry_tail on the whole row
    (table row tb). Shared by the decode and the prefill kernels."""
    tl.store(EBUF + b * D + dd, e, mask=dd < D)
    tl.debug_barrier()                                                # the whole block stored
    if NBLK == 1:
        _entry_tail(EBUF, b, tb, p, NW, eps, F, TABLES, stride_tb, DATA, SCALE, scratch, D, M,
                    DP, RR, BH, PB, INT8, BF16, RN)
    else:
        if tl.atomic_add(CNT + b, 1, sem="acq_rel", scope="gpu") == NBLK - 1:
            tl.store(CNT + b, 0)                                      # ready for the next call
            _entry_tail(EBUF, b, tb, p, NW, eps, F, TABLES, stride_tb, DATA, SCALE, scratch, D,
                        M, DP, RR, BH, PB, INT8, BF16, RN)


@triton.jit
def _store_kernel(X, sx_b, POS, SLOTS, TABLES, stride_tb, DATA, SCALE, R, scratch, D,
                  MODE: tl.constexpr, M: tl.constexpr, PB: tl.constexpr, INT8: tl.constexpr,
                  BD: tl.constexpr):
    """Row b: x[b] [D] -> DATA[i0, i1] (INT8: with SCALE[i0, i1])."""
    b = tl.program_id(0).to(tl.int64)
    p = tl.load(POS + b)
    if MODE == 0:                                                     # ring
        i0 = tl.load(SLOTS + b).to(tl.int64)
        i1 = p % R
    else:                                                             # compressed entry
        j = p // M
        done = (p + 1) % M == 0
        blk = tl.load(TABLES + b * stride_tb + tl.where(done, j // PB, 0))
        i0 = tl.where(done, blk, scratch).to(tl.int64)
        i1 = j % PB
    dd = tl.arange(0, BD)
    d_ok = dd < D
    x = tl.load(X + b * sx_b + dd, mask=d_ok, other=0.0)
    at = (i0 * R + i1) * D
    if INT8:
        xf = x.to(tl.float32)
        s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(xf), axis=0), 1e-30), 127.0)
        y = tl.math.div_rn(xf, tl.full((BD,), 1.0, tl.float32) * s)
        y = (y + 12582912.0) - 12582912.0                             # round half to even
        tl.store(DATA + at + dd, y.to(tl.int8), mask=d_ok)
        tl.store(SCALE + i0 * R + i1, s)
    else:
        tl.store(DATA + at + dd, x.to(DATA.dtype.element_ty), mask=d_ok)


def compress_decode(c: torch.Tensor, z: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                    ring_c: torch.Tensor, ring_z: torch.Tensor, ratio: int, overlap: bool,
                    D: int) -> torch.Tensor:
    """c, z [B, width] FP32 (each with its own row stride), pos [B], slots [B] int32, rings [S, R, width]
    FP32 -> E [B, D] FP32 (see the module docstring); the rings get this token's rows."""
    B, width = c.shape
    if z.shape != c.shape or c.dtype != torch.float32 or z.dtype != torch.float32 \
            or c.stride(1) != 1 or z.stride(1) != 1 or width != (2 if overlap else 1) * D:
        raise ValueError(f"compress_decode: c, z [B, {(2 if overlap else 1) * D}] FP32, unit "
                         f"stride in a row; got {list(c.shape)} {c.dtype} strides "
                         f"{c.stride()}/{z.stride()}")
    if ring_c.shape != ring_z.shape or ring_c.shape[2] != width or not ring_c.is_contiguous() \
            or not ring_z.is_contiguous():
        raise ValueError(f"compress_decode: rings [S, R, {width}] contiguous, got {list(ring_c.shape)}")
    E = torch.empty(B, D, dtype=torch.float32, device=c.device)
    if B:
        n = 2 * ratio if overlap else ratio
        NP = triton.next_power_of_2(n)
        BD = min(128, triton.next_power_of_2(D), max(16, 4096 // NP))   # NP x BD x 2 in registers
        _compress_kernel[(B, triton.cdiv(D, BD))](
            c, z, c.stride(0), z.stride(0), pos.contiguous(), slots.contiguous(), ring_c, ring_z, E,
            ring_c.shape[1], D, width, M=ratio, OVERLAP=overlap,
            N=n, NP=NP, BD=BD, num_warps=4)
    return E


def store_decode(x: torch.Tensor, pos: torch.Tensor, data: torch.Tensor, scale: torch.Tensor | None,
                 slots: torch.Tensor | None = None, tables: torch.Tensor | None = None,
                 ratio: int = 1, scratch: int = 0) -> None:
    """x [B, D] -> pool data [N, rows, D] (+ scale [N, rows] FP32 iff data is INT8). slots given:
    the ring store at (slot, pos % rows); tables [B, nblk] int32 given: the entry store (module
    docstring) with `ratio` = m and `scratch` the scratch block."""
    B, D = x.shape
    if data.dim() != 3 or data.shape[2] != D or not data.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"store_decode: x [B, D], data [N, rows, {D}] contiguous; got "
                         f"{list(x.shape)}, {list(data.shape)}")
    int8 = data.dtype == torch.int8
    if int8 != (scale is not None) or (slots is None) == (tables is None):
        raise ValueError("store_decode: a scale iff INT8 data, and exactly one of slots / tables")
    if B:
        BD = triton.next_power_of_2(D)
        _store_kernel[(B,)](
            x, x.stride(0), pos.contiguous(), slots if slots is not None else pos,
            tables if tables is not None else pos, tables.stride(0) if tables is not None else 0,
            data, scale if int8 else data, data.shape[1], scratch, D,
            MODE=0 if slots is not None else 1, M=ratio, PB=data.shape[1], INT8=int8, BD=BD,
            num_warps=4 if D <= 512 else 8)


def pool_launch(ratio: int, overlap: bool, D: int, rows: int, device: torch.device):
    """The pooling launch of the fused kernels for `rows` entries -> (N slots, NP, BD, channel
    blocks, the pooled-row buffer [rows, D] FP32, the row counters of the current stream)."""
    n = 2 * ratio if overlap else ratio
    NP = triton.next_power_of_2(n)
    BD = min(128, triton.next_power_of_2(D), max(16, 4096 // NP))   # compress_decode's blocks
    nblk = triton.cdiv(D, BD)
    ebuf = torch.empty(rows, D, dtype=torch.float32, device=device)  # pooled E, per row
    return n, NP, BD, nblk, ebuf, stream_counters(device, rows) if nblk > 1 else ebuf


def check_tail_args(name: str, dtype: torch.dtype, norm_weight: torch.Tensor,
                    inv_freq: torch.Tensor, rope_dim: int, D: int, data: torch.Tensor,
                    scale: torch.Tensor | None, tables: torch.Tensor, rows: int) -> bool:
    """The entry tail's arguments (_entry_tail: cast, norm, RoPE, store) of `name`, checked with
    a one-line ValueError -> whether the entry pool is INT8. tables [rows, nblk] int32."""
    if dtype not in (torch.bfloat16, torch.float32) or norm_weight.shape != (D,) \
            or norm_weight.dtype != torch.float32 or inv_freq.dtype != torch.float64 \
            or inv_freq.shape != (rope_dim // 2,) or rope_dim & (rope_dim - 1) or rope_dim > D:
        raise ValueError(f"{name}: act dtype bf16/FP32 (got {dtype}), norm weight FP32 [{D}], "
                         f"inv_freq FP64 [{rope_dim // 2}], power-of-2 rope_dim")
    int8 = data.dtype == torch.int8
    if data.dim() != 3 or data.shape[2] != D or not data.is_contiguous() \
            or int8 != (scale is not None) or (not int8 and data.dtype != dtype) \
            or tables.dim() != 2 or tables.shape[0] != rows or tables.dtype != torch.int32:
        raise ValueError(f"{name}: data [NB, PB, {D}] contiguous in {dtype} (or INT8 with a "
                         f"scale), tables [{rows}, nblk] int32; got "
                         f"{data.dtype}{list(data.shape)}, {tables.dtype}{list(tables.shape)}")
    return int8


def compress_decode_fused(c: torch.Tensor, z: torch.Tensor, ape: torch.Tensor | None,
                          pos: torch.Tensor, slots: torch.Tensor, ring_c: torch.Tensor,
                          ring_z: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          inv_freq: torch.Tensor, rope_dim: int, data: torch.Tensor,
                          scale: torch.Tensor | None, tables: torch.Tensor, scratch: int,
                          ratio: int, overlap: bool, D: int, dtype: torch.dtype,
                          head_w: tuple | None = None) -> torch.Tensor | None:
    """Compressor.decode_update's kernel path in one launch: z += ape[pos % m] (ape [m, width]
    FP32, None: already added), compress_decode, E.to(dtype), RMSNorm (norm_weight [D] FP32,
    eps), RoPE of the last rope_dim dims at (pos // m)·m (inv_freq FP64), and the entry store
    into data [NB, PB, D] (+ scale iff INT8) as store_decode(tables=...) does. Same operations
    in the same order as that chain, so the same entries bit for bit. head_w = (w [B, H] FP32,
    scale): also -> w.to(dtype).float() * scale [B, H] FP32 (Indexer.queries' head weights)."""
    B, width = c.shape
    if z.shape != c.shape or c.dtype != torch.float32 or z.dtype != torch.float32 \
            or c.stride(1) != 1 or z.stride(1) != 1 or width != (2 if overlap else 1) * D:
        raise ValueError(f"compress_decode_fused: c, z [B, {(2 if overlap else 1) * D}] FP32, "
                         f"unit stride in a row; got {list(c.shape)} {c.dtype}")
    if ring_c.shape != ring_z.shape or ring_c.shape[2] != width or not ring_c.is_contiguous() \
            or not ring_z.is_contiguous():
        raise ValueError(f"compress_decode_fused: rings [S, R, {width}] contiguous, got "
                         f"{list(ring_c.shape)}")
    if ape is not None and (ape.shape != (ratio, width) or ape.dtype != torch.float32
                            or not ape.is_contiguous()):
        raise ValueError(f"compress_decode_fused: ape [{ratio}, {width}] FP32 contiguous")
    int8 = check_tail_args("compress_decode_fused", dtype, norm_weight, inv_freq, rope_dim, D,
                           data, scale, tables, B)
    wI = None
    if head_w is not None:
        w_raw, w_scale = head_w
        if w_raw.dim() != 2 or w_raw.shape[0] != B or w_raw.dtype != torch.float32 \
                or w_raw.stride(1) != 1:
            raise ValueError(f"compress_decode_fused: head weights [{B}, H] FP32, unit stride in "
                             f"a row; got {w_raw.dtype}{list(w_raw.shape)}")
        wI = torch.empty(w_raw.shape, dtype=torch.float32, device=c.device)
    if not B:
        return wI
    n, NP, BD, nblk, ebuf, cnt = pool_launch(ratio, overlap, D, B, c.device)
    tables = tables.contiguous()
    _fused_kernel[(B, nblk)](
        c, z, c.stride(0), z.stride(0), ape if ape is not None else c, pos.contiguous(),
        slots.contiguous(), ring_c, ring_z, ebuf, cnt, norm_weight, float(eps), inv_freq,
        tables, tables.stride(0), data, scale if int8 else data, scratch,
        ring_c.shape[1], D, width, w_raw if wI is not None else c,
        w_raw.stride(0) if wI is not None else 0, wI if wI is not None else c,
        wI.shape[1] if wI is not None else 0, float(w_scale) if wI is not None else 1.0,
        M=ratio, OVERLAP=overlap, N=n, NP=NP, BD=BD, NBLK=nblk,
        HAS_APE=ape is not None, DP=triton.next_power_of_2(D), RR=rope_dim,
        BH=triton.next_power_of_2(max(D - rope_dim, 1)), PB=data.shape[1], INT8=int8,
        BF16=dtype == torch.bfloat16, RN=not interpreted(), HAS_W=wI is not None,
        BHW=max(16, triton.next_power_of_2(wI.shape[1])) if wI is not None else 16, num_warps=4)
    return wI
