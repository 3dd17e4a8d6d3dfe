"""Block manager: allocation, reference counts, prefix hits at snapshotted boundaries, collisions,
LRU eviction, rollback. Plain Python; each sequence is driven by hand (the runner is elsewhere)."""

import pytest

from backfit.engine import block_manager as bm_mod
from backfit.engine.block_manager import MAX_ROLLBACK, BlockManager
from backfit.engine.sampling_params import SamplingParams
from backfit.engine.sequence import Sequence

B = 4


def start_values(bm):
    return (bm.num_free_blocks, bm.num_free_slots, bm.num_free_snapshot_slots)


def admit(bm, seq):
    """Admit with whatever prefix the cache offers; returns the restore."""
    seq.prefill_len = seq.length
    hit = bm.match(seq)
    assert bm.can_admit(hit, seq.length)
    return bm.admit(seq, hit)


def compute(bm, seq, end):
    """Run positions num_computed .. end-1 as one chunk, saving a snapshot where the scheduler
    would (the prefill's last full-block boundary, decode boundaries); returns the save."""
    assert bm.grow(seq, end - seq.num_computed)
    save, B = None, bm.block_size
    if end % B == 0 and (end == seq.prefill_len // B * B or end > seq.prefill_len):
        save = bm.plan_save(seq, end, decode=end > seq.prefill_len)
    seq.num_computed = end
    bm.commit(seq)
    return save


def prefill(bm, seq):
    """Chunks ending at the last full-block boundary, then at the end; admits first."""
    restore = admit(bm, seq)
    last = seq.prefill_len // bm.block_size * bm.block_size
    if seq.num_computed < last < seq.length:
        compute(bm, seq, last)
    compute(bm, seq, seq.length)
    return restore


def decode(bm, seq, tokens):
    for t in tokens:                     # sample t, then run it
        seq.output_ids.append(t)
        compute(bm, seq, seq.length)


def test_allocate_free_and_ref_counts():
    bm = BlockManager(8, B, num_slots=2, num_snapshot_slots=2, enable_prefix_caching=False)
    start = start_values(bm)
    a, b = Sequence(0, list(range(10))), Sequence(1, list(range(100, 105)))
    prefill(bm, a)
    prefill(bm, b)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert {a.slot, b.slot} == {0, 1} and bm.num_free_slots == 0
    assert bm.num_free_blocks == 3 and not set(a.block_table) & set(b.block_table)
    bm.check([a, b])
    assert not bm.grow(a, 4 * B) and len(a.block_table) == 3      # short: nothing taken
    assert bm.grow(a, 2) and len(a.block_table) == 3               # 12 positions fit in 3
    bm.free(a)
    assert a.block_table == [] and a.slot is None and a.num_computed == 0
    bm.check([b])
    bm.free(b)
    bm.check([])
    assert start_values(bm) == start and bm.num_cached_blocks == 0


def test_shared_blocks_are_reference_counted():
    bm = BlockManager(16, B, num_slots=3, num_snapshot_slots=4)
    prompt = list(range(10))                                # last full boundary 8
    a = Sequence(0, prompt)
    assert prefill(bm, a) is None
    b, c = Sequence(1, prompt + [50, 51]), Sequence(2, prompt + [60])
    assert prefill(bm, b) == (bm.snap_of[a.block_table[1]], b.slot, 8)
    prefill(bm, c)
    assert b.block_table[:2] == c.block_table[:2] == a.block_table[:2]
    assert [bm.ref[x] for x in a.block_table[:2]] == [3, 3]
    bm.check([a, b, c])
    shared = a.block_table[:2]
    bm.free(c)
    bm.check([a, b])
    bm.free(a)
    bm.check([b])
    assert [bm.ref[x] for x in shared] == [1, 1]
    bm.free(b)
    assert [bm.ref[x] for x in shared] == [0, 0] and set(shared) <= set(bm.evictable)
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 16
    bm.check([])


def test_prefix_hit_only_up_to_a_snapshotted_boundary_and_never_whole():
    bm = BlockManager(32, B, num_slots=2, num_snapshot_slots=4)
    base = list(range(1, 19))                               # 18 tokens: snapshot at 16 only
    a = Sequence(0, base)
    prefill(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 4 and len(bm.snap_of) == 1
    hit = bm.match(Sequence(1, base + [99]))
    assert hit.num_tokens == 16 and len(hit.blocks) == 4 and hit.snapshot is not None
    # blocks 0, 1 match but neither boundary 4 nor 8 has a snapshot: no reuse
    assert bm.match(Sequence(2, base[:10] + [7, 7])).num_tokens == 0
    # exactly the 16 snapshotted tokens: the whole prompt is never reused
    assert bm.match(Sequence(3, base[:16])).num_tokens == 0
    assert bm.match(Sequence(4, base[:17])).num_tokens == 16
    # a different first block: the later blocks' tokens match but their parent does not
    assert bm.match(Sequence(5, [0, 0, 0, 0] + base[4:] + [1])).num_tokens == 0
    d = Sequence(6, base + [5, 6])
    prefill(bm, d)
    assert d.num_cached_tokens == 16 and d.num_computed == d.length
    assert bm.cache_hit_tokens == 16 and bm.cache_query_tokens == 18 + 20
    bm.free(d)
    bm.check([])


@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_snapshot_keeps_the_newest_per_sequence(block_size):
    bs = block_size
    bm = BlockManager(32, bs, num_slots=2, num_snapshot_slots=4)
    prompt = list(range(1, bs + 3))                          # prompt snapshot at bs
    a = Sequence(0, prompt, SamplingParams(max_tokens=80))
    prefill(bm, a)
    decode(bm, a, range(100, 100 + 4 * bs - 2))             # length 5*bs: boundaries 2bs..5bs
    held = bm.held[a.seq_id]
    # decode blocks register MAX_ROLLBACK tokens late; a decode snapshot is published with its
    # block, and then drops the sequence's previous one; at most one is pending
    assert held.registered == (a.num_computed - MAX_ROLLBACK) // bs
    ends = sorted((i + 1) * bs for i, x in enumerate(a.block_table) if x in bm.snap_of)
    assert [p[0] for p in held.pending] == [5 * bs]
    assert ends == ([bs] if bs <= MAX_ROLLBACK else [bs, 4 * bs])
    bm.free(a)                                              # leaving: everything committed
    ends = sorted((i + 1) * bs for i, x in enumerate(bm.match(
        Sequence(1, a.all_ids + [1])).blocks) if x in bm.snap_of)
    assert ends == [bs, 5 * bs] and bm.num_free_snapshot_slots == 4
    b = Sequence(1, a.all_ids[:5 * bs] + [7])
    assert bm.match(b).num_tokens == 5 * bs                 # the newest decode snapshot
    bm.check([])


def test_hash_collision_is_a_miss(monkeypatch):
    real = bm_mod.block_hash
    monkeypatch.setattr(bm_mod, "block_hash",
                        lambda p, t: 7 if t[0] in (1, 5) else real(p, t))
    bm = BlockManager(16, B, num_slots=2, num_snapshot_slots=2)
    start = start_values(bm)
    a = Sequence(0, [1, 1, 1, 1, 9])                        # block 0 hashes to 7, snapshot at 4
    prefill(bm, a)
    bm.free(a)
    assert bm.match(Sequence(1, [1, 1, 1, 1, 8])).num_tokens == 4
    b = Sequence(2, [5, 5, 5, 5, 9])                        # same hash, other tokens
    assert bm.match(b).num_tokens == 0
    prefill(bm, b)                                          # its block collides: stays private
    assert bm.held[b.seq_id].broken and b.block_table[0] not in bm.hash_of
    bm.free(b)
    assert bm.match(Sequence(3, [1, 1, 1, 1, 7])).num_tokens == 4   # a's entry survived
    bm.check([])
    assert start_values(bm) == start


@pytest.mark.parametrize("j", range(B))
def test_a_block_differing_in_any_one_token_is_an_entry_of_its_own(j):
    """Two prompts equal but for token j of block 1: the second has no hit there (a hash and key
    that skipped token j would hand it the first one's blocks and snapshot), registers blocks
    of its own (a hash alone that skipped it would collide, and a collision keeps a chain
    private), and a third prompt continuing the second hits those."""
    bm = BlockManager(32, B, num_slots=2, num_snapshot_slots=4)
    base = list(range(1, 14))                               # 13 tokens: snapshot at 12
    a = Sequence(0, base)
    prefill(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    other = base[:B + j] + [99] + base[B + j + 1:]
    assert bm.match(Sequence(1, other)).num_tokens == 0
    b = Sequence(1, other)
    prefill(bm, b)
    b_blocks = list(b.block_table)
    assert b.num_cached_tokens == 0 and b_blocks[1] != a_blocks[1]
    bm.free(b)
    hit = bm.match(Sequence(2, other + [50]))
    assert hit.num_tokens == 12 and hit.blocks[1:] == b_blocks[1:3]
    assert bm.match(Sequence(3, base + [50])).num_tokens == 12    # a's survive beside them
    bm.check([])


def test_lru_eviction_and_dependent_snapshots():
    bm = BlockManager(6, B, num_slots=2, num_snapshot_slots=2)
    a = Sequence(0, list(range(1, 6)))                      # block 0 + snapshot at 4
    prefill(bm, a)
    bm.free(a)
    e = Sequence(1, list(range(1, 9)) + [0])                # hits block 0; block 1 + snapshot 8
    assert prefill(bm, e) is not None
    bm.free(e)
    chain = bm.match(Sequence(2, list(range(1, 9)) + [5])).blocks
    assert len(chain) == 2 and len(bm.snap_of) == 2
    b0, b1 = chain
    assert bm.key_of[b1][0] == b0
    # allocations take never-used blocks first, then the least recently used cached one
    bm.evictable.move_to_end(b1)                            # make the parent the oldest
    x = Sequence(3, [42] * 17)
    admit(bm, x)
    assert bm.grow(x, 17)                                   # 4 never used, then b0 (and b1)
    assert b0 not in bm.hash_of and b1 not in bm.hash_of and not bm.snap_of
    assert bm.num_free_snapshot_slots == 2
    assert bm.match(Sequence(4, list(range(1, 10)))).num_tokens == 0
    bm.free(x)
    bm.check([])


def test_snapshot_slots_are_lru_evicted():
    bm = BlockManager(16, B, num_slots=2, num_snapshot_slots=1)
    a, b = Sequence(0, [1] * 5), Sequence(1, [2] * 5)
    prefill(bm, a)
    bm.free(a)
    assert bm.match(Sequence(2, [1] * 6)).num_tokens == 4
    prefill(bm, b)                                          # takes a's snapshot slot
    assert bm.match(Sequence(3, [1] * 6)).num_tokens == 0
    assert bm.match(Sequence(4, [2] * 6)).num_tokens == 4
    bm.free(b)
    bm.check([])


def test_rollback_frees_tail_and_never_rewrites_registered_blocks():
    bm = BlockManager(32, B, num_slots=1, num_snapshot_slots=4)
    start = start_values(bm)
    s = Sequence(0, list(range(1, 7)), SamplingParams(max_tokens=64))
    prefill(bm, s)
    decode(bm, s, range(100, 113))                          # length 19, all computed
    held = bm.held[s.seq_id]
    # a speculative step: 5 draft tokens appended and computed in one chunk (ends at 24)
    s.output_ids += [200, 201, 202, 203, 204]
    assert compute(bm, s, 24) is not None and held.pending[-1][0] == 24
    assert held.registered == 4                             # ends 4 .. 16 = 24 - MAX_ROLLBACK
    registered = list(s.block_table[:4])
    keys = [bm.key_of[x] for x in registered]
    free_before = bm.num_free_blocks
    bm.rollback(s, 4)                                       # 1 draft accepted, 4 rejected
    assert s.length == s.num_computed == 20 and s.output_ids[-1] == 200
    assert len(s.block_table) == 5 and bm.num_free_blocks == free_before + 1
    assert not held.pending                                 # the snapshot at 24 is gone
    assert s.block_table[:4] == registered and [bm.key_of[x] for x in registered] == keys
    bm.check([s])
    with pytest.raises(ValueError, match="0..8"):
        bm.rollback(s, MAX_ROLLBACK + 1)
    with pytest.raises(ValueError, match="registered"):
        bm.rollback(s, 8)                                   # 12 < 16: into a registered block
    assert s.length == 20
    with pytest.raises(ValueError, match="prompt"):
        bm.rollback(Sequence(9, [1]), 1)
    decode(bm, s, [7, 8, 9])                                # re-decodes different tokens
    bm.free(s)
    bm.check([])
    assert start_values(bm) == start
