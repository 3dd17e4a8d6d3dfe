"""Speculative decoding through the engine (CPU, float32, the tiny Flash and 0731 checkpoints):
greedy output with speculation equals greedy output without, token for token, under every
engine feature a decode step meets; the drafts the engine verifies are the reference's drafts for
each request's own history; bad configs are one-line errors.

The tiny models' own drafters accept little (random weights), so the engine's accept / rollback
paths are also driven by an oracle drafter: the plain run's greedy continuation with every 4th
draft wrong (tests only; the real drafters are held to the reference in
tests/runtime/test_drafter_blocks.py and here)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from backfit.engine.engine import EngineConfig, LLMEngine
from backfit.engine.sampling_params import SamplingParams
from backfit.runtime.model.draft import Draft

GREEDY = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
METHODS = {"mtp": ("flash", 3), "dspark": ("0731", 5)}


def make(conv, spec=None, k=None, **kw) -> LLMEngine:
    base = dict(model=str(conv), dtype="float32", block_size=16, max_num_seqs=8,
                max_num_batched_tokens=64, max_model_len=512, num_blocks=200,
                async_scheduling=False)
    if spec is not None:                        # up to 8 decoding: every test batch drafts
        base.update(speculative_method=spec, num_speculative_tokens=k,
                    speculative_disable_by_batch_size=8)
    base.update(kw)
    return LLMEngine(EngineConfig(**base))


def prompts(n, seed=0, lo=5, hi=70, shared=0):
    r = random.Random(seed)
    head = [r.randrange(3, 500) for _ in range(shared)]
    return [head + [r.randrange(3, 500) for _ in range(r.randrange(lo, hi))] for _ in range(n)]


def run(engine, ps, params=GREEDY, arrive_every=0):
    """Generate; arrive_every > 0: request i joins after i * arrive_every steps (continuous
    batching: rows shift as requests join and leave)."""
    if not arrive_every:
        return [o["token_ids"] for o in engine.generate(ps, params)]
    plist = params if isinstance(params, list) else [params] * len(ps)
    ids, out, step = [], {}, 0
    while len(ids) < len(ps) or engine.has_unfinished():
        if len(ids) < len(ps) and step % arrive_every == 0:
            ids.append(engine.add_request(ps[len(ids)], plist[len(ids)]))
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
        step += 1
    return [out.get(i, []) for i in ids]


@pytest.fixture(scope="module", params=list(METHODS))
def method(request):
    return request.param


@pytest.fixture(scope="module")
def conv(method, tiny_converted):
    return tiny_converted(1, "int8", METHODS[method][0])


def oracle(engine, want: dict[int, list[int]], wrong_every: int = 4):
    """Replace the runner's drafts by the plain run's continuation (want[seq_id] = prompt +
    greedy output), every `wrong_every`-th position off by one id."""
    d = engine.ranks.runner.drafting
    V = engine.model_cfg.vocab_size

    def draft(seqs, seed):
        ids = []
        for s in seqs:
            full = want[s.seq_id]
            row = [full[s.start + j] if s.start + j < len(full) else 3 for j in range(1, d.k + 1)]
            ids.append([(t + 1) % V if (s.start + j) % wrong_every == 0 else t
                        for j, t in enumerate(row, 1)])
        ids = torch.tensor(ids)
        return Draft(ids, None, torch.zeros(*ids.shape, V), None)
    d.draft = draft


def test_greedy_equals_plain_with_arrivals_chunks_and_prefix_hits(method, conv):
    ps = prompts(6, seed=1, shared=40)                  # shared 40-token head: prefix hits
    plain = make(conv)
    want = run(plain, ps)
    plain.close()
    e = make(conv, method, METHODS[method][1], max_num_batched_tokens=32)   # chunked prompts
    got = run(e, ps, arrive_every=3)
    st = e.stats()
    e.close()
    assert got == want
    assert st["spec_decode_num_drafts"] > 20 and st["prefix_cache_hits"] > 0
    assert st["spec_decode_num_draft_tokens"] >= st["spec_decode_num_drafts"]


def test_oracle_drafts_accept_roll_back_and_stay_lossless(method, conv):
    """Long accepted runs, rejections every 3rd position (the rings' rejected rows rewritten,
    across CSA / HCA entry ends), a stop token, a stop string and limits inside a run (usage
    counts only what was delivered); every emitted token's raw
    logprob within 1e-4 of the plain run's (a wrong row in a compressor ring moves them by far
    more, while the argmax often survives)."""
    ps = prompts(5, seed=2)
    lp = dict(temperature=0, ignore_eos=True, logprobs=2)
    plain = make(conv)
    base = [o["token_ids"] for o in plain.generate(ps, SamplingParams(max_tokens=26, **lp))]
    # stop strings: the text of 3 output tokens seen there first, in a row (some end inside an
    # accepted run, which is cut after the token that completes the stop), on the output with
    # the most distinct tokens (the tiny model often repeats one)
    r = max(range(len(base)), key=lambda i: len(set(base[i])))
    once = [i for i in range(4, 26) if base[r][i] not in base[r][:i]][:3]
    assert len(once) == 3
    stops = [plain.tokenizer.decode([base[r][i]]) for i in once]
    ps, base = ps + [ps[r]] * 3, base + [base[r]] * 3
    params = [SamplingParams(max_tokens=26, stop_token_ids=[base[0][6]], **lp),  # stop in a run
              SamplingParams(max_tokens=5, **lp), SamplingParams(max_tokens=9, **lp),
              SamplingParams(max_tokens=26, **lp),
              SamplingParams(max_tokens=11, min_tokens=3, **lp),
              *(SamplingParams(max_tokens=26, stop=[t], **lp) for t in stops)]
    want = plain.generate(ps, params)
    plain.close()
    e = make(conv, method, METHODS[method][1])
    oracle(e, {i: p + w for i, (p, w) in enumerate(zip(ps, base))}, wrong_every=3)
    got = e.generate(ps, params)
    st = e.stats()
    e.close()
    assert [g["token_ids"] for g in got] == [w["token_ids"] for w in want]
    assert [g["finish_reason"] for g in got] == [w["finish_reason"] for w in want]
    assert [g["usage"].completion_tokens for g in got] == [len(w["token_ids"]) for w in want]
    for g, w in zip(got, want):
        assert len(g["logprobs"]) == len(w["logprobs"])
        for a, b in zip(g["logprobs"], w["logprobs"]):
            assert abs(a[0] - b[0]) < 1e-4, (a[0], b[0])
            assert [t for t, _ in a[1]] == [t for t, _ in b[1]]
    assert st["spec_decode_num_accepted_tokens"] > 0.3 * st["spec_decode_num_draft_tokens"]
    assert st["spec_decode_num_accepted_tokens_per_pos"][1] > 0     # runs past one draft


def _outputs(e, ps, params) -> dict[int, list]:
    """Every RequestOutput of each request as the engine streamed it: (text, ids, logprobs)."""
    ids = [e.add_request(p, params) for p in ps]
    got = {i: [] for i in ids}
    while e.has_unfinished():
        for o in e.step():
            got[o.request_id].append((o.text, o.token_ids, o.logprobs, o.finished))
    return got


def test_accepted_runs_stream_token_by_token_as_plain(method, conv):
    """A verified run reaches the caller as the plain engine's outputs: one a token, each with
    its text and logprob (the server's parser counts reasoning tokens and splits logprobs at
    `</think>` by output; a run in one output counted answer tokens as reasoning and dropped
    their logprobs)."""
    ps = prompts(3, seed=6)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    plain = make(conv)
    base = [o["token_ids"] for o in plain.generate(ps, sp)]
    want = _outputs(plain, ps, sp)
    plain.close()
    e = make(conv, method, METHODS[method][1])
    oracle(e, {i: p + w for i, (p, w) in enumerate(zip(ps, base))}, wrong_every=4)
    got = _outputs(e, ps, sp)
    accepted = e.stats()["spec_decode_num_accepted_tokens"]
    e.close()
    assert accepted > 5
    for (_, a), (_, b) in zip(sorted(got.items()), sorted(want.items())):
        assert [(t, i, f) for t, i, _, f in a] == [(t, i, f) for t, i, _, f in b]
        for x, y in zip(a, b):
            assert abs(x[2][0][0] - y[2][0][0]) < 1e-4


def test_preemption_and_int8_kv_stay_lossless(method, conv):
    ps = prompts(6, seed=3, lo=30, hi=60)
    plain = make(conv, kv_cache_dtype="int8")
    base = run(plain, ps)
    plain.close()
    e = make(conv, method, METHODS[method][1], kv_cache_dtype="int8", num_blocks=14,
             max_model_len=200)
    oracle(e, {i: p + w for i, (p, w) in enumerate(zip(ps, base))}, wrong_every=3)
    got = run(e, ps)
    st = e.stats()
    e.close()
    assert st["num_preemptions"] > 0 and got == base


def test_speculation_turns_off_above_the_batch_size(conv, method):
    ps = prompts(4, seed=4)
    e = make(conv, method, 2, speculative_disable_by_batch_size=2)
    got = run(e, ps)
    st = e.stats()
    e.close()
    plain = make(conv)
    assert got == run(plain, ps)
    plain.close()
    assert 0 < st["spec_decode_num_drafts"]       # only once two or fewer were decoding


def test_bad_speculative_configs_are_one_line_errors(tiny_converted):
    flash, v0731 = tiny_converted(1, "int8"), tiny_converted(1, "int8", "0731")
    for conv, spec, k, msg in ((flash, "dspark", 3, "needs a DeepSeek-V4-Flash-0731"),
                               (v0731, "mtp", 2, "needs a DeepSeek-V4-Flash checkpoint"),
                               (flash, "mtp", 8, "verifies 1..7"),
                               (v0731, "dspark", 6, "verifies 1..5"),
                               (flash, "eagle", 2, "choose one of mtp, dspark")):
        with pytest.raises(ValueError, match=msg):
            make(conv, spec, k)


# ---- bug classes of spec-decoding.md §3 -------------------------------------------------------

def spy_drafts(e) -> list:
    """Every draft the engine's runner makes: (seq_id, start, x, draft ids, draft logits)."""
    seen, real = [], e.ranks.runner.drafting.draft

    def spy(seqs, seed):
        d = real(seqs, seed)
        seen.extend((s.seq_id, s.start, s.tokens[0], d.ids[i].tolist(), d.logits[i].clone())
                    for i, s in enumerate(seqs))
        return d
    e.ranks.runner.drafting.draft = spy
    return seen


