"""Lightning-indexer scores and top-k over the paged indexer keys (dsv4-model.md 5.4.7), Triton.

Decode: one query per sequence b at position p; valid keys j < (p+1)//4, key j at block
table[b, j // PB], row j % PB of the pool keys [NB, PB, 128] (act dtype, never int8).
  indexer_scores  score[b, j] = Σ_h w_h · ReLU(qI_h · K_j)  [B, NC] FP32, -inf where j is not
                  valid. Partial over the local heads: with TP the caller all-reduces it (as
                  Indexer.select does) before the top-k. qI·K on BF16 MMA (both hold BF16 values,
                  so products are exact), FP32 accumulate.
  topk_select     sel [B, k] int32: the k best j per row, best first, -1 where fewer than k are
                  valid. Two-pass: each C-wide chunk keeps its top k (bitonic tl.topk on packed
                  int64 keys = order-preserving score bits << 32 | (2^31-1-j), so equal scores
                  keep the lower j), then the chunk winners are reduced the same way until one
                  chunk is left.
                  TOPK_FAST (the default): one kernel per pass, _topk_pass_kernel, that skips the
                  bitonic top-k when every live key (score > -inf) of its chunk lies in the
                  chunk's first K: the scores pass then ranks the live prefix by comparison
                  counts, K/TOPK_RB programs a chunk side by side, and scatters it (an empty
                  chunk stores only the empty fill), a reduction pass copies its first,
                  already sorted, sub-chunk. Decode and prefill scores are
                  -inf past a prefix (j >= (p+1)//4), so only the chunk holding the boundary is
                  ranked; any other input still takes the full top-k (checked from the data, no
                  assumption). Full reduction chunks (long contexts) are merged, not sorted
                  (TOPK_MERGE): their K-wide sub-chunks are sorted, so a live key's rank is the
                  sum of C/K binary searches. The last pass writes sel itself (no unpack launch,
                  no fill): 1 launch for N <= C, 2 for N <= C·C/K. Results are bit-identical to
                  the old path (keys are unique: j is in the low word).
At the decode step indexer_scores(q_rope=) takes the indexer wq_b's raw output and each score
program rotates its query itself (_q_rope: rope_norm.rope's ops, angles p·f in FP64 rounded to
FP32, each product rounded alone, mul.rn, as that launch runs without FMA contraction; bit for
bit), one launch fewer on the indexer's chain. (The main query's norm + RoPE inside decode
attention lost twice, +7.8 and +122 µs a batch-1 slice step: docs/KERNELS.md "Attention".)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from backfit.runtime.kernels.common import interpreted

__all__ = ["TOPK_CHUNK", "TOPK_FAST", "indexer_scores", "topk_select"]

TOPK_CHUNK = 2048       # candidates per top-k program (int64 keys in registers: 16 KB)
_LOW = 2 ** 31 - 1      # j -> _LOW - j in the low word: equal scores prefer the lower j
TOPK_FAST = True        # False: the old path (_topk_scores/_topk_keys/_unpack + a fill launch)
# num_warps of _topk_pass_kernel, and the scores pass's chunk (> 0: a power of 2, 2K .. C; 0: C
# as the other passes). H200, `bench_topk.py --quick` (2026-12-01), µs at B = 1, N = 16384 for
# n_valid 128 / 512 / 2048 / 8192 / 16384: 4 warps, C 19.9 / 52.4 / 27.8 / 45.1 / 61.1 (the
# previous default); 16 warps, 1024 17.5 / 43.0 / 19.5 / 25.3 / 25.9 (best or within ~15 % of
# the best candidate in every row of B 1, 8 x N 4096, 8192, 16384)
TOPK_WARPS = 16
TOPK_BJ = 16            # keys compared per rank step: [K, BJ] int64 compares in registers
TOPK_MERGE = True       # keys passes merge sorted sub-chunks (binary searches), no bitonic top-k
# at most this many sub-chunks (C // K) per merge; wider chunks take the bitonic top-k. The merge
# unrolls C/K x (log2 K + 1) gathers of C keys: the tiny checkpoint's top-16 at C = 2048 (128 x 5)
# took 55 s to compile on a CPU and ~250 s in the 65K verify's first chunk on the H200's host
TOPK_MERGE_WAYS = 16
TOPK_SCORES_CHUNK = 1024
# the scores pass's ranking of a chunk whose live keys lie in its first K (a decode step's up to
# context 2,048): K // RB programs a chunk, each RB rows of the live prefix against BJ columns
# at a time (_rank_rows); 0: one program, all K rows against TOPK_BJ columns. RB = 128: a
# 512-token context's 128 keys in one program's block, 2,048 tokens' 512 in 4 side by side.
# H100, 43-layer TP-4 slice, mx4, bench_ab.py (2026-12-07, GPU time of the replay): RB 0 against
# 128 x 64 +136.1 / +136.8 us at batch 1 / 8 (context 512), +563.3 us at batch 1 (context 2,048);
# BJ 32 against 64 -46.7 us there. bench_topk.py --rank: docs/KERNELS.md "Attention".
TOPK_RB = 128
TOPK_RB_BJ = 32


@triton.jit
def _q_rope(Q, row, dd, ok, p, QF, D: tl.constexpr, QR: tl.constexpr, DT: tl.constexpr,
            F32: tl.constexpr):
    """Rows `row` [BH] of q [.., D] -> FP32 [BH, D] of DT values = rope_norm.rope(q, pos, QF, QR)
    of them: the last QR lanes' pairs (2i, 2i+1) = (a, b) -> (a·cos - b·sin, a·sin + b·cos) at
    angle p·QF[i], rounded to DT; the other lanes as loaded. Each lane reads its pair partner
    (lane ^ 1) as a second load: no register shuffle."""
    ptr = Q + row[:, None] * D
    x = tl.load(ptr + dd[None, :], mask=ok, other=0.0).to(tl.float32)         # [BH, D]
    y = tl.load(ptr + (dd ^ 1)[None, :], mask=ok, other=0.0).to(tl.float32)   # the partner
    rot = dd >= D - QR
    ang = p.to(tl.float64) * tl.load(QF + tl.where(rot, (dd - (D - QR)) // 2, 0), mask=rot,
                                     other=0.0)                                 # [D] FP64
    cos = tl.cos(ang).to(tl.float32)[None, :]
    sin = tl.sin(ang).to(tl.float32)[None, :]
    if F32:                                     # interpreter: numpy rounds each op
        xc, ys = x * cos, y * sin
    else:                                       # no FMA contraction (cache/decode.py's RN)
        xc, ys = libdevice.mul_rn(x, cos), libdevice.mul_rn(y, sin)
    # even lane: a·cos - b·sin (x = a, y = b); odd lane: a·sin + b·cos (y = a, x = b)
    r = tl.where((dd % 2 == 0)[None, :], xc - ys, ys + xc)
    return tl.where(rot[None, :], r.to(DT).to(tl.float32), x)


@triton.jit
def _score_kernel(QI, WI, KEYS, TABLES, POS, OUT, SEQ, H, NC, stride_tb,
                  PB: tl.constexpr, DI: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                  F32: tl.constexpr, EXACT: tl.constexpr, PREFILL: tl.constexpr = False,
                  QF=None, QR: tl.constexpr = 0):
    """Program (query b, key tile): scores of keys [tile·BN, +BN) for query b (of sequence b;
    PREFILL: of sequence SEQ[b], i.e. table row SEQ[b]). QR > 0 (decode): QI holds the indexer
    wq_b's raw output, rotated here (_q_rope)."""
    b, t = tl.program_id(0), tl.program_id(1)
    b64 = b.to(tl.int64)
    if PREFILL:
        sq = tl.load(SEQ + b).to(tl.int64)
    else:
        sq = b64
    hh = tl.arange(0, BH)
    h_ok = hh < H
    dd = tl.arange(0, DI)
    p = tl.load(POS + b).to(tl.int32)                                   # int64 or int32
    if QR > 0:
        qi = _q_rope(QI, b64 * H + hh, dd, h_ok[:, None], p, QF, DI, QR, QI.dtype.element_ty,
                     F32)
    else:
        qi = tl.load(QI + (b64 * H + hh[:, None]) * DI + dd[None, :], mask=h_ok[:, None],
                     other=0.0)
    w = tl.load(WI + b64 * H + hh, mask=h_ok, other=0.0)                # [BH] FP32
    n_valid = (p + 1) // 4
    j = t * BN + tl.arange(0, BN)
    ok = j < n_valid
    jj = tl.where(ok, j, 0)
    blk = tl.load(TABLES + sq * stride_tb + jj // PB, mask=ok, other=0).to(tl.int64)
    k = tl.load(KEYS + (blk * PB + jj % PB)[:, None] * DI + dd[None, :], mask=ok[:, None],
                other=0.0)                                              # [BN, DI]
    if F32:                                      # interpreter: BF16 dots are wrong there
        dots = tl.dot(qi.to(tl.float32), tl.trans(k.to(tl.float32)))
    elif EXACT:
        dots = tl.dot(qi.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        dots = tl.dot(qi.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16)))  # [BH, BN]
    score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)          # [BN]
    score = tl.where(ok, score, float("-inf"))
    tl.store(OUT + b64 * NC + j, score, mask=j < NC)


