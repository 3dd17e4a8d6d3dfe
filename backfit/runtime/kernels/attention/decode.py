"""Sparse decode attention over the engine's paged pools (dsv4-model.md 5.4.4, 5.4.8), in Triton.

One query token per sequence b at position p, all local heads, MQA over one D-wide latent
(K = V). Keys, read in place (no gather into a contiguous tensor):
  window   positions lo .. p-1 (lo = max(0, p-W+1)) from the slot's ring, row pos % R, and the
           token's own kv [B, D] (in flight: the torch path attends to it unquantized)
  HCA      compressed entries j < (p+1)//m, block table[b, j // PB], row j % PB      (all)
  CSA      the indexer's selection sel[b, :] (-1 = unused) from the same block pools
int8 pools: q_int8 · scale (FP32, one per vector), rounded to the act dtype as _Store.get does.
Scores s = (q·k)·D^-0.5 in FP32 (BF16 MMA: q and k are BF16 values, so every product is exact);
p·V with p split into two BF16 halves (hi + lo, ~16 mantissa bits); online softmax with the
sink only in the denominator: o = Σ e^(s-M) k / (Σ e^(s-M) + e^(sink-M)).
Split-KV (small batches): each program handles one key range and writes (m, l, acc); the merge
(kernels.attention.merge) adds the sink (decode_attention's out_rope: and applies the inverse
RoPE of the output path, storing the act dtype) in a launch of its own. With one split the
first kernel finishes alone.
sparse_attention: the same kernel (PREFILL) for T queries of chunks (chunked prefill, mixed
batches): query t of sequence seq[t] sees ring positions before its chunk's start and the
chunk's own kv rows in flight (attention_torch.attend's keys), its HCA entries or CSA selection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backfit.runtime.kernels.attention import merge
from backfit.runtime.kernels.common import interpreted, num_sms

__all__ = ["decode_attention", "sparse_attention", "decode_config"]

MODES = {"window": 0, "hca": 1, "csa": 2}


@triton.jit
def _pv(p, v, acc, F32: tl.constexpr, EXACT: tl.constexpr):
    """acc + p @ v, p [BH, BN] FP32, v [BN, D] act-dtype values (FP32 tensor)."""
    if F32:                                    # interpreter: BF16 dots are wrong there
        return tl.dot(p, v, acc)
    if EXACT:                                  # FP32 act dtype: no rounding anywhere
        return tl.dot(p, v, acc, input_precision="ieee")
    vb = v.to(tl.bfloat16)                     # exact: v holds BF16 values
    hi = p.to(tl.bfloat16)
    lo = (p - hi.to(tl.float32)).to(tl.bfloat16)
    acc = tl.dot(hi, vb, acc)
    return tl.dot(lo, vb, acc)


@triton.jit
def _qk(q, k, F32: tl.constexpr, EXACT: tl.constexpr):
    """q [BH, D] @ k[BN, D]^T in FP32."""
    if F32:
        return tl.dot(q, tl.trans(k))
    if EXACT:
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    return tl.dot(q.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16)))


@triton.jit
def _step(q, k, ok, m_i, l_i, acc, scale, F32: tl.constexpr, EXACT: tl.constexpr):
    """Online-softmax update with keys k [BN, D] (ok [BN]); m starts at -1e30, never -inf."""
    s = _qk(q, k, F32, EXACT) * scale                                   # [BH, BN]
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = _pv(p, k, acc * alpha[:, None], F32, EXACT)
    return m_new, l_i, acc


@triton.jit
def _load_kv(base, rows, ok, SC, dd, d_ok, D: tl.constexpr, INT8: tl.constexpr,
             DT: tl.constexpr):
    """Vectors base[rows] [BN, D] as FP32 act-dtype values; int8: dequantized with SC[rows]."""
    x = tl.load(base + rows[:, None] * D + dd[None, :], mask=ok[:, None] & d_ok[None, :], other=0)
    if INT8:
        s = tl.load(SC + rows, mask=ok, other=0.0)
        x = (x.to(tl.float32) * s[:, None]).to(DT)                     # = _Store.get
    return x.to(tl.float32)


@triton.jit
def _decode_kernel(Q, KV, RING, RSC, SLOTS, POS, ENT, ESC, TABLES, SEL, SINK, SEQ, START,
                   O, PO, PM, PL, H, R, stride_tb, n_sel, CHUNK, scale,
                   W: tl.constexpr, RATIO: tl.constexpr, PB: tl.constexpr, MODE: tl.constexpr,
                   INT8: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BH: tl.constexpr,
                   BN: tl.constexpr, SPLIT: tl.constexpr, F32: tl.constexpr,
                   EXACT: tl.constexpr, DT: tl.constexpr, PREFILL: tl.constexpr = False,
                   LIVE: tl.constexpr = False):
    """Program (query b, head block, split): keys [split·CHUNK, +CHUNK) of window ++ compressed;
    LIVE: CHUNK from query b's own key count (its live keys in SPLIT even parts of whole tiles)
    instead of the host's, sized on the pools' capacity.

    Decode: query b is sequence b's one token. PREFILL: query b belongs to sequence SEQ[b] whose
    chunk starts at START[b] and at row b - (p - START[b]) of q/kv; window positions >= START[b]
    come from kv (in flight), earlier ones from the ring."""
    b, hb, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hh = hb * BH + tl.arange(0, BH)
    h_ok = hh < H
    dd = tl.arange(0, DP)
    d_ok = dd < D
    b64 = b.to(tl.int64)
    q = tl.load(Q + (b64 * H + hh[:, None]) * D + dd[None, :], mask=h_ok[:, None] & d_ok[None, :],
                other=0.0).to(tl.float32)                               # [BH, DP]
    p = tl.load(POS + b).to(tl.int32)                  # int64 or int32 positions
    if PREFILL:
        sq = tl.load(SEQ + b).to(tl.int64)                              # sequence of query b
        st = tl.load(START + b)
    else:
        sq = b64
        st = p
    lo = tl.maximum(p - W + 1, 0)
    NW = p - lo + 1                                                     # window keys incl. p
    if MODE == 1:
        NC = (p + 1) // RATIO                                           # HCA: every valid entry
    elif MODE == 2:             # CSA: the selection's live slots, at most the valid entries
        NC = tl.minimum(n_sel, (p + 1) // RATIO)                        # (-1 past them: skipped)
    else:
        NC = 0
    if LIVE:                    # the live keys in SPLIT parts of whole BN tiles
        CHUNK = tl.cdiv(tl.cdiv(NW + NC, BN), SPLIT) * BN
    k0 = sp * CHUNK
    k1 = tl.minimum(k0 + CHUNK, NW + NC)
    m_i = tl.full((BH,), -1e30, tl.float32)
    l_i = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, DP), tl.float32)
    rn = tl.arange(0, BN)
    slot = tl.load(SLOTS + sq).to(tl.int64)
    cur = tl.load(KV + b64 * D + dd, mask=d_ok, other=0.0).to(tl.float32)  # this token's kv
    for t0 in range(k0, tl.minimum(k1, NW), BN):                        # window part
        t = t0 + rn
        ok = t < tl.minimum(k1, NW)
        kp = lo + t                                                     # key positions
        is_cur = kp == p
        rows = slot * R + (kp % R)
        k = _load_kv(RING, rows, ok & (kp < st), RSC, dd, d_ok, D, INT8, DT)
        if PREFILL:                                                     # chunk rows in flight
            fly = kp >= st
            kin = tl.load(KV + (b64 + kp - p)[:, None] * D + dd[None, :],
                          mask=(ok & fly)[:, None] & d_ok[None, :], other=0.0)
            k = tl.where(fly[:, None], kin.to(tl.float32), k)
        else:
            k = tl.where(is_cur[:, None], cur[None, :], k)
        m_i, l_i, acc = _step(q, k, ok, m_i, l_i, acc, scale, F32, EXACT)
    for c0 in range(tl.maximum(k0, NW) - NW, k1 - NW, BN):              # compressed part
        c = c0 + rn
        ok = c < k1 - NW
        if MODE == 2:
            j = tl.load(SEL + b64 * n_sel + c, mask=ok, other=-1)
            ok = ok & (j >= 0)
        else:
            j = c
        j = tl.where(ok, j, 0)
        blk = tl.load(TABLES + sq * stride_tb + j // PB, mask=ok, other=0).to(tl.int64)
        k = _load_kv(ENT, blk * PB + j % PB, ok, ESC, dd, d_ok, D, INT8, DT)
        m_i, l_i, acc = _step(q, k, ok, m_i, l_i, acc, scale, F32, EXACT)
    if SPLIT == 1:
        sink = tl.load(SINK + hh, mask=h_ok, other=0.0)
        M = tl.maximum(m_i, sink)
        a = tl.exp(m_i - M)
        o = acc * a[:, None] / (l_i * a + tl.exp(sink - M))[:, None]
        tl.store(O + (b64 * H + hh[:, None]) * D + dd[None, :], o,
                 mask=h_ok[:, None] & d_ok[None, :])
    else:
        row = (b64 * H + hh) * SPLIT + sp                                # [BH] in [B, H, SPLIT]
        tl.store(PM + row, m_i, mask=h_ok)
        tl.store(PL + row, l_i, mask=h_ok)
        tl.store(PO + row[:, None] * D + dd[None, :], acc, mask=h_ok[:, None] & d_ok[None, :])


MERGE_PAIRS = 64      # merge._merge_rope_kernel: pairs per program (D = 512: 4 programs a head)
# most KV splits a decode program row gets (each merged lane sums SPLIT partials).
# H200 (bench_attention.py --merge, batch 1, 2026-12-01): the CSA layer's 20 splits (SP 32) cost
# decode + merge 31.0 / 33.7 us at ctx 512 / 32K (the merge 19.5 us of it in the step's trace);
# capped at 16 (-> 10 splits of 64 keys, SP 16) 20.5 / 21.1 us; window / HCA rows within noise
MAX_SPLIT = 16
# Each query's keys cut into SPLIT parts by its live count, not by the pools' capacity: a CSA row
# at context 512 has 128 window keys and 128 live selected entries of the 512 slots, 8 tiles that
# the capacity's chunks of 64 keys gave to 4 programs (2 tiles each, 11.1 µs on the H100 trace of
# the TP-4 slice, 2026-12-07; one-tile window / HCA programs 5.9); False: the host's chunks.
LIVE_SPLIT = True


# _decode_kernel's tile: BH heads x BN keys a step (prefill: 16 keys), warps, stages. H100, the
# TP-4 slice's step (bench_ab.py --layers 43 --tp-shard 4 --experts mx4, GPU time of the replay,
# 2026-12-06), batch 1 / 8: 8 warps -20.7 / -15.1 us (within the A/B's noise), BN 16 +13.6 /
# +86.9 us, BN 16 on 2 warps with 3 stages +218.6 / +342.3 us
DECODE_TILE = dict(BH=16, BN=32, num_warps=4, num_stages=2)


def decode_config(B: int, H: int, n_keys: int, sms: int, split: int | None = None,
                  prefill: bool = False) -> dict:
    """Tiles and split count: >= ~2 programs per SM when the batch alone does not fill them.
    prefill: 16-key tiles (the in-flight kv tile is a second buffer: 32 would pass 99 KB)."""
    BH, BN = DECODE_TILE["BH"], 16 if prefill else DECODE_TILE["BN"]
    progs = B * triton.cdiv(H, BH)
    steps = max(1, triton.cdiv(n_keys, BN))
    if split is None:
        split = max(1, min(MAX_SPLIT, steps, triton.cdiv(2 * sms, progs)))
    chunk = triton.cdiv(steps, split) * BN
    return dict(BH=BH, BN=BN, SPLIT=triton.cdiv(max(n_keys, 1), chunk), CHUNK=chunk,
                num_warps=DECODE_TILE["num_warps"], num_stages=DECODE_TILE["num_stages"])


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def decode_attention(q, kv, pos, sink, ring, ring_scale, slots, window, mode="window",
                     entries=None, entry_scale=None, tables=None, ratio=0, sel=None,
                     split=None, out_rope=None) -> torch.Tensor:
    """q [B, H, D] act dtype, kv [B, D] (this token's, not yet read from the ring), pos [B],
    sink [H] FP32, ring [S, R, D] (+ ring_scale [S, R] if int8), slots [B]; mode "hca" / "csa":
    entries [NB, PB, D] (+ entry_scale), tables [B, nblk] int, ratio; csa: sel [B, k] (-1 unused).
    -> o [B, H, D] FP32 (the torch path's attend output). out_rope = (inv_freq FP64 [r/2], r,
    dtype): o de-rotated by its position and rounded to dtype instead, = rope_norm.rope(o, pos,
    inv_freq, r, inverse=True, out_dtype=dtype) (Attention.post's first step); with split KV
    it runs inside the merge (one launch fewer), else as that rope launch."""
    return sparse_attention(q, kv, pos, sink, ring, ring_scale, slots, window, mode, entries,
                            entry_scale, tables, ratio, sel, split=split, out_rope=out_rope)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, pos: torch.Tensor, sink: torch.Tensor,
                     ring: torch.Tensor, ring_scale: torch.Tensor | None, slots: torch.Tensor,
                     window: int, mode: str = "window", entries: torch.Tensor | None = None,
                     entry_scale: torch.Tensor | None = None, tables: torch.Tensor | None = None,
                     ratio: int = 0, sel: torch.Tensor | None = None,
                     seq: torch.Tensor | None = None, start: torch.Tensor | None = None,
                     split: int | None = None, out_rope: tuple | None = None) -> torch.Tensor:
    """decode_attention for T queries of chunks (chunked prefill, mixed batches): q [T, H, D],
    kv [T, D] the chunks' own rows, pos [T], seq [T] the sequence (row of slots [NS], tables
    [NS, nblk]) and start [T] its chunk's first position; sel [T, k]. Rows of one sequence's
    chunk are consecutive in q/kv. seq=None: one token per sequence (decode). out_rope (decode
    only, see decode_attention): with split KV the merge de-rotates and rounds, with one split
    the rope launch after the attention kernel does."""
    if q.dim() != 3 or kv.shape != (q.shape[0], q.shape[2]) or pos.shape != (q.shape[0],):
        raise ValueError(f"decode_attention: q [B, H, D], kv [B, D], pos [B]; got "
                         f"{list(q.shape)}, {list(kv.shape)}, {list(pos.shape)}")
    B, H, D = q.shape
    NS = B if seq is None else slots.shape[0]
    if (seq is None) != (start is None) or (seq is not None and (seq.shape != (B,)
                                                                 or start.shape != (B,))):
        raise ValueError(f"sparse_attention: seq and start [T={B}] go together")
    if mode not in MODES:
        raise ValueError(f"decode_attention: mode {mode!r}, expected one of {tuple(MODES)}")
    if ring.dim() != 3 or ring.shape[2] != D or ring.shape[1] < window:
        raise ValueError(f"decode_attention: ring [S, R>=W, {D}], got {list(ring.shape)}")
    int8 = ring.dtype == torch.int8
    if int8 != (ring_scale is not None) or sink.shape != (H,) or slots.shape != (NS,):
        raise ValueError("decode_attention: int8 ring needs ring_scale (and only then); "
                         f"sink [H={H}], slots [{NS}]")
    if q.dtype not in _TL or kv.dtype != q.dtype or (not int8 and ring.dtype != q.dtype):
        raise ValueError(f"decode_attention: q/kv/ring dtypes {q.dtype}/{kv.dtype}/{ring.dtype}")
    dev = q.device
    PB, n_sel, n_comp = 1, 0, 0
    if mode != "window":
        if entries is None or tables is None or entries.shape[2] != D or tables.dim() != 2 \
                or tables.shape[0] != NS or ratio <= 0 or (entries.dtype == torch.int8) != int8 \
                or (entry_scale is not None) != int8:
            raise ValueError("decode_attention: hca/csa need entries [NB, PB, D] of the ring's "
                             "storage (int8: with entry_scale), tables [B, nblk] and ratio > 0")
        PB = entries.shape[1]
        n_comp = tables.shape[1] * PB
        if mode == "csa":
            if sel is None or sel.dim() != 2 or sel.shape[0] != B:
                raise ValueError("decode_attention: csa needs sel [B, k]")
            sel = sel.to(device=dev, dtype=torch.int32).contiguous()
            n_sel = n_comp = sel.shape[1]
        tables = tables.to(device=dev, dtype=torch.int32).contiguous()
    o = torch.empty(B, H, D, dtype=torch.float32, device=dev)
    if B == 0:
        return o
    sms = num_sms(dev)
    cfg = decode_config(B, H, window + n_comp, sms, split, seq is not None)
    S, BH = cfg["SPLIT"], cfg["BH"]
    if out_rope is not None:
        f, r, dt = out_rope
        if seq is not None or f.dtype != torch.float64 or f.shape != (r // 2,) or r % 2 \
                or r > D or D & (D - 1):
            raise ValueError(f"decode_attention: out_rope = (FP64 inv_freq [r/2], even r <= D, "
                             f"dtype), decode only, D a power of 2; got r={r}, D={D}")
    po = torch.empty(B, H, S, D, dtype=torch.float32, device=dev) if S > 1 else o
    pm = torch.empty(B, H, S, dtype=torch.float32, device=dev) if S > 1 else o
    pl = torch.empty_like(pm) if S > 1 else o
    grid = (B, triton.cdiv(H, BH), S)
    rot = None if out_rope is None or S == 1 else torch.empty(B, H, D, dtype=dt, device=dev)
    dummy = ring_scale if int8 else sink
    ent = entries if entries is not None else ring
    sink = sink.float().contiguous()
    pos = pos.to(dev).contiguous()
    _decode_kernel[grid](
        q.contiguous(), kv.contiguous(), ring, dummy, slots.to(dev, torch.int32).contiguous(),
        pos, ent, entry_scale if int8 and entries is not None
        else dummy, tables if tables is not None else slots, sel if sel is not None else slots,
        sink, slots if seq is None else seq.to(dev, torch.int32).contiguous(),
        slots if start is None else start.to(dev, torch.int32).contiguous(),
        o, po, pm, pl, H, ring.shape[1],
        tables.shape[1] if tables is not None else 0, n_sel, cfg["CHUNK"], D ** -0.5,
        W=window, RATIO=max(ratio, 1), PB=PB, MODE=MODES[mode], INT8=int8, D=D,
        DP=triton.next_power_of_2(D), BH=BH, BN=cfg["BN"], SPLIT=S, F32=interpreted(),
        EXACT=q.dtype == torch.float32, DT=_TL[q.dtype], PREFILL=seq is not None,
        LIVE=LIVE_SPLIT, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if out_rope is not None and S == 1:             # no merge launch: the rope kernel's own
        from backfit.runtime.kernels.rope_norm import rope
        return rope(o, pos, f, r, inverse=True, out_dtype=dt)
    if rot is not None:
        mp = min(BH * D // 2, MERGE_PAIRS)
        merge._merge_rope_kernel[(B, grid[1], BH * D // 2 // mp)](
            po, pm, pl, sink, pos, f.contiguous(), rot, H, D=D, R=r, SPLIT=S, BH=BH, MP=mp,
            enable_fp_fusion=False)
        return rot
    if S > 1:
        merge._merge_kernel[(B, H)](po, pm, pl, sink, o, H, D=D, SPLIT=S,
                                    DP=triton.next_power_of_2(D // 2))
    return o
