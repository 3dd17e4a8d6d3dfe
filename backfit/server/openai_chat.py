"""POST /v1/chat/completions (api-protocols §1): JSON → ChatRequest → prompt → events → JSON/SSE.

Choices (api-protocols [U] points): `developer` and `function` roles map to system / tool;
image, audio and file parts are a 400 naming `messages[i].content[j]` (V4-Flash is text-only);
`n` > 1 and chat `logprobs` are a 400 naming the field (token logprobs: /v1/completions);
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
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from backfit.server.bridge import (
    CTX, KEEPALIVE, ContextTooLong, EngineUnavailable, FinishWithUsage, QueueFull,
    SamplingParams,
)
from backfit.server.http import (
    BadRequest, ClientGone, get_bool, get_dict, get_int, get_list, get_num, get_str,
    json_response, read_json, sse_comment, sse_data, sse_start,
)
from backfit.server.protocol import (
    ChatRequest, Message, ReasoningDelta, TextDelta, Tool, ToolCall, ToolCallArgsDelta,
    ToolCallStart, Usage,
)

__all__ = ["handle", "error_response", "parse_messages", "parse_reasoning", "sampling_params",
           "first_event", "usage_json", "FINISH"]

log = logging.getLogger("backfit.server")
FINISH = {"stop": "stop", "tool_calls": "tool_calls", "length": "length", "abort": "stop"}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool", "function": "tool"}
_TEXT_PARTS = ("text", "input_text", "output_text", "refusal")


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


# ---- request parsing (also used by /tokenize) ------------------------------------------------

def _text(content: Any, where: str, allow_none: bool = True) -> str:
    if content is None and allow_none:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or an array of content parts", where)
    out = []
    for j, p in enumerate(content):
        if isinstance(p, str):
            out.append(p)
            continue
        if not isinstance(p, dict):
            raise BadRequest(f"{where}[{j}] must be a content part object", f"{where}[{j}]")
        kind = p.get("type", "text")
        if kind in _TEXT_PARTS:
            t = p.get("text", p.get("refusal", ""))
            if not isinstance(t, str):
                raise BadRequest(f"{where}[{j}].text must be a string", f"{where}[{j}].text")
            out.append(t)
        else:
            raise BadRequest(f"{where}[{j}]: content part type {str(kind)[:40]!r} is not "
                             "supported (this model reads text only)", f"{where}[{j}]")
    return "".join(out)


def _calls(raw: Any, where: str) -> tuple[ToolCall, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise BadRequest(f"{where} must be an array", where)
    calls = []
    for k, c in enumerate(raw):
        w = f"{where}[{k}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{w}.function.name must be a string", f"{w}.function.name")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        cid = c.get("id")
        calls.append(ToolCall(cid if isinstance(cid, str) else f"call_{k}", fn["name"], args))
    return tuple(calls)


def parse_messages(raw: Any) -> tuple[Message, ...]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(raw):
        w = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{w} must be an object", w)
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise BadRequest(f"{w}.role: unknown role {str(role)[:40]!r} (expected system, "
                             "developer, user, assistant or tool)", f"{w}.role")
        role = _ROLES[role]
        content = _text(m.get("content"), f"{w}.content")
        if role == "assistant":
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning is not None and not isinstance(reasoning, str):
                raise BadRequest(f"{w}.reasoning_content must be a string",
                                 f"{w}.reasoning_content")
            prefix = m.get("prefix") is True and i == len(raw) - 1
            out.append(Message("assistant", content, reasoning or None,
                               _calls(m.get("tool_calls"), f"{w}.tool_calls"), prefix=prefix))
        elif role == "tool":
            tid = m.get("tool_call_id", m.get("name"))
            out.append(Message("tool", content, tool_call_id=tid if isinstance(tid, str) else None))
        else:
            out.append(Message(role, content))
    return tuple(out)


def parse_tools(body: dict) -> tuple[tuple[Tool, ...], Any]:
    tools = []
    for k, t in enumerate(get_list(body, "tools", []) or []):
        w = f"tools[{k}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise BadRequest(f"{w}: only function tools are supported", w)
        fn = t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"{w}.function.name must be a non-empty string", f"{w}.function.name")
        tools.append(Tool(fn["name"], dict(fn)))
    choice = body.get("tool_choice", "auto") if tools else "none"
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise BadRequest("tool_choice must be none, auto, required or a function",
                             "tool_choice")
    elif isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if isinstance(
            choice.get("function"), dict) else choice.get("name")
        if not isinstance(name, str) or name not in {t.name for t in tools}:
            raise BadRequest("tool_choice names no tool in tools", "tool_choice")
        choice = {"name": name}
    else:
        raise BadRequest("tool_choice must be a string or an object", "tool_choice")
    return tuple(tools), choice


def parse_reasoning(body: dict) -> tuple[bool | None, str | None]:
    """(thinking, effort) from every field clients use; later fields win."""
    thinking, effort = None, None
    kw = get_dict(body, "chat_template_kwargs", {}) or {}
    t = body.get("thinking")
    if isinstance(t, bool):
        thinking = t
    elif isinstance(t, dict):
        kind = t.get("type")
        if kind not in ("enabled", "disabled", "adaptive", None):
            raise BadRequest("thinking.type must be enabled or disabled", "thinking.type")
        thinking = kind != "disabled"
    elif t is not None:
        raise BadRequest("thinking must be a boolean or {\"type\": ...}", "thinking")
    for key in ("thinking", "enable_thinking"):
        if isinstance(kw.get(key), bool):
            thinking = kw[key]
    r = body.get("reasoning")
    if isinstance(r, dict) and isinstance(r.get("effort"), str):
        effort = r["effort"]
    for src, key in ((body, "reasoning_effort"), (kw, "reasoning_effort")):
        v = src.get(key)
        if v is not None and not isinstance(v, str):
            raise BadRequest(f"{key} must be a string", key)
        effort = v if v is not None else effort
    return thinking, effort


def sampling_params(body: dict, max_tokens: int | None, **extra) -> SamplingParams:
    """The sampling knobs every OpenAI path shares (logit_bias and stop_token_ids ignored)."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=get_int(body, "min_tokens", 0, lo=0),
            temperature=get_num(body, "temperature", 1.0, 0, 2),
            top_p=get_num(body, "top_p", 1.0, 0, 1) or 1e-6,
            top_k=get_int(body, "top_k", 0, lo=-1),
            min_p=get_num(body, "min_p", 0.0, 0, 1),
            seed=get_int(body, "seed", None, lo=-2**63, hi=2**64),
            presence_penalty=get_num(body, "presence_penalty", 0.0, -2, 2),
            frequency_penalty=get_num(body, "frequency_penalty", 0.0, -2, 2),
            repetition_penalty=get_num(body, "repetition_penalty", 1.0, 1e-6, 2),
            ignore_eos=get_bool(body, "ignore_eos", False), **extra)
    except ValueError as e:
        if isinstance(e, BadRequest):
            raise
        raise BadRequest(str(e), str(e).split(" ")[0]) from None


