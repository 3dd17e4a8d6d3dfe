"""Server-side defaults: `--default-max-tokens` (or vLLM's `--override-generation-config
'{"max_new_tokens": N}'`) caps a request that sets none, on every protocol and on the forced
tool-call path, never one that sets its own; with no `--max-model-len` the engine takes the
longest context its KV pool holds (up to the model's limit) and the server reports it once
loaded (the ready line at tp 2: tests/server/test_app.py::test_backfit_serve_tp2_subprocess);
`--default-chat-template-kwargs '{"thinking": false}'` turns thinking off for requests that do
not choose (Claude Code with MAX_THINKING_TOKENS=0 sends no `thinking`)."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
import support
from live_server import FakeEngine, LiveServer
from test_openai_chat import MSG, WEATHER, post

from backfit.server.app import chat_template_defaults, default_max_tokens, engine_ready

CAP = 7


@pytest.fixture(scope="module")
def capped(tiny_converted):
    srv = LiveServer(FakeEngine([("</think>", 1), ("ok", 1)], max_model_len=4096),
                     tiny_converted(1, "int8"), default_max_tokens=CAP)
    yield srv
    srv.stop()


def test_a_request_without_a_cap_gets_the_default(capped):
    eng = capped.engine
    tools = [{"type": "function", **WEATHER[0]["function"]}]
    for path, body in [("/v1/chat/completions", {"messages": MSG}),
                       ("/v1/chat/completions", {"messages": MSG, "stream": True}),
                       ("/v1/responses", {"input": "hi"}),
                       ("/v1/responses", {"input": "hi", "tools": tools,
                                          "tool_choice": "required"})]:
        st, text, _ = post(capped, path, {"model": "m", **body})
        assert st == 200 and eng.last_params.max_tokens <= CAP, (path, text)
        if "tool_choice" not in body:           # (the forced call's second part: what is left)
            assert eng.last_params.max_tokens == CAP, path
    # the request's own cap wins, larger or smaller; completions keep OpenAI's 16
    for path, body, want in [("/v1/chat/completions", {"messages": MSG, "max_tokens": 100}, 100),
                             ("/v1/chat/completions", {"messages": MSG,
                                                       "max_completion_tokens": 3}, 3),
                             ("/v1/responses", {"input": "hi", "max_output_tokens": 50}, 50),
                             ("/v1/messages", {"messages": MSG, "max_tokens": 40}, 40),
                             ("/v1/completions", {"prompt": "hi"}, 16)]:
        st, text, _ = post(capped, path, {"model": "m", **body})
        assert st == 200 and eng.last_params.max_tokens == want, (path, text)
    # near the end of the context the rest of it is the cap
    long = [{"role": "user", "content": "x" * 4088}]
    st, text, _ = post(capped, "/v1/chat/completions", {"model": "m", "messages": long})
    n = len(eng.last_prompt)
    assert st == 200 and eng.last_params.max_tokens == min(CAP, 4096 - n) < CAP, (n, text)


@pytest.mark.parametrize("flag, overrides, want", [
    (None, None, None), (512, None, 512), (None, '{"max_new_tokens": 256}', 256),
    (256, '{"max_new_tokens": 256}', 256),
    (None, '{"temperature": 0.6}', "only max_new_tokens"),
    (100, '{"max_new_tokens": 200}', "disagree"), (0, None, "positive integer"),
    (None, "{max_new_tokens: 1}", "not JSON"), (None, '{"max_new_tokens": "9"}', "positive"),
])
def test_the_flags_parse_as_vllms(flag, overrides, want):
    if isinstance(want, str):
        with pytest.raises(ValueError, match=want):
            default_max_tokens(flag, overrides)
    else:
        assert default_max_tokens(flag, overrides) == want


def test_the_default_context_is_the_longest_the_pool_holds(tiny_converted):
    """No max_model_len: 96 blocks of 16 tokens hold 1,536 tokens, which is the context; the
    server answers 503 until the engine has picked it, then lists it and holds requests to
    it."""
    from backfit.engine.async_engine import AsyncEngine
    from backfit.engine.engine import EngineConfig

    with support.one_thread():
        eng = AsyncEngine(EngineConfig(str(tiny_converted(1, "int8")), dtype="float32",
                                       block_size=16, max_num_seqs=2, num_blocks=96,
                                       max_model_len=None))
        srv = LiveServer(eng, tiny_converted(1, "int8"))
        try:
            assert srv.ctx.max_model_len is None and eng.max_model_len is None
            st, text, _ = post(srv, "/v1/responses", {"model": "m", "input": "hi"})
            assert st == 503, text                      # loading: not a 500 on a None length
            eng.start()
            t = time.time()
            while not eng.ready.is_set():
                assert eng.error is None and time.time() - t < 120, eng.error
                time.sleep(0.02)
            assert eng.max_model_len == 96 * 16 == eng.engine.scheduler.max_model_len
            srv.call(_ready(srv, eng))
            with urllib.request.urlopen(srv.url + "/v1/models", timeout=30) as r:
                assert json.loads(r.read())["data"][0]["max_model_len"] == 1536
            st, text, _ = post(srv, "/v1/chat/completions", {"model": "m", "messages": MSG,
                                                             "max_tokens": 1600})
            assert st == 400 and json.loads(text)["error"]["code"] == "context_length_exceeded"
            st, text, _ = post(srv, "/v1/chat/completions", {"model": "m", "messages": MSG,
                                                             "max_tokens": 2})
            assert st == 200, text
        finally:
            srv.stop()


async def _ready(srv, eng):
    engine_ready(srv.ctx, eng)


@pytest.mark.parametrize("text, want", [
    (None, (None, None)), ('{"thinking": false}', (False, None)),
    ('{"enable_thinking": true, "reasoning_effort": "max"}', (True, "max")),
    ('{"thinking": "no"}', "true or false"), ('{"reasoning_effort": "ultra"}', "unknown level"),
    ('{"temperature": 0}', "only"), ("nope", "not JSON"),
])
def test_chat_template_defaults_parse_as_vllms(text, want):
    if isinstance(want, str):
        with pytest.raises(ValueError, match=want):
            chat_template_defaults(text)
    else:
        assert chat_template_defaults(text) == want


def test_thinking_off_by_default_unless_the_request_asks(tiny_converted):
    srv = LiveServer(FakeEngine([("ok", 1)], max_model_len=4096), tiny_converted(1, "int8"),
                     chat_defaults=(False, None))
    think_end = srv.ctx.encoder.control_ids["</think>"]
    think = srv.ctx.encoder.control_ids["<think>"]
    try:
        for path, body, last in [
                ("/v1/chat/completions", {"messages": MSG}, think_end),
                ("/v1/chat/completions", {"messages": MSG, "reasoning_effort": "high"}, think_end),
                ("/v1/chat/completions", {"messages": MSG, "thinking": True}, think),
                ("/v1/messages", {"messages": MSG, "max_tokens": 8,       # MAX_THINKING_TOKENS=0
                                  "output_config": {"effort": "high"}}, think_end),
                ("/v1/messages", {"messages": MSG, "max_tokens": 8,
                                  "thinking": {"type": "adaptive"}}, think),
                ("/v1/responses", {"input": "hi"}, think_end),
                ("/v1/responses", {"input": "hi", "reasoning": {"effort": "high"}}, think_end)]:
            st, text, _ = post(srv, path, {"model": "m", **body})
            assert st == 200 and srv.engine.last_prompt[-1] == last, (path, body, text)
        st, text, _ = post(srv, "/tokenize", {"messages": MSG})
        assert json.loads(text)["tokens"][-1] == think_end
    finally:
        srv.stop()
