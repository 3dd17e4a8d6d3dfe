"""A live backfit server on a free loopback port, in a thread (for the real openai SDK), and a
scripted fake engine for golden transcripts (exact outputs the random tiny model never makes)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from backfit.engine.engine import RequestOutput, Usage
from backfit.server.app import make_context, start_server


class LiveServer:
    """serve(engine) on 127.0.0.1:<free port> in a background event loop; .url, .ctx, stop()."""

    def __init__(self, engine, model_dir, **ctx_kw):
        self.engine = engine
        self.ctx = make_context(engine, str(model_dir), **ctx_kw)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.runner = self.loop.run_until_complete(start_server(self.ctx, "127.0.0.1", 0))
            started.set()
            self.loop.run_forever()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        started.wait(30)
        self.port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"

    def call(self, coro, timeout=60):
        """Run a coroutine on the server's loop (to inspect or poke the bridge)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self):
        self.call(self.runner.cleanup())
        if self.ctx.images is not None:                  # its image-fetch session
            self.call(self.ctx.images.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if hasattr(self.engine, "shutdown"):
            self.engine.shutdown()


@dataclass
class _Cfg:
    max_model_len: int = 1024
    max_num_seqs: int = 4


class FakeEngine:
    """AsyncEngine's surface (cfg, ready, error, generate, stats) over a script: each request
    yields `script` = [(text, n_tokens), ...] one delta per step, then finishes with
    `finish_reason`. `delay` seconds between deltas; `aborted` counts requests closed early;
    `cached`: the prompt tokens every request reports as prefix-cache hits."""

    def __init__(self, script=(), finish_reason="stop", delay=0.0, cached=0, **cfg):
        self.cfg = _Cfg(**cfg)
        self.cached = cached
        self.ready = threading.Event()
        self.ready.set()
        self.error = None
        self.script, self.finish_reason, self.delay = list(script), finish_reason, delay
        self.aborted = self.finished = self.running = 0
        self.last_prompt: list[int] | None = None
        self.last_params = self.last_images = None

    def stats(self) -> dict:
        return {"num_requests_running": self.running, "num_requests_waiting": 0,
                "kv_cache_usage": 0.0, "num_blocks": 8, "num_free_blocks": 8,
                "prompt_tokens": 0, "generation_tokens": 0}

    async def generate(self, ids, params, images=()):
        self.last_prompt, self.last_params, self.last_images = list(ids), params, images
        self.running += 1
        done, n = False, 0
        try:
            for k, (text, nt) in enumerate(self.script):
                if self.delay:
                    await asyncio.sleep(self.delay)
                n += nt
                last = k == len(self.script) - 1
                o = RequestOutput(0, text, list(range(nt)), num_cached_tokens=self.cached)
                if last:
                    o.finished, o.finish_reason = True, self.finish_reason
                    o.usage = Usage(len(ids), n, self.cached)
                    done = True
                yield o
        finally:
            self.running -= 1
            if done:
                self.finished += 1
            else:
                self.aborted += 1


def real_server(model_dir, *, started: bool = True, async_scheduling: bool | None = None,
                engine_kw: dict | None = None, **ctx_kw):
    """A LiveServer on the real tiny engine (float32, CPU, small pools). started=False: the
    engine is not started yet (health must answer 503 until .engine.start() and load).
    async_scheduling: the engine's overlapped step (forced on: its default on CUDA).
    engine_kw: EngineConfig fields to change (max_model_len, num_blocks, a speculative method...)."""
    import time

    from backfit.engine.async_engine import AsyncEngine
    from backfit.engine.engine import EngineConfig

    kw = dict(dtype="float32", block_size=16, max_num_seqs=8, max_model_len=2048,
              num_blocks=384, max_num_batched_tokens=2048, async_scheduling=async_scheduling)
    eng = AsyncEngine(EngineConfig(str(model_dir), **{**kw, **(engine_kw or {})}))
    srv = LiveServer(eng, model_dir, **ctx_kw)
    if started:
        eng.start()
        t = time.time()
        while not eng.ready.is_set():
            assert eng.error is None and time.time() - t < 120, f"engine failed: {eng.error}"
            time.sleep(0.02)
    return srv


class ImageHost:
    """A loopback HTTP server for image URLs (the fetch path of server/images.py), in a thread:
    /a.png (a PNG), /b.png (another), /big.png (`big` bytes, image/png), /text (text/plain),
    /redir (302 to /a.png), /slow (the PNG after `slow_s` seconds), anything else 404."""

    def __init__(self, png: bytes, png_b: bytes, big: int = 300_000, slow_s: float = 5.0):
        from aiohttp import web

        async def slow(_):
            await asyncio.sleep(slow_s)
            return web.Response(body=png, content_type="image/png")
        def serve(body, ctype):
            async def handler(_):
                return web.Response(body=body, content_type=ctype)
            return handler

        async def redirect(_):
            raise web.HTTPFound("/a.png")
        app = web.Application()
        app.router.add_get("/a.png", serve(png, "image/png"))
        app.router.add_get("/b.png", serve(png_b, "image/png"))
        app.router.add_get("/big.png", serve(b"\x89PNG" + b"0" * big, "image/png"))
        app.router.add_get("/text", serve(b"not an image", "text/plain"))
        app.router.add_get("/redir", redirect)
        app.router.add_get("/slow", slow)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.runner = web.AppRunner(app)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            started.set()
            self.loop.run_forever()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        started.wait(30)
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