def parse_stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
        raise BadRequest("stop must be a string or an array of at most 16 strings", "stop")
    return tuple(s for s in stop if s)


def parse_request(body: dict) -> tuple[ChatRequest, SamplingParams]:
    get_str(body, "model")
    n = get_int(body, "n", 1)
    if n != 1:
        raise BadRequest("n must be 1 (one choice per request is supported)", "n")
    if get_bool(body, "logprobs", False) or body.get("top_logprobs") is not None:
        raise BadRequest("logprobs are not supported on chat completions; use /v1/completions "
                         "with logprobs", "logprobs")
    mt = get_int(body, "max_completion_tokens", None, lo=1)
    mt = mt if mt is not None else get_int(body, "max_tokens", None, lo=1)
    tools, choice = parse_tools(body)
    thinking, effort = parse_reasoning(body)
    fmt = get_dict(body, "response_format", None)
    if fmt is not None and fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise BadRequest("response_format.type must be text, json_object or json_schema",
                         "response_format.type")
    if fmt is not None and fmt.get("type") == "json_schema":
        fmt = fmt.get("json_schema", fmt)
        if not isinstance(fmt, dict):
            raise BadRequest("response_format.json_schema must be an object",
                             "response_format.json_schema")
    opts = get_dict(body, "stream_options", {}) or {}
    req = ChatRequest(
        messages=parse_messages(body.get("messages")), tools=tools, tool_choice=choice,
        thinking=thinking, reasoning_effort=effort, response_format=fmt, max_tokens=mt,
        stop=parse_stop(body), stream=bool(get_bool(body, "stream", False)),
        include_usage=opts.get("include_usage") is True,
        parallel_tool_calls=get_bool(body, "parallel_tool_calls", True))
    return req, sampling_params(body, mt)


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
    if req.stream:
        return await _stream(request, ctx, req, agen, task, cid, created, named)
    return await _complete(ctx, req, agen, task, cid, created, named)


async def _events(agen, task):
    """The first item (from `task`) then the rest of the stream."""
    try:
        yield await task
    except StopAsyncIteration:
        return
    async for ev in agen:
        yield ev


async def _complete(ctx, req, agen, task, cid, created, named):
    reasoning, content, calls, fin = [], [], {}, None
    try:
        async for ev in _events(agen, task):
            if isinstance(ev, ReasoningDelta):
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
        "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": reason}],
        "usage": usage_json(fin.usage)}, headers={"x-request-id": cid})


async def _stream(request, ctx, req, agen, task, cid, created, named):
    head = {"id": cid, "object": "chat.completion.chunk", "created": created,
            "model": ctx.model_name}

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": finish}]}
    resp = None
    try:
        resp = await sse_start(request, {"x-request-id": cid})
        await sse_data(resp, chunk({"role": "assistant", "content": ""}))
        n_calls = 0
        async for ev in _events(agen, task):
            if ev is KEEPALIVE:
                await sse_comment(resp)
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
    finally:
        await close_stream(agen, task)
    return resp if resp is not None else web.Response(status=499)