@triton.jit
def _pack(score, j):
    """FP32 score, index j -> int64 whose signed order is (score, -j)."""
    bits = score.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)                  # monotone in score
    return (key.to(tl.int64) << 32) | (2147483647 - j).to(tl.int64)


@triton.jit
def _topk_scores_kernel(SCORES, OUT, N, n_out, K: tl.constexpr, C: tl.constexpr):
    """Program (b, chunk): the top K packed keys of scores[b, chunk·C, +C) -> OUT[b, chunk]."""
    b, c = tl.program_id(0), tl.program_id(1)
    j = c * C + tl.arange(0, C)
    s = tl.load(SCORES + b.to(tl.int64) * N + j, mask=j < N, other=float("-inf"))
    key = tl.where(j < N, _pack(s, j), -9223372036854775807 - 1)
    top = tl.topk(key, K)
    tl.store(OUT + b.to(tl.int64) * n_out + c * K + tl.arange(0, K), top)


@triton.jit
def _topk_keys_kernel(IN, OUT, N, n_out, K: tl.constexpr, C: tl.constexpr):
    """Program (b, chunk): the top K of packed keys IN[b, chunk·C, +C) -> OUT[b, chunk]."""
    b, c = tl.program_id(0), tl.program_id(1)
    i = c * C + tl.arange(0, C)
    key = tl.load(IN + b.to(tl.int64) * N + i, mask=i < N, other=-9223372036854775807 - 1)
    top = tl.topk(key, K)
    tl.store(OUT + b.to(tl.int64) * n_out + c * K + tl.arange(0, K), top)