def check_drafts(ckpt, method, seen, full, k) -> set:
    """Each draft's logits = the reference's drafts of that request's own history (prompt +
    output, teacher-forced on the drafts used), FP32 < 1e-4; -> the requests checked."""
    from backfit.verify.reference import Reference
    ref, checked = Reference(ckpt), set()
    for sid, start, x, drafts, logits in seen:
        pre = ref.prefix(torch.tensor(full[sid][:start]))
        want = (ref.mtp_draft(pre, x, k, tokens=drafts) if method == "mtp"
                else ref.dspark_draft(pre, x, tokens=drafts))
        rel = (logits - want.logits[:k]).abs().max() / want.logits[:k].abs().max()
        assert rel < 1e-4, (sid, start, float(rel))
        checked.add(sid)
    return checked


def test_drafts_follow_each_request_not_its_row(tiny_converted, tiny_flash, tiny_0731, method):
    """The drafts the engine verifies are the reference's drafts for that request's own history
    (teacher-forced on the drafts actually used), through a batch whose rows shift: requests
    finish at different steps and a new one joins (the bug: drafter state keyed by batch row)."""
    variant, k = METHODS[method]
    conv = tiny_converted(1, "bf16", variant)            # lossless weights: FP32 agreement
    ps = prompts(3, seed=5, lo=20, hi=40)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 9, 6)]
    e = make(conv, method, k)
    seen = spy_drafts(e)
    ids = run(e, ps, params, arrive_every=2)
    e.close()
    full = {i: p + o for i, (p, o) in enumerate(zip(ps, ids))}
    checked = check_drafts(tiny_flash if variant == "flash" else tiny_0731, method, seen, full, k)
    assert checked == {0, 1, 2} and len(seen) > 6


