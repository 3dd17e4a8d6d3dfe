"""Scheduler: admission errors, chunking, continuous batching, preemption, stops, abort, prefix
hits, and a randomized run of 200 requests; driven by a fake runner that models the caches."""

import random

import pytest

from backfit.engine.block_manager import BlockManager
from backfit.engine.sampling_params import SamplingParams
from backfit.engine.scheduler import Scheduler
from backfit.engine.sequence import Sequence, SequenceStatus

B, EOS = 4, 0


def prefix_token(seq, prefix):
    """A token that depends only on the tokens before it (what greedy decoding would give)."""
    return 1 + hash(tuple(prefix)) % 29


class FakeRunner:
    """The caches as token lists: a slot holds the prefix it has consumed, a snapshot the prefix
    its slot held at its boundary, a block the tokens at its positions. Every chunk must start
    from exactly its own prefix (restored, shared or computed), and no chunk may write a shared
    or registered block."""

    def __init__(self, bm, next_token=prefix_token):
        self.bm, self.next_token = bm, next_token
        self.slots, self.blocks, self.snaps = {}, {}, {}

    def execute(self, step, prev=None):
        """prev: the tokens of the last step's sampled rows, by row (overlap: the placeholders
        -1 - r of an unresolved step are taken from it, as the runner takes them on the device)."""
        bm, out, B = self.bm, {}, self.bm.block_size
        real = (lambda ids: ids) if prev is None else \
            (lambda ids: [prev[-1 - t] if t < 0 else t for t in ids])
        for snap, slot, boundary in step.restores:        # before the forward
            assert len(self.snaps[snap]) == boundary, "restored at another boundary"
            self.slots[slot] = self.snaps[snap]
        for item in step.seqs:
            seq, start = item.seq, item.start
            end = start + len(item.token_ids)
            ids = real(seq.all_ids)
            assert min(ids) >= 0, "a placeholder of an older step"
            assert real(item.token_ids) == ids[start:end] and len(seq.block_table) * B >= end
            if start == 0:
                self.slots[seq.slot] = ()                 # a fresh slot is reset
            else:                                         # restored, or left by its last chunk
                assert self.slots[seq.slot] == tuple(ids[:start]), "slot state != prefix"
            for pos in range(start):
                assert self.blocks[seq.block_table[pos // B]][pos % B] == ids[pos]
            for pos in range(start, end):
                b = seq.block_table[pos // B]
                assert bm.ref[b] == 1 and b not in bm.hash_of, "write into a shared block"
                self.blocks.setdefault(b, [None] * B)[pos % B] = ids[pos]
            self.slots[seq.slot] = tuple(ids[:end])
            assert item.sample == (end == seq.length)
            if item.sample:
                out[seq.seq_id] = self.next_token(seq, ids[:end])
        for slot, snap, boundary in step.saves:           # after the forward
            assert len(self.slots[slot]) == boundary, "saved off its chunk's end"
            self.snaps[snap] = self.slots[slot]
        return out


def make(num_blocks=64, num_slots=4, snaps=4, caching=True, chunked=True, max_seqs=4,
         budget=16, max_len=128):
    bm = BlockManager(num_blocks, B, num_slots, snaps, enable_prefix_caching=caching)
    return bm, Scheduler(bm, max_seqs, budget, max_len, chunked, eos_token_id=EOS)


def run(sched, runner, max_steps=1000, each=None):
    """Steps until no work is left; returns (finished in order, steps)."""
    finished, steps = [], []
    while sched.has_work:
        step = sched.schedule()
        assert step, "work left but nothing scheduled"
        assert step.num_tokens <= sched.max_num_batched_tokens
        assert len(step.seqs) <= sched.max_num_seqs
        steps.append(step)
        finished += sched.postprocess(step, runner.execute(step))
        sched.bm.check(sched.running)
        if each:
            each(step)
        assert len(steps) <= max_steps, "no progress"
    return finished, steps


def counters(bm):
    return bm.num_free_blocks, bm.num_free_slots, bm.num_free_snapshot_slots


def test_add_rejects_requests_that_can_never_run():
    bm, sched = make(num_blocks=8, max_len=40, budget=16, chunked=False)
    with pytest.raises(ValueError, match="max_model_len 40"):
        sched.add(Sequence(0, [1] * 40))                   # no room for one output token
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(Sequence(1, [1] * 30, SamplingParams(max_tokens=20, min_tokens=11)))
    with pytest.raises(ValueError, match="cache blocks"):
        sched.add(Sequence(2, [1] * 10, SamplingParams(max_tokens=None)))   # 39 > 32 tokens
    with pytest.raises(ValueError, match="chunked prefill off"):
        sched.add(Sequence(3, [1] * 17, SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match="empty"):
        Sequence(4, [])
    sched.add(Sequence(5, [1] * 16, SamplingParams(max_tokens=17)))       # 32 tokens: fits
    with pytest.raises(ValueError, match="already in use"):
        sched.add(Sequence(5, [1]))
    assert list(sched.waiting) == [sched.seqs[5]]


@pytest.mark.parametrize("caching", [False, True])
def test_chunks_respect_budget_and_block_boundaries(caching):
    bm, sched = make(caching=caching, budget=10)
    sched.add(Sequence(0, list(range(1, 31)), SamplingParams(max_tokens=1)))
    _, steps = run(sched, FakeRunner(bm))
    chunks = [(s.seqs[0].start, s.seqs[0].start + len(s.seqs[0].token_ids)) for s in steps]
    for start, end in chunks[:-1]:
        assert end - start <= 10 and end % B == 0
    # 30 tokens: budget 10 rounds down to block ends; with caching 28 (last full block) is one
    assert chunks == [(0, 8), (8, 16), (16, 24)] + ([(24, 28), (28, 30)] if caching else [(24, 30)])


def test_decode_and_prefill_share_a_step():
    bm, sched = make(budget=16)
    a = Sequence(0, [1, 2, 3, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True))
    sched.add(a)
    runner = FakeRunner(bm)
    for _ in range(2):                                     # prefill 0..4, 4..5 (snapshot at 4)
        sched.postprocess(step := sched.schedule(), runner.execute(step))
    assert a.num_output == 1
    sched.add(b := Sequence(1, list(range(7, 37)), SamplingParams(max_tokens=2)))
    step = sched.schedule()
    assert [(s.seq.seq_id, s.start, len(s.token_ids), s.sample) for s in step.seqs] == [
        (0, 5, 1, True), (1, 0, 12, False)]                # 15 left -> ends at block 3
    sched.postprocess(step, runner.execute(step))
    run(sched, runner)
    assert a.finish_reason == "length" and a.num_output == 8 and b.num_output == 2


def test_an_older_prefill_leaves_a_token_to_each_newer_decode():
    bm = BlockManager(128, 1, 4, 0, enable_prefix_caching=False)  # block size 1: no rounding
    sched = Scheduler(bm, 4, 8, 128, True, eos_token_id=EOS)
    runner = FakeRunner(bm)
    new = Sequence(0, [5, 6], SamplingParams(max_tokens=12, ignore_eos=True))
    old = Sequence(1, list(range(1, 61)), SamplingParams(max_tokens=1))
    sched.add(new)
    sched.add(old)
    sched.postprocess(step := sched.schedule(), runner.execute(step))
    assert new.num_output == 1 and old.num_computed == 6
    # as after a preemption: the prefilling sequence is the older one
    new.arrival, old.arrival = old.arrival, new.arrival
    sched.running.sort(key=lambda s: s.arrival)
    decoded = 0
    while old.num_output == 0:
        left = old.length - old.num_computed
        step = sched.schedule()
        assert step.num_tokens <= 8
        if not new.is_finished:                             # 8 - 1 reserved for the decode
            assert [(s.seq.seq_id, len(s.token_ids)) for s in step.seqs] == [
                (1, min(7, left)), (0, 1)]
            decoded += 1
        sched.postprocess(step, runner.execute(step))
    assert decoded == 8 and new.num_output == 9
    run(sched, runner)


def test_max_num_seqs_and_slots_bound_the_running_set():
    bm, sched = make(num_slots=3, max_seqs=2, budget=64)
    for i in range(6):
        sched.add(Sequence(i, [i + 1] * (3 + i), SamplingParams(max_tokens=5, ignore_eos=True)))
    admitted = []

    def each(step):
        assert len(sched.running) <= 2
        admitted.extend(s.seq.seq_id for s in step.seqs if s.start == 0)
    finished, _ = run(sched, FakeRunner(bm), each=each)
    assert admitted == [0, 1, 2, 3, 4, 5] and len(finished) == 6     # FIFO


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_is_newest_first_and_resumes_by_recompute(caching):
    def go(num_blocks):
        bm, sched = make(num_blocks=num_blocks, num_slots=3, max_seqs=3, caching=caching)
        seqs = [Sequence(i, [10 + i] * 8, SamplingParams(max_tokens=24, ignore_eos=True))
                for i in range(3)]
        for s in seqs:
            sched.add(s)
        seen = []

        def each(step):
            for sid in step.preempted:
                victim = sched.seqs[sid]
                newest = max([s.arrival for s in sched.running] + [victim.arrival])
                assert victim.arrival == newest and victim.status is SequenceStatus.WAITING
                seen.append((sid, victim.all_ids))
            for item in step.seqs:                         # a resumed one recomputes it all
                for sid, ids in list(seen):
                    if item.seq.seq_id == sid and item.seq.slot is not None:
                        # from 0, or from a snapshot of its own prefix (the runner checks it)
                        assert item.seq.prefill_len == len(ids) and (item.start == 0 or caching)
                        assert item.token_ids == ids[item.start:item.start + len(item.token_ids)]
                        assert item.start % B == 0 and item.start < len(ids)
                        seen.remove((sid, ids))
        start = counters(bm)
        finished, _ = run(sched, FakeRunner(bm), each=each)
        assert counters(bm) == start
        assert sched.num_preemptions == sum(s.num_preemptions for s in seqs)
        return {s.seq_id: s.output_ids for s in finished}, sched.num_preemptions

    alone, n0 = go(64)
    squeezed, n1 = go(12)                                  # 3 x 8 blocks wanted, 12 there
    assert n0 == 0 and n1 > 0 and squeezed == alone        # same tokens as uninterrupted


def test_token_level_stops():
    script = {0: [EOS, 5, EOS, 9], 1: [EOS, EOS, EOS], 2: [4, 7, 8], 3: [1] * 9}

    def next_token(seq, prefix):
        return script[seq.seq_id][seq.num_output]

    bm, sched = make(max_len=14)
    sched.add(Sequence(0, [1, 2], SamplingParams(min_tokens=3)))       # first EOS suppressed
    sched.add(Sequence(1, [1, 2], SamplingParams(max_tokens=3, ignore_eos=True)))
    sched.add(Sequence(2, [1, 2], SamplingParams(stop_token_ids=(7,))))
    sched.add(Sequence(3, [3] * 10, SamplingParams(max_tokens=None)))  # 14 = max_model_len
    finished, _ = run(sched, FakeRunner(bm, next_token))
    got = {s.seq_id: (s.output_ids, s.finish_reason) for s in finished}
    assert got == {0: ([EOS, 5, EOS], "stop"), 1: ([EOS] * 3, "length"),
                   2: ([4, 7], "stop"), 3: ([1] * 4, "length")}


def run_overlapped(sched, runner, each=None, max_steps=3000):
    """run() with the engine's overlap: step N+1 is scheduled and executed before step N is
    resolved, its decode tokens the placeholders of step N (resolved from N's rows)."""
    finished, pending, steps = [], None, 0
    while sched.has_work or pending:
        step = sched.schedule() if sched.has_work else None
        out = None
        if step:
            assert step.num_tokens <= sched.max_num_batched_tokens
            prev = None if pending is None else pending[2]
            out = runner.execute(step, prev)
            sched.advance(step)
        elif pending is None:
            raise AssertionError("work left but nothing scheduled or pending")
        if pending:
            finished += sched.resolve(pending[0], pending[1])
        sched.bm.check(sched.running)
        pending = None if not step else \
            (step, out, [out[i.seq.seq_id] for i in step.seqs if i.sample])
        if each:
            each()
        steps += 1
        assert steps <= max_steps, "no progress"
    return finished


@pytest.mark.parametrize("caching,chunked,blocks", [(True, True, 64), (False, False, 64),
                                                    (True, True, 14), (False, True, 14)])
def test_overlapped_run_gives_the_sequential_tokens(caching, chunked, blocks):
    """40 requests with stop tokens, EOS, min/max tokens, max_model_len: the overlapped run
    (one step in flight while the next is scheduled) gives every request the tokens and finish
    reason of the plain run, never schedules a sequence past its end, gives every block back,
    and (14 blocks) preempts."""
    def token(seq, prefix):
        return hash(tuple(prefix)) % 23                     # EOS = 0 once in 23

    def go(overlap):
        rng = random.Random(7)
        bm, sched = make(num_blocks=blocks, num_slots=5, snaps=4, caching=caching,
                         chunked=chunked, max_seqs=5, budget=32, max_len=48)
        start = counters(bm)
        seqs = []
        for i in range(40):
            mt = rng.choice([None, rng.randrange(1, 20)])
            params = SamplingParams(max_tokens=mt, min_tokens=rng.randrange(0, 3),
                                    stop_token_ids=(rng.randrange(1, 23),),
                                    ignore_eos=rng.random() < 0.3)
            seqs.append(Sequence(i, [rng.randrange(1, 30) for _ in range(rng.randrange(1, 28))],
                                 params))
            sched.add(seqs[-1])

        def each():                                         # no row past its end, ever
            for s in seqs:
                assert s.num_output <= (s.params.max_tokens or 99) and s.length <= 48
        runner = FakeRunner(bm, token)
        done = run_overlapped(sched, runner, each) if overlap else run(sched, runner)[0]
        assert sorted(s.seq_id for s in done) == list(range(40))
        assert counters(bm) == start and not sched.seqs
        return {s.seq_id: (s.output_ids, s.finish_reason) for s in seqs}, sched.num_preemptions
    plain, n0 = go(False)
    overlapped, n1 = go(True)
    assert overlapped == plain
    assert (n0 > 0) == (n1 > 0) == (blocks == 14)
    assert any(r == "stop" for _, r in plain.values()) and any(r == "length"
                                                              for _, r in plain.values())


def test_overlapped_abort_and_finish_wait_for_the_steps_that_hold_them():
    bm, sched = make(num_slots=2, max_seqs=2, caching=False)
    start = counters(bm)
    runner = FakeRunner(bm)
    a, b = (Sequence(i, [i + 1] * 5, SamplingParams(max_tokens=30, ignore_eos=True))
            for i in range(2))
    sched.add(a), sched.add(b)
    s1 = sched.schedule()
    out1 = runner.execute(s1)
    sched.advance(s1)                                      # in flight: placeholders appended
    assert a.output_ids == [-1] and b.output_ids == [-2]
    s2 = sched.schedule()                                  # scheduled on the placeholders
    assert [i.token_ids for i in s2.seqs] == [[-1], [-2]]
    out2 = runner.execute(s2, [out1[0], out1[1]])
    sched.advance(s2)
    assert sched.abort(0) is a                             # held by s1 and s2
    assert a.finishing == "abort" and a.output_ids == [] and a.block_table
    with pytest.raises(RuntimeError, match="two steps unresolved"):
        sched.schedule()
    assert sched.resolve(s1, out1) == [] and a.block_table         # s2 still holds it
    assert b.output_ids == [out1[1], -2]
    s3 = sched.schedule()
    assert [i.seq for i in s3.seqs] == [b]                 # a is not scheduled again
    out3 = runner.execute(s3, [out2[0], out2[1]])
    sched.advance(s3)
    assert sched.resolve(s2, out2) == [a] and a.slot is None and a.finish_reason == "abort"
    assert sched.finish(1, "stop") is b                    # a stop string, b held by s3
    assert sched.resolve(s3, out3) == [b] and b.output_ids == [out1[1], out2[1]]
    assert not sched.has_work and counters(bm) == start


def test_abort_and_finish_give_everything_back():
    bm, sched = make(num_slots=2, max_seqs=2)
    start = counters(bm)
    runner = FakeRunner(bm)
    seqs = [Sequence(i, [i + 1] * 9, SamplingParams(max_tokens=30, ignore_eos=True))
            for i in range(4)]
    for s in seqs:
        sched.add(s)
    for _ in range(3):
        sched.postprocess(step := sched.schedule(), runner.execute(step))
    assert [s.status for s in seqs] == [SequenceStatus.RUNNING] * 2 + [SequenceStatus.WAITING] * 2
    step = sched.schedule()
    assert sched.abort(1) is seqs[1]                       # while the step is in flight
    assert seqs[1].status is SequenceStatus.RUNNING and seqs[1].block_table
    n1 = seqs[1].num_output
    assert seqs[1] in sched.postprocess(step, runner.execute(step))
    assert seqs[1].num_output == n1 and seqs[1].finish_reason == "abort"
    assert not seqs[1].block_table and seqs[1].slot is None
    assert sched.abort(3).finish_reason == "abort"         # waiting
    assert sched.abort(3) is None and sched.abort(99) is None
    assert sched.finish(0, "stop").finish_reason == "stop"  # a stop string, say
    bm.check(sched.running)
    run(sched, runner)
    assert seqs[2].finish_reason == "length" and counters(bm) == start


def test_prefix_hit_restores_a_snapshot_and_reports_cached_tokens():
    bm, sched = make()
    runner = FakeRunner(bm)
    prompt = list(range(1, 19))                            # snapshot at 16
    sched.add(Sequence(0, prompt, SamplingParams(max_tokens=3)))
    run(sched, runner)
    sched.add(b := Sequence(1, prompt + [40, 41, 42]))
    sched.add(c := Sequence(2, prompt))                    # same prompt: 16 of 18 reused
    step = sched.schedule()
    assert [(s.seq.seq_id, s.start) for s in step.seqs] == [(1, 16), (2, 16)]
    assert sorted(dst for _, dst, _ in step.restores) == sorted([b.slot, c.slot])
    sched.postprocess(step, runner.execute(step))
    run(sched, runner)
    assert b.num_cached_tokens == c.num_cached_tokens == 16
    assert bm.cache_hit_tokens == 32 and bm.cache_query_tokens == 18 + 21 + 18


@pytest.mark.parametrize("caching,chunked", [(True, True), (False, False), (True, False)])
def test_randomized_run_returns_every_counter(caching, chunked):
    rng = random.Random(1234 + 2 * caching + chunked)
    bm, sched = make(num_blocks=30, num_slots=6, snaps=5, caching=caching, chunked=chunked,
                     max_seqs=6, budget=32, max_len=96)
    start = counters(bm)
    stems = [[rng.randrange(1, 30) for _ in range(rng.randrange(4, 40))] for _ in range(4)]

    def next_token(seq, prefix):
        return rng.randrange(0, 60)                        # EOS = 0 once in 60

    pending, seqs, steps, done = list(range(200)), {}, 0, []
    runner = FakeRunner(bm, next_token)
    while pending or sched.has_work:
        for _ in range(rng.choice([0, 0, 0, 0, 0, 1, 1, 2])):
            if not pending:
                break
            i = pending.pop(0)
            prompt = rng.choice(stems + [[]])[:rng.randrange(0, 40)]
            prompt = (prompt + [rng.randrange(1, 30) for _ in range(rng.randrange(1, 25))])[:32]
            mt = rng.choice([None, rng.randrange(1, 40)])
            params = SamplingParams(max_tokens=mt, min_tokens=rng.randrange(0, min(mt or 3, 3)),
                                    stop_token_ids=tuple(rng.sample(range(1, 30), 2)),
                                    ignore_eos=rng.random() < 0.2)
            sched.add(seqs.setdefault(i, Sequence(i, prompt, params)))
        for sid in list(sched.seqs):
            if rng.random() < 0.003:
                done.append(sched.abort(sid))
            elif rng.random() < 0.003 and sched.seqs[sid].num_output:
                done.append(sched.finish(sid, "stop"))     # a stop string matched
        if not sched.has_work:
            continue
        step = sched.schedule()
        assert step and step.num_tokens <= 32 and len(step.seqs) <= 6
        done += sched.postprocess(step, runner.execute(step))
        bm.check(sched.running)
        steps += 1
        assert steps < 3000, "no progress"
    assert sorted(s.seq_id for s in done) == list(range(200))
    assert all(s.is_finished and s.slot is None and not s.block_table for s in seqs.values())
    assert all(s.length <= 96 for s in seqs.values())
    assert all(s.params.max_tokens is None or s.num_output <= s.params.max_tokens
               for s in seqs.values())
    assert counters(bm) == start and not sched.seqs
    assert sum(s.num_preemptions for s in seqs.values()) > 0
    assert (bm.cache_hit_tokens > 0) == caching
