"""Prefix caching at any block boundary (docs/ENGINE.md §3), through the engine on the tiny model
(CPU): each cache path against the same prompt run cold (prefix caching off), for each KV storage.

Blocks of 8 tokens, a periodic snapshot every 2 blocks (16 tokens), a token budget of 32. A
system prompt of 44 tokens with its `cache_boundaries` hint at 44 gets a snapshot at 40.

What is compared: every sampled row's logits (the prompt's last position first: the one a hit
changes) while the greedy tokens agree, and with FP32 storage every token. Rows are compared by
rel = max |Δlogit| / max |logit| over the request. A hit runs other chunk shapes than the cold
run, and a CPU's BLAS may round a row differently by the rows beside it (docs/TESTING.md, "No
test depends on how a CPU's BLAS rounds"), so the bound is set over a measured floor: the same
prompts cold at token budgets 32 vs 12, 20 and 64 (AMD EPYC, 2026-12-06): FP32 2.1e-7, int8
storage (FP32 activations) 6.7e-4, bf16 (bf16 activations) 1.7e-3; hits measured 2.3e-7, 1.4e-3,
1.3e-3; bounds 1e-5, 5e-3, 2e-2. Planted faults and the rel they gave: docs/TESTING.md.
"""

import random

import pytest
import torch

from backfit.engine.engine import EngineConfig, LLMEngine
from backfit.engine.sampling_params import SamplingParams

B, EVERY, SYS = 8, 2, 44
# storage -> (engine kwargs, bound on rel)
STORAGE = {"fp32": (dict(dtype="float32"), 1e-5),
           "bf16": (dict(dtype="bfloat16"), 2e-2),
           "int8": (dict(dtype="float32", kv_cache_dtype="int8"), 5e-3)}


@pytest.fixture(scope="module")
def conv(tiny_converted):
    return tiny_converted(1, "int8")


@pytest.fixture(scope="module", params=list(STORAGE))
def storage(request):
    return request.param


def make(conv, storage, **kw) -> LLMEngine:
    base = dict(model=str(conv), block_size=B, max_num_seqs=4, max_num_batched_tokens=32,
                max_model_len=256, num_blocks=120, prefix_snapshot_interval=EVERY,
                async_scheduling=False, **STORAGE[storage][0])
    base.update(kw)
    return LLMEngine(EngineConfig(**base))


def toks(n, seed):
    r = random.Random(seed)
    return [r.randrange(3, 500) for _ in range(n)]


def greedy(n=6, hint=()):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, cache_boundaries=hint)


class Recorder:
    """An engine whose sampled rows' logits are kept per request (FP32 copies)."""

    def __init__(self, engine):
        self.engine, self.rows = engine, {}
        fwd = engine.ranks.forward

        def forward(step, prev=None):
            out = fwd(step, prev)
            for r, s in enumerate([s for s in step.seqs if s.sample]):
                self.rows.setdefault(s.seq_id, []).append(out.logits[r].float().clone())
            return out
        engine.ranks.forward = forward

    def run(self, prompt, params):
        """One request to completion -> (tokens, cached tokens, logits rows [n, V])."""
        rid = self.engine.add_request(prompt, params)
        out, usage = [], None
        while self.engine.has_unfinished():
            for o in self.engine.step():
                out += o.token_ids
                usage = o.usage if o.finished else usage
        return out, usage.cached_tokens, torch.stack(self.rows.pop(rid))


@pytest.fixture(scope="module")
def cold(conv, storage):
    """cold(prompt, n) -> (tokens, logits rows): the prompt alone, prefix caching off."""
    rec, memo = Recorder(make(conv, storage, enable_prefix_caching=False)), {}

    def get(prompt, n=6):
        key = (tuple(prompt), n)
        if key not in memo:
            t, cached, rows = rec.run(prompt, greedy(n))
            assert cached == 0
            memo[key] = t, rows
        return memo[key]
    yield get
    rec.engine.close()


def same(got, want, storage):
    """got, want: (tokens, rows). Rows equal within the storage's bound while the tokens agree
    (all of them with FP32 storage); -> rel."""
    (gt, gr), (wt, wr) = got, want
    if storage == "fp32":
        assert gt == wt
    n = next((i + 1 for i, (a, b) in enumerate(zip(gt, wt)) if a != b), len(wt))
    rel = float((gr[:n] - wr[:n]).abs().max() / wr[:n].abs().max())
    assert rel < STORAGE[storage][1], f"rel {rel:.2e}"
    return rel


