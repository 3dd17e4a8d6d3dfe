"""What only the raw wire shows (the SDKs hide both): the API key is compared whole on both
headers, so near misses (a prefix of it, more than it, one character off, another case) are 401
on every protected path; and every streamed endpoint, in every stream mode and finish, ends with
its protocol's terminal event as its last frame, exactly once: `data: [DONE]` (Chat,
Completions), `message_stop` (Anthropic), `response.completed` / `response.incomplete`
(Responses). The SDKs stop reading at the end of the stream, so a missing terminal event would
pass them."""

from __future__ import annotations

import json

import pytest
from live_server import FakeEngine, LiveServer
from test_openai_chat import CALL, MSG, WEATHER, post

KEY = "sk-backfit-0123456789abcdef"
NEAR = [KEY[:-1], KEY[:8], KEY + "0", KEY + " x", KEY[:-1] + "e", KEY.upper(), "x" + KEY,
        KEY.replace("-", "_"), ""]
PATHS = {"/v1/chat/completions": {"model": "m", "messages": MSG, "max_tokens": 2},
         "/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 2},
         "/v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 2},
         "/v1/messages": {"model": "m", "max_tokens": 2, "messages": MSG},
         "/v1/messages/count_tokens": {"model": "m", "messages": MSG},
         "/tokenize": {"prompt": "hi"}}


@pytest.fixture(scope="module")
def fake(tiny_converted):
    srv = LiveServer(FakeEngine([("</think>", 1), ("ok", 1)], max_model_len=4096),
                     tiny_converted(1, "int8"), api_key=KEY)
    yield srv
    srv.stop()


def test_near_miss_keys_are_refused_on_both_headers(fake):
    fake.engine.script, fake.engine.finish_reason = [("</think>", 1), ("ok", 1)], "stop"
    for path, body in PATHS.items():
        for header in ("Authorization", "x-api-key"):
            def send(key, header=header, path=path, body=body):
                value = f"Bearer {key}" if header == "Authorization" else key
                return post(fake, path, body, {header: value})[0]
            assert send(KEY) == 200, (path, header)
            for near in NEAR:
                assert send(near) == 401, (path, header, near)
    # both headers sent: the Bearer one decides (a right x-api-key does not rescue a wrong one)
    assert post(fake, "/v1/messages", PATHS["/v1/messages"],
                {"x-api-key": KEY[:-1], "Authorization": f"Bearer {KEY}"})[0] == 200
    assert post(fake, "/v1/messages", PATHS["/v1/messages"],
                {"x-api-key": KEY, "Authorization": f"Bearer {KEY[:-1]}"})[0] == 401


# ---- raw SSE endings --------------------------------------------------------------------------

def frames(sse: str) -> list[str]:
    """The SSE body's frames (keep-alive comments dropped), each as its raw text."""
    return [f for f in sse.split("\n\n") if f and not f.startswith(":")]


SCRIPTS = {"stop": ([("</think>", 1), ("Hello", 1), (" there", 1)], "stop"),
           "length": ([("</think>", 1), ("Hello", 1), (" there", 1)], "length"),
           "tool_call": ([("</think>", 1), (CALL[0], 6), (CALL[1], 8)], "stop")}
RESPONSES_TOOL = [{"type": "function", **WEATHER[0]["function"]}]
ANTHROPIC_TOOL = [{"name": "get_weather", "input_schema": WEATHER[0]["function"]["parameters"]}]
# endpoint x stream mode -> (request, the terminal frame's test, how many such frames)
MODES = {
    "chat": ("/v1/chat/completions", {"messages": MSG, "tools": WEATHER}),
    "chat_usage": ("/v1/chat/completions", {"messages": MSG, "tools": WEATHER,
                                            "stream_options": {"include_usage": True}}),
    "chat_n2": ("/v1/chat/completions", {"messages": MSG, "n": 2}),
    "chat_logprobs": ("/v1/chat/completions", {"messages": MSG, "logprobs": True,
                                               "thinking": False}),
    "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 8}),
    "completions_usage": ("/v1/completions", {"prompt": "hi", "max_tokens": 8, "echo": True,
                                              "stream_options": {"include_usage": True}}),
    "responses": ("/v1/responses", {"input": MSG, "tools": RESPONSES_TOOL}),
    "anthropic": ("/v1/messages", {"messages": MSG, "max_tokens": 64, "tools": ANTHROPIC_TOOL}),
    "anthropic_thinking": ("/v1/messages", {"messages": MSG, "max_tokens": 64,
                                            "thinking": {"type": "enabled",
                                                         "budget_tokens": 32}}),
}


def terminal(mode: str, finish: str) -> str:
    """The last frame the protocol must send."""
    if mode.startswith(("chat", "completions")):
        return "data: [DONE]"
    if mode.startswith("anthropic"):
        return 'event: message_stop\ndata: {"type":"message_stop"}'
    return "response.incomplete" if finish == "length" else "response.completed"


@pytest.mark.parametrize("finish", sorted(SCRIPTS))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_stream_ends_with_its_terminal_event(fake, mode, finish):
    fake.engine.script, fake.engine.finish_reason = SCRIPTS[finish]
    path, req = MODES[mode]
    st, sse, h = post(fake, path, {"model": "m", "stream": True, **req},
                      {"Authorization": f"Bearer {KEY}"})
    assert st == 200 and h["Content-Type"].startswith("text/event-stream"), sse
    fs = frames(sse)
    assert sse.endswith("\n\n"), sse[-200:]
    want = terminal(mode, finish)
    if mode.startswith("responses"):
        last = fs[-1].split("\n")
        assert last[0] == f"event: {want}", fs[-1]
        assert json.loads(last[1][6:])["type"] == want
        assert sum(f.startswith(("event: response.completed", "event: response.incomplete",
                                 "event: response.failed")) for f in fs) == 1
    else:
        assert fs[-1] == want, (mode, finish, fs[-3:])
        assert sum(f == want for f in fs) == 1, (mode, finish)