def test_drafts_after_a_prefix_hit_are_the_requests_own(tiny_converted, tiny_flash, tiny_0731,
                                                        method):
    """A second request that shares the first one's 32 tokens and differs from token 32 on
    joins while the first decodes (another slot) and restores the snapshot at 32 (the hint):
    its drafter rings come from the snapshot, and its MTP ring row 31 is made by its own first
    row (X_31 restored with the snapshot, its own token 32), not the first request's (else its
    first drafts, whose window holds row 31, are not the reference's)."""
    variant, k = METHODS[method]
    conv = tiny_converted(1, "bf16", variant)
    head = prompts(1, seed=7, lo=32, hi=33)[0]
    ps = [head + [5, 6, 7, 8, 9, 10], head + [11, 12, 13, 14, 15, 16, 17, 18]]
    sp = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, cache_boundaries=(32,))
          for n in (14, 6)]
    e = make(conv, method, k)
    seen = spy_drafts(e)
    ids = run(e, ps, sp, arrive_every=3)
    st = e.stats()
    e.close()
    assert st["prefix_cache_hits"] == 32
    full = {i: p + o for i, (p, o) in enumerate(zip(ps, ids))}
    second = [d for d in seen if d[0] == 1]
    assert check_drafts(tiny_flash if variant == "flash" else tiny_0731, method, second, full,
                        k) == {1}