def test_agent_sessions_hit_at_the_hint_the_next_turn_and_an_edit(conv, storage, cold):
    """One engine, requests in turn (each cached count by hand; see the module notes):
    A   system + user A (59 tokens), hint at 44: cold; snapshots at 16, 32, 40 (the hint), 48,
        56 (its last full block) and, decoding past 64, at 64
    B   system + user B: restores 40 (the hint), nothing recomputed
    C   A's prompt + A's reply + a new user turn: restores A's decode snapshot at 64
    D   A with position 35 edited (history edited mid-prompt): blocks 0-3 match, 32 restored
    E   A with position 25 edited: blocks 0-2 match (24), 16 restored, 16..24 recomputed
    F2  another system prompt of 44 tokens, no hint, after F1 with it: 32 restored (a
        periodic snapshot), 32..40 recomputed and not counted as cached."""
    system, user_a = toks(SYS, 1), toks(15, 2)
    a = system + user_a
    rec = Recorder(make(conv, storage, num_snapshot_slots=24))     # no snapshot evicted
    try:
        got = rec.run(a, greedy(6, (SYS,)))
        assert got[1] == 0
        same((got[0], got[2]), cold(a), storage)
        c = a + got[0] + toks(5, 3)
        other = toks(SYS, 4)
        for prompt, hint, cached in ((system + toks(12, 5), (SYS,), 40),
                                     (c, (SYS,), 64),
                                     (a[:35] + [7] + a[36:], (SYS,), 32),
                                     (a[:25] + [7] + a[26:], (SYS,), 16),
                                     (other + toks(10, 6), (), 0),
                                     (other + toks(10, 7), (), 32)):
            t, n, rows = rec.run(prompt, greedy(4, hint))
            assert n == cached, (len(prompt), n, cached)
            same((t, rows), cold(prompt, 4), storage)
        assert rec.engine.stats()["prefix_cache_hits"] == 40 + 64 + 32 + 16 + 32
    finally:
        rec.engine.close()


def test_eviction_under_memory_pressure_falls_back_to_what_is_left(conv, storage, cold):
    """Blocks: a 22-block pool. A (59 + 6 tokens) leaves blocks 0-7 cached with snapshots at
    16 .. 64; X (138 + 6 tokens, 18 blocks) takes the 14 free ones, then A's deepest cached
    blocks 7, 6, 5, 4 (LRU), whose snapshots 64, 56, 48, 40 go with them; B (A's system,
    another user) matches blocks 0-3 and restores 32.
    Snapshots: a pool of two. G1 (35 + 3) saves 16 and 32; G15 (G1's first 20 + 3, one token)
    restores 16, which makes 32 the least recently used; H (20 unrelated tokens) saves 16 and
    evicts G1's 32; G2 (G1's 35 + 3 others) matches 4 blocks and falls back to 16."""
    system = toks(SYS, 11)
    a, x, b = system + toks(15, 12), toks(138, 13), system + toks(12, 14)
    rec = Recorder(make(conv, storage, num_blocks=22, max_model_len=176, num_snapshot_slots=32))
    try:
        for prompt, cached in ((a, 0), (x, 0), (b, 32)):
            t, n, rows = rec.run(prompt, greedy(6, (SYS,)))
            assert n == cached, (len(prompt), n, cached)
            same((t, rows), cold(prompt), storage)
    finally:
        rec.engine.close()
    g = toks(35, 15)
    rec = Recorder(make(conv, storage, num_snapshot_slots=2))
    try:
        for prompt, n_out, cached in ((g + toks(3, 16), 2, 0), (g[:20] + toks(3, 17), 1, 16),
                                      (toks(20, 18), 1, 0), (g + toks(3, 19), 2, 16)):
            t, n, rows = rec.run(prompt, greedy(n_out))
            assert n == cached, (len(prompt), n, cached)
            same((t, rows), cold(prompt, n_out), storage)
    finally:
        rec.engine.close()


def test_preemption_resumes_from_its_own_snapshots(conv, storage, cold):
    """Four requests sharing a system prompt in a pool too small for all of them: preempted
    ones come back through the prefix cache (their own prompt's snapshots); every request's
    logits are its cold run's."""
    system = toks(SYS, 21)
    prompts = [system + toks(6 + 5 * i, 22 + i) for i in range(4)]
    e = make(conv, storage, num_blocks=14, max_model_len=112)
    rec = Recorder(e)
    try:
        ids = [e.add_request(p, greedy(10, (SYS,))) for p in prompts]
        out = {i: [] for i in ids}
        while e.has_unfinished():
            for o in e.step():
                out[o.request_id] += o.token_ids
        st = e.stats()
        assert st["num_preemptions"] > 0 and st["prefix_cache_hits"] > 0
        for i, p in zip(ids, prompts):
            same((out[i], torch.stack(rec.rows[i])), cold(p, 10), storage)
    finally:
        e.close()
