"""The engine's paged pools give exactly DecodeState's logits (same math, other storage).

Storage is the only difference, so float32 logits must be bit-identical: any wrong ring row,
block-table lookup or entry offset changes them. Blocks are handed out in a shuffled order so a
table that is ignored or mis-indexed cannot pass by luck. The tiny model: window 16, CSA ratio 4,
HCA ratio 8; lengths up to 300 cross the window and every compression period many times.
"""

import random

import pytest
import torch

from backfit.runtime.batch import ForwardBatch
from backfit.runtime.cache.paged import ROLLBACK, PagedCache

B = 16                                   # block size: a multiple of the ratios 4 and 8
S = 300


class Alloc:
    """Test allocator: one slot per sequence, blocks from a shuffled free list."""

    def __init__(self, cache: PagedCache, seed=0):
        self.cache, self.slots, self.tables = cache, {}, {}
        self.free = list(range(cache.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.free_slots = list(range(cache.num_slots))[::-1]

    def batch(self, seqs, last_only_rows=False):
        """seqs: [(seq_id, tokens, start)] -> ForwardBatch with slots and grown tables."""
        slots, tables = [], []
        for sid, toks, start in seqs:
            if sid not in self.slots:
                self.slots[sid], self.tables[sid] = self.free_slots.pop(), []
            t = self.tables[sid]
            while len(t) * self.cache.block_size < start + len(toks):
                t.append(self.free.pop())
            slots.append(self.slots[sid])
            tables.append(t)
        return ForwardBatch.build(seqs, slots=slots, block_tables=tables)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 512, (S,), generator=torch.Generator().manual_seed(11))


def _paged(model, kv_dtype="auto", slots=8, blocks=200, block_size=B, snapshots=0):
    return PagedCache(model.cfg, slots, blocks, block_size, model.dtype, kv_dtype,
                      num_snapshots=snapshots)


def _run_chunks(model, cache, tokens, chunks, sid=0, alloc=None):
    """Feed tokens in chunks of the given sizes through cache; -> logits [sum, V]."""
    alloc = alloc or (Alloc(cache) if isinstance(cache, PagedCache) else None)
    outs, start = [], 0
    for n in chunks:
        seq = [(sid, tokens[start:start + n], start)]
        b = alloc.batch(seq) if alloc else ForwardBatch.build(seq)
        outs.append(model(b, cache))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("chunks", [[140] + [1] * 60, [3, 5, 1, 9, 13, 2, 7, 40, 1, 69, 150]])
def test_paged_equals_decode_state(model_f32, tokens, chunks):
    want = _run_chunks(model_f32, model_f32.new_state(), tokens, chunks)
    got = _run_chunks(model_f32, _paged(model_f32), tokens, chunks)
    assert torch.equal(got, want)


def _interleaved(model, cache, seqs, alloc=None):
    """Run seqs {id: tokens} together: every 3rd step a prefill chunk, else one decode token."""
    pos, got, step = {i: 0 for i in seqs}, {i: [] for i in seqs}, 0
    while any(pos[i] < len(t) for i, t in seqs.items()):
        live = [i for i in seqs if pos[i] < len(seqs[i])]
        part = [(i, seqs[i][pos[i]:pos[i] + (7 + i * 5 if step % 3 == 0 else 1)], pos[i])
                for i in live]
        out = model(alloc.batch(part) if alloc else ForwardBatch.build(part), cache)
        lo = 0
        for i, t, _ in part:
            got[i].append(out[lo:lo + len(t)])
            lo, pos[i] = lo + len(t), pos[i] + len(t)
        step += 1
    return {i: torch.cat(g) for i, g in got.items()}


def test_batched_sequences_in_shuffled_blocks(model_f32, rel_err):
    """Four sequences of different lengths interleaved in one pool: bit-identical to the same
    schedule on DecodeState, and equal (float tolerance) to each sequence's own full forward."""
    seqs = {i: torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(i))
            for i, n in enumerate((70, 33, 101, 9))}
    cache = _paged(model_f32)
    got = _interleaved(model_f32, cache, seqs, Alloc(cache, seed=3))
    ref = _interleaved(model_f32, model_f32.new_state(), seqs)
    for i, t in seqs.items():
        assert torch.equal(got[i], ref[i]), f"sequence {i}"
        assert rel_err(got[i], model_f32(ForwardBatch.single(t))).max() < 1e-4


