"""POST /v1/chat/completions (api-protocols §1): JSON → ChatRequest → prompt → events → JSON/SSE.

Choices (api-protocols [U] points): `developer` and `function` roles map to system / tool;
audio and file parts are a 400 naming `messages[i].content[j]`; `image_url` parts of user and
tool messages are images on a Vision-Exp model (server/images.py), a 400 on a text-only one;
`n` up to 16 choices (each its own engine request, choice i sampling with seed + i; usage counts
the prompt once); `logprobs` / `top_logprobs` (≤ 20) give the answer's tokens
(chat_logprobs: after the reasoning; reasoning and forced tokens have none);
stop strings apply to the answer text only (not to reasoning or tool arguments); a named
`tool_choice` finishes with "stop" (OpenAI's non-streaming behaviour); `parallel_tool_calls:
false` keeps only the first call; a tool call cut off or malformed is not returned as a call
in the JSON reply (its deltas were already streamed; finish_reason says length / stop).
Thinking and effort are read from `reasoning_effort`, `reasoning.effort`, `thinking`
(bool or {"type": "enabled"|"disabled"}) and `chat_template_kwargs` (thinking,
enable_thinking, reasoning_effort), resolved once by the encoder (pitfall #16).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import replace
from typing import Any

from aiohttp import web

from backfit.server.bridge import (
    CTX,
    KEEPALIVE,
    ContextTooLong,
    EngineUnavailable,
    FinishWithUsage,
    QueueFull,
)
from backfit.server.chat_logprobs import TokenText
from backfit.server.http import (
    BadRequest,
    ClientGone,
    json_response,
    read_json,
    sse_comment,
    sse_data,
    sse_start,
)
from backfit.server.openai_request import (  # noqa: F401 (re-exported for the other paths)
    parse_messages,
    parse_reasoning,
    parse_request,
    parse_stop,
    parse_tools,
    sampling_params,
)
from backfit.server.protocol import (
    ReasoningDelta,
    TextDelta,
    TokenLogprobs,
    ToolCallArgsDelta,
    ToolCallStart,
    Usage,
)

__all__ = [
    "FINISH",
    "error_response",
    "first_event",
    "handle",
    "parse_messages",
    "parse_reasoning",
    "sampling_params",
    "usage_json",
]

log = logging.getLogger("backfit.server")
FINISH = {"stop": "stop", "tool_calls": "tool_calls", "length": "length", "abort": "stop"}


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> web.Response:
    """The OpenAI error envelope; string codes (pitfall #9)."""
    return json_response({"error": {"message": message, "type": type_, "param": param,
                                    "code": code}}, status, headers)


def map_exception(e: BaseException) -> web.Response:
    """Errors raised before the first byte of a reply → the OpenAI status and shape."""
    if isinstance(e, BadRequest):
        return error_response(e.status, e.message, param=e.param, code=e.code)
    if isinstance(e, QueueFull):
        return error_response(429, str(e), "rate_limit_exceeded", code="rate_limit_exceeded",
                              headers={"Retry-After": str(e.retry_after)})
    if isinstance(e, EngineUnavailable):
        return error_response(503, str(e), "server_error", code="overloaded",
                              headers={"Retry-After": str(e.retry_after)})
    if isinstance(e, ContextTooLong):
        return error_response(400, str(e), param="messages", code="context_length_exceeded")
    if isinstance(e, ValueError):
        return error_response(400, str(e)[:500])
    raise e


def usage_json(u: Usage | None) -> dict:
    u = u or Usage(0, 0)
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens}}


async def first_event(agen, timeout: float = 0.5):
    """Start an event stream and wait up to `timeout` for its first item, so errors raised at
    admission (queue full, context, a request the engine refuses) become a status code, while
    a long prefill still gets its headers at once. -> a task holding the first item."""
    task = asyncio.ensure_future(agen.__anext__())
    try:
        await asyncio.wait({task}, timeout=timeout)
        if task.done() and task.exception() is not None:
            exc = task.exception()
            if isinstance(exc, StopAsyncIteration):
                return task
            raise exc
    except BaseException:
        await close_stream(agen, task)
        raise
    return task


