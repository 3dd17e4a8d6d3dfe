"""What a replica behind a router needs (docs/DEPLOY.md): a drain on SIGINT/SIGTERM
(`--shutdown-timeout`: /health and new requests 503 at once, admitted requests finish, the rest
end with an error at the timeout or a second signal), readiness vs liveness, and x-request-id
passed through headers and the log. FakeEngine scripts; the real processes behind a real router
are tests/deploy/test_replicas_router.py."""

import asyncio
import json
import logging
import threading
import urllib.request

import anthropic
import openai
import pytest
from live_server import FakeEngine, LiveServer
from test_app import _wait, get
from test_openai_chat import MSG, post
from test_tool_choice import REST, PhasedEngine, _req

from backfit.server.app import shut_down
from backfit.server.bridge import Bridge, SamplingParams
from backfit.server.chat_format import THINK_END
from backfit.server.parser import fold
from backfit.synthetic import write_small_tokenizer

REPLY = [("</think>", 1)] + [("x", 1)] * 30            # 31 steps


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A model dir with only the 512-id byte-level tokenizer: FakeEngine needs no weights."""
    d = tmp_path_factory.mktemp("tok")
    write_small_tokenizer(d, 512)
    return d


def _fake(tok_dir, delay=0.02, **kw):
    return LiveServer(FakeEngine(REPLY, delay=delay, **kw), tok_dir)


def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)


def _stream_in_thread(srv, out: dict) -> threading.Thread:
    def run():
        try:
            chunks = list(_client(srv).chat.completions.create(model="m", messages=MSG,
                                                               stream=True))
            out["text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            out["finish"] = chunks[-1].choices[0].finish_reason
        except openai.APIError as e:                # the error event of an ended stream
            out["error"] = str(e)
    t = threading.Thread(target=run)
    t.start()
    return t


def _shut_down(srv, timeout: float):
    """shut_down on the server's loop, not waited for -> (its future, the 'second signal')."""
    again = asyncio.Event()
    fut = asyncio.run_coroutine_threadsafe(shut_down(srv.ctx, timeout, again), srv.loop)
    return fut, lambda: srv.loop.call_soon_threadsafe(again.set)


def test_drain_finishes_admitted_requests_and_refuses_new_ones(tok_dir):
    """The first signal: /health turns 503 `draining` (liveness stays 200) and a new request
    gets a retryable 503 while the admitted stream runs to its normal end; then shut_down
    returns without aborting anything."""
    srv = _fake(tok_dir, delay=0.03)
    try:
        out = {}
        t = _stream_in_thread(srv, out)
        _wait(lambda: srv.ctx.bridge.active == 1)
        fut, _ = _shut_down(srv, 30.0)
        _wait(lambda: srv.ctx.bridge.draining)
        st, body, h = get(srv, "/health")
        assert st == 503 and json.loads(body)["status"] == "draining" and h["Retry-After"]
        assert get(srv, "/health/live")[0] == 200 and get(srv, "/health/ready")[0] == 503
        st, body, h = post(srv, "/v1/chat/completions", {"model": "m", "messages": MSG})
        assert st == 503 and json.loads(body)["error"]["code"] == "overloaded"
        assert h["Retry-After"] == "5"
        assert not fut.done() and srv.ctx.bridge.active == 1      # still streaming
        t.join(30)
        fut.result(10)
        assert out == {"text": "x" * 30, "finish": "stop"}, out
        assert srv.engine.finished == 1 and srv.engine.aborted == 0
    finally:
        srv.stop()


@pytest.mark.parametrize("how", ["timeout", "second signal"])
def test_drain_ends_what_is_left_at_the_timeout_or_a_second_signal(tok_dir, how):
    """A stream longer than the drain: it ends with an error event when the timeout passes or a
    second signal comes, long before its own end (31 steps x 0.2 s)."""
    srv = _fake(tok_dir, delay=0.2)
    try:
        out = {}
        t = _stream_in_thread(srv, out)
        _wait(lambda: srv.ctx.bridge.active == 1)
        fut, second = _shut_down(srv, 0.3 if how == "timeout" else 60.0)
        if how == "second signal":
            _wait(lambda: srv.ctx.bridge.draining)
            second()
        fut.result(5)
        t.join(10)
        assert "shutting down" in out["error"] and srv.engine.aborted == 1
    finally:
        srv.stop()


