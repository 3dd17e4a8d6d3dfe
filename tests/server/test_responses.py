"""/v1/responses: request parsing, the §2.3 event sequence (golden SSE transcripts) and the folded
reply on a fake bridge; then the official `openai` SDK against a live tiny-model server."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from pathlib import Path

import pydantic
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from backfit.server import openai_responses as R
from backfit.server import responses_render as RR
from fake_bridge import FakeBridge, post, sse
from backfit.server.bridge import CTX, KEEPALIVE, QueueFull, ServerContext
from backfit.server.http import BadRequest
from backfit.server.protocol import (
    Finish, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart, Usage,
)

openai = pytest.importorskip("openai")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402

STREAM_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)

GOLDEN = Path(__file__).parent / "golden"
TOOL = {"type": "function", "name": "shell", "description": "run a command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}
# a thinking turn: reasoning, text, one tool call (arguments in 2 fragments), usage, finish
TOOL_TURN = [ReasoningDelta("The user wants "), ReasoningDelta("a listing."), TextDelta("Sure."),
             ToolCallStart(0, "call_1", "shell"), ToolCallArgsDelta(0, '{"cmd": "l'),
             ToolCallArgsDelta(0, 's"}'), ToolCallEnd(0, '{"cmd": "ls"}'),
             Usage(40, 12, cached_tokens=16, reasoning_tokens=5), Finish("tool_calls")]
CUT = [TextDelta("Hello"), Usage(30, 4), Finish("length")]


@pytest.fixture
def fixed_ids(monkeypatch):
    """Deterministic ids and clock, so transcripts are byte-stable."""
    counter = itertools.count(1)
    monkeypatch.setattr(RR, "_hex", lambda: f"{next(counter):04d}")
    monkeypatch.setattr(RR, "_now", lambda: 1767225600)


def call(encoder, bridge, body, raw: bytes | None = None):
    """POST body to /v1/responses on an app around the fake bridge -> (status, headers, text)."""
    return post(encoder, bridge, {"/v1/responses": R.handle}, "/v1/responses", body, raw,
                {"Content-Type": "application/json"})


# ---- parsing --------------------------------------------------------------------------------

def test_input_items_become_neutral_messages():
    req, custom = R.parse_request({"model": "x", "instructions": "Be brief.", "input": [
        {"role": "developer", "content": "dev rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi "},
                                                         {"type": "input_image"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "think"}], "encrypted_content": "zz"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "ok"}]},
        {"type": "function_call", "call_id": "call_a", "name": "shell", "arguments": "{}"},
        {"type": "custom_tool_call", "call_id": "call_b", "name": "apply_patch", "input": "P"},
        {"type": "function_call_output", "call_id": "call_a", "output": "done"},
        {"type": "web_search_call"}, {"type": "compaction", "encrypted_content": "c"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
        {"type": "function_call", "call_id": "call_c", "name": "shell", "arguments": "{}"}],
        "tools": [TOOL, {"type": "custom", "name": "apply_patch"}, {"type": "web_search"}],
        "reasoning": {"effort": "high", "summary": "auto"}, "store": False,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k"})
    roles = [m.role for m in req.messages]
    assert roles == ["system", "system", "user", "assistant", "tool", "assistant"]
    assert req.messages[2].content == "hi [Unsupported input_image]"
    a = req.messages[3]
    assert (a.reasoning, a.content) == ("think", "ok")
    assert [(c.id, c.name) for c in a.tool_calls] == [("call_a", "shell"),
                                                      ("call_b", "apply_patch")]
    assert json.loads(a.tool_calls[1].arguments) == {"input": "P"}
    assert req.messages[4].tool_call_id == "call_a" and req.messages[4].content == "done"
    assert req.messages[5].reasoning == "s"          # summary used when content is missing
    assert [t.name for t in req.tools] == ["shell", "apply_patch"] and custom == {"apply_patch"}
    assert req.reasoning_effort == "high" and req.thinking is None


@pytest.mark.parametrize("body, thinking, effort", [
    ({"reasoning": {"effort": "none"}}, None, "none"),
    ({"reasoning_effort": "max"}, None, "max"),
    ({"thinking": {"type": "disabled"}}, False, None),
    ({"thinking": {"type": "enabled"}, "chat_template_kwargs": {"thinking": False}}, False, None),
    ({"chat_template_kwargs": {"enable_thinking": True, "reasoning_effort": "low"}}, True, "low"),
])
def test_thinking_and_effort_from_every_field(body, thinking, effort):
    req, _ = R.parse_request({"input": "q", **body})
    assert (req.thinking, req.reasoning_effort) == (thinking, effort)


@pytest.mark.parametrize("fields", [
    {"thinking": {"type": "enabled"}, "chat_template_kwargs": {"enable_thinking": False}},
    {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "max"}},
    {"thinking": False, "reasoning_effort": "high"},
    {"thinking": {"type": "adaptive"}},
])
def test_conflicting_fields_resolve_as_on_chat(fields):
    """The same fields, the same answer on all three protocols (pitfall #16's premise)."""
    from backfit.server import anthropic as A
    from backfit.server.openai_request import parse_reasoning
    req, _ = R.parse_request({"input": "q", **fields})
    msg = A.parse_request({"max_tokens": 4, "messages": [{"role": "user", "content": "q"}],
                           **fields})
    assert (req.thinking, req.reasoning_effort) == (msg.thinking, msg.reasoning_effort) == \
        parse_reasoning(fields)


@pytest.mark.parametrize("body, param", [
    ({"input": "q", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": 5}, "input"),
    ({"input": "q", "max_output_tokens": "9"}, "max_output_tokens"),
    ({"input": "q", "temperature": True}, "temperature"),
    ({"input": "q", "reasoning": {"effort": "ultra"}}, "reasoning.effort"),
    ({"input": "q", "n": 2}, "n"),
    ({"input": [{"type": "function_call", "arguments": "{}"}]}, "input[0].name"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "hologram"}]}, "input[0].type"),
    ({"input": "q", "tools": [{"type": "teleport", "name": "t"}]}, "tools[0].type"),
    ({"input": "q", "tools": [{"type": "namespace", "name": "n", "tools": [
        {"type": "web_search"}]}]}, "tools[0].tools[0].type"),
    ({"input": "q", "tools": [{"type": "namespace", "name": "n", "tools": []}]}, "tools[0].tools"),
    ({"input": "q", "tools": [TOOL, {"type": "namespace", "name": "n", "tools": [
        {"type": "function", "name": "shell"}]}]}, "tools[1].tools[0].name"),
    ({"input": "q", "tool_choice": {"type": "web_search"}}, "tool_choice"),
])
def test_bad_fields_are_named(body, param):
    with pytest.raises(BadRequest) as e:
        R.parse_request(body)
    assert e.value.param == param


