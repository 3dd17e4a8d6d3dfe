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
Replaces ~35 small torch ops per compressor and ~5 per ring store. The pooling uses Triton's exp
(not torch's), so entries agree with the torch path to FP32 rounding, not bit for bit; the store
is exact (the same quantization arithmetic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["compress_decode", "store_decode"]


@triton.jit
def _compress_kernel(C, Z, sc_b, sz_b, POS, SLOTS, RC, RZ, E, R, D, WIDTH,
                     M: tl.constexpr, OVERLAP: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
                     BD: tl.constexpr):
    """Program (b, channel block): ring rows of this token, then E[b, block] over N slots
    (N = 2M for CSA, M for HCA; NP = N rounded up to a power of two)."""
    b, db = tl.program_id(0).to(tl.int64), tl.program_id(1)
    dd = db * BD + tl.arange(0, BD)
    d_ok = dd < D
    p = tl.load(POS + b)
    slot = tl.load(SLOTS + b).to(tl.int64)
    ring = slot * R * WIDTH                                           # this slot's ring rows
    own = ring + (p % R) * WIDTH
    c0 = tl.load(C + b * sc_b + dd, mask=d_ok, other=0.0)            # this token, first D
    z0 = tl.load(Z + b * sz_b + dd, mask=d_ok, other=0.0)
    tl.store(RC + own + dd, c0, mask=d_ok)
    tl.store(RZ + own + dd, z0, mask=d_ok)
    if OVERLAP:                                                       # rows are 2D wide
        c1 = tl.load(C + b * sc_b + D + dd, mask=d_ok, other=0.0)
        z1 = tl.load(Z + b * sz_b + D + dd, mask=d_ok, other=0.0)
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
    if OVERLAP:                                                       # virtual block -1
        virt = ((p < M) & (i < M))[:, None]
        sc = tl.where(virt, 0.0, sc)
        sz = tl.where(virt, float("-inf"), sz)
    sz = tl.where(i_ok[:, None], sz, float("-inf"))
    mx = tl.max(sz, axis=0)
    e = tl.exp(sz - mx[None, :])
    w = e / tl.sum(e, axis=0)[None, :]                                # softmax over the slots
    tl.store(E + b * D + dd, tl.sum(w * sc, axis=0), mask=d_ok)


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
