"""POST /v1/chat/completions (api-protocols §1): JSON → ChatRequest → prompt → events → JSON/SSE.

Choices (api-protocols [U] points): `developer` and `function` roles map to system / tool;
image, audio and file parts are a 400 naming `messages[i].content[j]` (V4-Flash is text-only);
`n` > 1 is a 400 naming the field; `logprobs` / `top_logprobs` (≤ 20) give the answer's tokens
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
    try:
        body = await read_json(request)
        req, params = parse_request(body)
        try:
            prompt = ctx.encoder.encode_request(req)
        except ValueError as e:
            raise BadRequest(str(e)[:500], "messages") from None
        log.debug("chat: %d prompt tokens, thinking=%s effort=%s", len(prompt.ids),
                  prompt.thinking_mode, prompt.reasoning_effort)
        agen = ctx.bridge.stream(prompt, params, tools=req.tools_enabled, stop=req.stop)
        task = await first_event(agen)
    except (ValueError, QueueFull, EngineUnavailable) as e:
        return map_exception(e)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    named = isinstance(req.tool_choice, dict)
    lp = TokenText(ctx.encoder.tokenizer) if params.logprobs is not None else None
    if req.stream:
        return await _stream(request, ctx, req, agen, task, cid, created, named, lp)
    return await _complete(ctx, req, agen, task, cid, created, named, lp)


async def _events(agen, task):
    """The first item (from `task`) then the rest of the stream."""
    try:
        yield await task
    except StopAsyncIteration:
        return
    async for ev in agen:
        yield ev


async def _complete(ctx, req, agen, task, cid, created, named, lp):
    reasoning, content, calls, fin, logprobs = [], [], {}, None, []
    try:
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
                calls[ev.index]["broken"] = True         # ToolCallEnd with error
    finally:
        await close_stream(agen, task)
    if fin is None or fin.reason == "error":
        return error_response(503, (fin.error if fin else None) or "generation failed",
                              "server_error", code="engine_error",
                              headers={"Retry-After": "5"})
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
    reason = FINISH.get(fin.reason, "stop")
    if reason == "tool_calls" and (named or not tool_calls):
        reason = "stop"
    return json_response({
        "id": cid, "object": "chat.completion", "created": created, "model": ctx.model_name,
        "choices": [{"index": 0, "message": msg, "finish_reason": reason,
                     "logprobs": {"content": logprobs, "refusal": None} if lp else None}],
        "usage": usage_json(fin.usage)}, headers={"x-request-id": cid})


async def _stream(request, ctx, req, agen, task, cid, created, named, lp):
    head = {"id": cid, "object": "chat.completion.chunk", "created": created,
            "model": ctx.model_name}
    pending: list[dict] = []                    # logprobs for the next chunk written

    def chunk(delta: dict, finish: str | None = None) -> dict:
        lps = {"content": pending[:], "refusal": None} if pending else None
        pending.clear()
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": lps,
                                     "finish_reason": finish}]}
    resp = None
    try:
        resp = await sse_start(request, {"x-request-id": cid})
        await sse_data(resp, chunk({"role": "assistant", "content": ""}))
        n_calls = 0
        async for ev in _events(agen, task):
            if ev is KEEPALIVE:
                await sse_comment(resp)
            elif isinstance(ev, TokenLogprobs):
                pending += lp.entries(ev.items)
            elif isinstance(ev, ReasoningDelta):
                await sse_data(resp, chunk({"reasoning_content": ev.text}))
            elif isinstance(ev, TextDelta):
                await sse_data(resp, chunk({"content": ev.text}))
            elif isinstance(ev, ToolCallStart):
                if req.parallel_tool_calls or ev.index == 0:
                    n_calls += 1
                    await sse_data(resp, chunk({"tool_calls": [{
                        "index": ev.index, "id": ev.id, "type": "function",
                        "function": {"name": ev.name, "arguments": ""}}]}))
            elif isinstance(ev, ToolCallArgsDelta):
                if req.parallel_tool_calls or ev.index == 0:
                    await sse_data(resp, chunk({"tool_calls": [{
                        "index": ev.index, "function": {"arguments": ev.text}}]}))
            elif isinstance(ev, FinishWithUsage):
                if ev.reason == "error":
                    await sse_data(resp, {"error": {"message": ev.error or "generation failed",
                                                    "type": "server_error", "param": None,
                                                    "code": "engine_error"}})
                else:
                    reason = FINISH.get(ev.reason, "stop")
                    if reason == "tool_calls" and (named or not n_calls):
                        reason = "stop"
                    await sse_data(resp, chunk({}, reason))
                    if req.include_usage:
                        await sse_data(resp, {**head, "choices": [],
                                              "usage": usage_json(ev.usage)})
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
    finally:
        await close_stream(agen, task)
    return resp if resp is not None else web.Response(status=499)
