"""POST /v1/completions (legacy) on the real tiny engine through the openai SDK: echo +
logprobs as lm-eval's local-completions reads them, token-id and batched prompts, streaming."""

import json
import math

import openai
import pytest
from test_openai_chat import post


@pytest.fixture(scope="module")
def srv(real):
    return real


def client(s):
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)


def test_echo_logprobs_score_a_continuation(srv):
    """The logprob of a generated token equals the prompt logprob of the same token when the
    continuation is echoed back (how lm-eval scores loglikelihood)."""
    c = client(srv)
    g = c.completions.create(model="m", prompt="The harbour town", max_tokens=3, logprobs=2,
                             temperature=0)
    ch = g.choices[0]
    lp = ch.logprobs
    assert ch.finish_reason == "length" and len(lp.tokens) == 3 == g.usage.completion_tokens
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and len(top) <= 2 and math.isclose(max(top.values()), v, abs_tol=1e-4)
    ids = srv.ctx.tokenizer.encode("The harbour town").ids       # no BOS (add_bos_token false)
    st, body, _ = post(srv, "/tokenize", {"prompt": "The harbour town"})
    assert st == 200, body
    assert json.loads(body)["tokens"] == ids
    g2 = c.completions.create(model="m", prompt=ids, max_tokens=3, logprobs=2, temperature=0,
                              extra_body={"return_tokens_as_token_ids": True})
    got = g2.choices[0].logprobs.token_logprobs  # another request may share the step, and the
    assert len(got) == len(lp.token_logprobs) and all(   # CPU BLAS rounds rows by count
        math.isclose(a, b, abs_tol=1e-4) for a, b in zip(got, lp.token_logprobs))
    gen = [int(t.split(":")[1]) for t in g2.choices[0].logprobs.tokens]
    full = ids + gen                    # echo prompt + generated ids (lm-eval's token requests)
    e = c.completions.create(model="m", prompt=full, max_tokens=0, echo=True, logprobs=1,
                             temperature=0)
    elp = e.choices[0].logprobs
    assert e.usage.completion_tokens == 0 and len(elp.token_logprobs) == len(full)
    assert elp.token_logprobs[0] is None and all(v <= 0 for v in elp.token_logprobs[1:])
    for k in range(3):
        assert math.isclose(elp.token_logprobs[len(ids) + k], lp.token_logprobs[k],
                            abs_tol=2e-3), k
    assert e.choices[0].text.startswith("The harbour town")


def test_batched_and_token_prompts(srv):
    c = client(srv)
    r = c.completions.create(model="m", prompt=["one", "two two"], max_tokens=2, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1]
    single = [c.completions.create(model="m", prompt=p, max_tokens=2, temperature=0)
              for p in ("one", "two two")]
    assert [ch.text for ch in r.choices] == [s.choices[0].text for s in single]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)
    ids = json.loads(post(srv, "/tokenize", {"prompt": "one"})[1])["tokens"]
    t = c.completions.create(model="m", prompt=ids, max_tokens=2, temperature=0)
    assert t.choices[0].text == single[0].choices[0].text


def test_stream_and_usage(srv):
    c = client(srv)
    full = c.completions.create(model="m", prompt="abc", max_tokens=5, temperature=0)
    chunks = list(c.completions.create(model="m", prompt="abc", max_tokens=5, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(k.choices[0].text for k in chunks if k.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert [k.choices[0].finish_reason for k in chunks if k.choices][-1] == "length"
    assert all(k.object == "text_completion" and k.id == chunks[0].id for k in chunks)


def test_errors(srv):
    vocab = srv.ctx.tokenizer.get_vocab_size()
    for body, param in [({"prompt": "x", "suffix": "y"}, "suffix"),
                        ({"prompt": [1, vocab + 5]}, "prompt"),
                        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "x", "n": 3}, "n"),
                        ({"prompt": {"a": 1}}, "prompt"),
                        ({"prompt": "x", "logprobs": 99}, "logprobs")]:
        st, text, _ = post(srv, "/v1/completions", {"model": "m", **body})
        assert st == 400 and json.loads(text)["error"]["param"] == param, (body, text)
    st, text, _ = post(srv, "/v1/completions", {"model": "m", "prompt": "x",
                                                "max_tokens": 10**30})
    assert st == 400 and json.loads(text)["error"]["code"] == "context_length_exceeded"