@pytest.mark.parametrize("k", [1, 3, ROLLBACK])
def test_rollback_then_redecode(model_f32, tokens, k):
    """Decode k tokens, roll them back, decode k others: = a run that never saw the first k.

    The rollback crosses a window wrap and compression boundaries (prefix 61 = 15 * 4 + 1)."""
    n0 = 61
    other = torch.randint(0, 512, (k,), generator=torch.Generator().manual_seed(99 + k))
    seq = torch.cat((tokens[:n0], other))
    want = _run_chunks(model_f32, model_f32.new_state(), seq, [n0] + [1] * k)[n0:]
    cache = _paged(model_f32)
    alloc = Alloc(cache)
    model_f32(alloc.batch([(0, tokens[:n0], 0)]), cache)
    for p in range(n0, n0 + k):                                   # the tokens to forget
        model_f32(alloc.batch([(0, tokens[p:p + 1], p)]), cache)
    got = [model_f32(alloc.batch([(0, other[p:p + 1], n0 + p)]), cache) for p in range(k)]
    assert torch.equal(torch.cat(got), want)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("L,block", [(64, 16), (16, 16), (8, 8)])
def test_snapshot_restore_continues_a_shared_prefix(model_f32, tokens, kv_dtype, L, block):
    """Seq 0 stops at block boundary L; its boundary state is saved to a snapshot; seq 0 goes on
    (overwriting its slot); seq 1 shares its blocks, restores the snapshot into a fresh slot and
    resumes: bit-identical to one sequence run through the same chunk shapes (same storage, so
    int8 included: a restore copies the stored bytes and scales). L = 8 < W - 1 = 15: the rows
    of negative positions travel too and are never read."""
    tail = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(5))
    seq = torch.cat((tokens[:L], tail))
    chunks = [L, 25] + [1] * 15
    want = _run_chunks(model_f32, _paged(model_f32, kv_dtype, block_size=block), seq, chunks)[L:]
    if kv_dtype == "auto":
        assert torch.equal(want, _run_chunks(model_f32, model_f32.new_state(), seq, chunks)[L:])
    cache = _paged(model_f32, kv_dtype, block_size=block, snapshots=3)
    alloc = Alloc(cache)
    model_f32(alloc.batch([(0, tokens[:L], 0)]), cache)
    cache.snapshots.save(alloc.slots[0], 2, L)
    model_f32(alloc.batch([(0, tokens[L:L + 20], L)]), cache)    # seq 0 goes on, overwriting
    alloc.slots[1] = alloc.free_slots.pop()
    alloc.tables[1] = list(alloc.tables[0][:L // block])         # shared full blocks
    cache.snapshots.restore(2, alloc.slots[1], L)
    got = [model_f32(alloc.batch([(1, tail[:25], L)]), cache)]
    got += [model_f32(alloc.batch([(1, tail[p:p + 1], L + p)]), cache) for p in range(25, 40)]
    assert torch.equal(torch.cat(got), want)


def test_bad_snapshot_ids_are_errors(model_f32):
    cache = _paged(model_f32, snapshots=2)
    with pytest.raises(IndexError, match="snapshot 2 of a pool of 2"):
        cache.snapshots.save(0, 2, 16)
    with pytest.raises(ValueError, match="block boundary > 0"):
        cache.snapshots.restore(0, 0, 0)


def test_int8_kv_is_close_and_not_exact(model_f32, tokens, rel_err):
    want = _run_chunks(model_f32, model_f32.new_state(), tokens, [100] + [1] * 50)
    got = _run_chunks(model_f32, _paged(model_f32, "int8"), tokens, [100] + [1] * 50)
    err = rel_err(got, want)
    assert 0 < err.max() < 0.05, f"int8 KV rel err {err.max():.2e}"
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95


def test_missing_block_is_a_clear_error(model_f32, tokens):
    cache = _paged(model_f32)
    b = ForwardBatch.build([(0, tokens[:40], 0)], slots=[0], block_tables=[[0]])   # needs 3
    with pytest.raises(IndexError, match="needs block"):
        model_f32(b, cache)


def test_pool_bytes(model_f32):
    """What the pools allocate, from the tiny config by hand (fp32 activations, 4 B/elem)."""
    cfg = model_f32.cfg
    c = _paged(model_f32, slots=3, blocks=5, snapshots=2)
    D, W, K = cfg.head_dim, cfg.sliding_window, ROLLBACK
    rs = [cfg.ratio(i) for i in range(cfg.num_hidden_layers)]
    slot = sum((W + K) * D * 4 for _ in rs)
    slot += sum((8 + K) * 2 * D * 4 * 2 + (8 + K) * 256 * 4 * 2 for r in rs if r == 4)
    slot += sum((r + K) * D * 4 * 2 for r in rs if r > 4)
    block = sum(B // 4 * (D + 128) * 4 for r in rs if r == 4) + sum(B // r * D * 4 for r in rs if r > 4)
    # a snapshot: W - 1 window rows a layer, 4 rows of each CSA compressor (c and z)
    snap = sum((W - 1) * D * 4 for _ in rs) + sum(4 * (2 * D + 256) * 4 * 2 for r in rs if r == 4)
    assert c.nbytes() == {"slots": 3 * slot, "blocks": 5 * block, "snapshots": 2 * snap}
