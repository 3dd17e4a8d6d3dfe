"""The aiohttp application: routes, auth, CORS, error shapes, and `serve` (the CLI's entry).

    POST /v1/chat/completions        openai_chat.handle
    POST /v1/completions             openai_completions.handle (legacy; lm-eval)
    POST /v1/responses               openai_responses.handle           (imported lazily)
    POST /v1/messages[/count_tokens] anthropic.handle_messages / handle_count_tokens
    GET  /v1/models[/{id}]           OpenAI list, or Anthropic's with an anthropic-version header
    POST /tokenize, /detokenize      vLLM-compatible (also under /v1/; tokenizer_api.py)
    GET  /tokenizer_info             vLLM's: the tokenizer's config (lm-eval's remote tokenizer)
    GET  /health, /ping, /health/ready   readiness: 200 while new requests are taken; 503
                                     while loading, draining or failed (what a router probes)
    GET  /health/live                liveness: 200 while loading, serving or draining; 503 once
                                     the engine failed (restart the replica)
    GET  /version                    {"version"}
    GET  /metrics                    Prometheus text (metrics.py)
Every POST route is also served without the /v1 prefix (clients with bare base URLs).
x-request-id in, out and in the log: request_ids.py.
Errors come in the protocol's own shape: Anthropic's for /v1/messages*, OpenAI's elsewhere;
an unexpected exception is logged and answered 500 with `x-should-retry: false` (the fuzz
test holds this at zero). Auth (`--api-key`): `Authorization: Bearer` or `x-api-key`,
compared in constant time, on every path but OPTIONS, /health, /ping, /version and /metrics.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib
import json
import logging
import time

from aiohttp import web

from backfit import __version__
from backfit.server import openai_chat, openai_completions, tokenizer_api
from backfit.server.bridge import CTX, ContextTooLong, EngineUnavailable, QueueFull, ServerContext
from backfit.server.http import MAX_BODY, BadRequest, json_response
from backfit.server.metrics import CONTENT_TYPE
from backfit.server.openai_chat import error_response
from backfit.server.request_ids import RID_IN, on_prepare, request_ids

__all__ = [
    "OPEN_PATHS",
    "anthropic_error",
    "build_app",
    "chat_template_defaults",
    "default_max_tokens",
    "engine_ready",
    "make_context",
    "ready_line",
    "serve",
    "shut_down",
    "start_server",
]

log = logging.getLogger("backfit.server")
OPEN_PATHS = ("/health", "/ping", "/health/ready", "/health/live", "/version", "/metrics")
_CORS = {"Access-Control-Allow-Origin": "*", "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
         "Access-Control-Expose-Headers": "x-request-id, request-id, retry-after",
         "Access-Control-Max-Age": "600"}


def _is_anthropic(path: str) -> bool:
    return path.startswith(("/v1/messages", "/messages"))


def anthropic_error(status: int, type_: str, message: str, headers: dict | None = None):
    return json_response({"type": "error", "error": {"type": type_, "message": message}},
                         status, headers)


def _error(path: str, status: int, message: str, headers: dict | None = None,
           param: str | None = None, code: str | None = None) -> web.Response:
    if _is_anthropic(path):
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}
        return anthropic_error(status, kind.get(status, "api_error"), message, headers)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return error_response(status, message, kind, param, code, headers)


# ---- middlewares ---------------------------------------------------------------------------

@web.middleware
async def cors(request: web.Request, handler):
    if request.method == "OPTIONS":
        asked = request.headers.get("Access-Control-Request-Headers", "authorization, "
                                    "content-type, x-api-key, anthropic-version")
        return web.Response(status=204, headers={**_CORS, "Access-Control-Allow-Headers": asked})
    resp = await handler(request)
    if not resp.prepared:
        resp.headers.update({k: v for k, v in _CORS.items() if k not in resp.headers})
    return resp


@web.middleware
async def errors(request: web.Request, handler):
    path = request.path
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(path, e.status, e.reason or "error")
    except BadRequest as e:
        return _error(path, e.status, e.message, param=e.param, code=e.code)
    except QueueFull as e:
        status = 529 if _is_anthropic(path) else 429
        return _error(path, status, str(e), {"Retry-After": str(e.retry_after)},
                      code="rate_limit_exceeded")
    except EngineUnavailable as e:
        return _error(path, 503, str(e), {"Retry-After": str(e.retry_after)}, code="overloaded")
    except ContextTooLong as e:
        return _error(path, 400, str(e), param="messages", code="context_length_exceeded")
    except ValueError as e:                        # the engine refused the request (add)
        return _error(path, 400, str(e)[:500])
    except (ConnectionError, asyncio.CancelledError):
        raise
    except Exception as e:
        log.exception("unhandled error on %s %s (request_id=%s)", request.method, path,
                      request.get(RID_IN, "-"))
        return _error(path, 500, f"internal error: {type(e).__name__}",
                      {"x-should-retry": "false"})


@web.middleware
async def auth(request: web.Request, handler):
    key = request.app[CTX].api_key
    if key and request.method != "OPTIONS" and request.path not in OPEN_PATHS:
        given = request.headers.get("x-api-key", "")
        bearer = request.headers.get("Authorization", "")
        if bearer[:7].lower() == "bearer ":
            given = bearer[7:].strip()
        if not hmac.compare_digest(given.encode("utf-8", "replace"), key.encode()):
            if _is_anthropic(request.path):
                return anthropic_error(401, "authentication_error", "invalid x-api-key")
            return error_response(401, "Invalid API key", code="invalid_api_key")
    return await handler(request)


# ---- small endpoints -----------------------------------------------------------------------

async def health(request: web.Request) -> web.Response:
    """Readiness: 200 only while new requests are admitted."""
    b = request.app[CTX].bridge
    if b.ready:
        return json_response({"status": "ok"})
    return json_response({"status": b.state}, 503, {"Retry-After": "5"})


async def live(request: web.Request) -> web.Response:
    """Liveness: loading and draining are alive; a failed engine is not."""
    state = request.app[CTX].bridge.state
    return json_response({"status": state}, 503 if state == "failed" else 200)


async def version(request: web.Request) -> web.Response:
    return json_response({"version": __version__})


async def metrics(request: web.Request) -> web.Response:
    m = request.app[CTX].metrics
    body = m.render() if m is not None else b""
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def _model_card(ctx: ServerContext, name: str) -> dict:
    return {"id": name, "object": "model", "created": ctx.created, "owned_by": "backfit",
            "root": ctx.model_name, "parent": None, "max_model_len": ctx.max_model_len,
            "context_window": ctx.max_model_len}


def _anthropic_card(ctx: ServerContext, name: str) -> dict:
    ts = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ctx.created))
    return {"type": "model", "id": name, "display_name": name, "created_at": ts}


async def models(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    names = (ctx.model_name, *ctx.aliases)
    if "anthropic-version" in request.headers:
        data = [_anthropic_card(ctx, n) for n in names]
        return json_response({"data": data, "has_more": False, "first_id": names[0],
                              "last_id": names[-1]})
    return json_response({"object": "list", "data": [_model_card(ctx, n) for n in names]})


async def model(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    name = request.match_info["id"]
    if name not in (ctx.model_name, *ctx.aliases):
        return error_response(404, f"The model {name!r} does not exist", param="model",
                              code="model_not_found")
    if "anthropic-version" in request.headers:
        return json_response(_anthropic_card(ctx, name))
    return json_response(_model_card(ctx, name))


# ---- protocol modules written elsewhere, imported lazily -----------------------------------

def _lazy(module: str, attr: str, anthropic: bool):
    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            mod = importlib.import_module(f"backfit.server.{module}")
            fn = getattr(mod, attr)
        except (ImportError, AttributeError):
            return _error("/v1/messages" if anthropic else "/v1/responses", 501,
                          f"{request.path} is not implemented in this build")
        return await fn(request)
    return handler


def build_app(ctx: ServerContext) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY,
                          middlewares=[request_ids, cors, errors, auth])
    app[CTX] = ctx
    app.on_response_prepare.append(on_prepare)
    post = [("/chat/completions", openai_chat.handle),
            ("/completions", openai_completions.handle),
            ("/responses", _lazy("openai_responses", "handle", False)),
            ("/messages", _lazy("anthropic", "handle_messages", True)),
            ("/messages/count_tokens", _lazy("anthropic", "handle_count_tokens", True)),
            ("/tokenize", tokenizer_api.tokenize), ("/detokenize", tokenizer_api.detokenize)]
    for path, fn in post:
        app.router.add_post("/v1" + path, fn)
        app.router.add_post(path, fn)
    for path, fn in (("/v1/models", models), ("/models", models), ("/v1/models/{id}", model),
                     ("/tokenizer_info", tokenizer_api.tokenizer_info),
                     ("/v1/tokenizer_info", tokenizer_api.tokenizer_info),
                     ("/health", health), ("/ping", health), ("/health/ready", health),
                     ("/health/live", live), ("/version", version),
                     ("/metrics", metrics)):
        app.router.add_get(path, fn)
    return app


async def start_server(ctx: ServerContext, host: str, port: int) -> web.AppRunner:
    """Listen now (health answers 503 until the engine is ready). handler_cancellation: a
    client that goes away cancels its handler, which aborts its engine request (§7.9)."""
    runner = web.AppRunner(build_app(ctx), handler_cancellation=True, access_log=None,
                           shutdown_timeout=5)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


# ---- assembling a server -------------------------------------------------------------------

def make_context(engine, model_dir: str, *, model_name: str = "deepseek-v4-flash",
                 api_key: str | None = None, max_queue: int = 256, keepalive_s: float = 10.0,
                 aliases: tuple[str, ...] = (), encoder_profile: str = "flash",
                 default_max_tokens: int | None = None,
                 chat_defaults: tuple[bool | None, str | None] = (None, None),
                 media=None) -> ServerContext:
    """ServerContext over an engine (AsyncEngine, or a test double with the same surface:
    cfg, ready, error, generate, stats). The tokenizer is read from model_dir, and its
    config.json (when there) says whether the model reads images. media: the image limits
    (server.images.MediaLimits; default: its defaults). A max_model_len the engine picks while
    loading (cfg None) is filled in by `engine_ready`."""
    from pathlib import Path

    from backfit.config import ModelConfig
    from backfit.server.bridge import Bridge, load_tokenizer
    from backfit.server.chat_format import ChatEncoder
    from backfit.server.images import ImageInput, MediaLimits
    from backfit.server.metrics import Metrics
    from backfit.server.tokenizer_api import load_tokenizer_config

    tok = load_tokenizer(model_dir)
    m = Metrics(model_name, engine.stats)
    bridge = Bridge(engine, max_model_len=engine.cfg.max_model_len,
                    max_num_seqs=engine.cfg.max_num_seqs, max_queue=max_queue,
                    keepalive_s=keepalive_s, metrics=m, default_max_tokens=default_max_tokens)
    path = Path(model_dir) / "config.json"
    cfg = ModelConfig.from_file(path) if path.exists() else None
    images = None
    if cfg is not None and cfg.vision is not None:
        images = ImageInput(cfg.vision, media or MediaLimits())
    encoder = ChatEncoder(tok, encoder_profile, *chat_defaults,
                          vocab_size=cfg.vocab_size if cfg is not None else None)
    return ServerContext(bridge, encoder, model_name, engine.cfg.max_model_len, api_key, tok,
                         tuple(aliases), int(time.time()), m, images=images,
                         tokenizer_config=load_tokenizer_config(model_dir))


def engine_ready(ctx: ServerContext, engine) -> None:
    """The loaded engine's context length (cfg's, or the longest its KV pools hold)."""
    ctx.max_model_len = ctx.bridge.max_model_len = engine.max_model_len


def ready_line(engine, host: str, port: int, t_start: float) -> str:
    """The start-up report: address, capacity from the planner's pools, time to ready."""
    e = engine.engine
    t = getattr(e, "timings", {}) or {}
    total = time.perf_counter() - t_start
    cap = e.num_blocks * e.block_size
    graphs = (f"CUDA graphs {t['graphs_s']:.1f} s" if "graphs_s" in t else "no CUDA graphs")
    auto = " (the longest the KV pool holds)" if e.cfg.max_model_len is None else ""
    if "prefill_graphs_s" in t:
        graphs += f" + prefill pieces {t['prefill_graphs_s']:.1f} s"
    return (f"backfit serve: ready on http://{host}:{port} (model {e.cfg.model}, tp {e.cfg.tp}, "
            f"{e.cfg.device}) | capacity: {e.num_blocks} blocks x {e.block_size} tokens = "
            f"{cap} cached tokens, {e.cfg.max_num_seqs} sequences, max_model_len "
            f"{e.max_model_len}{auto}, {e.max_num_batched_tokens} tokens a step | "
            f"ready in {total:.1f} s: weights {t.get('weights_s', 0):.1f} s, pools "
            f"{t.get('pools_s', 0):.1f} s, {graphs}")


