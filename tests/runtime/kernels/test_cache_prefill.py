"""Prefill-chunk cache kernels (runtime.kernels.cache.prefill) and the paged cache's batched
prefill updates (CPU: the Triton interpreter).

compress_prefill + store_rows over a batch of chunks write the same entries, scales and ring
rows bit for bit as compress_decode_fused run token by token (itself bit-equal to the decode
chain, test_cache_ops): chunks from position 0 (CSA's virtual block -1), chunks starting
mid-block (their entries pool ring rows and chunk rows), single-token rows that do and do not
complete a block, padded row lists. Compressor.prefill_update on PagedCache equals the torch
`update` per sequence (rings exactly, entries to FP32 rounding), the batched window store equals
write_window per sequence, and a block table too short for an entry is the torch path's error.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"

from support import kernel_module  # noqa: E402

from backfit.runtime import kernels as kpkg  # noqa: E402
from backfit.runtime.batch import ForwardBatch  # noqa: E402
from backfit.runtime.cache.paged import PagedCache  # noqa: E402


def kmods():
    return (kernel_module("cache.prefill", "_compress_prefill_kernel", INTERPRET),
            kernel_module("cache.decode", "_fused_kernel", INTERPRET))


def _chunks(m: int):
    """(start, n) of four sequences: from 0 across block ends, from mid-block across one, a
    token that does not complete a block, one that does."""
    if m >= 64:
        return [(0, m + 2), (m - 8, 10), (5 * m + 1, 1), (3 * m - 1, 1)]
    return [(0, 2 * m + 3), (m - 2, m + 4), (5 * m + 1, 1), (3 * m - 1, 1)]


def _case(m, overlap, D, int8, dtype):
    from backfit.runtime.layers import yarn_inv_freq
    g = torch.Generator().manual_seed(11 * m + D)
    chunks = _chunks(m)
    NS, PB, r = len(chunks), 4, 32
    width = (2 if overlap else 1) * D
    S, R = NS + 2, (2 * m if overlap else m) + 8
    nblk = (max(s + n for s, n in chunks) // m) // PB + 1
    NB = NS * nblk
    pos = torch.cat([torch.arange(s, s + n) for s, n in chunks])
    seq = torch.cat([torch.full((n,), i) for i, (s, n) in enumerate(chunks)]).int()
    start = torch.cat([torch.full((n,), s) for s, n in chunks]).int()
    T = pos.shape[0]
    both = torch.randn(T, 3, width, generator=g)
    c, z = both[:, 0].to(DEV), both[:, 2].to(DEV)                     # strided rows
    slots = torch.randperm(S, generator=g)[:NS].int()
    tables = torch.randperm(NB, generator=g).int().view(NS, nblk)
    rc, rz = torch.randn(S, R, width, generator=g), torch.randn(S, R, width, generator=g)
    w = 1 + 0.1 * torch.randn(D, generator=g)
    pools = []
    for _ in range(2):
        data = torch.zeros(NB + 1, PB, D, dtype=torch.int8 if int8 else dtype)
        pools.append([t.to(DEV) for t in (rc.clone(), rz.clone(), data)]
                     + [torch.ones(NB + 1, PB, device=DEV) if int8 else None])
    ends = torch.tensor([n for _, n in chunks]).cumsum(0)
    entry = [t for t in range(T) if (pos[t] + 1) % m == 0]
    ring = [t for i, (s, n) in enumerate(chunks) for t in range(max(ends[i] - n, ends[i] - R),
                                                                 ends[i])]
    dev = [x.to(DEV) for x in (pos, seq, start, slots, tables)]
    norm = (w.to(DEV), 1e-6, yarn_inv_freq(r, 160000.0, None).to(DEV), r)
    return c, z, dev, norm, pools, NB, entry, ring


@pytest.mark.parametrize("m, overlap, D, int8, dtype", [
    (4, True, 256, False, torch.bfloat16), (4, True, 128, True, torch.bfloat16),
    (8, False, 64, False, torch.float32), (128, False, 64, True, torch.bfloat16)])
def test_prefill_equals_decode_token_by_token(m, overlap, D, int8, dtype):
    kp, kd = kmods()
    c, z, (pos, seq, start, slots, tables), norm, pools, NB, entry, ring = _case(m, overlap, D,
                                                                              int8, dtype)
    (rc0, rz0, d0, s0), (rc1, rz1, d1, s1) = pools
    for t in range(c.shape[0]):                      # decode, one token at a time, in order
        i = int(seq[t])
        kd.compress_decode_fused(c[t:t + 1], z[t:t + 1], None, pos[t:t + 1], slots[i:i + 1],
                                 rc0, rz0, *norm, d0, s0, tables[i:i + 1], NB, m, overlap, D,
                                 dtype)
    rows = torch.tensor(entry + [-1, -1], dtype=torch.int32, device=DEV)   # padded list
    before = rc1.clone(), rz1.clone()
    kp.compress_prefill(c, z, rows, pos, seq, start, slots, rc1, rz1, *norm, d1, s1, tables, NB,
                        m, overlap, D, dtype)
    assert torch.equal(rc1, before[0]) and torch.equal(rz1, before[1])   # rings: read only
    rr = torch.tensor(ring, dtype=torch.int32, device=DEV)
    kp.store_rows(c, z, rr, pos[rr.long()].int(), slots[seq[rr.long()].long()], rc1, rz1)
    assert torch.equal(rc0, rc1) and torch.equal(rz0, rz1)
    assert torch.equal(d0[:NB], d1[:NB])                          # the scratch block aside
    if int8:
        assert torch.equal(s0[:NB], s1[:NB])
    assert d1[:NB].flatten(1).any(1).sum() >= 2                   # entries of two sequences
    with pytest.raises(ValueError, match="compress_prefill"):
        kp.compress_prefill(c, z, rows.long(), pos, seq, start, slots, rc1, rz1, *norm, d1, s1,
                            tables, NB, m, overlap, D, dtype)
    with pytest.raises(ValueError, match="store_rows"):
        kp.store_rows(c, z, rr.long(), pos[rr.long()].int(), slots[seq[rr.long()].long()],
                      rc1, rz1)



@pytest.mark.parametrize("width, m, ape", [(1024, 4, True), (512, 128, True), (256, 4, False)])
def test_store_rows_of_a_verify_equals_the_torch_stores(width, m, ape):
    """store_rows(rows=None, ape=): a multi-row decode batch's rows (several a slot, at
    consecutive positions; int64 positions) -> the rings exactly as PagedCache.write_rows_tokens
    with the torch ape add (Compressor._store_rows' two forms), other ring rows untouched."""
    kp, _ = kmods()
    g = torch.Generator().manual_seed(width + m)
    S, R, B = 5, 2 * m + 8, 6
    slots = torch.tensor([3, 3, 3, 1, 1, 0], dtype=torch.int32)
    pos = torch.tensor([9, 10, 11, 2 * m + 7, 2 * m + 8, 0])          # wraps the ring at m = 4
    both = torch.randn(B, 3, width, generator=g)
    c, z = both[:, 0], both[:, 2]                                      # strided rows
    ap = torch.randn(m, width, generator=g)
    ring = torch.randn(2, S, R, width, generator=g)
    want = ring.clone()
    r = pos % R
    want[0][slots.long(), r] = c
    want[1][slots.long(), r] = z + ap[pos % m] if ape else z
    got = ring.clone().to(DEV)
    kp.store_rows(c.to(DEV), z.to(DEV), None, pos.to(DEV), slots.to(DEV), got[0], got[1],
                  ape=ap.to(DEV) if ape else None)
    assert torch.equal(got.cpu(), want)
    with pytest.raises(ValueError, match="store_rows: ape"):
        kp.store_rows(c.to(DEV), z.to(DEV), None, pos.to(DEV), slots.to(DEV), got[0], got[1],
                      ape=ap[:, :8].to(DEV))

def _batch(steps, tables):
    """ForwardBatch of (seq, n new tokens, start) with slots 2, 0, 1 and the given tables."""
    g = torch.Generator().manual_seed(sum(n for _, n, _ in steps))
    seqs = [(i, torch.randint(3, 200, (n,), generator=g).tolist(), s) for i, n, s in steps]
    return ForwardBatch.build(seqs, slots=[2, 0, 1][:len(steps)], block_tables=tables)


def test_paged_prefill_update_equals_torch_update(model_f32, monkeypatch):
    """Two steps of three sequences (chunks of 7, 13, 3 tokens, then 5, 9, 1) through a CSA
    and an HCA layer's compressors: prefill_update (kernels) on one PagedCache, `update` per
    sequence (torch) on its twin; then the batched window store against write_window."""
    cfg = model_f32.cfg
    tables = [(5, 2, 7), (0, 6, 3), (1, 4, 8)]
    twin = [PagedCache(cfg, 3, 9, 16, torch.float32, device=DEV) for _ in range(2)]
    g = torch.Generator().manual_seed(3)
    starts = [0, 0, 0]
    for lens in ((7, 13, 3), (5, 9, 1)):
        b = _batch([(i, n, starts[i]) for i, n in enumerate(lens)], tables)
        pos = b.positions.to(DEV)
        seq, start = (t.to(DEV) for t in b.token_seq_start)
        ref, new = (c.bind(b) for c in twin)
        for li in (2, 3):                                         # ratio 4 (CSA), 8 (HCA)
            mod = copy.deepcopy(model_f32.layers[li].attn.compressor).to(DEV)
            width = (2 if mod.overlap else 1) * mod.head_dim
            cz = torch.randn(2, pos.shape[0], width, generator=g).to(DEV)
            for s in b.slices():
                r = slice(s.lo, s.hi)
                mod.update(ref.layer(li), s.index, "comp", cz[0][r], cz[1][r], s.start,
                           torch.float32, read=False)
            mod.prefill_update(new.layer(li), "comp", cz[0], cz[1], pos, seq, start,
                               torch.float32)
            a, b_ = twin[0].layers[li].comp, twin[1].layers[li].comp
            assert torch.equal(a.c, b_.c) and torch.equal(a.z, b_.z)
            torch.testing.assert_close(b_.entries.data, a.entries.data, rtol=2e-6, atol=2e-6)
            kv = torch.randn(pos.shape[0], cfg.head_dim, generator=g).to(DEV)
            ref.layer(li).write_window_chunk(pos, kv)             # CPU: per sequence (torch)
            monkeypatch.setattr(kpkg, "_backend", "triton")
            monkeypatch.setattr(kpkg, "_ANY_DEVICE", True)
            new.layer(li).write_window_chunk(pos, kv)             # one gather + store launch
            monkeypatch.undo()
            assert torch.equal(twin[0].layers[li].ring.data, twin[1].layers[li].ring.data)
        starts = [s + n for s, n in zip(starts, lens)]
    assert twin[1].layers[2].comp.entries.data[[5, 0, 1]].flatten(1).any(1).all()


def test_entry_rows_missing_block(model_f32):
    cache = PagedCache(model_f32.cfg, 3, 9, 16, torch.float32, device=DEV)
    b = _batch([(0, 40, 0)], [(0,)])                               # entries up to 9: 3 blocks
    with pytest.raises(IndexError, match="needs block"):
        cache.bind(b).layer(2).entry_rows("comp")
    rows = cache.bind(_batch([(0, 10, 3)], [(0,)])).layer(2).entry_rows("comp").tolist()
    assert rows == [0, 4, 8]                                        # positions 3, 7, 11
