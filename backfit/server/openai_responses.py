"""POST /v1/responses (OpenAI Responses, Codex CLI): JSON → ChatRequest; events → SSE or JSON.

Request (api-protocols §2.1): `input` is a string or a list of items: messages (role
system/developer → system, user, assistant; text parts joined, other parts → `[Unsupported
<type>]`), `function_call` / `custom_tool_call` (joined onto the assistant turn they follow),
`function_call_output` / `custom_tool_call_output` (→ tool results), `reasoning` (text from
`content`, else `summary`; `encrypted_content` ignored: attached to the next assistant turn);
`item_reference` and hosted-tool items are dropped. `instructions` is a leading system message.
Tools are flat `{"type":"function","name",...}`; `custom` tools (Codex's `apply_patch`) are shown
to the model as a function with one string parameter `input`, and its calls come back as
`custom_tool_call` items; hosted tools (web_search, local_shell, ...) are ignored, not 400.
`previous_response_id` / `conversation` need server state we do not keep: 400 naming them.

Reply (§2.2-§2.6): the event sequence of §2.3 with dense `sequence_number` and `output_index`,
exactly one terminal event (completed | incomplete(max_output_tokens) | failed), and the same
items (same ids) in the terminal response as in each `output_item.done`. The non-streaming reply
is the terminal event's `response`, built by the same renderer (the fold of the stream).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from aiohttp import web

from backfit.server import http
from backfit.server.bridge import (
    CTX, ContextTooLong, EngineUnavailable, KeepAlive, QueueFull, SamplingParams,
)
from backfit.server.chat_format import resolve_reasoning
from backfit.server.http import BadRequest
from backfit.server.openai_request import parse_reasoning
from backfit.server.protocol import ChatRequest, Message, Tool, ToolCall
from backfit.server.responses_render import ResponsesRenderer

__all__ = ["handle", "parse_request", "reasoning_wishes", "sampling_params", "ResponsesRenderer",
           "openai_error"]

log = logging.getLogger(__name__)
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")


# ---- request → ChatRequest ------------------------------------------------------------------

def reasoning_wishes(body: dict, effort: Any = None, effort_param: str = "reasoning.effort"
                     ) -> tuple[bool | None, str | None]:
    """(thinking, effort) with the Chat rules (`openai_request.parse_reasoning`: top-level
    `thinking`, `chat_template_kwargs.thinking/enable_thinking/reasoning_effort`,
    `reasoning_effort`, `reasoning.effort`; later fields win), so every protocol maps the same
    fields the same way. `effort` is the protocol's own field (Anthropic `output_config.effort`),
    used when none of those gives one. Validated once here (400 naming the field)."""
    thinking, chosen = parse_reasoning(body)
    kw = body.get("chat_template_kwargs") or {}
    param = ("chat_template_kwargs.reasoning_effort" if kw.get("reasoning_effort") is not None
             else "reasoning_effort" if body.get("reasoning_effort") is not None
             else effort_param)
    if param == effort_param and effort is not None:
        if not isinstance(effort, str):
            raise BadRequest(f"{param} must be a string, got {effort!r}"[:200], param)
        chosen = effort
    try:
        resolve_reasoning(thinking, chosen)
    except ValueError as e:
        raise BadRequest(str(e), param) from None
    return thinking, chosen


def _parts_text(content: Any, param: str) -> str:
    """A string, or parts [{type: input_text|output_text|..., text}] joined; others flagged."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{param} must be a string or an array of content parts", param)
    out = []
    for j, p in enumerate(content):
        if isinstance(p, str):
            out.append(p)
        elif not isinstance(p, dict):
            raise BadRequest(f"{param}[{j}] must be an object", f"{param}[{j}]")
        elif p.get("type") in _TEXT_PARTS or (p.get("type") is None and "text" in p):
            text = p.get("text", p.get("refusal", ""))
            if not isinstance(text, str):
                raise BadRequest(f"{param}[{j}].text must be a string", f"{param}[{j}].text")
            out.append(text)
        else:
            out.append(f"[Unsupported {str(p.get('type'))[:40]}]")
    return "".join(out)