async def shut_down(ctx: ServerContext, timeout: float, again: asyncio.Event) -> None:
    """After SIGINT/SIGTERM (vLLM's --shutdown-timeout): /health turns 503 and new requests get
    503 at once (a router retries them on another replica); with timeout > 0 the admitted
    requests run on until they finish, `timeout` seconds pass or `again` is set (a second
    signal); then every stream still open ends with an error event."""
    b = ctx.bridge
    n = b.stop_admitting()
    if timeout > 0 and n:
        print(f"backfit serve: draining {n} requests for up to {timeout:g} s (/health answers "
              "503; a second signal ends them now)", flush=True)
        idle = asyncio.ensure_future(b.wait_idle(timeout))
        second = asyncio.ensure_future(again.wait())
        await asyncio.wait({idle, second}, return_when=asyncio.FIRST_COMPLETED)
        idle.cancel()
        second.cancel()
    n = b.abort_all()
    print(f"backfit serve: shutting down ({n} open streams end with an error event)", flush=True)
    await b.wait_idle(2.0)                                 # let streams write their error event


async def _serve(cfg, host: str, port: int, ctx_kw: dict, shutdown_timeout: float) -> None:
    import signal

    from backfit.server.bridge import AsyncEngine

    t0 = time.perf_counter()
    engine = AsyncEngine(cfg)
    ctx = make_context(engine, cfg.model, **ctx_kw)
    runner = await start_server(ctx, host, port)
    print(f"backfit serve: listening on http://{host}:{port}; loading {cfg.model} "
          "(/health answers 503 until ready)", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    engine.start()
    waiter = asyncio.ensure_future(engine.wait_ready())
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if waiter.done():
            waiter.result()                              # EngineDeadError: load failed
            engine_ready(ctx, engine)
            print(ready_line(engine, host, port, t0), flush=True)
            await stopper
        stop.clear()
        await shut_down(ctx, shutdown_timeout, stop)
    finally:
        waiter.cancel()
        stopper.cancel()
        await runner.cleanup()
        if ctx.images is not None:
            await ctx.images.close()
        await asyncio.to_thread(engine.shutdown)         # joins the engine thread; ranks exit


def default_max_tokens(flag: int | None, overrides: str | None) -> int | None:
    """--default-max-tokens N and vLLM's --override-generation-config '{"max_new_tokens": N}'
    (the one key served: other defaults would be silently unlike vLLM's) -> N or None."""
    n = None
    if overrides:
        try:
            cfg = json.loads(overrides)
        except ValueError as e:
            raise ValueError(f"--override-generation-config: not JSON ({e})") from None
        if not isinstance(cfg, dict) or set(cfg) - {"max_new_tokens"}:
            extra = sorted(set(cfg) - {"max_new_tokens"}) if isinstance(cfg, dict) else cfg
            raise ValueError(f"--override-generation-config: only max_new_tokens is supported, "
                             f"not {extra}")
        n = cfg.get("max_new_tokens")
    if flag is not None and n is not None and flag != n:
        raise ValueError(f"--default-max-tokens {flag} and --override-generation-config "
                         f"max_new_tokens {n} disagree")
    n = flag if flag is not None else n
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"the default max tokens must be a positive integer, not {n!r}")
    return n