def test_verify_rows_equal_single_token_decode(conv, method):
    """A verify step's rows [x, d_1, d_2, d_3] give the logits that decoding x, d_1, d_2, d_3
    one token at a time gives (FP32 torch path: to float rounding; the bug: a verify path that
    computes the accepted rows differently from the single-token path)."""
    from backfit.runtime.distributed import set_tp_info, tp_is_set
    from backfit.runtime.runner import ModelRunner, RunnerConfig, StepInput, StepSeq
    if not tp_is_set():                                  # this process as rank 0 of 1
        set_tp_info(0, 1)
    rc = RunnerConfig(str(conv), dtype="float32", max_num_seqs=2, max_model_len=128,
                      block_size=16, num_blocks=16)
    spec = ModelRunner(RunnerConfig(**{**rc.__dict__, "speculative_method": method,
                                       "num_speculative_tokens": 3}))
    plain = ModelRunner(rc)
    p = prompts(1, seed=6, lo=37, hi=38)[0]
    table = tuple(range(8))
    for r in (spec, plain):
        r.forward(StepInput((StepSeq(0, 0, table, 0, tuple(p), True),)))
    x = 17
    out = spec.forward(StepInput((StepSeq(0, 0, table, len(p), (x,), True, draft=3),)))
    toks = [x] + out.draft.ids[0].tolist()
    want = torch.cat([plain.forward(StepInput((StepSeq(0, 0, table, len(p) + j, (t,), True),))
                                    ).logits for j, t in enumerate(toks)])
    assert out.logits.shape == want.shape == (4, want.shape[1])
    rel = ((out.logits - want).abs().max() / want.abs().max()).item()
    assert rel < 1e-5, rel


_TP2 = """
import json, sys
from backfit.engine.engine import EngineConfig, LLMEngine
from backfit.engine.sampling_params import SamplingParams
if __name__ == "__main__":
    conv, method, ps, k = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    spec = dict(speculative_method=method, num_speculative_tokens=k) if k else {}
    e = LLMEngine(EngineConfig(conv, tp=2, dtype="float32", block_size=16, max_num_seqs=4,
                               max_model_len=256, num_blocks=64, async_scheduling=False, **spec))
    got = e.generate(ps, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    print(json.dumps({"tokens": [o["token_ids"] for o in got],
                      "drafts": e.stats().get("spec_decode_num_drafts", 0)}))
    e.close()
"""


def test_tp2_ranks_greedy_equals_plain(method, tiny_converted, tmp_path):
    """Two rank processes (gloo; a process per engine, as a tp > 1 engine owns its TP info):
    every rank drafts from the same all-gathered logits and accepts the same run, so the
    speculative engine's greedy tokens are the plain TP-2 engine's."""
    conv2 = tiny_converted(2, "int8", METHODS[method][0])
    script = tmp_path / "tp2_spec.py"
    script.write_text(_TP2)
    ps = json.dumps(prompts(3, seed=7, lo=10, hi=30))
    out = {}
    for name, k in (("plain", 0), ("spec", METHODS[method][1])):
        r = subprocess.run([sys.executable, str(script), str(conv2), method, ps, str(k)],
                           capture_output=True, text=True, timeout=600,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr[-3000:]
        out[name] = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["spec"]["tokens"] == out["plain"]["tokens"] and out["spec"]["drafts"] > 5
