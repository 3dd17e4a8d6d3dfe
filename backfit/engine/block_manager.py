"""Block, slot and snapshot bookkeeping for the paged caches (docs/ENGINE.md §2-3); plain Python.

Ids only; the runner owns the memory. Three pools:
  blocks          0 .. num_blocks-1: B positions of CSA/HCA entries and indexer keys each
  sequence slots  0 .. num_slots-1: one per running sequence (window ring, compressor rows)
  snapshots       0 .. num_snapshot_slots-1: a sequence slot's state at a block boundary, the
                  part a continuation reads (docs/ENGINE.md §3; the runner's snapshot pool)

Prefix cache. A full block is registered under hash(parent hash, its B token ids) and keeps its
key (parent block id, token tuple; with images, Sequence.block_key adds the content key of every
image block it overlaps); a hit compares that key, so a hash collision is a miss, and
the parent is a block *id*, exact by induction: unregistering a block unregisters its registered
descendants with it, so a reused id is never a stale parent. A block computed again while its twin
is registered is swapped for the twin. Registered blocks with no reference stay cached
(`evictable`, LRU) and count as free; taking one evicts it. A snapshot hangs on the registered
block that ends at its boundary: a hit restores the last one on the longest matched run (window
ring and compressor rows cannot be rebuilt from cached entries) and the sequence computes the
matched blocks after it again, into blocks of its own that are swapped for their registered
twins as they register. Snapshots are saved only at boundaries that cut no image block (the
scheduler moves a chosen boundary down to before the image), so a hit never ends inside one.
Snapshots are LRU too; unregistering a block drops its own.

Invariant: a running sequence's registered blocks are the leading blocks of its table, and each
one's parent is the block before it, so a referenced block's ancestors are referenced too and
eviction (ref 0 only) never unregisters a block in use.

Rollback never rewrites a shared or registered block: only registered blocks are ever shared,
registration waits until a block ends MAX_ROLLBACK tokens before the computed length (prompt
blocks, committed at admission, register at once), and `rollback` refuses to go below the end of
the last registered block.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import NamedTuple

from backfit.engine.sequence import Sequence

__all__ = ["MAX_ROLLBACK", "block_hash", "PrefixHit", "BlockManager"]

MAX_ROLLBACK = 8          # K in docs/ENGINE.md: tokens speculative decoding may take back
_ROOT = -1                # parent (block id and hash) of a sequence's block 0


def block_hash(parent_hash: int, tokens: tuple[int, ...]) -> int:
    """Chain hash of a full block (tests monkeypatch it to force collisions)."""
    return hash((parent_hash, tokens))


class PrefixHit(NamedTuple):
    blocks: list[int]            # cached blocks to share, block i = positions i*B .. i*B+B-1
    snapshot: int | None         # the snapshot at the end of blocks[-1]
    num_tokens: int              # len(blocks) * B, always < the sequence length


@dataclass
class _Held:
    """What the block manager tracks per admitted sequence."""
    registered: int = 0                      # leading blocks of the table that are registered
    broken: bool = False                     # a collision stopped registration for good
    pending: list[tuple[int, int, bool]] = field(default_factory=list)  # (boundary, snap, decode)
    decode_snap: tuple[int, int] | None = None   # (block, snap): its newest published decode one


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int,
                 num_snapshot_slots: int = 0, enable_prefix_caching: bool = True):
        for name, v, low in (("num_blocks", num_blocks, 1), ("block_size", block_size, 1),
                             ("num_slots", num_slots, 1),
                             ("num_snapshot_slots", num_snapshot_slots, 0)):
            if not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_slots, self.num_snapshot_slots = num_slots, num_snapshot_slots
        self.enable_prefix_caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))         # unregistered, ref 0
        self.evictable: OrderedDict[int, None] = OrderedDict()          # registered, ref 0; LRU
        self.by_hash: dict[int, int] = {}                               # hash -> block
        self.hash_of: dict[int, int] = {}                               # block -> hash
        self.key_of: dict[int, tuple[int, tuple[int, ...]]] = {}        # block -> (parent, ids)
        self.children: dict[int, set[int]] = {}                         # block -> registered
        self.free_slots: deque[int] = deque(range(num_slots))
        self.free_snaps: deque[int] = deque(range(num_snapshot_slots))
        self.snap_of: dict[int, int] = {}                               # block -> snapshot
        self.snap_lru: OrderedDict[int, None] = OrderedDict()           # blocks with one; LRU
        self.held: dict[int, _Held] = {}                                # seq_id -> _Held
        self.cache_query_tokens = 0     # tokens looked up at admission
        self.cache_hit_tokens = 0       # of those, served by the prefix cache

    # ---- counters (a test asserts they come back to their start values) ----
    @property
    def saves_snapshots(self) -> bool:
        """Prefix caching with a snapshot pool: chosen boundaries end prefill chunks."""
        return self.enable_prefix_caching and self.num_snapshot_slots > 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never used, or cached with no reference (evicted)."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_of)

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    @property
    def num_free_snapshot_slots(self) -> int:
        """Snapshots a save can take: free, or holding an (evictable) published one."""
        return len(self.free_snaps) + len(self.snap_lru)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- admission ----
    def match(self, seq: Sequence) -> PrefixHit:
        """The longest run of cached full blocks matching seq.all_ids and ending strictly before
        the last token (its logits give the next token), cut back to its last block with a
        snapshot: the blocks after it are computed again. None for a request that wants prompt
        logprobs (they need every prompt position's logits; vLLM)."""
        if not self.enable_prefix_caching or \
                getattr(seq.params, "prompt_logprobs", None) is not None:
            return PrefixHit([], None, 0)
        B = self.block_size
        chain, best, parent, h = [], 0, _ROOT, _ROOT
        for i in range((seq.length - 1) // B):        # boundaries i*B+B < length
            tokens = seq.block_key(i * B, (i + 1) * B)            # ids (+ image contents)
            h = block_hash(h, tokens)
            b = self.by_hash.get(h)
            if b is None or self.key_of[b] != (parent, tokens):   # miss, or a collision
                break
            chain.append(b)
            parent = b
            if b in self.snap_of:                     # (never inside an image block: the
                best = i + 1                          # scheduler saves none there)
        if not best:
            return PrefixHit([], None, 0)
        return PrefixHit(chain[:best], self.snap_of[chain[best - 1]], best * B)

    def can_admit(self, hit: PrefixHit, end: int) -> bool:
        """A slot, and blocks for positions 0 .. end-1 on top of the shared ones (sharing a cached
        block with no reference takes it out of the free count)."""
        taken = sum(1 for b in hit.blocks if self.ref[b] == 0)
        need = self.blocks_for(end) - len(hit.blocks) + taken
        return bool(self.free_slots) and need <= self.num_free_blocks

    def admit(self, seq: Sequence, hit: PrefixHit) -> tuple[int, int, int] | None:
        """Give seq a slot and the hit's blocks; num_computed := hit length. Returns the snapshot
        restore (snapshot, seq slot, boundary) the runner copies before the forward, or None."""
        if seq.seq_id in self.held or seq.block_table or seq.slot is not None:
            raise RuntimeError(f"sequence {seq.seq_id} is already admitted")
        if not self.free_slots:
            raise RuntimeError("no free sequence slot (call can_admit first)")
        seq.slot = self.free_slots.popleft()
        for b in hit.blocks:
            self._share(b)
        seq.block_table = list(hit.blocks)
        seq.num_computed = hit.num_tokens
        seq.num_cached_tokens = min(hit.num_tokens, seq.num_prompt)
        self.held[seq.seq_id] = _Held(registered=len(hit.blocks))
        if self.enable_prefix_caching:
            self.cache_query_tokens += seq.length
            self.cache_hit_tokens += hit.num_tokens
        if hit.snapshot is None:
            return None
        self.snap_lru.move_to_end(hit.blocks[-1])
        return hit.snapshot, seq.slot, hit.num_tokens

    def grow(self, seq: Sequence, n: int) -> bool:
        """Blocks for positions up to num_computed + n; False (nothing taken) if the pool is short:
        the caller preempts."""
        need = self.blocks_for(seq.num_computed + n) - len(seq.block_table)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            seq.block_table.append(self._take_block())
        return True

    # ---- after a step ----
    def plan_save(self, seq: Sequence, boundary: int, decode: bool) -> tuple[int, int, int] | None:
        """Reserve a snapshot of seq's slot at `boundary` (its chunk end, a multiple of B):
        (seq slot, snapshot, boundary), copied after the forward; None if caching is off or every
        snapshot is pending. The oldest published snapshot is evicted if none is free. None too
        for a boundary inside an image block: the slot never holds a state there."""
        if not self.enable_prefix_caching or boundary <= 0 or boundary % self.block_size:
            return None
        if seq.images and seq.inside_image(boundary):
            return None
        held = self.held[seq.seq_id]
        if decode:          # an older pending decode snapshot would be dropped when this publishes
            for p in [p for p in held.pending if p[2]]:
                held.pending.remove(p)
                self.free_snaps.append(p[1])
        if self.free_snaps:
            slot = self.free_snaps.popleft()
        elif self.snap_lru:
            slot = self._drop_snapshot(next(iter(self.snap_lru)))
        else:
            return None
        held.pending.append((boundary, slot, decode))
        return seq.slot, slot, boundary

    def commit(self, seq: Sequence, final: bool = False) -> None:
        """Register seq's newly full blocks up to its registration horizon and publish the pending
        snapshots they end. final (the sequence is leaving): everything computed is committed."""
        if not self.enable_prefix_caching:
            return
        held, B, nc = self.held[seq.seq_id], self.block_size, seq.num_computed
        horizon = nc if final or nc <= seq.prefill_len else max(seq.prefill_len, nc - MAX_ROLLBACK)
        while held.registered < horizon // B and not held.broken:
            self._register(seq, held.registered, held)
        still = []
        for boundary, slot, decode in held.pending:
            if boundary <= held.registered * B:
                self._publish(seq.block_table[boundary // B - 1], slot, decode, held)
            elif held.broken or final:
                self.free_snaps.append(slot)        # its block will never be registered
            else:
                still.append((boundary, slot, decode))
        held.pending = still

    def free(self, seq: Sequence) -> None:
        """Give back seq's blocks (registered ones stay cached) and slot; commits first."""
        if seq.seq_id not in self.held:
            raise RuntimeError(f"sequence {seq.seq_id} is not admitted")
        self.commit(seq, final=True)
        self.held.pop(seq.seq_id)
        for b in reversed(seq.block_table):     # deepest first: evicted before their parents
            self._release(b)
        self.free_slots.append(seq.slot)
        seq.slot, seq.block_table, seq.num_computed = None, [], 0

    def rollback(self, seq: Sequence, k: int) -> None:
        """Take back the last k output tokens (k <= MAX_ROLLBACK) and their KV: output_ids loses
        k, num_computed := min(num_computed, new length); blocks past it go back to the pool and
        pending snapshots past it are dropped. Refuses to cut into a registered (or shared)
        block."""
        if not (isinstance(k, int) and 0 <= k <= MAX_ROLLBACK):
            raise ValueError(f"rollback takes 0..{MAX_ROLLBACK} tokens, got {k!r}")
        if k > seq.num_output:
            raise ValueError(f"sequence {seq.seq_id}: cannot roll back {k} tokens, it has "
                             f"{seq.num_output} output tokens (the prompt is committed)")
        held = self.held[seq.seq_id]
        nc = min(seq.num_computed, seq.length - k)
        if nc < held.registered * self.block_size:
            raise ValueError(f"sequence {seq.seq_id}: rolling back to {nc} would rewrite registered"
                             f" block {nc // self.block_size} (only {MAX_ROLLBACK} uncommitted "
                             f"tokens can be taken back)")
        if k:
            del seq.output_ids[-k:]
        seq.num_computed = nc
        keep = self.blocks_for(nc)
        for b in seq.block_table[keep:]:
            assert self.ref[b] == 1 and b not in self.hash_of, "rollback past a shared block"
            self._release(b)
        del seq.block_table[keep:]
        still = []
        for boundary, slot, decode in held.pending:
            if boundary > nc:
                self.free_snaps.append(slot)
            else:
                still.append((boundary, slot, decode))
        held.pending = still

    # ---- internals ----
    def _share(self, b: int) -> None:
        if self.ref[b] == 0:
            del self.evictable[b]
        self.ref[b] += 1

    def _release(self, b: int) -> None:
        self.ref[b] -= 1
        assert self.ref[b] >= 0, f"block {b} released twice"
        if self.ref[b] == 0:
            if b in self.hash_of:
                self.evictable[b] = None            # newest at the end
            else:
                self.free_blocks.append(b)

    def _take_block(self) -> int:
        if not self.free_blocks:
            self._unregister(next(iter(self.evictable)))   # LRU cached block (and descendants)
        b = self.free_blocks.popleft()
        self.ref[b] = 1
        return b

    def _register(self, seq: Sequence, i: int, held: _Held) -> None:
        """Register block i of seq (all of its positions computed); its parent is block i-1."""
        B, b = self.block_size, seq.block_table[i]
        parent = seq.block_table[i - 1] if i else _ROOT
        tokens = seq.block_key(i * B, (i + 1) * B)
        h = block_hash(self.hash_of[parent] if i else _ROOT, tokens)
        other = self.by_hash.get(h)
        if other is None:
            self.by_hash[h], self.hash_of[b], self.key_of[b] = b, h, (parent, tokens)
            if i:
                self.children.setdefault(parent, set()).add(b)
        elif self.key_of[other] == (parent, tokens):
            # the same block computed twice (e.g. past a snapshot-limited hit): share the
            # registered copy, give ours back (same tokens and parent, so the same entries)
            self._share(other)
            seq.block_table[i] = other
            self._release(b)
        else:
            held.broken = True                      # collision: keep this chain private
            return
        held.registered += 1

    def _unregister(self, b: int) -> None:
        """Forget b and every registered descendant, their snapshots with them."""
        stack = [b]
        while stack:
            x = stack.pop()
            assert self.ref[x] == 0, f"unregistering block {x} in use"
            stack.extend(self.children.pop(x, ()))
            parent, _ = self.key_of.pop(x)
            if parent != _ROOT and parent in self.children:
                self.children[parent].discard(x)
            del self.by_hash[self.hash_of.pop(x)]
            if x in self.snap_of:
                self.free_snaps.append(self._drop_snapshot(x))
            del self.evictable[x]
            self.free_blocks.append(x)

    def _publish(self, b: int, slot: int, decode: bool, held: _Held) -> None:
        if b in self.snap_of:
            self.free_snaps.append(slot)            # already has one (a twin computed it)
        else:
            self.snap_of[b] = slot
            self.snap_lru[b] = None
        if decode:
            prev, held.decode_snap = held.decode_snap, (b, self.snap_of[b])
            if prev is not None and prev[0] != b and self.snap_of.get(prev[0]) == prev[1]:
                self.free_snaps.append(self._drop_snapshot(prev[0]))   # newest per sequence

    def _drop_snapshot(self, b: int) -> int:
        del self.snap_lru[b]
        return self.snap_of.pop(b)

    def check(self, running: list[Sequence] = ()) -> None:
        """Assert the pools are consistent with the running sequences' tables (tests)."""
        refs = [0] * self.num_blocks
        for s in running:
            for b in s.block_table:
                refs[b] += 1
        assert refs == self.ref, "reference counts disagree with the block tables"
        used = {b for b in range(self.num_blocks) if self.ref[b]}
        parts = [set(self.free_blocks), set(self.evictable), used]
        assert sum(map(len, parts)) == self.num_blocks == len(set().union(*parts)), "block lists"
        assert set(self.evictable) <= set(self.hash_of), "an unregistered block is evictable"
        assert set(self.by_hash.values()) == set(self.hash_of) == set(self.key_of)
        pending = [p[1] for h in self.held.values() for p in h.pending]
        snaps = list(self.free_snaps) + list(self.snap_of.values()) + pending
        assert sorted(snaps) == list(range(self.num_snapshot_slots)), "snapshots"
        assert set(self.snap_of) == set(self.snap_lru) <= set(self.hash_of)
        seq_slots = list(self.free_slots) + [s.slot for s in running]
        assert sorted(seq_slots) == list(range(self.num_slots)), "sequence slots"