def chat_template_defaults(text: str | None) -> tuple[bool | None, str | None]:
    """vLLM's --default-chat-template-kwargs JSON ({"thinking": false}, "enable_thinking",
    "reasoning_effort") -> (thinking, effort) for requests that set neither."""
    if not text:
        return None, None
    try:
        kw = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--default-chat-template-kwargs: not JSON ({e})") from None
    keys = {"thinking", "enable_thinking", "reasoning_effort"}
    if not isinstance(kw, dict) or set(kw) - keys:
        raise ValueError(f"--default-chat-template-kwargs: only {sorted(keys)} are read, not "
                         f"{sorted(set(kw) - keys) if isinstance(kw, dict) else kw}")
    thinking = kw.get("thinking", kw.get("enable_thinking"))
    if thinking is not None and not isinstance(thinking, bool):
        raise ValueError("--default-chat-template-kwargs: thinking must be true or false")
    effort = kw.get("reasoning_effort")
    from backfit.server.chat_format import resolve_reasoning
    try:
        resolve_reasoning(thinking, effort)
    except ValueError as e:
        raise ValueError(f"--default-chat-template-kwargs: {e}") from None
    return thinking, effort


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, *, served_model_name: str
          = "deepseek-v4-flash", api_key: str | None = None, max_queue: int = 256,
          keepalive_s: float = 10.0, aliases: tuple[str, ...] = (),
          shutdown_timeout: float = 0.0, default_max_tokens: int | None = None,
          chat_defaults: tuple[bool | None, str | None] = (None, None), media=None,
          **engine_kw) -> None:
    """`backfit serve`: engine + HTTP in this process (TP ranks are child processes).
    media: server.images.MediaLimits (--limit-mm-per-prompt, --allowed-media-domains)."""
    from backfit.formats import load_manifest
    from backfit.server.bridge import EngineConfig

    engine_kw["tp"] = engine_kw.get("tp") or load_manifest(model)["tp"]
    cfg = EngineConfig(str(model), **engine_kw)
    asyncio.run(_serve(cfg, host, port, {"model_name": served_model_name, "api_key": api_key,
                                         "max_queue": max_queue, "keepalive_s": keepalive_s,
                                         "aliases": aliases,
                                         "default_max_tokens": default_max_tokens,
                                         "chat_defaults": chat_defaults, "media": media},
                        shutdown_timeout))
