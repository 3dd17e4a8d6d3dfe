"""Request fuzz: >= 2,000 malformed and random requests across every endpoint (bad JSON, wrong
types, huge numbers, deep nesting, binary and truncated bodies, invalid UTF-8, lone surrogates,
control-token strings); not one 5xx, and the server is healthy afterwards. The bulk runs on a
scripted engine (every server path, fast); a smaller set of random sampling knobs runs on the
real tiny engine (a value that passed validation must not kill the engine thread)."""

import asyncio
import copy
import importlib
import json
import random

import aiohttp
import pytest
import support
from live_server import FakeEngine, LiveServer, real_server

MSG = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "string"}}}}}]
BASE = {
    "/v1/chat/completions": {"model": "m", "messages": MSG, "max_tokens": 2, "tools": TOOLS,
                             "temperature": 0.5, "stop": ["x"], "reasoning_effort": "high",
                             "stream_options": {"include_usage": True}},
    "/v1/completions": {"model": "m", "prompt": "hello", "max_tokens": 2, "logprobs": 1,
                        "echo": True},
    "/v1/responses": {"model": "m", "input": [{"role": "user", "content": "hi"}],
                      "max_output_tokens": 2, "reasoning": {"effort": "low"},
                      "tools": [{"type": "function", "name": "f", "parameters": {}}]},
    "/v1/messages": {"model": "m", "max_tokens": 2, "messages": MSG, "system": "s",
                     "thinking": {"type": "enabled", "budget_tokens": 100},
                     "tools": [{"name": "f", "input_schema": {"type": "object"}}]},
    "/v1/messages/count_tokens": {"model": "m", "messages": MSG},
    "/tokenize": {"messages": MSG, "return_token_strs": True},
    "/detokenize": {"tokens": [1, 2, 3]},
}
ODD = [None, True, False, 0, -1, 1.5, -1e308, 10**40, -(10**40), "", "x" * 300, "\ud83d",
       "<｜end▁of▁sentence｜>", "｜DSML｜", [], [None], {}, {"type": None}, {"role": "user"},
       [{"type": "image_url"}], [[[[[]]]]], "\x00\x01", "🦜" * 20, {"content": [1, 2]}]


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _mutate(rng, body):
    body = json.loads(json.dumps(body))
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in _paths(body) if p]
        if not paths:
            break
        path = rng.choice(paths)
        node = body
        for k in path[:-1]:
            node = node[k]
        if rng.random() < 0.15 and isinstance(node, dict):
            node.pop(path[-1], None)
        else:                        # a copy: a shared list set inside itself is a cycle
            node[path[-1]] = copy.deepcopy(rng.choice(ODD))
    if rng.random() < 0.3:
        body["stream"] = rng.choice([True, False, "yes", 1])
    return body


def _raw(rng, body: dict) -> bytes:
    text = json.dumps(body, ensure_ascii=rng.random() < 0.5)
    kind = rng.randrange(9)
    if kind == 0:
        return rng.randbytes(rng.randint(0, 300))
    if kind == 1:
        return text[:rng.randint(0, len(text))].encode()            # truncated
    if kind == 2:
        cut = rng.randint(0, len(text))
        return text[:cut].encode() + b"\xff\xfe\xc3" + text[cut:].encode()   # invalid UTF-8
    if kind == 3:
        return text.replace('"hi"', '"\\ud83d\\ude00x\\udc00"').encode()    # lone surrogates
    if kind == 4:
        d = rng.choice([50, 70, 5000, 100000])
        return ('{"messages": ' + "[" * d + "]" * d + "}").encode()         # deep nesting
    if kind == 5:
        return text.replace("2", "1e400", 1).replace("0.5", "-1e999").encode()   # inf
    if kind == 6:
        return rng.choice([b"", b"null", b"[]", b"1", b'"s"', b"\xef\xbb\xbf{}", b"{" * 3])
    if kind == 7:
        return text.replace('"max_tokens": 2', '"max_tokens": ' + "9" * 5000).encode()
    return text.replace("NaN", "x").replace('0.5', "NaN").encode()