async def close_stream(agen, task=None) -> None:
    if task is not None and not task.done():
        task.cancel()
    if task is not None:
        with contextlib.suppress(BaseException):
            await task
    with contextlib.suppress(BaseException):
        await agen.aclose()


# ---- the handler -----------------------------------------------------------------------------

async def handle(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CTX]
    streams: list[tuple[Any, Any]] = []        # (events, first-item task) a choice
    try:
        body = await read_json(request)
        req, params = parse_request(body, images=ctx.images is not None)
        if ctx.images is not None:             # fetch, decode and prepare (400 on failure)
            req = await ctx.images.resolve(req)
        try:
            prompt = ctx.encoder.encode_request(req)
        except ValueError as e:
            raise BadRequest(str(e)[:500], "messages") from None
        log.debug("chat: %d prompt tokens, thinking=%s effort=%s, n=%d", len(prompt.ids),
                  prompt.thinking_mode, prompt.reasoning_effort, req.n)
        for i in range(req.n):                 # choice i samples with seed + i
            p = params if params.seed is None else replace(params, seed=params.seed + i)
            agen = ctx.bridge.stream(prompt, p, tools=req.tools_enabled, stop=req.stop)
            streams.append((agen, await first_event(agen)))
    except (ValueError, QueueFull, EngineUnavailable) as e:
        for agen, task in streams:             # admitted choices of a refused request
            await close_stream(agen, task)
        return map_exception(e)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    named = isinstance(req.tool_choice, dict)
    lp = TokenText(ctx.encoder.tokenizer) if params.logprobs is not None else None
    try:
        if req.stream:
            return await _stream(request, ctx, req, streams, cid, created, named, lp)
        return await _complete(ctx, req, streams, cid, created, named, lp)
    finally:
        for agen, task in streams:
            await close_stream(agen, task)


async def _events(agen, task):
    """The first item (from `task`) then the rest of the stream."""
    try:
        yield await task
    except StopAsyncIteration:
        return
    async for ev in agen:
        yield ev


def _reason(fin, named: bool, n_calls: int) -> str:
    reason = FINISH.get(fin.reason, "stop")
    return "stop" if reason == "tool_calls" and (named or not n_calls) else reason


def _sum_usage(usages: list[Usage]) -> Usage:
    """n choices of one prompt: the prompt (and its cache hits) once, the outputs summed."""
    return Usage(usages[0].prompt_tokens, sum(u.completion_tokens for u in usages),
                 usages[0].cached_tokens, sum(u.reasoning_tokens for u in usages))


async def _choice(index: int, req, agen, task, named, lp) -> tuple[dict | None, Any]:
    """One choice's events folded -> (the choice's JSON, its FinishWithUsage) or (None, why)."""
    reasoning, content, calls, fin, logprobs = [], [], {}, None, []
    async for ev in _events(agen, task):
        if isinstance(ev, TokenLogprobs):
            logprobs += lp.entries(ev.items)
        elif isinstance(ev, ReasoningDelta):
            reasoning.append(ev.text)
        elif isinstance(ev, TextDelta):
            content.append(ev.text)
        elif isinstance(ev, ToolCallStart):
            calls[ev.index] = {"id": ev.id, "type": "function",
                               "function": {"name": ev.name, "arguments": ""}}
        elif isinstance(ev, ToolCallArgsDelta):
            calls[ev.index]["function"]["arguments"] += ev.text
        elif isinstance(ev, FinishWithUsage):
            fin = ev
        elif getattr(ev, "error", None) is not None and hasattr(ev, "arguments"):
            calls[ev.index]["broken"] = True             # ToolCallEnd with error
    if fin is None or fin.reason == "error":
        return None, (fin.error if fin else None) or "generation failed"
    tool_calls = [c for _, c in sorted(calls.items()) if not c.pop("broken", False)]
    if not req.parallel_tool_calls:
        tool_calls = tool_calls[:1]
    text = "".join(content)
    msg: dict[str, Any] = {"role": "assistant",
                           "content": None if tool_calls and not text else text}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return {"index": index, "message": msg, "finish_reason": _reason(fin, named, len(tool_calls)),
            "logprobs": {"content": logprobs, "refusal": None} if lp else None}, fin


