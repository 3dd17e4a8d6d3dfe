"""POST /v1/messages and /v1/messages/count_tokens (Anthropic Messages: Claude Code, SDK).

Request (api-protocols §3.1): `system` string or text blocks (blocks starting with
`x-anthropic-billing-header` dropped: a per-request hash that defeats prefix caching); roles
user / assistant / system, Claude Code's `ctx` / `msg` → user; content blocks: text; tool_use
(assistant) and tool_result (user, → tool results); thinking (→ the turn's reasoning, signature
accepted unchecked), redacted_thinking and server-tool history blocks (`DROPPED_BLOCKS`)
dropped; image blocks (base64 or url, in user turns and tool results) are images on a
Vision-Exp model (server/images.py), else `[Unsupported image]`; documents →
`[Unsupported document]` (a text document's data is kept); any other block type, and
tool_use / tool_result on the wrong side, are a 400 naming `messages[i].content[j].type`. A
final assistant message is a prefill: continued, not closed. Tools `{name, description?,
input_schema}` with `input_schema.type` defaulted to object and `required: null` → []; server
tools (a `type` other than custom, no input_schema) are dropped; a custom tool without
input_schema is a 400. thinking/effort as on the OpenAI paths (`thinking`,
`output_config.effort`, `reasoning_effort`, `chat_template_kwargs`).

Reply (§3.2-§3.6): message_start, ping, one content block open at a time (thinking with a
signature_delta before its stop, text, tool_use with input_json_delta), message_delta (stop
reason, stop_sequence, cumulative usage), message_stop; `event: error` mid-stream. Usage:
input_tokens excludes the prefix-cache hit, reported as cache_read_input_tokens. The
non-streaming reply is the message the same renderer builds (the fold of the stream).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

from aiohttp import web

from backfit.server import http
from backfit.server.bridge import CTX, ContextTooLong, EngineUnavailable, KeepAlive, QueueFull
from backfit.server.anthropic_render import AnthropicRenderer, signature
from backfit.server.http import BadRequest
from backfit.server.images import ImageRef, content_parts, image_part
from backfit.server.openai_responses import reasoning_wishes, sampling_params
from backfit.server.protocol import ChatRequest, Message, Tool, ToolCall

__all__ = ["handle_messages", "handle_count_tokens", "parse_request", "anthropic_error",
           "AnthropicRenderer", "signature"]

log = logging.getLogger(__name__)
_USER_ROLES = ("user", "ctx", "msg")
# blocks the API defines that carry nothing the model can read here (encrypted thinking, the
# history of server tools that ran on Anthropic's side): dropped; any other unknown type is a 400
DROPPED_BLOCKS = ("redacted_thinking", "server_tool_use", "web_search_tool_result",
                  "web_fetch_tool_result", "code_execution_tool_result",
                  "bash_code_execution_tool_result", "text_editor_code_execution_tool_result",
                  "tool_search_tool_result", "mcp_tool_use", "mcp_tool_result",
                  "container_upload")


def anthropic_error(status: int, type: str, message: str, headers: dict | None = None
                    ) -> web.Response:
    rid = "req_" + uuid.uuid4().hex[:24]
    return http.json_response({"type": "error", "error": {"type": type, "message": message},
                               "request_id": rid}, status=status,
                              headers={"request-id": rid, **(headers or {})})


# ---- request → ChatRequest ------------------------------------------------------------------

def _block_text(b: dict, p: str, images: bool = False) -> str | ImageRef:
    """A text, document or image block -> its text; with images (a vision model) an image
    block -> its ImageRef (base64 source as a data: URL, or its url)."""
    kind = b.get("type")
    if kind == "text":
        if not isinstance(b.get("text"), str):
            raise BadRequest(f"{p}.text must be a string", f"{p}.text")
        return b["text"]
    src = b.get("source")
    if kind == "document" and isinstance(src, dict) and src.get("type") == "text" \
            and isinstance(src.get("data"), str):
        return src["data"]
    if kind == "image" and images:
        src = src if isinstance(src, dict) else {}
        if src.get("type") == "base64" and isinstance(src.get("data"), str) \
                and isinstance(src.get("media_type"), str):
            return ImageRef(f"data:{src['media_type']};base64,{src['data']}", p)
        if src.get("type") == "url" and isinstance(src.get("url"), str):
            return ImageRef(src["url"], p)
        raise BadRequest(f"{p}.source must be {{type: base64, media_type, data}} or "
                         f"{{type: url, url}}", f"{p}.source")
    return f"[Unsupported {str(kind)[:40]}]"


def _result_content(c: Any, p: str, images: bool = False) -> str | list[dict]:
    if c is None or isinstance(c, str):
        return c or ""
    if not isinstance(c, list):
        raise BadRequest(f"{p} must be a string or an array of blocks", p)
    out = []
    for j, b in enumerate(c):
        if not isinstance(b, dict):
            raise BadRequest(f"{p}[{j}] must be an object", f"{p}[{j}]")
        kind = b.get("type")
        x = _block_text(b, f"{p}[{j}]", images) if kind in ("text", "document", "image") else None
        if isinstance(x, ImageRef):
            out.append(image_part(x))
        elif kind in ("text", "document"):
            out.append({"type": "text", "text": x})
        else:
            out.append({"type": kind})              # rendered `[Unsupported <type>]`
    return out


def _message(m: Any, i: int, last: bool, images: bool = False) -> list[Message]:
    p = f"messages[{i}]"
    if not isinstance(m, dict):
        raise BadRequest(f"{p} must be an object", p)
    role = m.get("role")
    if role not in _USER_ROLES + ("assistant", "system"):
        raise BadRequest(f"{p}.role must be user, assistant or system, got {role!r}"[:200],
                         f"{p}.role")
    content = m.get("content")
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{p}.content must be a string or an array of blocks", f"{p}.content")
    out: list[Message] = []
    text, reasoning, calls = [], [], []
    for j, b in enumerate(content):
        q = f"{p}.content[{j}]"
        if not isinstance(b, dict):
            raise BadRequest(f"{q} must be an object", q)
        kind = b.get("type")
        if kind == "tool_result" and role != "assistant":
            if text:
                out.append(Message("user", content_parts(text)))
                text = []
            tid = b.get("tool_use_id", "")
            if not isinstance(tid, str):
                raise BadRequest(f"{q}.tool_use_id must be a string", f"{q}.tool_use_id")
            out.append(Message("tool", _result_content(b.get("content"), f"{q}.content",
                                                       images), tool_call_id=tid))
        elif kind == "tool_use" and role == "assistant":
            name, tid = b.get("name"), b.get("id", "")
            if not isinstance(name, str) or not name or not isinstance(tid, str):
                raise BadRequest(f"{q}: tool_use needs a string id and name", f"{q}.name")
            calls.append(ToolCall(tid, name, json.dumps(b.get("input") or {},
                                                        ensure_ascii=False)))
        elif kind == "thinking":
            if isinstance(b.get("thinking"), str):
                reasoning.append(b["thinking"])
        elif kind in ("text", "image", "document", "search_result"):
            text.append(_block_text(b, q, images and role in _USER_ROLES))
        elif kind in DROPPED_BLOCKS:
            log.debug("anthropic: dropped %s block in %s", kind, p)
        elif kind in ("tool_use", "tool_result"):
            side = "an assistant" if kind == "tool_use" else "a user"
            raise BadRequest(f"{q}: a {kind} block belongs in {side} message", f"{q}.type")
        else:
            raise BadRequest(f"{q}.type {str(kind)[:40]!r} is not a content block type this "
                             "server can read", f"{q}.type")
    if role == "assistant":
        out.append(Message("assistant", "".join(text), "".join(reasoning) or None, tuple(calls),
                           prefix=last))
    elif text or not out:
        out.append(Message("system" if role == "system" else "user", content_parts(text)))
    return out


def _system(v: Any) -> str:
    if v is None or isinstance(v, str):
        return v or ""
    if not isinstance(v, list):
        raise BadRequest("system must be a string or an array of text blocks", "system")
    texts = []
    for j, b in enumerate(v):
        if not isinstance(b, dict) or not isinstance(b.get("text"), str):
            raise BadRequest(f"system[{j}] must be a text block", f"system[{j}]")
        if not b["text"].startswith("x-anthropic-billing-header"):
            texts.append(b["text"])
    return "\n".join(texts)


def _tools(v: Any) -> tuple[Tool, ...]:
    out = []
    for i, t in enumerate(v or []):
        if not isinstance(t, dict):
            raise BadRequest(f"tools[{i}] must be an object", f"tools[{i}]")
        if "input_schema" not in t and t.get("type") not in (None, "custom"):
            continue                     # server tools (web_search_*, bash_*): cannot run here
        name, schema = t.get("name"), t.get("input_schema")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"tools[{i}].name must be a non-empty string", f"tools[{i}].name")
        if not isinstance(schema, dict):
            raise BadRequest(f"tools[{i}].input_schema must be an object",
                             f"tools[{i}].input_schema")
        schema = {"type": "object", **schema}
        if schema.get("required", []) is None:
            schema["required"] = []      # Claude Code sends required: null
        desc = t.get("description")
        out.append(Tool.function(name, desc if isinstance(desc, str) else None, schema))
    return tuple(out)


def _tool_choice(v: Any) -> tuple[str | dict, bool]:
    if v is None:
        return "auto", True
    if not isinstance(v, dict) or v.get("type") not in ("auto", "any", "tool", "none"):
        raise BadRequest("tool_choice.type must be auto, any, tool or none", "tool_choice")
    parallel = not v.get("disable_parallel_tool_use", False)
    if v["type"] == "tool":
        if not isinstance(v.get("name"), str):
            raise BadRequest("tool_choice.name must be a string", "tool_choice.name")
        return {"name": v["name"]}, parallel
    return {"any": "required"}.get(v["type"], v["type"]), parallel


def parse_request(body: dict, count_only: bool = False, images: bool = False) -> ChatRequest:
    """Messages JSON → ChatRequest; BadRequest names the field (max_tokens is required).
    images: the model reads images (image blocks of user turns and tool results)."""
    if http.get_int(body, "n", 1) != 1:
        raise BadRequest("n > 1 is not supported", "n")
    max_tokens = http.get_int(body, "max_tokens", lo=1)
    if max_tokens is None and not count_only:
        raise BadRequest("max_tokens is required", "max_tokens")
    msgs = http.get_list(body, "messages")
    if not msgs:
        raise BadRequest("messages must be a non-empty array", "messages")
    messages = [x for i, m in enumerate(msgs)
                for x in _message(m, i, i == len(msgs) - 1, images)]
    system = _system(body.get("system"))
    if system:
        messages.insert(0, Message("system", system))
    thinking_cfg = body["thinking"] if isinstance(body.get("thinking"), dict) else {}
    budget = http.get_int(thinking_cfg, "budget_tokens", lo=0)
    budget = budget if thinking_cfg.get("type") == "enabled" else None
    out_cfg = http.get_dict(body, "output_config", {})
    thinking, effort = reasoning_wishes(body, out_cfg.get("effort"), "output_config.effort")
    fmt = http.get_dict(out_cfg, "format")
    fmt = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}} \
        if fmt and fmt.get("type") == "json_schema" else None
    stop = http.get_list(body, "stop_sequences", [])
    if not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop_sequences must be non-empty strings", "stop_sequences")
    choice, parallel = _tool_choice(body.get("tool_choice"))
    return ChatRequest(
        messages=tuple(messages), tools=_tools(http.get_list(body, "tools", [])),
        tool_choice=choice, thinking=thinking, reasoning_effort=effort, reasoning_budget=budget,
        response_format=fmt, max_tokens=max_tokens, temperature=http.get_num(body, "temperature", lo=0, hi=2),
        top_p=http.get_num(body, "top_p", lo=0, hi=1), top_k=http.get_int(body, "top_k", lo=-1),
        seed=http.get_int(body, "seed", lo=-2**63, hi=2**64), stop=tuple(stop),
        stream=http.get_bool(body, "stream", False), parallel_tool_calls=parallel,
        extra={"display": thinking_cfg.get("display")})


# ---- handlers --------------------------------------------------------------------------------

def _context_error(n: int, m: int | None, limit: int) -> str:
    if m is None or n >= limit:
        return f"prompt is too long: {n} tokens > {limit - 1} maximum"
    return (f"input length and `max_tokens` exceed context limit: {n} + {m} > {limit}, "
            "decrease input length or `max_tokens` and try again")


async def _parse(request: web.Request, count_only: bool):
    ctx = request.app[CTX]
    body = await http.read_json(request)
    req = parse_request(body, count_only, images=ctx.images is not None)
    if ctx.images is not None:                 # fetch, decode and prepare (400 on failure)
        req = await ctx.images.resolve(req)
    try:
        prompt = ctx.encoder.encode_request(req)
    except ValueError as e:
        raise BadRequest(str(e), "tool_choice" if "tool_choice" in str(e) else "messages") \
            from None
    return ctx, req, prompt


async def handle_count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the exact prompt length from the DSV4 encoder."""
    try:
        _, _, prompt = await _parse(request, count_only=True)
    except BadRequest as e:
        return anthropic_error(e.status, "invalid_request_error" if e.status != 413
                               else "request_too_large", e.message)
    return http.json_response({"input_tokens": len(prompt.ids)})


