"""/v1/messages and count_tokens: request parsing, the §3.3 event sequence (golden SSE
transcripts), the folded reply and errors on a fake bridge; then the official `anthropic` SDK
against a live tiny-model server."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pydantic
import pytest

from backfit.server import anthropic as A
from backfit.server import anthropic_render as AR
from fake_bridge import FakeBridge, post, sse
from backfit.server.bridge import KEEPALIVE, QueueFull
from backfit.server.http import BadRequest
from backfit.server.protocol import (
    Finish, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart, Usage,
)

anthropic = pytest.importorskip("anthropic")
from anthropic.types import Message as SDKMessage, RawMessageStreamEvent  # noqa: E402

STREAM_EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)
GOLDEN = Path(__file__).parent / "golden"
TOOL = {"name": "Bash", "description": "run a command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                         "required": None}}
TOOL_TURN = [ReasoningDelta("The user wants "), ReasoningDelta("a listing."), TextDelta("Sure."),
             ToolCallStart(0, "call_00ff", "Bash"), ToolCallArgsDelta(0, '{"command": "l'),
             ToolCallArgsDelta(0, 's"}'), ToolCallEnd(0, '{"command": "ls"}'),
             Usage(40, 12, cached_tokens=16, reasoning_tokens=5), Finish("tool_calls")]


@pytest.fixture
def fixed_ids(monkeypatch):
    counter = itertools.count(1)
    monkeypatch.setattr(AR, "_hex", lambda: f"{next(counter):04d}")
    monkeypatch.setattr(AR, "_SECRET", b"golden")


def call(encoder, bridge, body, path="/v1/messages", raw: bytes | None = None):
    """POST body to an Anthropic route on an app around the fake bridge."""
    return post(encoder, bridge, {"/v1/messages": A.handle_messages,
                                  "/v1/messages/count_tokens": A.handle_count_tokens},
                path + "?beta=true", body, raw, {"anthropic-version": "2023-06-01"})


def body(**kw):
    return {"model": "claude-haiku-4-5", "max_tokens": 64,
            "messages": [{"role": "user", "content": "list files"}], **kw}


# ---- parsing --------------------------------------------------------------------------------

def test_messages_become_neutral_messages():
    req = A.parse_request(body(
        system=[{"type": "text", "text": "x-anthropic-billing-header: cc=1;"},
                {"type": "text", "text": "You are Claude Code.", "cache_control": {}}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "plan", "signature": "forged"},
                {"type": "redacted_thinking", "data": "xx"}, {"type": "text", "text": "ok"},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
                {"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}]},
            {"role": "ctx", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": False,
                 "content": [{"type": "text", "text": "a.txt"}]},
                {"type": "text", "text": "go on"}]},
            {"role": "assistant", "content": "The files"}],
        tools=[TOOL, {"type": "web_search_20250305", "name": "web_search"}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        thinking={"type": "enabled", "budget_tokens": 2048}, stop_sequences=["END"],
        metadata={"user_id": "u"}, container=None, context_management={}))
    assert [m.role for m in req.messages] == ["system", "user", "assistant", "tool", "user",
                                              "assistant"]
    assert req.messages[0].content == "You are Claude Code."    # billing header dropped
    assert req.messages[1].content == "hi[Unsupported image]"
    a = req.messages[2]
    assert (a.reasoning, a.content, a.prefix) == ("plan", "ok", False)
    assert [(c.id, c.name, json.loads(c.arguments)) for c in a.tool_calls] == \
        [("toolu_1", "Bash", {"command": "ls"})]
    assert req.messages[3].tool_call_id == "toolu_1"
    assert req.messages[5].prefix is True                        # a prefill is continued
    assert [t.name for t in req.tools] == ["Bash"]
    assert req.tools[0].schema["parameters"]["required"] == []   # required: null accepted
    assert (req.tool_choice, req.parallel_tool_calls) == ("required", False)
    assert (req.thinking, req.stop, req.max_tokens) == (True, ("END",), 64)


@pytest.mark.parametrize("extra, thinking, effort", [
    ({"thinking": {"type": "disabled"}}, False, None),
    ({"thinking": {"type": "adaptive"}, "output_config": {"effort": "max"}}, True, "max"),
    ({"reasoning_effort": "none"}, None, "none"),
    ({"chat_template_kwargs": {"thinking": False}}, False, None),
    ({}, None, None),
])
def test_thinking_and_effort_from_every_field(extra, thinking, effort):
    req = A.parse_request(body(**extra))
    assert (req.thinking, req.reasoning_effort) == (thinking, effort)


@pytest.mark.parametrize("bad, param", [
    ({"max_tokens": None}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"thinking": {"type": "maybe"}}, "thinking.type"),
    ({"output_config": {"effort": "ultra"}}, "output_config.effort"),
    ({"stop_sequences": "END"}, "stop_sequences"), ({"n": 3}, "n"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                 "input": {}}]}]}, "messages[0].content[0].type"),
    ({"tools": [{"name": "f", "description": "no schema"}]}, "tools[0].input_schema"),
])
def test_bad_fields_are_named(bad, param):
    with pytest.raises(BadRequest) as e:
        A.parse_request(body(**bad))
    assert e.value.param == param


# ---- rendering through the handler ----------------------------------------------------------

@pytest.mark.parametrize("name, events, extra", [
    ("tool_use", TOOL_TURN, {"tools": [TOOL]}),
    ("stop_sequence", [TextDelta("one two"), Usage(20, 3), Finish("stop", stop_sequence="END")],
     {"stop_sequences": ["END"], "thinking": {"type": "disabled"}}),
    ("max_tokens", [ReasoningDelta("hm"), Usage(20, 64, reasoning_tokens=64), Finish("length")],
     {}),
    ("error", [TextDelta("par"), Usage(20, 1), Finish("error", error="engine failed: boom")],
     {}),
])
def test_golden_sse_transcripts(encoder, fixed_ids, name, events, extra):
    bridge = FakeBridge()
    bridge.events = events[:1] + [KEEPALIVE] + events[1:]
    status, headers, text = call(encoder, bridge, body(stream=True, **extra))
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    golden = GOLDEN / f"anthropic_{name}.txt"
    if os.environ.get("UPDATE_GOLDEN"):          # regenerate, then review the diff by hand
        golden.write_text(text)
    assert text == golden.read_text(), f"transcript differs from {golden}"
    frames = sse(text)
    for t, d in frames:
        assert d["type"] == t                            # the event: line repeats the type
        if t not in ("ping", "error"):
            STREAM_EVENT.validate_python(d)
    assert [t for t, _ in frames[:2]] == ["message_start", "ping"]
    m = frames[0][1]["message"]
    assert (m["type"], m["role"], m["stop_sequence"]) == ("message", "assistant", None)
    idx = [d["index"] for t, d in frames if t == "content_block_start"]
    assert idx == list(range(len(idx)))
    assert frames[-1][0] == ("error" if name == "error" else "message_stop")
    assert bridge.closed == 1


def test_tool_use_turn_and_fold(encoder, fixed_ids, monkeypatch):
    bridge = FakeBridge()
    bridge.events = TOOL_TURN
    _, _, text = call(encoder, bridge, body(stream=True, tools=[TOOL]))
    frames = sse(text)
    delta = [d for t, d in frames if t == "message_delta"][0]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": 24, "output_tokens": 12,
                              "cache_creation_input_tokens": 0, "cache_read_input_tokens": 16,
                              "output_tokens_details": {"thinking_tokens": 5}}
    sig = [d["delta"] for t, d in frames if t == "content_block_delta"
           and d["delta"]["type"] == "signature_delta"]
    assert sig == [{"type": "signature_delta", "signature": A.signature("The user wants a "
                                                                        "listing.")}]
    start = [d["content_block"] for t, d in frames if t == "content_block_start"][2]
    assert start == {"type": "tool_use", "id": "toolu_00ff", "name": "Bash", "input": {}}
    # the non-streaming reply is the fold of the same events
    counter = itertools.count(1)
    monkeypatch.setattr(AR, "_hex", lambda: f"{next(counter):04d}")
    status, _, folded = call(encoder, bridge, body(tools=[TOOL]))
    msg = SDKMessage.model_validate(json.loads(folded))
    assert status == 200 and msg.stop_reason == "tool_use" and msg.id == "msg_0001"
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[2].input == {"command": "ls"} and msg.content[0].signature == sig[0][
        "signature"]
    assert (msg.usage.input_tokens, msg.usage.cache_read_input_tokens) == (24, 16)


def test_thinking_display_omitted_sends_an_empty_signed_block(encoder, fixed_ids):
    bridge = FakeBridge()
    bridge.events = [ReasoningDelta("secret"), TextDelta("hi"), Usage(5, 3), Finish("stop")]
    _, _, text = call(encoder, bridge, body(thinking={"type": "enabled", "budget_tokens": 1024,
                                                      "display": "omitted"}))
    content = json.loads(text)["content"]
    assert content[0] == {"type": "thinking", "thinking": "", "signature": A.signature("")}
    assert content[1] == {"type": "text", "text": "hi"}


@pytest.mark.parametrize("disable, n", [(False, 2), (True, 1)])
def test_disable_parallel_tool_use_keeps_the_first_call(encoder, disable, n):
    bridge = FakeBridge()
    bridge.events = [ToolCallStart(0, "call_1", "Bash"), ToolCallArgsDelta(0, "{}"),
                     ToolCallEnd(0, "{}"), ToolCallStart(1, "call_2", "Bash"),
                     ToolCallArgsDelta(1, "{}"), ToolCallEnd(1, "{}"), Usage(9, 6),
                     Finish("tool_calls")]
    _, _, text = call(encoder, bridge, body(tools=[TOOL], tool_choice={
        "type": "auto", "disable_parallel_tool_use": disable}))
    m = json.loads(text)
    assert [b["id"] for b in m["content"]] == ["toolu_1", "toolu_2"][:n]
    assert m["stop_reason"] == "tool_use"


def test_errors_in_anthropic_shape(encoder):
    bridge = FakeBridge()
    status, headers, text = call(encoder, bridge, None, raw=b"\xff\xfe{")
    err = json.loads(text)
    assert status == 400 and err["type"] == "error"
    assert err["error"]["type"] == "invalid_request_error" and err["request_id"]
    status, _, text = call(encoder, bridge, body(max_tokens=5000))
    assert status == 400 and "exceed context limit" in json.loads(text)["error"]["message"]
    bridge.raise_first = QueueFull("busy")
    status, headers, text = call(encoder, bridge, body(stream=True))
    assert status == 529 and headers["Retry-After"] == "2"
    assert json.loads(text)["error"]["type"] == "overloaded_error"


def test_count_tokens_uses_the_encoder(encoder):
    bridge = FakeBridge()
    q = {"model": "m", "messages": [{"role": "user", "content": "hello there"}],
         "system": "sys", "tools": [TOOL]}
    status, _, text = call(encoder, bridge, q, path="/v1/messages/count_tokens")
    want = len(encoder.encode_request(A.parse_request(q, count_only=True)).ids)
    assert status == 200 and json.loads(text) == {"input_tokens": want}
    assert want > len("hello there") + len("sys") and not bridge.calls
    status, _, text = call(encoder, bridge, {"messages": "x"}, path="/v1/messages/count_tokens")
    assert status == 400 and json.loads(text)["error"]["type"] == "invalid_request_error"


# ---- live server: the official anthropic SDK against the tiny model on CPU ------------------

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
        server = LiveServer(engine, tiny_converted(1), api_key="sk-test")
        try:
            yield server
        finally:
            server.stop()


def client(live, key="sk-test", **kw):
    return anthropic.Anthropic(base_url=live.url, api_key=key, max_retries=0, timeout=60, **kw)


def pool_idle(live, timeout=10.0) -> bool:
    import time
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = live.engine.stats()
        if live.ctx.bridge.active == 0 and s["num_requests_running"] == 0 and \
                s["num_free_blocks"] == s["num_blocks"]:
            return True
        time.sleep(0.05)
    return False


def test_live_create_thinking_on_and_off(live):
    c = client(live)
    m = c.messages.create(model="claude-haiku-4-5", max_tokens=6, extra_body={"temperature": 0},
                          messages=[{"role": "user", "content": "Hello there"}])
    assert m.role == "assistant" and m.model == "deepseek-v4-flash"
    assert m.stop_reason in ("end_turn", "max_tokens") and 1 <= m.usage.output_tokens <= 6
    if m.content and m.content[0].type == "thinking":    # thinking is the V4 default
        assert m.content[0].signature and m.usage.output_tokens_details.thinking_tokens >= 1
    off = c.messages.create(model="m", max_tokens=6, extra_body={"temperature": 0},
                            thinking={"type": "disabled"},
                            messages=[{"role": "user", "content": "Hello there"}])
    assert all(b.type != "thinking" for b in off.content)
    assert off.usage.output_tokens_details.thinking_tokens == 0
    n = c.messages.count_tokens(model="m", messages=[{"role": "user", "content": "Hello there"}])
    assert n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_live_stream_and_usage(live):
    c = client(live)
    q = dict(model="m", max_tokens=8, extra_body={"temperature": 0}, system="Be brief.",
             messages=[{"role": "user", "content": "Tell me a story"}])
    with c.messages.stream(**q) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.stop_reason == "max_tokens" or final.stop_reason == "end_turn"
    again = c.messages.create(**q)                      # the prefix cache serves the prompt
    assert [b.model_dump() for b in again.content] == [b.model_dump() for b in final.content]
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == \
        final.usage.input_tokens + final.usage.cache_read_input_tokens
    assert pool_idle(live)


def test_live_tool_round_trip_history(live):
    c = client(live)
    tools = [TOOL, {"type": "web_search_20250305", "name": "web_search", "max_uses": 1}]
    thought = {"type": "thinking", "thinking": "I should run ls.", "signature": "x"}
    turn = [{"role": "user", "content": "List the files"},
            {"role": "assistant", "content": [thought, {
                "type": "tool_use", "id": "toolu_9", "name": "Bash", "input": {"command": "ls"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9",
                                          "content": "a.txt"}]}]
    m = c.messages.create(model="m", max_tokens=2, tools=tools, messages=turn)
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")
    turn[1]["content"] = turn[1]["content"][1:]          # a client that drops thinking: no 400
    bare = c.messages.create(model="m", max_tokens=2, tools=tools, messages=turn)
    n = len(live.ctx.encoder.encode_text("I should run ls."))
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens - n == \
        bare.usage.input_tokens + bare.usage.cache_read_input_tokens


def test_live_errors_and_auth(live):
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(live, key="wrong").messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    bearer = client(live, key=None, auth_token="sk-test")      # Authorization: Bearer
    assert bearer.messages.create(model="m", max_tokens=1,
                                  messages=[{"role": "user", "content": "x"}]).usage
    with pytest.raises(anthropic.BadRequestError) as e:
        client(live).messages.create(model="m", max_tokens=3000,
                                     messages=[{"role": "user", "content": "x"}])
    assert "exceed context limit" in e.value.body["error"]["message"]


def test_live_cancel_mid_stream_frees_the_request(live):
    c = client(live)
    with c.messages.stream(model="m", max_tokens=400, messages=[
            {"role": "user", "content": "Write a long essay"}]) as s:
        for e in s:
            if e.type == "content_block_delta":
                break                                    # leave after the first token
    assert pool_idle(live), live.engine.stats()