@triton.jit
def _unpack_kernel(IN, SEL, N, k, NEG_INF_KEY, KP: tl.constexpr):
    """Row b: the first k packed keys -> j (int32), -1 where the score was -inf (not valid)."""
    b = tl.program_id(0)
    i = tl.arange(0, KP)
    key = tl.load(IN + b.to(tl.int64) * N + i, mask=i < k, other=0)
    hi = key >> 32
    j = (2147483647 - (key - (hi << 32))).to(tl.int32)             # the low word
    j = tl.where(hi > NEG_INF_KEY, j, -1)
    tl.store(SEL + b.to(tl.int64) * k + i, j, mask=i < k)


@triton.jit
def _unpack(key, NEG_INF_KEY):
    """Packed key -> j (int32), -1 where the score was -inf (or the slot empty)."""
    hi = key >> 32
    j = (2147483647 - (key - (hi << 32))).to(tl.int32)             # the low word
    return tl.where(hi > NEG_INF_KEY, j, -1)


@triton.jit
def _scatter_ranked(SEL, OUT, b, c, k, n_out, key, live, rank, NEG_INF_KEY, K: tl.constexpr,
                    FINAL: tl.constexpr):
    """The live keys of a chunk to their ranks (unique, < K kept), the other K slots empty
    (slots [#live, K)): FINAL -> their j in SEL[b, :k] (-1 empty), else the keys in OUT[b,
    chunk c] (the smallest int64 empty)."""
    _store_ranked(SEL, OUT, b, c, k, n_out, key, live, rank, NEG_INF_KEY, K, FINAL)
    _store_empty(SEL, OUT, b, c, k, n_out, tl.sum(live.to(tl.int32), axis=0), K, FINAL)