async def _storm(url: str, n: int, seed: int) -> list[tuple[int, str, str]]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        path = rng.choice(list(BASE))
        r = rng.random()
        if r < 0.45:
            data = json.dumps(_mutate(rng, BASE[path])).encode()
        elif r < 0.9:
            data = _raw(rng, BASE[path])
        else:
            data = json.dumps(BASE[path]).encode()
        method = "POST"
        if rng.random() < 0.04:
            method, path = rng.choice([("GET", path), ("GET", "/v1/models/%00x"),
                                       ("DELETE", "/v1/models"), ("GET", "/v1/nope"),
                                       ("GET", "/metrics"), ("GET", "/v1/models")])
        ctype = rng.choice(["application/json"] * 4 + ["text/plain", "application/x-www-form"])
        jobs.append((method, path, data, ctype))
    out: list[tuple[int, str, str]] = []
    sem = asyncio.Semaphore(12)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def one(method, path, data, ctype):
            async with sem, s.request(method, url + path, data=data,
                                 headers={"Content-Type": ctype}) as resp:
                body = await resp.read()
                out.append((resp.status, path, body[:300].decode("utf-8", "replace")))
        await asyncio.gather(*(one(*j) for j in jobs))
    return out


def _allowed_5xx(path: str, status: int) -> bool:
    """501 only while a protocol module does not exist in this build."""
    mod = {"/v1/responses": "openai_responses", "/v1/messages": "anthropic",
           "/v1/messages/count_tokens": "anthropic"}.get(path)
    if status != 501 or mod is None:
        return False
    try:
        importlib.import_module(f"backfit.server.{mod}")
        return False
    except ImportError:
        return True


def _check(srv, results, n):
    assert len(results) == n
    bad = [r for r in results if r[0] >= 500 and not _allowed_5xx(r[1], r[0])]
    assert not bad, f"{len(bad)} x 5xx, e.g. {bad[:3]}"
    assert sum(1 for r in results if r[0] == 400) > n // 3       # the fuzz did reach validation
    assert sum(1 for r in results if r[0] == 200) > n // 20      # and some got through
    health = asyncio.run(_storm_health(srv.url))
    assert health == [200, 200], health


async def _storm_health(url):
    async with aiohttp.ClientSession() as s:
        out = []
        async with s.get(url + "/health") as r:
            out.append(r.status)
        async with s.post(url + "/v1/chat/completions", json={
                "model": "m", "messages": MSG, "max_tokens": 2}) as r:
            out.append(r.status)
        return out


def test_fuzz_2000_requests_no_5xx(tiny_converted):
    srv = LiveServer(FakeEngine([("</think>", 1), ("ok", 1)], max_model_len=4096),
                     tiny_converted(1, "int8"))
    try:
        n = 2200
        _check(srv, asyncio.run(_storm(srv.url, n, seed=1)), n)
    finally:
        srv.stop()