def test_a_drain_lets_an_admitted_two_part_request_finish(encoder):
    """tool_choice required runs as two engine requests (bridge.Bridge._forced): a drain that
    starts during the reasoning still admits the continuation — the call comes out whole."""
    te = encoder.tokenizer.token_to_id(THINK_END)
    eng = PhasedEngine([[("Need", [10]), (" the", [11]), (THINK_END, [te])], [(REST, [20, 21])]],
                       [("stop", te), ("stop", None)])
    prompt = encoder.encode_request(_req("required"))
    bridge = Bridge(eng, max_model_len=4096, max_num_seqs=4)

    async def go():
        got = []
        async for e in bridge.stream(prompt, SamplingParams(max_tokens=64), tools=True):
            if not got:
                bridge.stop_admitting()
            got.append(e)
        return got
    events = asyncio.run(go())
    assert len(eng.calls) == 2 and events[-1].reason == "tool_calls"
    assert [c.name for c in fold(events).tool_calls] == ["get_weather"]


def test_liveness_and_readiness(tok_dir):
    """Loading: not ready, alive. Ready: both. Engine failed: neither (restart it)."""
    srv = _fake(tok_dir)
    try:
        srv.engine.ready.clear()
        want = {"/health": (503, "loading"), "/ping": (503, "loading"),
                "/health/ready": (503, "loading"), "/health/live": (200, "loading")}
        for path, (st, state) in want.items():
            got, body, _ = get(srv, path)
            assert (got, json.loads(body)["status"]) == (st, state), path
        srv.engine.ready.set()
        for path in want:
            assert get(srv, path)[:2] == (200, json.dumps({"status": "ok"},
                                                           separators=(",", ":"))), path
        srv.engine.error = RuntimeError("rank 1 died")
        for path in want:
            got, body, _ = get(srv, path)
            assert (got, json.loads(body)["status"]) == (503, "failed"), path
    finally:
        srv.stop()


def test_request_id_passes_through_headers_and_the_log(tok_dir, caplog):
    """A router's x-request-id comes back on plain and streamed responses of each protocol
    and is in the log line with the completion's own id; an invalid one is not echoed; without
    one the response carries the completion's id, or a fresh one on an error."""
    caplog.set_level(logging.INFO, logger="backfit.server")
    srv = _fake(tok_dir, delay=0.0)
    try:
        c = _client(srv)
        rid = {"x-request-id": "router-7f3a"}
        r = c.chat.completions.with_raw_response.create(model="m", messages=MSG,
                                                        extra_headers=rid)
        cid = r.parse().id
        assert r.headers["x-request-id"] == "router-7f3a" and cid.startswith("chatcmpl-")
        with c.chat.completions.with_streaming_response.create(
                model="m", messages=MSG, stream=True, extra_headers=rid) as s:
            assert s.headers["x-request-id"] == "router-7f3a"
            s.read()                 # to its end: the log line is written when the stream ends
        with c.responses.with_streaming_response.create(
                model="m", input="hi", stream=True, extra_headers=rid) as s:
            assert s.headers["x-request-id"] == "router-7f3a"
            s.read()
        a = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
        m = a.messages.with_raw_response.create(model="m", max_tokens=8, messages=MSG,
                                                extra_headers=rid)
        assert m.headers["x-request-id"] == "router-7f3a"
        m = a.messages.with_raw_response.create(model="m", max_tokens=8, messages=MSG)
        assert m.headers["x-request-id"] == m.parse().id and m.parse().id.startswith("msg_")
        r = c.chat.completions.with_raw_response.create(model="m", messages=MSG)
        assert r.headers["x-request-id"] == r.parse().id
        for bad in ("has space", "x" * 129):
            r = c.chat.completions.with_raw_response.create(
                model="m", messages=MSG, extra_headers={"x-request-id": bad})
            assert r.headers["x-request-id"] == r.parse().id
        st, _, h = post(srv, "/v1/chat/completions", {"model": "m"})
        assert st == 400 and h["x-request-id"].startswith("req-")
        lines = [rec.getMessage() for rec in caplog.records if "request_id=" in rec.getMessage()]
        assert "POST /v1/chat/completions 200" in lines[0] and \
            lines[0].endswith(f"request_id=router-7f3a id={cid}"), lines
        assert any(ln.startswith("POST /v1/responses 200") and "request_id=router-7f3a" in ln
                   for ln in lines), lines
        assert not any("/health" in ln or "/metrics" in ln for ln in lines)
    finally:
        srv.stop()


def test_metrics_carry_the_gauges_a_router_reads(tok_dir):
    """The router scrapes vllm:num_requests_running / _waiting and vllm:kv_cache_usage_perc
    (its vLLM-worker load path): present, with the engine's numbers, while a request runs."""
    srv = _fake(tok_dir, delay=0.05)
    try:
        out = {}
        t = _stream_in_thread(srv, out)
        _wait(lambda: srv.engine.running == 1)
        with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        for name, want in (("vllm:num_requests_running", 1.0),
                           ("vllm:num_requests_waiting", 0.0), ("vllm:kv_cache_usage_perc", 0.0)):
            rows = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
            assert len(rows) == 1 and float(rows[0].rsplit(" ", 1)[1]) == want, (name, rows)
        t.join(30)
    finally:
        srv.stop()