@triton.jit
def _store_ranked(SEL, OUT, b, c, k, n_out, key, live, rank, NEG_INF_KEY, K: tl.constexpr,
                  FINAL: tl.constexpr):
    """_scatter_ranked's first half, for live keys of any shape (a row block's too)."""
    if FINAL:
        tl.store(SEL + b.to(tl.int64) * k + rank, _unpack(key, NEG_INF_KEY), mask=live & (rank < k))
    else:
        tl.store(OUT + b.to(tl.int64) * n_out + c * K + rank, key, mask=live & (rank < K))


@triton.jit
def _store_empty(SEL, OUT, b, c, k, n_out, cnt, K: tl.constexpr, FINAL: tl.constexpr):
    """_scatter_ranked's second half: slots [cnt, K) of chunk c empty."""
    o = tl.arange(0, K)
    if FINAL:
        tl.store(SEL + b.to(tl.int64) * k + o, tl.full([K], -1, tl.int32),
                 mask=(o >= cnt) & (o < k))
    else:
        tl.store(OUT + b.to(tl.int64) * n_out + c * K + o,
                 tl.full([K], -9223372036854775807 - 1, tl.int64), mask=o >= cnt)


@triton.jit
def _rank_rows(IN, OUT, SEL, b, c, row, N, n_out, k, key, i, NEG_INF_KEY, r, K: tl.constexpr,
               C: tl.constexpr, RB: tl.constexpr, BJ: tl.constexpr, FINAL: tl.constexpr):
    """A scores chunk whose live keys all lie in its first K (key [C] its packed keys, i [C] the
    offsets), row program r of K // RB: the live keys of rows [r·RB, +RB) get their rank = #live
    keys above them, counted over the live prefix [0, last) only in RB x BJ blocks, and are
    scattered as _scatter_ranked does (ranks are unique: the programs write disjoint slots);
    program 0 writes the empty fill. The decode step's prefix of (p+1)//4 keys: one block at
    p < 4·RB, and K // RB programs side by side, not one walking them all."""
    live = key >> 32 > NEG_INF_KEY
    last = tl.max(tl.where(live, i + 1, 0), axis=0)                     # live ones lie < last
    cnt = tl.sum(live.to(tl.int32), axis=0)
    if r * RB < last:
        ri = r * RB + tl.arange(0, RB)
        jr = c * C + ri
        kr = _pack(tl.load(IN + row + jr, mask=(ri < last) & (jr < N), other=float("-inf")), jr)
        lr = kr >> 32 > NEG_INF_KEY                                     # [RB]
        rank = tl.zeros([RB], dtype=tl.int32)
        for jb in range(0, last, BJ):
            jj = jb + tl.arange(0, BJ)
            jc = c * C + jj
            kj = _pack(tl.load(IN + row + jc, mask=(jj < last) & (jc < N),
                               other=float("-inf")), jc)                # [BJ]
            above = (kj[None, :] > kr[:, None]) & (kj >> 32 > NEG_INF_KEY)[None, :]
            rank += tl.sum(above.to(tl.int32), axis=1)
        _store_ranked(SEL, OUT, b, c, k, n_out, kr, lr, rank, NEG_INF_KEY, K, FINAL)
    if r == 0:
        _store_empty(SEL, OUT, b, c, k, n_out, cnt, K, FINAL)


