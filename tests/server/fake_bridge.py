"""A fake Bridge (scripted neutral events) and an in-process app around one protocol handler,
shared by the Responses and Anthropic unit tests."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from backfit.server.bridge import CTX, ServerContext


class FakeBridge:
    """Bridge.stream's contract: events, or an exception before the first; records closes."""

    def __init__(self):
        self.events, self.raise_first, self.calls, self.closed = [], None, [], 0

    async def stream(self, prompt, params, *, tools, stop=()):
        self.calls.append({"prompt": prompt, "params": params, "tools": tools, "stop": stop})
        if self.raise_first is not None:
            raise self.raise_first
        try:
            for e in self.events:
                await asyncio.sleep(0)
                yield e
        finally:
            self.closed += 1


def post(encoder, bridge, routes: dict, path: str, body=None, raw: bytes | None = None,
         headers: dict | None = None):
    """POST body (or raw bytes) to `path` on an app with `routes` {path: handler} around the
    fake bridge -> (status, headers, text)."""
    async def go():
        app = web.Application()
        app[CTX] = ServerContext(bridge=bridge, encoder=encoder, model_name="deepseek-v4-flash",
                                 max_model_len=4096, api_key=None, tokenizer=None)
        for p, handler in routes.items():
            app.router.add_post(p, handler)
        async with TestClient(TestServer(app)) as c:
            r = await c.post(path, data=raw if raw is not None else json.dumps(body),
                             headers=headers or {})
            return r.status, r.headers, await r.text()
    return asyncio.run(go())


def sse(text: str) -> list[tuple[str, dict]]:
    """An SSE body -> [(event, data)], comment lines (keep-alives) skipped."""
    out = []
    for frame in text.strip().split("\n\n"):
        lines = frame.split("\n")
        if lines[0].startswith(":"):
            continue
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), frame
        out.append((lines[0][7:], json.loads(lines[1][6:])))
    return out