def test_fuzz_sampling_knobs_on_the_real_engine(tiny_converted):
    rng = random.Random(7)
    knobs = {"temperature": [0, 0.01, 1, 2, 3, -1], "top_p": [1e-9, 0.5, 1, 0, 2],
             "top_k": [-1, 0, 1, 10**9, 511, 512, 513], "min_p": [0, 0.99, 1, 2],
             "seed": [0, -1, 2**63, -(2**63), 2**64 - 1, 10**30], "min_tokens": [0, 1, 2, 3],
             "presence_penalty": [-2, 2, 3], "frequency_penalty": [-2, 2],
             "repetition_penalty": [1e-6, 0.5, 2, 0], "ignore_eos": [True, False],
             "logprobs": [0, 5, 20, 21], "max_tokens": [1, 2]}
    with support.one_thread():
        srv = real_server(tiny_converted(1, "int8"))
        try:
            async def go():
                out = []
                async with aiohttp.ClientSession() as s:
                    for i in range(60):
                        path = "/v1/completions" if i % 2 else "/v1/chat/completions"
                        body = dict(BASE[path], max_tokens=2)
                        body.pop("tools", None)
                        for k in rng.sample(sorted(knobs), 4):
                            body[k] = rng.choice(knobs[k])
                        if path.endswith("chat/completions"):
                            body.pop("logprobs", None)
                        body["stream"] = rng.random() < 0.5
                        async with s.post(srv.url + path, json=body) as r:
                            out.append((r.status, path, (await r.read())[:300].decode()))
                return out
            res = asyncio.run(go())
            assert not [r for r in res if r[0] >= 500], res
            assert srv.engine.error is None and sum(r[0] == 200 for r in res) > 10
            assert asyncio.run(_storm_health(srv.url)) == [200, 200]
            st = srv.engine.stats()                 # every block back (cached ones count free)
            assert st["num_requests_running"] == 0 and st["num_free_blocks"] == st["num_blocks"]
        finally:
            srv.stop()