@triton.jit
def _topk_pass_kernel(IN, OUT, SEL, N, n_out, k, NEG_INF_KEY, K: tl.constexpr, C: tl.constexpr,
                      BJ: tl.constexpr, SCORES: tl.constexpr, FINAL: tl.constexpr,
                      MERGE: tl.constexpr = False, LK: tl.constexpr = 0, RB: tl.constexpr = 0):
    """Program (b, chunk) of one pass over IN[b, chunk·C, +C) (SCORES: FP32 scores, else packed
    keys whose K-wide sub-chunks are sorted, live first): its top K packed keys -> OUT[b, chunk]
    (FINAL, one chunk: their j -> SEL[b, :k], -1 past the live ones). Live = score > -inf.
    MERGE (keys pass, K = 2^LK): a chunk with live keys past its first sub-chunk is merged, not
    sorted: each live key's rank = Σ over the C/K sorted sub-chunks of the keys above it there
    (a binary search in each), and the live keys of rank < K are scattered to their rank.
    RB > 0 (scores pass; grid (B, chunks, K // RB)): a chunk whose live keys lie in its first K
    is ranked by _rank_rows, RB rows a program (RB x BJ blocks of the live prefix only); any
    other chunk by its program 0 alone. RB 0: one program a chunk, [K, BJ] blocks (all K
    rows)."""
    b, c, r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = b.to(tl.int64) * N
    i = tl.arange(0, C)
    j = c * C + i
    if SCORES:
        s = tl.load(IN + row + j, mask=j < N, other=float("-inf"))
        key = tl.where(j < N, _pack(s, j), -9223372036854775807 - 1)
    else:
        key = tl.load(IN + row + j, mask=j < N, other=-9223372036854775807 - 1)
    tail = tl.sum(((key >> 32 > NEG_INF_KEY) & (i >= K)).to(tl.int32), axis=0)
    o = tl.arange(0, K)
    if tail == 0 and SCORES and RB > 0:          # every live key is in the first K: no sort
        _rank_rows(IN, OUT, SEL, b, c, row, N, n_out, k, key, i, NEG_INF_KEY, r, K, C, RB, BJ,
                   FINAL)
    elif r > 0:                                   # the other row programs: nothing to do
        pass
    elif tail == 0:
        jo = c * C + o
        if SCORES:
            sh = tl.load(IN + row + jo, mask=jo < N, other=float("-inf"))
            kh = _pack(sh, jo)                                          # [K]; -inf: not live
            lh = kh >> 32 > NEG_INF_KEY
            last = tl.max(tl.where(lh, o + 1, 0), axis=0)               # live ones lie < last
            rank = tl.zeros([K], dtype=tl.int32)          # rank = #live keys above: unique
            for jb in range(0, last, BJ):
                jj = jb + tl.arange(0, BJ)
                jc = c * C + jj
                sj = tl.load(IN + row + jc, mask=(jj < last) & (jc < N), other=float("-inf"))
                kj = _pack(sj, jc)                                      # [BJ]
                above = (kj[None, :] > kh[:, None]) & (kj >> 32 > NEG_INF_KEY)[None, :]
                rank += tl.sum(above.to(tl.int32), axis=1)
        else:                                     # sub-chunk 0 is sorted, live first: copy
            kh = tl.load(IN + row + jo, mask=jo < N, other=-9223372036854775807 - 1)
            lh = kh >> 32 > NEG_INF_KEY
            rank = o
        _scatter_ranked(SEL, OUT, b, c, k, n_out, kh, lh, rank, NEG_INF_KEY, K, FINAL)
    elif MERGE and not SCORES:
        live = key >> 32 > NEG_INF_KEY
        rk = tl.zeros([C], dtype=tl.int32)     # rank (a name of its own: [C], not [K])
        for a in tl.static_range(C // K):         # sub-chunk a: IN[b, c·C + a·K, +K), sorted
            base = c * C + a * K
            at = tl.zeros([C], dtype=tl.int32)    # #keys above `key` there, up to K-1 ...
            for e in tl.static_range(LK):
                q = base + at + (K >> (e + 1)) - 1
                probe = tl.load(IN + row + q, mask=q < N, other=-9223372036854775807 - 1)
                at += tl.where(probe > key, K >> (e + 1), 0)
            q = base + at
            probe = tl.load(IN + row + q, mask=q < N, other=-9223372036854775807 - 1)
            rk += at + (probe > key).to(tl.int32)                     # ... then up to K
        _scatter_ranked(SEL, OUT, b, c, k, n_out, key, live, rk, NEG_INF_KEY, K, FINAL)
    else:
        top = tl.topk(key, K)                     # as _topk_scores_kernel / _topk_keys_kernel
        if FINAL:
            tl.store(SEL + b.to(tl.int64) * k + o, _unpack(top, NEG_INF_KEY), mask=o < k)
        else:
            tl.store(OUT + b.to(tl.int64) * n_out + c * K + o, top)


def check_q_rope(q_rope: tuple | None, D: int, decode: bool) -> tuple:
    """q_rope = (inv_freq FP64 [r/2], r) -> the kernel's (QF, QR); None -> (None, 0)."""
    if q_rope is None:
        return None, 0
    f, r = q_rope
    if not decode or f.dtype != torch.float64 or f.shape != (r // 2,) or r <= 0 or r > D \
            or r & (r - 1) or D % 2:
        raise ValueError(f"indexer_scores: q_rope = (FP64 inv_freq [r/2], power-of-two r <= D), "
                         f"decode only, D even; got r={r}, D={D}")
    return f.contiguous(), r


def indexer_scores(qI: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, tables: torch.Tensor,
                   pos: torch.Tensor, seq: torch.Tensor | None = None,
                   q_rope: tuple | None = None) -> torch.Tensor:
    """qI [B, H, 128] (FP32 holding act-dtype values), w [B, H] FP32, keys [NB, PB, 128] pool,
    tables [B, nblk], pos [B] -> scores [B, nblk·PB] FP32 (-inf past (p+1)//4).
    Chunked prefill: B queries, seq [B] = each query's row of tables [NS, nblk].
    q_rope = (inv_freq FP64 [r/2], r), decode only: qI is the indexer wq_b's raw output (in the
    keys' dtype) and the scores are those of rope_norm.rope(qI, pos, inv_freq, r), bit for bit,
    each program rotating its query's heads (one launch fewer)."""
    if qI.dim() != 3 or w.shape != qI.shape[:2] or keys.dim() != 3 or keys.shape[2] != qI.shape[2]:
        raise ValueError(f"indexer_scores: qI [B, H, d], w [B, H], keys [NB, PB, d]; got "
                         f"{list(qI.shape)}, {list(w.shape)}, {list(keys.shape)}")
    B, H, DI = qI.shape
    if tables.dim() != 2 or (seq is None and tables.shape[0] != B) or pos.shape != (B,) \
            or DI & (DI - 1) or (seq is not None and seq.shape != (B,)):
        raise ValueError(f"indexer_scores: tables [B={B}, nblk], pos [B], power-of-2 key width; "
                         f"got {list(tables.shape)}, {list(pos.shape)}, {DI}")
    qf, qr = check_q_rope(q_rope, DI, seq is None)
    if qr and qI.dtype != keys.dtype:
        raise ValueError(f"indexer_scores: q_rope needs qI in the keys' dtype {keys.dtype}, got "
                         f"{qI.dtype}")
    PB = keys.shape[1]
    NC = tables.shape[1] * PB
    out = torch.empty(B, NC, dtype=torch.float32, device=qI.device)
    if B == 0 or NC == 0:
        return out
    exact = keys.dtype == torch.float32
    BN = 32
    pos32 = pos.to(qI.device).contiguous()                  # int64 or int32: no cast launch
    _score_kernel[(B, triton.cdiv(NC, BN))](
        qI.to(keys.dtype if not exact else torch.float32).contiguous(), w.float().contiguous(),
        keys, tables.to(qI.device, torch.int32).contiguous(), pos32, out,
        pos32 if seq is None else seq.to(qI.device, torch.int32).contiguous(), H, NC,
        tables.shape[1], PB=PB, DI=DI, BH=max(16, triton.next_power_of_2(H)), BN=BN,
        F32=interpreted(), EXACT=exact, PREFILL=seq is not None, QF=qf if qr else w, QR=qr,
        num_warps=4)
    return out


def _neg_inf_key() -> int:
    bits = int(torch.tensor(float("-inf")).view(torch.int32))
    return bits ^ 0x7FFFFFFF


_NEG_INF_KEY = _neg_inf_key()


def topk_select(scores: torch.Tensor, k: int, chunk: int = TOPK_CHUNK,
                fast: bool | None = None) -> torch.Tensor:
    """scores [B, N] FP32 -> sel [B, k] int32: indices of the k largest, best first (ties: lower
    index), -1 where the score is -inf; k may exceed N (the tail is -1). fast: TOPK_FAST's
    choice of path unless given (both give the same sel); no host sync either way."""
    if scores.dim() != 2 or scores.dtype != torch.float32 or k < 1:
        raise ValueError(f"topk_select: scores [B, N] FP32 and k >= 1, got "
                         f"{scores.dtype}{list(scores.shape)}, k={k}")
    B, N = scores.shape
    KP = max(2, triton.next_power_of_2(k))      # tl.topk(x, 1) does not compile (Triton 3.6)
    C = max(min(chunk, triton.next_power_of_2(N)), 2 * KP)            # no wider than needed
    if chunk & (chunk - 1):
        raise ValueError(f"topk_select: chunk {chunk} must be a power of two")
    if TOPK_FAST if fast is None else fast:
        return _topk_fast(scores, k, KP, C)
    sel = torch.full((B, k), -1, dtype=torch.int32, device=scores.device)
    if B == 0 or N == 0:
        return sel
    scores = scores.contiguous()
    n_chunks = triton.cdiv(N, C)
    keys = torch.empty(B, n_chunks * KP, dtype=torch.int64, device=scores.device)
    _topk_scores_kernel[(B, n_chunks)](scores, keys, N, n_chunks * KP, K=KP, C=C)
    while keys.shape[1] > KP:                                           # reduce chunk winners
        n = keys.shape[1]
        n_chunks = triton.cdiv(n, C)
        nxt = torch.empty(B, n_chunks * KP, dtype=torch.int64, device=scores.device)
        _topk_keys_kernel[(B, n_chunks)](keys, nxt, n, n_chunks * KP, K=KP, C=C)
        keys = nxt
    _unpack_kernel[(B,)](keys, sel, keys.shape[1], k, _neg_inf_key(), KP=KP)
    return sel


def _topk_fast(scores: torch.Tensor, k: int, KP: int, C: int) -> torch.Tensor:
    """TOPK_FAST: _topk_pass_kernel passes, scores -> chunk winners -> ... -> sel."""
    B, N = scores.shape
    sel = torch.empty(B, k, dtype=torch.int32, device=scores.device)
    if B == 0 or N == 0:
        return sel.fill_(-1)
    src, n, first = scores.contiguous(), N, True
    CS = min(max(TOPK_SCORES_CHUNK, 2 * KP), C) if TOPK_SCORES_CHUNK else C
    while True:                 # keys passes: no wider than their n keys need (C at most)
        CC = CS if first else max(min(C, triton.next_power_of_2(n)), 2 * KP)
        n_chunks = triton.cdiv(n, CC)
        final = n_chunks == 1                       # the grid depends on shapes only
        out = sel if final else torch.empty(B, n_chunks * KP, dtype=torch.int64,
                                            device=scores.device)
        merge = TOPK_MERGE and not first and CC // KP <= TOPK_MERGE_WAYS
        rb = min(TOPK_RB, KP) if first else 0       # BJ: the scores pass's ranking columns
        _topk_pass_kernel[(B, n_chunks, KP // rb if rb else 1)](
            src, out, sel, n, n_chunks * KP, k, _NEG_INF_KEY, K=KP, C=CC,
            BJ=min(TOPK_RB_BJ if rb else TOPK_BJ, KP), SCORES=first, FINAL=final, MERGE=merge,
            LK=KP.bit_length() - 1, RB=rb, num_warps=TOPK_WARPS)
        if final:
            return sel
        src, n, first = out, n_chunks * KP, False