async def _complete(ctx, req, streams, cid, created, named, lp):
    got = await asyncio.gather(*(_choice(i, req, agen, task, named, lp)
                                 for i, (agen, task) in enumerate(streams)))
    failed = [why for choice, why in got if choice is None]
    if failed:
        return error_response(503, failed[0], "server_error", code="engine_error",
                              headers={"Retry-After": "5"})
    return json_response({
        "id": cid, "object": "chat.completion", "created": created, "model": ctx.model_name,
        "choices": [choice for choice, _ in got],
        "usage": usage_json(_sum_usage([fin.usage for _, fin in got]))},
        headers={"x-request-id": cid})


async def _merged(streams):
    """(choice index, event) of every choice as they come; (i, None) ends choice i."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, agen, task):
        try:
            async for ev in _events(agen, task):
                await q.put((i, ev))
        except Exception as e:                  # noqa: BLE001 - re-raised by the consumer
            await q.put((i, e))
        await q.put((i, None))
    pumps = [asyncio.ensure_future(pump(i, a, t)) for i, (a, t) in enumerate(streams)]
    try:
        left = len(pumps)
        while left:
            i, ev = await q.get()
            if isinstance(ev, Exception):
                raise ev
            left -= ev is None
            yield i, ev
    finally:
        for t in pumps:
            t.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _stream(request, ctx, req, streams, cid, created, named, lp):
    head = {"id": cid, "object": "chat.completion.chunk", "created": created,
            "model": ctx.model_name}
    pending: dict[int, list[dict]] = {i: [] for i in range(len(streams))}   # next chunk's
    n_calls, usages, resp = dict.fromkeys(pending, 0), [], None

    def chunk(i: int, delta: dict, finish: str | None = None) -> dict:
        lps = {"content": pending[i][:], "refusal": None} if pending[i] else None
        pending[i].clear()
        return {**head, "choices": [{"index": i, "delta": delta, "logprobs": lps,
                                     "finish_reason": finish}]}
    try:
        resp = await sse_start(request, {"x-request-id": cid})
        for i in pending:
            await sse_data(resp, chunk(i, {"role": "assistant", "content": ""}))
        async with contextlib.aclosing(_merged(streams)) as events:
            async for i, ev in events:
                if ev is KEEPALIVE:
                    await sse_comment(resp)
                elif isinstance(ev, TokenLogprobs):
                    pending[i] += lp.entries(ev.items)
                elif isinstance(ev, ReasoningDelta):
                    await sse_data(resp, chunk(i, {"reasoning_content": ev.text}))
                elif isinstance(ev, TextDelta):
                    await sse_data(resp, chunk(i, {"content": ev.text}))
                elif isinstance(ev, ToolCallStart):
                    if req.parallel_tool_calls or ev.index == 0:
                        n_calls[i] += 1
                        await sse_data(resp, chunk(i, {"tool_calls": [{
                            "index": ev.index, "id": ev.id, "type": "function",
                            "function": {"name": ev.name, "arguments": ""}}]}))
                elif isinstance(ev, ToolCallArgsDelta):
                    if req.parallel_tool_calls or ev.index == 0:
                        await sse_data(resp, chunk(i, {"tool_calls": [{
                            "index": ev.index, "function": {"arguments": ev.text}}]}))
                elif isinstance(ev, FinishWithUsage):
                    if ev.reason == "error":
                        await sse_data(resp, {"error": {"message": ev.error or "generation failed",
                                                        "type": "server_error", "param": None,
                                                        "code": "engine_error"}})
                        break
                    usages.append(ev.usage)
                    await sse_data(resp, chunk(i, {}, _reason(ev, named, n_calls[i])))
            else:
                if req.include_usage and usages:
                    await sse_data(resp, {**head, "choices": [],
                                          "usage": usage_json(_sum_usage(usages))})
        await sse_data(resp, "[DONE]")
    except (ClientGone, ConnectionError):
        log.debug("chat %s: client went away", cid)
    except (ValueError, RuntimeError) as e:      # refused after the headers went out (slow add)
        if resp is None:
            raise
        with contextlib.suppress(ClientGone, ConnectionError):
            await sse_data(resp, {"error": {"message": str(e)[:500], "type":
                                            "invalid_request_error", "param": None,
                                            "code": None}})
            await sse_data(resp, "[DONE]")
    return resp if resp is not None else web.Response(status=499)