def _args_text(v: Any, param: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, dict):
        return json.dumps(v, ensure_ascii=False)
    raise BadRequest(f"{param} must be a JSON string", param)


class _Turns:
    """Builds Messages; consecutive assistant items (reasoning, message, calls) form one turn."""

    def __init__(self):
        self.out: list[Message] = []
        self.cur: dict | None = None         # {"reasoning", "content", "calls"}

    def flush(self):
        if self.cur is not None:
            c = self.cur
            self.out.append(Message("assistant", c["content"], c["reasoning"] or None,
                                    tuple(c["calls"])))
            self.cur = None

    def assistant(self, *, reasoning: str = "", content: str = "", call: ToolCall | None = None):
        c = self.cur
        if c is not None and ((reasoning and (c["content"] or c["calls"]))
                              or (content and c["calls"])):
            self.flush()                     # text after calls, or new reasoning: a new turn
        if self.cur is None:
            self.cur = {"reasoning": "", "content": "", "calls": []}
        self.cur["reasoning"] += reasoning
        if content and self.cur["content"]:
            self.cur["content"] += "\n\n"     # two message items of one turn: not glued
        self.cur["content"] += content
        if call is not None:
            self.cur["calls"].append(call)

    def other(self, m: Message):
        self.flush()
        self.out.append(m)


def _input_messages(items: Any) -> list[Message]:
    if isinstance(items, str):
        return [Message("user", items)]
    if not isinstance(items, list):
        raise BadRequest("input must be a string or an array of items", "input")
    turns = _Turns()
    for i, it in enumerate(items):
        p = f"input[{i}]"
        if not isinstance(it, dict):
            raise BadRequest(f"{p} must be an object", p)
        kind = it.get("type") or ("message" if "role" in it else None)
        if kind == "message":
            role = it.get("role")
            text = _parts_text(it.get("content"), f"{p}.content")
            if role in ("system", "developer"):
                turns.other(Message("system", text))
            elif role == "user":
                turns.other(Message("user", text))
            elif role == "assistant":
                turns.assistant(content=text)
            else:
                raise BadRequest(f"{p}.role must be user, assistant, system or developer, "
                                 f"got {role!r}"[:200], f"{p}.role")
        elif kind in ("function_call", "custom_tool_call"):
            name = it.get("name")
            if not isinstance(name, str) or not name:
                raise BadRequest(f"{p}.name must be a non-empty string", f"{p}.name")
            call_id = it.get("call_id") or it.get("id") or ""
            if not isinstance(call_id, str):
                raise BadRequest(f"{p}.call_id must be a string", f"{p}.call_id")
            if kind == "custom_tool_call":
                raw = it.get("input", "")
                if not isinstance(raw, str):
                    raise BadRequest(f"{p}.input must be a string", f"{p}.input")
                args = json.dumps({"input": raw}, ensure_ascii=False)
            else:
                args = _args_text(it.get("arguments", "{}"), f"{p}.arguments")
            turns.assistant(call=ToolCall(call_id, name, args))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = it.get("call_id", "")
            if not isinstance(call_id, str):
                raise BadRequest(f"{p}.call_id must be a string", f"{p}.call_id")
            turns.other(Message("tool", _parts_text(it.get("output"), f"{p}.output"),
                                tool_call_id=call_id))
        elif kind == "reasoning":           # accepted with or without summary/content (§2.4)
            text = _parts_text(it.get("content"), f"{p}.content") or \
                _parts_text(it.get("summary"), f"{p}.summary")
            turns.assistant(reasoning=text)
        else:                               # item_reference, web_search_call, compaction, ...
            log.debug("responses: dropped input item of type %r", kind)
    turns.flush()
    return turns.out