# ---- rendering through the handler ----------------------------------------------------------

@pytest.mark.parametrize("name, events, body", [
    ("tool_call", TOOL_TURN, {"input": "list files", "tools": [TOOL], "stream": True}),
    ("incomplete", CUT, {"input": "hi", "max_output_tokens": 4, "stream": True}),
    ("failed", [TextDelta("par"), Usage(30, 1), Finish("error", error="engine failed: boom")],
     {"input": "hi", "stream": True}),
])
def test_golden_sse_transcripts(encoder, fixed_ids, name, events, body):
    bridge = FakeBridge()
    bridge.events = events[:1] + [KEEPALIVE] + events[1:]
    status, headers, text = call(encoder, bridge, body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    golden = GOLDEN / f"responses_{name}.txt"
    if os.environ.get("UPDATE_GOLDEN"):          # regenerate, then review the diff by hand
        golden.write_text(text)
    assert text == golden.read_text(), f"transcript differs from {golden}"
    frames = sse(text)
    for _, d in frames:                                 # every event parses as the SDK's type
        assert type(STREAM_EVENT.validate_python(d)).__name__.startswith("Response"), d
    assert [d["sequence_number"] for _, d in frames] == list(range(len(frames)))
    assert all(t == d["type"] for t, d in frames)
    assert frames[0][0] == "response.created"
    terminal = [t for t, _ in frames if t in ("response.completed", "response.incomplete",
                                              "response.failed")]
    assert terminal == [frames[-1][0]]                  # exactly one, and last
    assert isinstance(frames[0][1]["response"]["created_at"], int)
    done = [d["item"] for t, d in frames if t == "response.output_item.done"]
    assert frames[-1][1]["response"]["output"] == done  # same items, same ids (pitfall #13)
    assert bridge.closed == 1


def test_tool_turn_shapes(encoder, fixed_ids):
    bridge = FakeBridge()
    bridge.events = TOOL_TURN
    _, _, text = call(encoder, bridge, {"input": "ls", "tools": [TOOL], "stream": True})
    frames = sse(text)
    out = frames[-1][1]["response"]
    assert [i["type"] for i in out["output"]] == ["reasoning", "message", "function_call"]
    assert [d["output_index"] for t, d in frames if t == "response.output_item.added"] == [0, 1, 2]
    fc = out["output"][2]
    assert (fc["call_id"], fc["name"], json.loads(fc["arguments"])) == ("call_1", "shell",
                                                                         {"cmd": "ls"})
    args = "".join(d["delta"] for t, d in frames if t == "response.function_call_arguments.delta")
    assert args == fc["arguments"]
    assert out["output"][0]["content"] == [{"type": "reasoning_text",
                                            "text": "The user wants a listing."}]
    assert out["usage"] == {"input_tokens": 40, "input_tokens_details": {
        "cached_tokens": 16, "cache_write_tokens": 0}, "output_tokens": 12,
        "output_tokens_details": {"reasoning_tokens": 5}, "total_tokens": 52}
    assert bridge.calls[0]["tools"] is True


def test_non_streaming_reply_is_the_fold_of_the_stream(encoder, fixed_ids, monkeypatch):
    bridge = FakeBridge()
    bridge.events = TOOL_TURN
    _, _, text = call(encoder, bridge, {"input": "ls", "tools": [TOOL], "stream": True})
    streamed = sse(text)[-1][1]["response"]
    counter = itertools.count(1)
    monkeypatch.setattr(RR, "_hex", lambda: f"{next(counter):04d}")
    status, _, body = call(encoder, bridge, {"input": "ls", "tools": [TOOL]})
    assert status == 200 and json.loads(body) == streamed
    Response.model_validate(json.loads(body))         # the SDK's required keys are all there


def test_custom_tool_call_is_unwrapped(encoder, fixed_ids):
    bridge = FakeBridge()
    bridge.events = [ToolCallStart(0, "call_p", "apply_patch"),
                     ToolCallArgsDelta(0, '{"input": "*** Begin Patch\\n"}'),
                     ToolCallEnd(0, '{"input": "*** Begin Patch\\n"}'), Usage(9, 3),
                     Finish("tool_calls")]
    _, _, text = call(encoder, bridge, {"input": "fix", "stream": True,
                                        "tools": [{"type": "custom", "name": "apply_patch"}]})
    frames = sse(text)
    item = frames[-1][1]["response"]["output"][0]
    assert item["type"] == "custom_tool_call" and item["input"] == "*** Begin Patch\n"
    assert [d["input"] for t, d in frames if t == "response.custom_tool_call_input.done"] == \
        ["*** Begin Patch\n"]


NAMESPACE = {"type": "namespace", "name": "multi_agent_v1",
             "description": "Tools for spawning and managing sub-agents.",
             "tools": [{"type": "function", "name": "spawn_agent", "description": "Spawn one.",
                        "strict": False, "parameters": {"type": "object", "properties": {
                            "message": {"type": "string"}}}},
                       {"type": "function", "name": "wait_agent", "parameters": {}}]}


def test_namespace_tools_reach_the_model_and_calls_carry_the_namespace(encoder, fixed_ids):
    """Codex's sub-agent tools come in a namespace entry: each function is shown to the model
    (the namespace's description in front of its own), and a call of one comes back as a
    function_call item with its namespace, streamed and in the terminal response."""
    req, _ = R.parse_request({"input": "go", "tools": [TOOL, NAMESPACE,
                                                        {"type": "web_search"}]})
    assert [t.name for t in req.tools] == ["shell", "spawn_agent", "wait_agent"]
    assert req.tools[1].schema["description"] == \
        "(multi_agent_v1: Tools for spawning and managing sub-agents.) Spawn one."
    prompt = encoder.encode_request(req).text
    assert '"name": "spawn_agent"' in prompt and '"name": "wait_agent"' in prompt
    bridge = FakeBridge()
    bridge.events = [ToolCallStart(0, "call_s", "spawn_agent"),
                     ToolCallArgsDelta(0, '{"message": "hi"}'),
                     ToolCallEnd(0, '{"message": "hi"}'), ToolCallStart(1, "call_t", "shell"),
                     ToolCallArgsDelta(1, "{}"), ToolCallEnd(1, "{}"), Usage(9, 3),
                     Finish("tool_calls")]
    _, _, text = call(encoder, bridge, {"input": "go", "stream": True,
                                        "tools": [TOOL, NAMESPACE]})
    frames = sse(text)
    added = [d["item"] for t, d in frames if t == "response.output_item.added"]
    final = frames[-1][1]["response"]["output"]
    for items in (added, final):
        assert [(i["name"], i.get("namespace")) for i in items] == \
            [("spawn_agent", "multi_agent_v1"), ("shell", None)]
    for t, d in frames:
        STREAM_EVENT.validate_python(d)


def test_allowed_tools_narrow_the_tools_and_set_the_mode():
    body = {"input": "go", "tools": [TOOL, NAMESPACE], "tool_choice": {
        "type": "allowed_tools", "mode": "required",
        "tools": [{"type": "function", "name": "wait_agent"}]}}
    req, _ = R.parse_request(body)
    assert [t.name for t in req.tools] == ["wait_agent"] and req.tool_choice == "required"
    body["tool_choice"]["tools"] = []
    req, _ = R.parse_request(body)                     # nothing left to call: a 400 at encoding
    assert req.tools == () and req.tool_choice == "required"


TWO_CALLS = [ToolCallStart(0, "call_1", "shell"), ToolCallArgsDelta(0, "{}"), ToolCallEnd(0, "{}"),
             ToolCallStart(1, "call_2", "shell"), ToolCallArgsDelta(1, "{}"), ToolCallEnd(1, "{}"),
             Usage(9, 6), Finish("tool_calls")]


@pytest.mark.parametrize("parallel, n", [(True, 2), (False, 1)])
def test_parallel_tool_calls_false_keeps_the_first_call(encoder, parallel, n):
    bridge = FakeBridge()
    bridge.events = TWO_CALLS
    _, _, text = call(encoder, bridge, {"input": "x", "tools": [TOOL],
                                        "parallel_tool_calls": parallel})
    out = json.loads(text)["output"]
    assert [o["call_id"] for o in out] == ["call_1", "call_2"][:n]


def test_errors_in_openai_shape(encoder):
    bridge = FakeBridge()
    status, _, text = call(encoder, bridge, None, raw=b'{"input": "x"')
    assert status == 400 and json.loads(text)["error"]["type"] == "invalid_request_error"
    status, _, text = call(encoder, bridge, {"input": "x", "max_output_tokens": 10_000})
    err = json.loads(text)["error"]
    assert status == 400 and err["code"] == "context_length_exceeded"
    assert err["param"] == "max_output_tokens"
    bridge.raise_first = QueueFull("busy")
    status, headers, text = call(encoder, bridge, {"input": "x", "stream": True})
    assert status == 429 and headers["Retry-After"] == "2"
    assert json.loads(text)["error"]["code"] == "rate_limit_exceeded"


class SlowBridge(FakeBridge):
    """A prefill that never ends: the first event never comes."""

    async def stream(self, prompt, params, *, tools, stop=()):
        try:
            await asyncio.Event().wait()
            yield None
        finally:
            self.closed += 1


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_before_the_first_event_closes_the_stream(encoder, stream):
    """A client gone during a long prefill: the handler is cancelled and the engine stream is
    closed (that is what aborts the engine request)."""
    bridge = SlowBridge()

    async def go():
        app = web.Application()
        app[CTX] = ServerContext(bridge=bridge, encoder=encoder, model_name="m",
                                 max_model_len=4096, api_key=None, tokenizer=None)
        app.router.add_post("/v1/responses", R.handle)
        async with TestClient(TestServer(app, handler_cancellation=True)) as c:
            with pytest.raises(asyncio.TimeoutError):
                async with asyncio.timeout(0.5):
                    await c.post("/v1/responses", json={"input": "x", "stream": stream})
            for _ in range(100):
                if bridge.closed:
                    break
                await asyncio.sleep(0.02)
            assert bridge.closed == 1                   # while the server is still up
    asyncio.run(go())


def test_params_reach_the_bridge(encoder):
    bridge = FakeBridge()
    bridge.events = [TextDelta("a"), Usage(5, 1), Finish("stop")]
    status, _, _ = call(encoder, bridge, {
        "input": "x", "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9,
        "reasoning": {"effort": "none"}, "tools": [TOOL], "tool_choice": "none",
        "metadata": {"a": "b"}, "service_tier": "auto", "unknown_vendor_field": {"x": 1}})
    c = bridge.calls[0]
    assert status == 200
    assert (c["params"].max_tokens, c["params"].temperature, c["params"].top_p) == (7, 0.5, 0.9)
    assert c["tools"] is False                          # tool_choice none: no DSML parsing
    assert c["prompt"].thinking_mode == "chat" and not c["prompt"].reasoning_open


# ---- live server: the official openai SDK against the tiny model on CPU ---------------------

@pytest.fixture(scope="module")
def live(tiny_converted):
    from live_server import LiveServer                  # the in-process server (tests/server)
    from support import one_thread

    from backfit.server.bridge import AsyncEngine, EngineConfig

    with one_thread():
        engine = AsyncEngine(EngineConfig(str(tiny_converted(1)), dtype="float32",
                                          max_model_len=2048, max_num_seqs=8, block_size=16,
                                          num_blocks=256))
        engine.start()
        engine.ready.wait(120)
        server = LiveServer(engine, tiny_converted(1), keepalive_s=10.0)
        try:
            yield server
        finally:
            server.stop()


def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def pool_idle(live, timeout=10.0) -> bool:
    """Every request finished and every cache block back in the pool (polls the engine)."""
    import time
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = live.engine.stats()
        if live.ctx.bridge.active == 0 and s["num_requests_running"] == 0 and \
                s["num_free_blocks"] == s["num_blocks"]:
            return True
        time.sleep(0.05)
    return False


def test_live_create_reasoning_on_and_off(live):
    c = client(live)
    raw = c.responses.with_raw_response.create(model="deepseek-v4-flash", input="Hello there",
                                               max_output_tokens=6, temperature=0)
    assert isinstance(json.loads(raw.text)["created_at"], int)
    r = raw.parse()
    assert r.status in ("completed", "incomplete") and r.model == "deepseek-v4-flash"
    u = r.usage
    assert 1 <= u.output_tokens <= 6 and u.total_tokens == u.input_tokens + u.output_tokens
    kinds = [o.type for o in r.output]
    if "reasoning" in kinds:                             # thinking is the default: <think> open
        assert u.output_tokens_details.reasoning_tokens >= 1
    off = c.responses.create(model="m", input="Hello there", max_output_tokens=6,
                             temperature=0, reasoning={"effort": "none"})
    assert "reasoning" not in [o.type for o in off.output]
    assert off.usage.output_tokens_details.reasoning_tokens == 0
    on = c.responses.create(model="m", input="Hello there", max_output_tokens=6, temperature=0,
                            extra_body={"chat_template_kwargs": {"thinking": True}})
    assert on.usage.input_tokens == u.input_tokens   # same prompt as the default (thinking on)
    assert on.usage.input_tokens_details.cached_tokens >= 0


def test_live_stream_matches_final_response(live):
    c = client(live)
    with c.responses.stream(model="m", input="Tell me a story", max_output_tokens=8,
                            temperature=0) as s:
        events = list(s)
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    if last.type == "response.completed":
        assert s.get_final_response().id == last.response.id
    else:                                               # the cap was hit (§2.6)
        assert last.response.incomplete_details.reason == "max_output_tokens"
        assert last.response.usage.output_tokens == 8
    again = list(c.responses.create(model="m", input="Tell me a story", max_output_tokens=8,
                                    temperature=0, stream=True))
    assert [e.sequence_number for e in again] == list(range(len(again)))
    assert again[-1].type == last.type
    assert again[-1].response.output[-1].type == last.response.output[-1].type
    texts = [[e.delta for e in evs if e.type.endswith("text.delta")] for evs in (events, again)]
    assert texts[0] == texts[1] and texts[0]            # greedy: the same text both times
    assert pool_idle(live)


def test_live_tool_round_trip_history(live):
    c = client(live)
    tools = [TOOL, {"type": "custom", "name": "apply_patch", "description": "patch files"},
             {"type": "web_search"}]
    thought = {"type": "reasoning", "id": "rs_9", "summary": [], "encrypted_content": "opaque",
               "content": [{"type": "reasoning_text", "text": "I should run ls."}]}
    history = [
        {"role": "developer", "content": "You are Codex."},
        {"role": "user", "content": "List the files"}, thought,
        {"type": "function_call", "call_id": "call_9", "name": "shell",
         "arguments": json.dumps({"cmd": "ls"})},
        {"type": "function_call_output", "call_id": "call_9", "output": "a.txt\nb.txt"},
        {"type": "custom_tool_call", "call_id": "call_8", "name": "apply_patch", "input": "*"},
        {"type": "custom_tool_call_output", "call_id": "call_8", "output": "ok"}]
    kw = dict(model="m", tools=tools, max_output_tokens=2, store=False,
              include=["reasoning.encrypted_content"], prompt_cache_key="abc")
    r = c.responses.create(input=history, **kw)
    assert r.status in ("completed", "incomplete")
    bare = c.responses.create(input=[h for h in history if h is not thought], **kw)
    # with tools the encoder keeps history reasoning: exactly its tokens are in the prompt
    n = len(live.ctx.encoder.encode_text("I should run ls."))
    assert r.usage.input_tokens - bare.usage.input_tokens == n


def test_live_errors(live):
    c = client(live)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="m", input="x", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="m", input="x", max_output_tokens=3000)
    assert e.value.body["code"] == "context_length_exceeded"


def test_live_cancel_mid_stream_frees_the_request(live):
    c = client(live)
    with c.responses.create(model="m", input="Write a long essay", max_output_tokens=400,
                            stream=True) as s:
        for e in s:
            if e.type.endswith(".delta"):
                break                                    # leave after the first token
    assert pool_idle(live), live.engine.stats()
