"""Usage equals what was delivered, for every finish reason on every protocol and stream mode:
completion tokens = the engine's tokens up to where the reply ended (the EOS counted, tokens after
a stop string not), cached tokens = the request's prefix-cache hit (also when a stop string ends
the reply before the engine's last output, which alone carries the engine's usage). A scripted
engine gives exact counts; the real tiny engine shows the cache hit after a stop string."""

from __future__ import annotations

import json

import pytest
import support
from live_server import FakeEngine, LiveServer, real_server
from test_openai_chat import CALL, WEATHER, post

CACHED = 7
MSG = [{"role": "user", "content": "Tell me about the harbour, in a few words please."}]
# finish -> (script [(text, n tokens)], engine finish_reason, tokens delivered, request extras)
CASES = {
    "eos": ([("</think>", 1), ("Hi there", 3), ("", 1)], "stop", 5, {}),
    "length": ([("</think>", 1), ("Hi", 1), (" there", 2)], "length", 4, {}),
    "stop_string": ([("</think>", 1), ("Hello ", 1), ("wor", 1), ("ld END", 2), (" more", 1),
                     ("x", 1)], "stop", 5, {"stop": ["END"]}),
    "tool_call": ([("</think>", 1), ("Let me check.", 3), (CALL[0], 6), (CALL[1], 8), ("", 1)],
                  "stop", 19, {"tools": True}),
}
PROTOCOLS = ("chat", "responses", "anthropic", "completions")


@pytest.fixture(scope="module")
def fake(tiny_converted):
    srv = LiveServer(FakeEngine(max_model_len=4096, cached=CACHED), tiny_converted(1, "int8"))
    yield srv
    srv.stop()


def body(protocol: str, stream: bool, extra: dict) -> tuple[str, dict]:
    """(path, request) asking for usage in the protocol's own way."""
    stop, tools = extra.get("stop"), extra.get("tools")
    if protocol == "chat":
        b = {"model": "m", "messages": MSG, "stream": stream,
             "stream_options": {"include_usage": True} if stream else None}
        return "/v1/chat/completions", {**b, **({"stop": stop} if stop else {}),
                                        **({"tools": WEATHER} if tools else {})}
    if protocol == "responses":
        b = {"model": "m", "input": MSG, "stream": stream}
        tool = [{"type": "function", **WEATHER[0]["function"]}]
        return "/v1/responses", {**b, **({"stop": stop} if stop else {}),
                                 **({"tools": tool} if tools else {})}
    if protocol == "anthropic":
        b = {"model": "m", "max_tokens": 100, "messages": MSG, "stream": stream}
        tool = [{"name": "get_weather", "input_schema": WEATHER[0]["function"]["parameters"]}]
        return "/v1/messages", {**b, **({"stop_sequences": stop} if stop else {}),
                                **({"tools": tool} if tools else {})}
    b = {"model": "m", "prompt": MSG[0]["content"], "max_tokens": 50, "stream": stream,
         "stream_options": {"include_usage": True} if stream else None}
    return "/v1/completions", {**b, **({"stop": stop} if stop else {})}


def usage_of(protocol: str, stream: bool, text: str) -> tuple[int, int, int]:
    """(prompt tokens, completion tokens, cached tokens) from a raw reply or SSE body."""
    if stream:
        frames = [json.loads(ln[6:]) for ln in text.splitlines()
                  if ln.startswith("data: ") and ln != "data: [DONE]"]
        if protocol in ("chat", "completions"):
            u = [f["usage"] for f in frames if f.get("usage")][-1]
        elif protocol == "responses":
            u = frames[-1]["response"]["usage"]
        else:
            start = next(f for f in frames if f["type"] == "message_start")["message"]["usage"]
            u = {**start, **[f for f in frames if f["type"] == "message_delta"][-1]["usage"]}
    else:
        u = json.loads(text)["usage"]
    if protocol in ("chat", "completions"):
        return u["prompt_tokens"], u["completion_tokens"], \
            u["prompt_tokens_details"]["cached_tokens"]
    if protocol == "responses":
        return u["input_tokens"], u["output_tokens"], u["input_tokens_details"]["cached_tokens"]
    cached = u["cache_read_input_tokens"]
    return u["input_tokens"] + cached, u["output_tokens"], cached


@pytest.mark.parametrize("finish", sorted(CASES))
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_usage_is_what_was_delivered(fake, protocol, finish):
    script, reason, delivered, extra = CASES[finish]
    if protocol == "completions" and finish in ("stop_string", "tool_call"):
        pytest.skip("the engine applies completions' stop strings (real engine test below); "
                    "completions has no tools")
    fake.engine.script, fake.engine.finish_reason = script, reason
    for stream in (False, True):
        path, b = body(protocol, stream, extra)
        st, text, _ = post(fake, path, b)
        assert st == 200, text
        n_prompt = len(fake.engine.last_prompt)
        assert usage_of(protocol, stream, text) == (n_prompt, delivered, CACHED), \
            (protocol, finish, stream)


def test_cached_tokens_after_a_stop_string_on_the_real_engine(tiny_converted):
    """The second identical prompt is served by the prefix cache; a reply that ends on a stop
    string (the parser's on the chat protocols, the engine's on completions) still reports it."""
    with support.one_thread():
        srv = real_server(tiny_converted(1, "int8"))
        try:
            off = {"thinking": {"type": "disabled"}, "temperature": 0}
            first = {"chat": {"messages": MSG, "max_tokens": 12, **off},
                     "responses": {"input": MSG, "max_output_tokens": 12, **off},
                     "anthropic": {"messages": MSG, "max_tokens": 12, **off},
                     "completions": {"prompt": MSG[0]["content"] * 3, "max_tokens": 12,
                                     "temperature": 0}}
            for protocol in PROTOCOLS:
                path = body(protocol, False, {})[0]
                st, text, _ = post(srv, path, {"model": "m", **first[protocol]})
                out = json.loads(text)
                reply = {"chat": lambda: out["choices"][0]["message"]["content"],
                         "completions": lambda: out["choices"][0]["text"],
                         "responses": lambda: out["output"][-1]["content"][0]["text"],
                         "anthropic": lambda: out["content"][-1]["text"]}[protocol]()
                stop = reply[3:5]               # ends the identical greedy reply early
                assert len(reply) > 6 and stop.strip(), (protocol, reply)
                n_first = usage_of(protocol, False, text)[1]
                key = {"anthropic": "stop_sequences"}.get(protocol, "stop")
                for stream in (False, True):
                    again = {"model": "m", **first[protocol], key: [stop], "stream": stream}
                    if stream and protocol in ("chat", "completions"):
                        again["stream_options"] = {"include_usage": True}
                    st, text, _ = post(srv, path, again)
                    assert st == 200, text
                    n_prompt, n_out, cached = usage_of(protocol, stream, text)
                    assert 0 < cached < n_prompt and n_out < n_first, (protocol, stream, text)
        finally:
            srv.stop()
