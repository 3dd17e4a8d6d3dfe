"""Query-blocked chunked-prefill sparse attention (dsv4-model.md 5.4.4, 5.4.8), in Triton.

The same op as attention.sparse_attention with seq/start (chunked prefill, mixed batches): query t
of sequence seq[t], whose chunk starts at position start[t] (row t - (pos[t] - start[t]) of q/kv),
sees ring positions max(0, p-W+1) .. start-1, the chunk's own kv rows up to itself (in flight),
then its HCA entries j < (p+1)//ratio or its CSA selection sel[t] (-1 = unused). MQA: K = V.
With span (Vision-Exp image prompts) query t also sees the in-flight rows span_lo[t] ..
span_hi[t] (its whole image span, dsv4-vision.md 11.2); the entries stay causal.

One program per (block of BQ consecutive queries of one chunk, block of BH heads): its M = BQ·BH
rows (query qi = r // BH, head r % BH) are one matmul operand, so every key tile is loaded once
per block of queries and heads instead of once per (query, 16 heads):
  window  the block's key positions lo(p0) .. p_last, a band mask per row (p-W < kp <= p)
  HCA     entries j < (p_last+1)//ratio, masked per row to j < (p+1)//ratio
  CSA     per-query selections: BQ = 1, all heads of the query share each gathered entry; sel
          is valid first, -1 after (indexer.topk_select), so the loop ends at min(k, (p+1)//ratio)
Numerics as attention._decode_kernel: FP32 scores (q·k)·D^-0.5 (BF16 mma of BF16 values: exact
products), p·V with p split into two BF16 halves, online softmax with the sink only in the
denominator, int8 pools dequantized as _Store.get (q·scale in FP32, rounded to the act dtype).
The blocks (first row of each) are built on the device from pos - start (no host sync); the grid
is an upper bound from shapes, spare programs store nothing. Tiles per arch: PREFILL_CONFIGS
(sm_90+) and SM80_CONFIGS, a config= argument overrides them (the sweep); CD 1 there runs the
same op in kernels.attention.prefill_cd (the head dimension in eight column chunks, which lets
Triton lay the warps along the rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backfit.runtime.kernels.common import interpreted
from backfit.runtime.kernels.attention.tiles import (_block_rows, _entry_tile, _finish,
                                                     _fly_mask, _fly_range, _kv_tile, _ring_tile)

__all__ = ["PREFILL_CONFIGS", "SM80_CONFIGS", "SM80_INT8_CONFIGS", "prefill_blocks",
           "prefill_config", "sparse_attention_prefill"]

MODES = {"window": 0, "hca": 1, "csa": 2}
# Tiles per mode: M = BQ·BH rows per program, BN keys per tile; CD 1: the column-chunked kernel
# (kernels.attention.prefill_cd: warps along the rows, two programs a row), else the plain one:
# one program a row block, p·V as two dots into an [M, D] FP32 accumulator (its register
# budget; the 2026-12-01 variants with p·V as one [hi|lo] dot or split output columns never won a
# table and are gone since 2026-12-02).
# sm_90 and later (H200): the best of the 2026-12-02 sweep
# (benchmarks/kernels/bench_attention_prefill.py
# --T 8192 --starts 0, one 8192-token chunk, µs): window 2520 -> 1724, CSA 8257 -> 4969, HCA
# 3159 -> 2211 against the 2026-12-01 best plain tiles (BQ 1, BH 16 | 32, BN 16, 4 warps, 3 stages);
# on sm_90 the CD
# kernel's dots compile to wgmma (M = 64 rows on one warp group), the plain kernel's to mma.sync.
PREFILL_CONFIGS = {
    "window": dict(CD=1, BQ=1, BH=64, BN=16, num_warps=4, num_stages=2),
    "hca": dict(CD=1, BQ=1, BH=64, BN=16, num_warps=4, num_stages=2),
    "csa": dict(CD=1, BQ=1, BH=64, BN=16, num_warps=4, num_stages=2),
}
# sm_80 (A100): mma.sync, <= 99 KB of shared memory with bf16 and int8 pools (two blocks an SM).
# Not measured on an A100: chosen on the H200 with Triton's wgmma off (DISABLE_MMA_V3=1, so
# mma.sync as on sm_80; 2026-12-02, one 8192-token chunk, µs): window 3171 -> 2089, CSA 11061
# -> 6054, HCA 4392 -> 2220 against the plain tiles this table held before
SM80_CONFIGS = {
    "window": dict(CD=1, BQ=1, BH=64, BN=32, num_warps=4, num_stages=2),
    "hca": dict(CD=1, BQ=1, BH=64, BN=32, num_warps=4, num_stages=2),
    "csa": dict(CD=1, BQ=1, BH=64, BN=16, num_warps=4, num_stages=2),
}
# sm_80 with int8 pools: the CD kernel's hca / csa entry tiles take 141-147 KB of shared memory
# there (sm_80 compile; bf16: 82-98 KB), so those keep the plain tiles; so does the window: its CD
# tile fits (98 KB) under Triton 3.9 but takes 143 KB under 3.6 (BN 16: 137 KB), the plain one
# 50 / 80 KB under 3.9 / 3.6 (docs/KERNELS.md, 2026-12-02)
SM80_INT8_CONFIGS = dict(SM80_CONFIGS,
                         window=dict(BQ=1, BH=32, BN=16, num_warps=4, num_stages=2),
                         hca=dict(BQ=2, BH=16, BN=16, num_warps=4, num_stages=2),
                         csa=dict(BQ=1, BH=32, BN=16, num_warps=4, num_stages=2))


@triton.jit
def _step(q, k, ok, m_i, l_i, acc, scale, F32: tl.constexpr, EXACT: tl.constexpr,
          DT: tl.constexpr):
    """Online softmax over keys k [BN, DP] (K = V), ok [M, BN]; m starts at -1e30, never -inf."""
    if EXACT:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))                                     # BF16 mma, FP32 out
    s = tl.where(ok, s * scale, float("-inf"))                         # [M, BN]
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if EXACT:                                  # FP32 act dtype: no rounding anywhere
        acc = tl.dot(p, k, acc, input_precision="ieee")
    else:
        hi = p.to(DT)                          # p = hi + lo (~16 bits), both exact in FP32
        lo = (p - hi.to(tl.float32)).to(DT)
        if F32:                                # interpreter: the same sum in FP32 dots
            hi, lo = hi.to(tl.float32), lo.to(tl.float32)
        acc = tl.dot(hi, k, acc)
        acc = tl.dot(lo, k, acc)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(Q, KV, RING, RSC, SLOTS, POS, ENT, ESC, TABLES, SEL, SINK, SEQ, START,
                    BLOCKS, O, SPAN_LO, SPAN_HI, T, H, R, stride_tb, n_sel, scale,
                    W: tl.constexpr, RATIO: tl.constexpr, PB: tl.constexpr, MODE: tl.constexpr,
                    INT8: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BQ: tl.constexpr,
                    BH: tl.constexpr, BN: tl.constexpr, F32: tl.constexpr, EXACT: tl.constexpr,
                    DT: tl.constexpr, SPAN: tl.constexpr):
    """Program (block i, head block hb): rows r = (query t0 + r // BH, head hb·BH + r % BH)."""
    M: tl.constexpr = BQ * BH
    if MODE == 2:
        tl.static_assert(BQ == 1, "csa: one query per block (per-query selections)")
    i, hb = tl.program_id(0), tl.program_id(1)
    t0, sqi, st, p0, p_last, p_r, hh, row_ok, trow = _block_rows(BLOCKS, SEQ, START, POS, T, H,
                                                                 i, hb, BQ, BH)
    dd = tl.arange(0, DP)
    d_ok = dd < D
    q = tl.load(Q + trow[:, None] * D + dd[None, :], mask=row_ok[:, None] & d_ok[None, :],
                other=0.0)                                             # [M, DP]
    if F32:
        q = q.to(tl.float32)
    m_i = tl.full((M,), -1e30, tl.float32)
    l_i = tl.zeros((M,), tl.float32)
    acc = tl.zeros((M, DP), tl.float32)
    rn = tl.arange(0, BN)
    slot = tl.load(SLOTS + sqi).to(tl.int64)
    lo = tl.maximum(p0 - W + 1, 0)                                     # oldest key of the block
    # window part in two loops, so each tile has one source (one buffer, one dtype): ring
    # positions lo .. st-1, then the chunk's own rows max(lo, st) .. p_last (in flight)
    k_end = tl.minimum(st, p_last + 1)
    for k0 in range(lo, k_end, BN):
        kp = k0 + rn                                                   # key positions [BN]
        k_ok = kp < k_end
        k = _ring_tile(RING, RSC, slot, R, kp, k_ok, dd, d_ok, D, INT8, F32, DT)
        ok = (kp[None, :] <= p_r[:, None]) & (kp[None, :] > p_r[:, None] - W) & k_ok[None, :]
        m_i, l_i, acc = _step(q, k, ok, m_i, l_i, acc, scale, F32, EXACT, DT)
    row0 = t0.to(tl.int64) - p0                                        # kv row of position 0
    kv_lo, kv_hi, s_lo, s_hi = _fly_range(SPAN_LO, SPAN_HI, trow, H, row_ok, p0, p_last, p_r, lo,
                                          st, SPAN)
    for k0 in range(kv_lo, kv_hi + 1, BN):
        kp = k0 + rn
        k_ok = kp <= kv_hi
        k = _kv_tile(KV, row0 + kp, k_ok, dd, d_ok, D, F32, DT)
        ok = _fly_mask(kp, k_ok, p_r, s_lo, s_hi, W, SPAN)
        m_i, l_i, acc = _step(q, k, ok, m_i, l_i, acc, scale, F32, EXACT, DT)
    if MODE == 1:                                                      # HCA: all valid entries
        n_r = (p_r + 1) // RATIO                                       # [M] entries per row
        n_c = (p_last + 1) // RATIO
        for c0 in range(0, n_c, BN):
            c = c0 + rn
            c_ok = c < n_c
            k = _entry_tile(ENT, ESC, TABLES, sqi, stride_tb, c, c_ok, dd, d_ok, PB, D, INT8,
                            F32, DT)
            ok = (c[None, :] < n_r[:, None]) & c_ok[None, :]
            m_i, l_i, acc = _step(q, k, ok, m_i, l_i, acc, scale, F32, EXACT, DT)
    if MODE == 2:                                                      # CSA: t0's selection
        sel = SEL + t0.to(tl.int64) * n_sel
        # sel is valid first, -1 after (indexer.topk_select): at most min(k, (p+1)//ratio) live,
        # so the loop stops there, with no branch around its tiles (one kept Triton from
        # pipelining the loop's loads)
        n_live = tl.minimum(n_sel, (p0 + 1) // RATIO)
        for c0 in range(0, n_live, BN):
            j = tl.load(sel + c0 + rn, mask=c0 + rn < n_live, other=-1)
            c_ok = j >= 0
            k = _entry_tile(ENT, ESC, TABLES, sqi, stride_tb, j, c_ok, dd, d_ok, PB, D,
                            INT8, F32, DT)
            ok = tl.broadcast_to(c_ok[None, :], (M, BN))
            m_i, l_i, acc = _step(q, k, ok, m_i, l_i, acc, scale, F32, EXACT, DT)
    a, den = _finish(SINK, hh, H, m_i, l_i)
    o = acc * a[:, None] / den[:, None]
    tl.store(O + trow[:, None] * D + dd[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def prefill_config(mode: str, H: int, config: dict | None = None, sm90: bool = True,
                   D: int = 512, int8: bool = False) -> dict:
    """The tiles for `mode` (PREFILL_CONFIGS on sm_90+, else SM80_CONFIGS, SM80_INT8_CONFIGS
    for int8 pools; keys of config
    override; a table's CD tiles run the plain kernel below D 128), BH capped at H's power of 2 (BQ
    grows to keep M = BQ·BH >= 16 rows for the mma,
    except csa: one query per block, BH >= 16)."""
    table = PREFILL_CONFIGS if sm90 else SM80_INT8_CONFIGS if int8 else SM80_CONFIGS
    cfg = dict(table[mode], **(config or {}))
    if cfg.get("CD") and triton.next_power_of_2(D) < 128 and "CD" not in (config or {}):
        cfg["CD"] = 0                       # the table's CD tiles, below D 128: plain kernel
    cfg["BH"] = min(cfg["BH"], triton.next_power_of_2(H))
    if mode == "csa":
        cfg["BQ"], cfg["BH"] = 1, max(cfg["BH"], 16)
    while cfg["BQ"] * cfg["BH"] < 16:
        cfg["BQ"] *= 2
    for k in ("BQ", "BH", "BN"):
        if k not in cfg:
            continue
        if cfg[k] < 1 or cfg[k] & (cfg[k] - 1) or (k == "BN" and cfg[k] < 16):
            raise ValueError(f"sparse_attention_prefill: {k}={cfg[k]}: a power of 2 (BN >= 16)")
    return cfg


def prefill_blocks(pos: torch.Tensor, start: torch.Tensor, BQ: int, n_max: int) -> torch.Tensor:
    """First row of each block of <= BQ consecutive queries of one chunk: a block starts at every
    row whose offset in its chunk, pos - start, is a multiple of BQ. -> int32 [n_max], -1 past
    the last block (on the device: cumsum and scatter, no host sync)."""
    first = (pos - start) % BQ == 0
    bid = torch.cumsum(first, 0) - 1
    idx = torch.where(first & (bid < n_max), bid, n_max)
    rows = torch.arange(pos.shape[0], dtype=torch.int32, device=pos.device)
    out = torch.full((n_max + 1,), -1, dtype=torch.int32, device=pos.device)
    return out.scatter_(0, idx, rows)[:n_max]


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def sparse_attention_prefill(q: torch.Tensor, kv: torch.Tensor, pos: torch.Tensor,
                             sink: torch.Tensor, ring: torch.Tensor,
                             ring_scale: torch.Tensor | None, slots: torch.Tensor, window: int,
                             mode: str = "window", entries: torch.Tensor | None = None,
                             entry_scale: torch.Tensor | None = None,
                             tables: torch.Tensor | None = None, ratio: int = 0,
                             sel: torch.Tensor | None = None, seq: torch.Tensor | None = None,
                             start: torch.Tensor | None = None, split: int | None = None,
                             config: dict | None = None,
                             out_dtype: torch.dtype = torch.float32,
                             memo: dict | None = None,
                             span: tuple[torch.Tensor, torch.Tensor] | None = None
                             ) -> torch.Tensor:
    """attention.sparse_attention's arguments and result: q [T, H, D], kv [T, D] the chunks'
    own rows, pos/seq/start [T] (seq=None: one token per sequence), slots [NS], tables
    [NS, nblk], sel [T, k] -> o [T, H, D] FP32. split is accepted and ignored (no split-KV:
    prefill has queries enough); config overrides keys of prefill_config's tiles. out_dtype: o
    stored rounded to it (bf16: = the FP32 o .to(bf16), half the bytes; the inverse RoPE that
    follows rounds its input so anyway, and then rotates only the last R lanes in place).
    memo: a dict living as long as pos / seq / start (ForwardBatch.memo): the int32 positions
    and the query blocks are made once there and reused by every layer with the same tile.
    span: (lo, hi) [T] int32 (Vision-Exp image prompts, ForwardBatch.images): query t also sees
    the chunk's keys at positions lo[t] .. hi[t] (its image span, after it too; lo = hi = pos
    outside spans); every span must lie inside its query's chunk."""
    if q.dim() != 3 or kv.shape != (q.shape[0], q.shape[2]) or pos.shape != (q.shape[0],):
        raise ValueError(f"sparse_attention_prefill: q [T, H, D], kv [T, D], pos [T]; got "
                         f"{list(q.shape)}, {list(kv.shape)}, {list(pos.shape)}")
    T, H, D = q.shape
    NS = T if seq is None else slots.shape[0]
    if (seq is None) != (start is None) or (seq is not None and (seq.shape != (T,)
                                                                 or start.shape != (T,))):
        raise ValueError(f"sparse_attention_prefill: seq and start [T={T}] go together")
    if mode not in MODES:
        raise ValueError(f"sparse_attention_prefill: mode {mode!r}, expected one of "
                         f"{tuple(MODES)}")
    if ring.dim() != 3 or ring.shape[2] != D or ring.shape[1] < window:
        raise ValueError(f"sparse_attention_prefill: ring [S, R>=W, {D}], got "
                         f"{list(ring.shape)}")
    int8 = ring.dtype == torch.int8
    if int8 != (ring_scale is not None) or sink.shape != (H,) or slots.shape != (NS,):
        raise ValueError("sparse_attention_prefill: int8 ring needs ring_scale (and only "
                         f"then); sink [H={H}], slots [{NS}]")
    if q.dtype not in _TL or kv.dtype != q.dtype or (not int8 and ring.dtype != q.dtype):
        raise ValueError(f"sparse_attention_prefill: q/kv/ring dtypes "
                         f"{q.dtype}/{kv.dtype}/{ring.dtype}")
    dev = q.device
    if span is not None and (seq is None or span[0].shape != (T,) or span[1].shape != (T,)):
        raise ValueError(f"sparse_attention_prefill: span (lo, hi) [T={T}] each, with seq")
    PB, n_sel = 1, 0
    if mode != "window":
        if entries is None or tables is None or entries.shape[2] != D or tables.dim() != 2 \
                or tables.shape[0] != NS or ratio <= 0 or (entries.dtype == torch.int8) != int8 \
                or (entry_scale is not None) != int8:
            raise ValueError("sparse_attention_prefill: hca/csa need entries [NB, PB, D] of the "
                             "ring's storage (int8: with entry_scale), tables [NS, nblk], "
                             "ratio > 0")
        PB = entries.shape[1]
        if mode == "csa":
            if sel is None or sel.dim() != 2 or sel.shape[0] != T:
                raise ValueError("sparse_attention_prefill: csa needs sel [T, k]")
            sel = sel.to(device=dev, dtype=torch.int32).contiguous()
            n_sel = sel.shape[1]
        tables = tables.to(device=dev, dtype=torch.int32).contiguous()
    if out_dtype not in (torch.float32, q.dtype):
        raise ValueError(f"sparse_attention_prefill: out_dtype FP32 or q's {q.dtype}, got "
                         f"{out_dtype}")
    o = torch.empty(T, H, D, dtype=out_dtype, device=dev)
    if T == 0:
        return o
    sm90 = dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9
    cfg = prefill_config(mode, H, config, sm90, D, int8)
    memo = {} if memo is None else memo
    if "pos32" not in memo:
        memo["pos32"] = pos.to(dev, torch.int32).contiguous()
    pos = memo["pos32"]
    if seq is None:                                    # decode rows: each its own chunk
        seq = torch.arange(T, dtype=torch.int32, device=dev)
        start = pos
    seq, start = seq.to(dev, torch.int32).contiguous(), start.to(dev, torch.int32).contiguous()
    n_blk = min(T, triton.cdiv(T, cfg["BQ"]) + NS)     # each chunk adds <= one partial block
    if ("blocks", cfg["BQ"], n_blk) not in memo:
        memo["blocks", cfg["BQ"], n_blk] = prefill_blocks(pos, start, cfg["BQ"], n_blk)
    blocks = memo["blocks", cfg["BQ"], n_blk]
    slots = slots.to(dev, torch.int32).contiguous()
    dummy = ring_scale if int8 else sink
    DP = triton.next_power_of_2(D)
    args = (q.contiguous(), kv.contiguous(), ring, dummy, slots, pos,
            entries if entries is not None else ring,
            entry_scale if int8 and entries is not None else dummy,
            tables if tables is not None else slots, sel if sel is not None else slots,
            sink.float().contiguous(), seq, start, blocks, o,
            *((pos, pos) if span is None else
              (t.to(dev, torch.int32).contiguous() for t in span)), T, H, ring.shape[1],
            tables.shape[1] if tables is not None else 0, n_sel, D ** -0.5)
    common = dict(W=window, RATIO=max(ratio, 1), PB=PB, MODE=MODES[mode], INT8=int8, D=D, DP=DP,
                  BQ=cfg["BQ"], BH=cfg["BH"], BN=cfg["BN"], F32=interpreted(),
                  EXACT=q.dtype == torch.float32, DT=_TL[q.dtype], SPAN=span is not None,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if cfg.get("CD"):                                  # column-chunked: two halves of D
        from backfit.runtime.kernels.attention.prefill_cd import _prefill_cd_kernel
        if DP < 128:
            raise ValueError(f"sparse_attention_prefill: CD needs D >= 128 (eight chunks of "
                             f">= 16 columns), got {D}")
        _prefill_cd_kernel[(n_blk, triton.cdiv(H, cfg["BH"]), 2)](*args, **common)
    else:
        _prefill_kernel[(n_blk, triton.cdiv(H, cfg["BH"]))](*args, **common)
    return o