def _tools(body: dict) -> tuple[tuple[Tool, ...], set[str]]:
    tools, custom = [], set()
    for i, t in enumerate(http.get_list(body, "tools", [])):
        if not isinstance(t, dict):
            raise BadRequest(f"tools[{i}] must be an object", f"tools[{i}]")
        kind = t.get("type", "function")
        f = t.get("function") if kind == "function" and isinstance(t.get("function"), dict) else t
        name = f.get("name")
        if kind not in ("function", "custom"):
            continue                        # hosted tools cannot run here: ignored, not 400
        if not isinstance(name, str) or not name:
            raise BadRequest(f"tools[{i}].name must be a non-empty string", f"tools[{i}].name")
        desc = f.get("description")
        desc = desc if isinstance(desc, str) else None
        if kind == "custom":
            custom.add(name)
            params = {"type": "object", "properties": {"input": {
                "type": "string", "description": "the raw input text for this tool"}},
                "required": ["input"]}
        else:
            params = f.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise BadRequest(f"tools[{i}].parameters must be an object",
                                 f"tools[{i}].parameters")
        tools.append(Tool.function(name, desc, params))
    return tuple(tools), custom


def _tool_choice(v: Any) -> str | dict:
    if v is None:
        return "auto"
    if v in ("auto", "none", "required"):
        return v
    if isinstance(v, dict) and v.get("type") in ("function", "custom"):
        if not isinstance(v.get("name"), str):
            raise BadRequest("tool_choice.name must be a string", "tool_choice.name")
        return {"name": v["name"]}
    if isinstance(v, dict):
        return "auto"                       # allowed_tools, hosted tools: lenient
    raise BadRequest(f"tool_choice must be auto, none, required or an object, got {v!r}"[:200],
                     "tool_choice")


def _text_format(body: dict) -> dict | None:
    fmt = http.get_dict(http.get_dict(body, "text", {}), "format", None)
    if fmt is None or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    raise BadRequest(f"text.format.type must be text, json_object or json_schema, got "
                     f"{fmt.get('type')!r}"[:200], "text.format.type")


def parse_request(body: dict) -> tuple[ChatRequest, set[str]]:
    """Responses JSON → (ChatRequest, names of the custom tools); BadRequest names the field."""
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise BadRequest(f"{name} is not supported: this server keeps no conversation "
                             "state; send the whole input instead", name)
    if http.get_int(body, "n", 1) != 1:
        raise BadRequest("n > 1 is not supported", "n")
    if "input" not in body:
        raise BadRequest("input is required", "input")
    messages = _input_messages(body["input"])
    instructions = http.get_str(body, "instructions")
    if instructions:
        messages.insert(0, Message("system", instructions))
    if not messages:
        raise BadRequest("input must contain at least one message", "input")
    tools, custom = _tools(body)
    reasoning = http.get_dict(body, "reasoning", {})
    thinking, effort = reasoning_wishes(body, reasoning.get("effort"))
    stop = body.get("stop")
    stop = (stop,) if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, list)
                                 and all(isinstance(s, str) and s for s in stop)):
        raise BadRequest("stop must be a string or an array of strings", "stop")
    req = ChatRequest(
        messages=tuple(messages), tools=tools, tool_choice=_tool_choice(body.get("tool_choice")),
        thinking=thinking, reasoning_effort=effort, response_format=_text_format(body),
        max_tokens=http.get_int(body, "max_output_tokens", lo=1),
        temperature=http.get_num(body, "temperature", lo=0, hi=2),
        top_p=http.get_num(body, "top_p", lo=0, hi=1), top_k=http.get_int(body, "top_k", lo=-1),
        seed=http.get_int(body, "seed", lo=-2**63, hi=2**64), stop=tuple(stop or ()),
        stream=http.get_bool(body, "stream", False),
        parallel_tool_calls=http.get_bool(body, "parallel_tool_calls", True),
        extra={"reasoning_summary": reasoning.get("summary"), "instructions": instructions,
               "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
               "tools_echo": [t for t in body.get("tools") or [] if isinstance(t, dict)]})
    return req, custom


def sampling_params(req: ChatRequest, prompt_len: int, max_model_len: int,
                    param: str = "max_output_tokens") -> SamplingParams:
    """Output cap (reasoning included) checked against the context (400 context_length_...)."""
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
        return SamplingParams(max_tokens=want, **kw)
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
        req, custom = parse_request(body)
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