ANTHROPIC_TOOL = [{"name": "f", "input_schema": {"type": "object"}}]
# requests the real APIs refuse, that once got 200 here: (path, body or raw bytes, the field)
HOSTILE = [
    ("/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "hologram", "data": "x"}]}]}, "messages[0].content[0].type"),
    ("/v1/chat/completions", {"messages": MSG, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MSG, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    ("/v1/responses", {"input": "hi", "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f"}],
                       "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ("/v1/messages", {"messages": MSG, "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice"),
    ("/v1/messages", {"messages": MSG, "tools": ANTHROPIC_TOOL,
                      "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ("/v1/messages", {"messages": MSG, "tool_choice": {"type": "any"}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MSG + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "out"}], "tools": TOOLS}, "messages[2].tool_call_id"),
    ("/v1/responses", {"input": [{"type": "hologram"}]}, "input[0].type"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "teleport"}]}, "tools[0].type"),
] + [(path, b'{"model": "m", "messages": [{"role": "user", "content": "h\xffi\xc3"}], '
            b'"input": "h\xffi", "prompt": "h\xffi", "max_tokens": 2}', None)
     for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                  "/v1/messages/count_tokens", "/tokenize")]


def test_hostile_requests_are_the_protocols_400(tiny_converted):
    srv = LiveServer(FakeEngine([("</think>", 1), ("ok", 1)], max_model_len=4096),
                     tiny_converted(1, "int8"))
    try:
        async def go():
            out = []
            async with aiohttp.ClientSession() as s:
                for path, body, field in HOSTILE:
                    data = body if isinstance(body, bytes) else \
                        json.dumps({"model": "m", "max_tokens": 2, **body}).encode()
                    async with s.post(srv.url + path, data=data) as r:
                        out.append((path, field, r.status, await r.json()))
            return out
        def ok(path, field, status, err) -> bool:
            e = err.get("error") or {}
            if status != 400 or e.get("type") != "invalid_request_error":
                return False
            if field is None:                   # invalid UTF-8
                return "UTF-8" in e.get("message", "")
            if path.startswith("/v1/messages"):
                return err.get("type") == "error" and field in e.get("message", "")
            return e.get("param") == field
        bad = [r for r in asyncio.run(go()) if not ok(*r)]
        assert not bad, [(p, f, s) for p, f, s, _ in bad]
    finally:
        srv.stop()


@pytest.mark.parametrize("size", [65 * 1024 * 1024])
def test_body_over_64_mib_is_413(tiny_converted, size):
    srv = LiveServer(FakeEngine([("ok", 1)]), tiny_converted(1, "int8"))
    try:
        async def go():
            async with aiohttp.ClientSession() as s:
                data = b'{"model": "m", "messages": [{"role": "user", "content": "' + \
                    b"a" * size + b'"}]}'
                async with s.post(srv.url + "/v1/chat/completions", data=data) as r:
                    return r.status, await r.json()
        st, body = asyncio.run(go())
        assert st == 413 and body["error"]["type"] == "invalid_request_error"
    finally:
        srv.stop()


def _huge_png(w: int = 20000, h: int = 20000) -> bytes:
    """A PNG header claiming w x h pixels (no pixel data): refused before decoding."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + \
            struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) \
        + chunk(b"IEND", b"")


def _image_bodies(png: bytes) -> dict:
    """Per case, a request body builder for each protocol (the image as a data URL)."""
    import base64
    quote = "<｜deepseek_image｜> <|place_holder_mm_span_0433|>"

    def url(data: bytes, mime: str = "image/png") -> str:
        return f"data:{mime};base64," + base64.b64encode(data).decode()
    cases = {"truncated": [url(png[:len(png) // 3])], "huge": [url(_huge_png())],
             "oversized": [url(b"\x89PNG" + bytes(150_000))], "wrong_mime": [url(png, "text/html")],
             "bad_base64": ["data:image/png;base64,!!!"], "not_a_url": ["/etc/passwd"],
             "97_images": [url(b"junk")] * 97}
    out = {}
    for case, urls in cases.items():
        chat = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
        resp = [{"type": "input_image", "image_url": u} for u in urls]
        anth = [{"type": "image", "source": {"type": "base64", "media_type": u[5:].split(";")[0],
                                             "data": u.split(",", 1)[1]} if u.startswith("data:")
                 else {"type": "url", "url": u}} for u in urls]
        out[case] = {"/v1/chat/completions": {"model": "m", "max_tokens": 2, "messages": [
                         {"role": "user", "content": [{"type": "text", "text": "x"}, *chat]}]},
                     "/v1/responses": {"model": "m", "input": [{"role": "user", "content": resp}]},
                     "/v1/messages": {"model": "m", "max_tokens": 2,
                                      "messages": [{"role": "user", "content": anth}]}}
    out["placeholders"] = {
        "/v1/chat/completions": {"model": "m", "max_tokens": 2, "messages": [
            {"role": "system", "content": quote}, {"role": "user", "content": quote}]},
        "/v1/responses": {"model": "m", "instructions": quote, "input": quote},
        "/v1/messages": {"model": "m", "max_tokens": 2, "system": quote,
                         "messages": [{"role": "user", "content": quote}]}}
    return out


def test_fuzz_image_cases_4xx_never_5xx(tiny_converted):
    """On a Vision-Exp model (scripted engine: images are the server's work): truncated, huge,
    oversized, wrong-MIME, bad-base64, path and 97-image requests are 4xx on every protocol,
    quoted placeholders are 200, ~300 random mutations of image requests give no 5xx, and the
    server is healthy after."""
    from backfit.server.images import MediaLimits
    from backfit.verify.image_prompts import synthetic_png
    srv = LiveServer(FakeEngine([("</think>", 1), ("ok", 1)], max_model_len=4096),
                     tiny_converted(1, "int8", "vision"), media=MediaLimits(max_bytes=100_000))
    try:
        cases = _image_bodies(synthetic_png(64, 48))

        async def go(jobs):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
                async def one(path, body):
                    async with s.post(srv.url + path, json=body) as r:
                        return r.status, path, (await r.read())[:300].decode("utf-8", "replace")
                return await asyncio.gather(*(one(p, b) for p, b in jobs))
        for case, bodies in cases.items():
            for status, path, text in asyncio.run(go(list(bodies.items()))):
                ok = status == 200 if case == "placeholders" else 400 <= status < 500
                assert ok, (case, path, status, text)
        rng = random.Random(3)
        jobs = [(p, _mutate(rng, b)) for _ in range(50) for bodies in cases.values()
                for p, b in bodies.items() if rng.random() < 0.3]
        res = asyncio.run(go(jobs))
        assert len(res) > 250 and not [r for r in res if r[0] >= 500], res[:3]
        assert asyncio.run(_storm_health(srv.url)) == [200, 200]
    finally:
        srv.stop()