async def handle_messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages (`?beta=true` and anthropic-* headers accepted)."""
    try:
        ctx, req, prompt = await _parse(request, count_only=False)
        n = len(prompt.ids)
        try:
            params = sampling_params(req, n, ctx.max_model_len, "max_tokens")
        except BadRequest as e:
            if e.code != "context_length_exceeded":
                raise
            raise BadRequest(_context_error(n, req.max_tokens, ctx.max_model_len),
                             "max_tokens") from None
    except BadRequest as e:
        return anthropic_error(e.status, "invalid_request_error" if e.status != 413
                               else "request_too_large", e.message)
    r = AnthropicRenderer(req, ctx.model_name, n)
    it = ctx.bridge.stream(prompt, params, tools=req.tools_enabled, stop=req.stop).__aiter__()
    try:                                # closed in every case: aborts the request
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            first = None
        except QueueFull as e:                  # Claude Code retries 529 as an overload
            return anthropic_error(529, "overloaded_error", str(e),
                                   {"Retry-After": str(QueueFull.retry_after)})
        except EngineUnavailable as e:
            return anthropic_error(503, "api_error", str(e),
                                   {"Retry-After": str(EngineUnavailable.retry_after)})
        except ContextTooLong:
            return anthropic_error(400, "invalid_request_error",
                                   _context_error(n, req.max_tokens, ctx.max_model_len))
        except ValueError as e:
            return anthropic_error(400, "invalid_request_error", str(e))
        if req.stream:
            return await _stream(request, r, it, first)
        try:
            async for ev in http.with_first(it, first):
                if not isinstance(ev, KeepAlive):
                    r.feed(ev)
        except EngineUnavailable as e:
            return anthropic_error(503, "api_error", str(e))
        frames = r.close()
        if frames and frames[-1][0] == "error":
            return anthropic_error(500, "api_error", frames[-1][1]["error"]["message"],
                                   {"x-should-retry": "false"})
        return http.json_response(r.message, headers={"request-id": r.message["id"]})
    finally:
        await http.close_stream(it)         # abort the engine request if it is still running


async def _stream(request, r: AnthropicRenderer, it, first) -> web.StreamResponse:
    resp = await http.sse_start(request, {"request-id": r.message["id"]})
    try:
        for etype, data in r.start():
            await http.sse_event(resp, etype, data)
        try:
            async for ev in http.with_first(it, first):
                if isinstance(ev, KeepAlive):
                    await http.sse_event(resp, "ping", {"type": "ping"})
                    continue
                for etype, data in r.feed(ev):
                    await http.sse_event(resp, etype, data)
            frames = r.close()
        except (http.ClientGone, asyncio.CancelledError):
            raise
        except Exception as e:              # noqa: BLE001 - engine died mid-stream
            log.warning("anthropic: stream failed: %r", e)
            frames = [r.error(f"generation failed: {e}"[:300])]
        for etype, data in frames:
            await http.sse_event(resp, etype, data)
        await http.sse_end(resp)
    except http.ClientGone:
        pass                                # the finally in handle_messages() aborts it
    return resp
