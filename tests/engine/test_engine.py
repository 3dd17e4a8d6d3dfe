"""The engine end to end on the tiny model (CPU, float32 activations, int8 conversion).

Reference for every check: the same request run alone, greedy, uninterrupted, uncached — or the
plain runtime (DecodeState) one token at a time. Small blocks (16 tokens) so that 40-150-token
prompts span several blocks, chunks and prefix-cache boundaries. Every test of the `engine`
fixture runs twice: without and with async scheduling (the overlapped step, forced on on CPU).
"""

import random

import pytest
import torch

from backfit.engine.engine import EngineConfig, LLMEngine
from backfit.engine.sampling_params import SamplingParams
from backfit.runtime.batch import ForwardBatch

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def conv(tiny_converted):
    return tiny_converted(1, "int8")


def make(conv, **kw) -> LLMEngine:
    base = dict(model=str(conv), dtype="float32", block_size=16, max_num_seqs=8,
                max_num_batched_tokens=64, max_model_len=512, num_blocks=200)
    base.update(kw)
    return LLMEngine(EngineConfig(**base))


def prompts(n, seed=0, lo=5, hi=150):
    r = random.Random(seed)
    return [[r.randrange(3, 512) for _ in range(r.randrange(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def plain(conv):
    e = make(conv, async_scheduling=False)
    yield e
    e.close()


@pytest.fixture(scope="module")
def overlapped(conv):
    e = make(conv, async_scheduling=True)
    yield e
    e.close()


@pytest.fixture(params=[False, True], ids=["sync", "overlap"])
def engine(request, plain, overlapped):
    e = overlapped if request.param else plain
    assert e.overlap == request.param
    return e


@pytest.fixture(scope="module")
def alone(plain):
    """Greedy tokens of each of 8 prompts, each run alone in a fresh pass (no overlap)."""
    ps = prompts(8)
    return ps, [plain.generate([p], GREEDY)[0]["token_ids"] for p in ps]


def _counters(e):
    bm = e.block_manager
    return (bm.num_free_blocks, bm.num_free_slots)


def test_alone_matches_the_plain_runtime(plain, alone):
    """Engine greedy = argmax of the plain runtime (DecodeState, one sequence, token by token)."""
    model = plain.ranks.runner.model
    p, want = alone[0][0], alone[1][0]
    st, ids, out = model.new_state(), list(p), []
    logits = model(ForwardBatch.single(ids), st, last_only=True)
    for _ in range(len(want)):
        t = int(logits[-1].argmax())
        out.append(t)
        logits = model(ForwardBatch.single([t], start=len(ids) + len(out) - 1), st, last_only=True)
    assert out == want


@pytest.mark.parametrize("chunked", [True, False])
def test_batched_equals_alone(conv, engine, alone, chunked):
    """8 requests of different lengths arriving at different steps = each one alone."""
    ps, want = alone
    e = make(conv, enable_chunked_prefill=chunked, max_num_batched_tokens=64 if chunked else 160,
             enable_prefix_caching=False, async_scheduling=engine.overlap)
    try:
        start = _counters(e)
        got, pending = {}, list(enumerate(ps))
        ids = {}
        step = 0
        while pending or e.has_unfinished():
            if pending and step % 2 == 0:                         # staggered arrivals
                i, p = pending.pop(0)
                ids[e.add_request(p, GREEDY)] = i
            for o in e.step():
                got.setdefault(ids[o.request_id], []).extend(o.token_ids)
            step += 1
        assert [got[i] for i in range(len(ps))] == want
        assert _counters(e) == start
    finally:
        e.close()


def test_prefix_cache_hit_same_tokens_and_reported(engine, alone):
    ps, want = alone
    shared = ps[2][:70]
    first = engine.generate([shared + [7, 8, 9]], GREEDY)[0]
    second = engine.generate([shared + [7, 8, 9]], GREEDY)[0]
    assert second["token_ids"] == first["token_ids"]
    assert first["usage"].cached_tokens == 0
    assert second["usage"].cached_tokens == 64                   # 4 full blocks of 16


def test_preemption_gives_the_same_tokens(conv, engine, alone):
    """A pool too small for all 8 at once forces preemption by recompute."""
    ps, want = alone
    e = make(conv, num_blocks=24, max_model_len=300, enable_prefix_caching=False,
             async_scheduling=engine.overlap)
    try:
        got = e.generate(ps, GREEDY)
        assert [g["token_ids"] for g in got] == want
        assert e.scheduler.num_preemptions > 0
    finally:
        e.close()


def test_stop_strings_and_logprobs(engine):
    p = prompts(1, seed=5)[0]
    full = engine.generate([p], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                               logprobs=3))[0]
    text = full["text"]
    assert len(text) > 6
    stop = text[3:6]
    cut = engine.generate([p], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                              stop=[stop]))[0]
    assert cut["text"] == text[:text.index(stop)] and cut["finish_reason"] == "stop"
    # logprobs: log_softmax of the runtime's logits at each step
    model = engine.ranks.runner.model
    ids = p + full["token_ids"]
    logits = model(ForwardBatch.single(ids))[len(p) - 1:-1]
    lsm = torch.log_softmax(logits.double(), -1)
    for k, (lp, top) in enumerate(full["logprobs"]):
        assert abs(lp - float(lsm[k, full["token_ids"][k]])) < 1e-4
        assert [t for t, _ in top] == lsm[k].topk(3).indices.tolist()


def test_seeded_sampling_is_reproducible_across_batches(engine):
    ps = prompts(4, seed=9)
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    alone = engine.generate([ps[0]], sp)[0]["token_ids"]
    mixed = engine.generate(ps, [sp] + [SamplingParams(max_tokens=10, temperature=1.0)] * 3)
    assert mixed[0]["token_ids"] == alone


def test_oversized_and_bad_requests_are_clear_errors(engine):
    with pytest.raises(ValueError, match="max_model_len|context|max-model-len"):
        engine.add_request([5] * 600, GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([10**6], GREEDY)


def test_abort_frees_everything(engine):
    start = _counters(engine)
    rid = engine.add_request(prompts(1, seed=3)[0], SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    out = engine.abort(rid)
    assert out.finish_reason == "abort"
    assert not engine.has_unfinished()
    assert _counters(engine) == start


def test_random_requests_with_stops_and_aborts_return_every_counter(engine):
    """60 random requests (lengths, max_tokens, stop strings, seeds), some aborted mid-way:
    every one ends, and free blocks / slots / snapshot slots are back at their start values
    (cached prefix blocks count as free: they are evictable)."""
    bm = engine.block_manager
    start = (bm.num_free_blocks, bm.num_free_slots, bm.num_free_snapshot_slots)
    r = random.Random(42)
    live, ended, steps = set(), 0, 0
    for i, p in enumerate(prompts(60, seed=77, lo=2, hi=90)):
        sp = SamplingParams(max_tokens=r.randrange(1, 12), temperature=r.choice([0, 0.8]),
                            seed=r.randrange(100), stop=[chr(r.randrange(97, 123))],
                            presence_penalty=r.choice([0.0] * 5 + [0.5]))   # overlap: off
        live.add(engine.add_request(p, sp))
        if i % 3 == 0:
            for o in engine.step():
                ended += o.finished
                live.discard(o.request_id) if o.finished else None
            steps += 1
        if i % 7 == 0 and live:
            victim = r.choice(sorted(live))
            assert engine.abort(victim).finish_reason == "abort"
            live.discard(victim)
            ended += 1
    while engine.has_unfinished() and steps < 2000:
        for o in engine.step():
            ended += o.finished
        steps += 1
    assert not engine.has_unfinished() and ended == 60
    assert (bm.num_free_blocks, bm.num_free_slots, bm.num_free_snapshot_slots) == start


def test_overlap_launches_the_next_step_before_reading_this_one(conv, alone):
    """With async scheduling, step N+1's forward is queued before step N's ids are read (the
    host part hides behind the GPU), its decode tokens are placeholders filled from step N's
    ids, the tokens are those of the plain engine, and every block comes back."""
    from backfit.runtime import sampling
    ps, want = alone
    e = make(conv, async_scheduling=True, enable_prefix_caching=False)
    events, fwd, wait = [], e.ranks.forward, sampling.PendingSample.wait

    def forward(step, prev=None):
        holes = sum(t < 0 for s in step.seqs for t in s.tokens)
        events.append(("forward", holes, prev is not None))
        return fwd(step, prev)

    def waited(self):
        events.append(("wait",))
        return wait(self)
    e.ranks.forward = forward
    sampling.PendingSample.wait = waited
    try:
        start = _counters(e)
        got = e.generate(ps[:3], GREEDY)
        assert [g["token_ids"] for g in got] == want[:3]
        assert _counters(e) == start and e._pending is None
    finally:
        sampling.PendingSample.wait = wait
        e.close()
    kinds = [ev[0] for ev in events]
    # after the first: every forward comes before the read of the step before it
    assert kinds[:2] == ["forward", "forward"] and kinds.count("wait") >= 12
    assert all(a != ("wait",) or b[0] == "forward" for a, b in zip(events, events[1:-1]))
    decode = [ev for ev in events if ev[0] == "forward" and ev[1]]
    assert len(decode) >= 10 and all(ev[2] for ev in decode)   # filled from the device


def test_penalties_read_every_token_first_under_overlap(plain, overlapped):
    """Requests with repetition / frequency / presence penalties need the token history on the
    host: the overlapped engine reads each step before the next (the plain engine's tokens),
    and a penalty-free request beside them gets its tokens too."""
    ps = prompts(3, seed=11)
    sps = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, presence_penalty=1.5),
           SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                          frequency_penalty=0.7), GREEDY]
    want = [g["token_ids"] for g in plain.generate(ps, sps)]
    assert [g["token_ids"] for g in overlapped.generate(ps, sps)] == want


def test_placeholders_without_the_last_ids_are_an_error(plain):
    from backfit.runtime.runner import StepInput, StepSeq
    with pytest.raises(ValueError, match="no previous sampled ids"):
        plain.ranks.runner.forward(StepInput((StepSeq(0, 0, (0,), 3, (-1,), True),)))


def test_async_scheduling_defaults(conv):
    assert not EngineConfig(model=str(conv)).overlap           # auto: off on CPU
    assert EngineConfig(model=str(conv), device="cuda:0", kernels="torch", tp=4).overlap


def test_tp2_engine_gives_the_tp1_tokens(tiny_converted, tmp_path):
    """`backfit generate --tp 2` (two real rank processes, gloo) = the tp 1 engine's tokens,
    also with async scheduling (rank 1 takes the placeholders' ids from rank 0 in the step)."""
    import subprocess
    import sys
    ps = ["Hello world", "The quick brown fox", "1 2 3 4 5"]
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(ps) + "\n")
    args = ["--prompts-file", str(f), "--max-tokens", "8", "--dtype", "float32",
            "--ignore-eos", "--max-model-len", "256"]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    outs = []
    for tp, more in ((1, []), (2, []), (2, ["--async-scheduling"])):
        r = subprocess.run([sys.executable, "-m", "backfit.cli", "generate",
                            str(tiny_converted(tp)), *args, *more], capture_output=True,
                           text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout)
    assert outs[0] == outs[1] == outs[2]
    assert outs[0].count("\n") == 3 and "[2] " in outs[0]
