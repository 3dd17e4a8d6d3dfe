"""Batched sampler: greedy, raw logprobs, penalties/bias/min_tokens against hand computations,
truncation never samples an excluded id, and seeded rows independent of the batch around them."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from backfit.engine.sampling_params import SamplingParams
from backfit.runtime.sampling import (SamplingBatch, prompt_logprobs, process_logits, row_seed,
                                      sample)

V = 64
EOS = 1


def _batch(params, outs=None, prompts=None, vocab=V, gen_seed=None, eos=EOS):
    outs = outs if outs is not None else [[] for _ in params]
    prompts = prompts if prompts is not None else [[] for _ in params]
    gen = None
    if gen_seed is not None:
        gen = torch.Generator().manual_seed(gen_seed)
    return SamplingBatch.build(params, outs, prompts, vocab, "cpu", eos_token_id=eos, generator=gen)


def _logits(b, seed=0, vocab=V):
    return torch.randn(b, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_logprobs_are_raw_log_softmax():
    x = _logits(5)
    params = [SamplingParams(temperature=0.0, logprobs=n) for n in (None, 0, 1, 5, 20)]
    out = sample(x, _batch(params))
    assert torch.equal(out.token_ids, x.argmax(-1))
    ref = torch.log_softmax(x, -1)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None])[:, 0])
    host = out.to_host()
    assert host.token_ids == x.argmax(-1).tolist()
    assert host.top[0] is None and host.top[1] == []
    for b, n in enumerate((None, 0, 1, 5, 20)):
        if n:
            ids = [i for i, _ in host.top[b]]
            assert ids == ref[b].topk(n).indices.tolist()
            assert [lp for _, lp in host.top[b]] == pytest.approx(ref[b, ids].tolist(), abs=1e-5)


def test_logprobs_ignore_penalties_temperature_and_bias():
    x = _logits(2, seed=1)
    p = SamplingParams(temperature=0.3, top_k=3, presence_penalty=1.5, logit_bias={7: 100},
                       repetition_penalty=1.7, logprobs=4, seed=3)
    out = sample(x, _batch([p, p], outs=[[7, 8], [9]], prompts=[[1, 2], [3]]))
    assert out.token_ids.tolist() == [7, 7]           # +100 bias wins whatever else happens
    ref = torch.log_softmax(x, -1)
    torch.testing.assert_close(out.logprobs, ref[:, 7])
    torch.testing.assert_close(out.top_logprobs, ref.topk(4).values)


def test_penalties_match_hand_computation():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0, 0.0, -0.5]])
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                       logit_bias={6: 1.5, 0: -3.0})
    prompt, out = [4, 5], [0, 0, 1, 3, 0]       # output counts: 0 x3, 1 x1, 3 x1
    got = process_logits(x, _batch([p], outs=[out], prompts=[prompt], vocab=8))[0].tolist()
    want = x[0].tolist()
    for t in set(prompt) | set(out):            # repetition: prompt + output, sign-dependent
        want[t] = want[t] / 2.0 if want[t] > 0 else want[t] * 2.0
    for t in set(out):                          # frequency x count + presence, output only
        want[t] -= 0.25 * out.count(t) + 0.5
    want[6] += 1.5
    want[0] -= 3.0
    assert got == pytest.approx(want, abs=1e-6)
    assert got[4] == pytest.approx(-4.0) and got[5] == pytest.approx(0.5)   # prompt-only ids
    assert got[2] == 0.5                                                     # untouched id


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    x = torch.zeros(4, V)
    x[:, EOS] = 10.0
    x[:, 5] = 9.0
    x[:, 9] = 8.0

    def mk(**kw):
        return SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5], **kw)

    params = [mk(), mk(), mk(ignore_eos=True), SamplingParams(temperature=0)]
    outs = [[4, 4], [4, 4, 4], [4], []]
    out = sample(x, _batch(params, outs=outs))
    # row 0: 2 < 3 tokens, eos and 5 banned -> 9; row 1: reached -> eos; row 2: eos not a stop
    # token under ignore_eos, only 5 banned; row 3: no min_tokens
    assert out.token_ids.tolist() == [9, EOS, EOS, EOS]


def test_seeded_rows_do_not_depend_on_batch_or_row():
    """The same seeded request gives the same tokens alone, among others, and at another row."""
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    others = [SamplingParams(temperature=0.7), SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, top_k=5, seed=9)]

    def run(layout, steps=25):
        outs = [[] for _ in layout]
        for t in range(steps):
            x = torch.stack([_logits(1, seed=1000 * t + (7 if q is p else 11 + j))[0]
                             for j, q in enumerate(layout)])
            ids = sample(x, _batch(layout, outs=outs, gen_seed=t)).token_ids.tolist()
            for o, i in zip(outs, ids):
                o.append(i)
        return outs[layout.index(p)]

    alone = run([p])
    assert run(others + [p]) == alone
    assert run([others[0], p, others[2]]) == alone
    assert len(set(alone)) > 5                  # it really samples
    q = SamplingParams(temperature=1.0, top_p=0.9, seed=4321)
    outs = [[]]
    for t in range(25):
        x = _logits(1, seed=1000 * t + 7)
        outs[0].append(sample(x, _batch([q], outs=outs)).token_ids.item())
    assert outs[0] != alone                     # another seed, another sequence
    assert row_seed(1234, 0) != row_seed(1234, 1) != row_seed(1235, 1)


def _allowed(logits: torch.Tensor, temp, k, p, min_p) -> set[int]:
    """Reference truncation on one row, in plain Python."""
    z = [v / temp for v in logits.tolist()]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    keep = order[:k] if k else order
    m = max(z[i] for i in keep)
    e = {i: math.exp(z[i] - m) for i in keep}
    tot, acc, nucleus = sum(e.values()), 0.0, []
    for i in keep:                              # descending; keep until mass >= p
        nucleus.append(i)
        acc += e[i] / tot
        if acc >= p - 1e-6:
            break
    top = max(e[i] for i in nucleus)
    return {i for i in nucleus if e[i] >= min_p * top}


@pytest.mark.parametrize("temp,k,p,min_p", [(1.0, 5, 1.0, 0.0), (0.8, 0, 0.6, 0.0),
                                            (1.3, 0, 1.0, 0.2), (1.0, 12, 0.8, 0.1)])
def test_truncation_never_samples_an_excluded_id(temp, k, p, min_p):
    x = _logits(1, seed=5)[0] * 0.5             # flat-ish: many ids carry mass
    n = 4000                                    # draws = rows of one batch (shared generator)
    params = [SamplingParams(temperature=temp, top_k=k, top_p=p, min_p=min_p)] * n
    ids = sample(x.expand(n, V).clone(), _batch(params, gen_seed=0)).token_ids
    allowed = _allowed(x, temp, k, p, min_p)
    drawn = set(ids.tolist())
    assert drawn <= allowed, sorted(drawn - allowed)
    assert 2 <= len(allowed) < V
    # frequencies follow the renormalised distribution over the allowed ids
    z = torch.full((V,), float("-inf"))
    idx = torch.tensor(sorted(allowed))
    z[idx] = x[idx] / temp
    freq = torch.bincount(ids, minlength=V).float() / n
    assert (freq - z.softmax(-1)).abs().max() < 0.03


def test_seeded_draws_follow_the_distribution():
    """Rows seeded 0..n-1 (one generator each) sample softmax(x / T), like the shared one."""
    x = _logits(1, seed=9)[0] * 0.4
    n = 3000
    params = [SamplingParams(temperature=0.8, seed=s) for s in range(n)]
    ids = sample(x.expand(n, V).clone(), _batch(params)).token_ids
    freq = torch.bincount(ids, minlength=V).float() / n
    assert (freq - (x / 0.8).softmax(-1)).abs().max() < 0.03


def test_mixed_batch_rows_keep_their_own_settings():
    x = _logits(3, seed=6)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1, seed=1),
              SamplingParams(temperature=0.5, top_k=2, top_p=0.5, seed=2)]
    out = sample(x, _batch(params)).token_ids
    assert out[0] == x[0].argmax() and out[1] == x[1].argmax()    # top-1 sampling = argmax
    assert out[2] in x[2].topk(2).indices
    # top-k alone (no full sort): a row with top-k off beside a top-1 row still samples freely
    flat = torch.zeros(201, V)
    flat[:, 0] = 1.0
    rows = [SamplingParams(top_k=1)] + [SamplingParams()] * 200
    ids = sample(flat, _batch(rows, gen_seed=0)).token_ids
    assert ids[0] == 0 and len(set(ids[1:].tolist())) > 20


def test_duck_typed_params_and_errors():
    ns = SimpleNamespace(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=None,
                         presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                         logit_bias=((3, 50.0),), stop_token_ids=(), ignore_eos=False,
                         min_tokens=0, logprobs=None)
    assert sample(_logits(1), _batch([ns])).token_ids.item() == 3
    with pytest.raises(ValueError, match="out of range for vocab 64"):
        _batch([SamplingParams(logit_bias={64: 1.0})])
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingBatch.build([ns], [], [[]], V, "cpu")
    with pytest.raises(ValueError, match=r"logits must be \[B, 64\]"):
        sample(torch.zeros(1, 65), _batch([ns]))


def test_prompt_logprobs_match_log_softmax():
    x = _logits(7, seed=8)
    nxt = torch.tensor([3, 1, 4, 1, 5, 9, 2])
    out = prompt_logprobs(x, nxt, 3, chunk=3)              # 3 chunks, the last partial
    ref = torch.log_softmax(x, -1)
    torch.testing.assert_close(out.logprobs, ref.gather(1, nxt[:, None])[:, 0])
    assert torch.equal(out.top_ids, ref.topk(3).indices)
    assert out.to_host().top[6][0][0] == int(ref[6].argmax())
    with pytest.raises(ValueError, match="next_ids"):
        prompt_logprobs(x, nxt[:3], 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_the_rules_at_full_vocab():
    """On the device at V = 129,280: greedy = argmax, raw logprobs, one-sync host copy, seeded
    rows equal alone and in a mixed batch, truncated rows inside their allowed set."""
    Vf, dev = 129280, "cuda"
    x = torch.randn(8, Vf, device=dev, generator=torch.Generator(dev).manual_seed(0)) * 4
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=77, logprobs=5)
    params = [SamplingParams(temperature=0), seeded, SamplingParams(top_k=50),
              SamplingParams(min_p=0.3, presence_penalty=1.0), SamplingParams(top_p=0.5)] * 2
    params = params[:8]
    x[6] = x[1]                                         # the seeded request again, at row 6
    outs = [[3, 4, 5] for _ in params]
    sb = SamplingBatch.build(params, outs, [[1, 2]] * 8, Vf, dev, eos_token_id=EOS)
    out = sample(x, sb)
    host = out.to_host()
    assert host.token_ids[0] == int(x[0].argmax())
    ref = torch.log_softmax(x, -1)
    assert host.logprobs == pytest.approx(
        ref.gather(1, out.token_ids[:, None])[:, 0].tolist(), abs=1e-4)
    assert [i for i, _ in host.top[1]] == ref[1].topk(5).indices.tolist()
    assert host.token_ids[2] in set(x[2].topk(50).indices.tolist())
    alone = sample(x[1:2], SamplingBatch.build([seeded], [outs[1]], [[1, 2]], Vf, dev))
    assert alone.to_host().token_ids[0] == host.token_ids[1] == host.token_ids[6]
