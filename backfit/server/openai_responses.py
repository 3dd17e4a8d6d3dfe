"""POST /v1/responses (OpenAI Responses, Codex CLI): the request (`responses_request`, image
parts on a Vision-Exp model included) → ChatRequest; events → SSE or JSON.

Reply (§2.2-§2.6): the event sequence of §2.3 with dense `sequence_number` and `output_index`,
exactly one terminal event (completed | incomplete(max_output_tokens) | failed), and the same
items (same ids) in the terminal response as in each `output_item.done`. The non-streaming reply
is the terminal event's `response`, built by the same renderer (the fold of the stream).
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from backfit.server import http
from backfit.server.bridge import (
    CTX, ContextTooLong, EngineUnavailable, KeepAlive, QueueFull, SamplingParams,
)
from backfit.server.http import BadRequest
from backfit.server.protocol import ChatRequest
from backfit.server.responses_render import ResponsesRenderer
from backfit.server.responses_request import parse_request, reasoning_wishes

__all__ = ["handle", "parse_request", "reasoning_wishes", "sampling_params", "ResponsesRenderer",
           "openai_error"]

log = logging.getLogger(__name__)


def sampling_params(req: ChatRequest, prompt_len: int, max_model_len: int | None,
                    param: str = "max_output_tokens") -> SamplingParams:
    """Output cap (reasoning included) checked against the context (400 context_length_...);
    no cap given: None, the bridge's default (the rest of the context or --default-max-tokens).
    max_model_len None: the engine is still picking it (loading): 503."""
    if max_model_len is None:
        raise EngineUnavailable("the model is loading; try again later")
    room = max_model_len - prompt_len
    want = req.max_tokens if req.max_tokens is not None else room
    if want < 1 or prompt_len + want > max_model_len:
        raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. "
                         f"However, you requested {prompt_len + max(want, 0)} tokens "
                         f"({prompt_len} in the input, {max(want, 0)} for the output). Please "
                         "reduce the length of the input or of the output cap.", param,
                         code="context_length_exceeded")
    kw = {k: v for k, v in (("temperature", req.temperature), ("top_p", req.top_p),
                            ("top_k", req.top_k), ("seed", req.seed)) if v is not None}
    try:
        return SamplingParams(max_tokens=req.max_tokens, **kw)
    except ValueError as e:
        raise BadRequest(str(e), str(e).split(" ", 1)[0]) from None


def openai_error(status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict | None = None) -> web.Response:
    return http.json_response({"error": {"message": message, "type": type, "param": param,
                                         "code": code}}, status=status, headers=headers)


async def handle(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses."""
    ctx = request.app[CTX]
    try:
        body = await http.read_json(request)
        req, custom = parse_request(body, images=ctx.images is not None)
        if ctx.images is not None:             # fetch, decode and prepare (400 on failure)
            req = await ctx.images.resolve(req)
        try:
            prompt = ctx.encoder.encode_request(req)
        except ValueError as e:
            raise BadRequest(str(e), "tool_choice" if "tool_choice" in str(e) else "input") \
                from None
        params = sampling_params(req, len(prompt.ids), ctx.max_model_len)
    except BadRequest as e:
        return openai_error(e.status, e.message, param=e.param, code=e.code)
    r = ResponsesRenderer(req, ctx.model_name, custom)
    it = ctx.bridge.stream(prompt, params, tools=req.tools_enabled, stop=req.stop).__aiter__()
    try:                                # closed in every case: aborts the request
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            first = None
        except QueueFull as e:
            return openai_error(429, str(e), type="rate_limit_exceeded",
                                code="rate_limit_exceeded",
                                headers={"Retry-After": str(e.retry_after)})
        except EngineUnavailable as e:
            return openai_error(503, str(e) or "engine unavailable", type="server_error",
                                code="overloaded", headers={"Retry-After": str(e.retry_after)})
        except ContextTooLong as e:
            return openai_error(400, str(e), param="max_output_tokens",
                                code="context_length_exceeded")
        except ValueError as e:
            return openai_error(400, str(e), param="input")
        if not req.stream:
            return await _fold(r, it, first)
        return await _stream(request, r, it, first)
    finally:
        await http.close_stream(it)         # abort the engine request if it is still running


async def _fold(r: ResponsesRenderer, it, first) -> web.Response:
    try:
        async for ev in http.with_first(it, first):
            if not isinstance(ev, KeepAlive):
                r.feed(ev)
    except EngineUnavailable as e:
        return openai_error(503, str(e) or "engine unavailable", type="server_error",
                            code="overloaded", headers={"Retry-After": str(e.retry_after)})
    r.close()
    return http.json_response(r.response, headers={"x-request-id": r.id})


async def _stream(request, r: ResponsesRenderer, it, first) -> web.StreamResponse:
    resp = await http.sse_start(request, {"x-request-id": r.id})
    try:
        for etype, data in r.start():
            await http.sse_event(resp, etype, data)
        try:
            async for ev in http.with_first(it, first):
                if isinstance(ev, KeepAlive):
                    await http.sse_comment(resp)
                    continue
                for etype, data in r.feed(ev):
                    await http.sse_event(resp, etype, data)
            frames = r.close()
        except (http.ClientGone, asyncio.CancelledError):
            raise
        except Exception as e:              # noqa: BLE001 - engine died mid-stream: failed
            log.warning("responses: stream failed: %r", e)
            frames = r.fail(f"generation failed: {e}"[:300])
        for etype, data in frames:
            await http.sse_event(resp, etype, data)
        await http.sse_end(resp)
    except http.ClientGone:
        pass                                # the finally in handle() aborts the request
    return resp
