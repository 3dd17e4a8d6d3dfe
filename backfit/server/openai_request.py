"""OpenAI request parsing shared by /v1/chat/completions, /v1/completions and /tokenize:
messages (roles, content parts: text, and image_url parts of user / tool messages as ImageRefs
that server/images.py loads), history tool calls and reasoning, tools and tool_choice,
thinking/effort from every known field, sampling knobs, stop strings. Each bad field is a
BadRequest naming it (`messages[2].content[0]`, `tool_choice`, ...)."""

from __future__ import annotations

import json
from typing import Any

from backfit.server.bridge import MAX_LOGPROBS, SamplingParams
from backfit.server.http import BadRequest, get_bool, get_dict, get_int, get_list, get_num, get_str
from backfit.server.images import ImageRef, content_parts
from backfit.server.protocol import ChatRequest, Message, Tool, ToolCall

MAX_CHOICES = 16          # `n`: choices a chat request may ask for (each an engine request)

__all__ = [
    "parse_messages",
    "parse_reasoning",
    "parse_request",
    "parse_stop",
    "parse_tools",
    "sampling_params",
]

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool", "function": "tool"}
_TEXT_PARTS = ("text", "input_text", "output_text", "refusal")


def _text(content: Any, where: str, images: bool | None = None) -> str | list[dict]:
    """A message's content: a string, or parts (text, and with images=True image_url /
    input_image parts -> ImageRef, server/images.py) -> the text, or text and image parts.
    images: True (a vision model, a user or tool message), False (a vision model, another
    role), None (a text-only model)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or an array of content parts", where)
    out: list = []
    for j, p in enumerate(content):
        if isinstance(p, str):
            out.append(p)
            continue
        w = f"{where}[{j}]"
        if not isinstance(p, dict):
            raise BadRequest(f"{w} must be a content part object", w)
        kind = p.get("type", "text")
        if kind in _TEXT_PARTS:
            t = p.get("text", p.get("refusal", ""))
            if not isinstance(t, str):
                raise BadRequest(f"{w}.text must be a string", f"{w}.text")
            out.append(t)
        elif kind in ("image_url", "input_image") and images:
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url:
                raise BadRequest(f"{w}.image_url.url must be a string (a data: or http(s) URL)",
                                 f"{w}.image_url")
            out.append(ImageRef(url, w))
        elif kind in ("image_url", "input_image") and images is not None:
            raise BadRequest(f"{w}: image parts are only accepted in user and tool messages", w)
        else:
            reads = "text and images" if images is not None else "text only"
            raise BadRequest(f"{w}: content part type {str(kind)[:40]!r} is not supported "
                             f"(this model reads {reads})", w)
    return content_parts(out)


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


def parse_messages(raw: Any, images: bool = False) -> tuple[Message, ...]:
    """images: the model reads images (user and tool messages may hold image parts)."""
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
        content = _text(m.get("content"), f"{w}.content",
                        images=role in ("user", "tool") if images else None)
        if role == "assistant":
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning is not None and not isinstance(reasoning, str):
                raise BadRequest(f"{w}.reasoning_content must be a string",
                                 f"{w}.reasoning_content")
            prefix = m.get("prefix") is True and i == len(raw) - 1
            out.append(Message("assistant", content, reasoning or None,
                               _calls(m.get("tool_calls"), f"{w}.tool_calls"), prefix=prefix))
        elif role == "tool":                 # the legacy `function` role names its call
            tid = m.get("tool_call_id") if m["role"] == "tool" else m.get("name")
            if not isinstance(tid, str) or not tid:
                key = "tool_call_id" if m["role"] == "tool" else "name"
                raise BadRequest(f"{w}.{key} is required (the id of the call this answers)",
                                 f"{w}.{key}")
            out.append(Message("tool", content, tool_call_id=tid))
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
    choice = body.get("tool_choice")
    if not tools and choice not in (None, "none", "auto"):
        raise BadRequest("tool_choice names or requires a tool, but no tools were given",
                         "tool_choice")
    choice = "auto" if choice is None else choice if tools else "none"
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


def parse_request(body: dict, images: bool = False) -> tuple[ChatRequest, SamplingParams]:
    get_str(body, "model")
    n = get_int(body, "n", 1, lo=1, hi=MAX_CHOICES)
    want_lp = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not want_lp:
        raise BadRequest("top_logprobs requires logprobs to be true", "top_logprobs")
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
        messages=parse_messages(body.get("messages"), images), tools=tools, tool_choice=choice,
        thinking=thinking, reasoning_effort=effort, response_format=fmt, max_tokens=mt,
        stop=parse_stop(body), stream=bool(get_bool(body, "stream", False)),
        include_usage=opts.get("include_usage") is True,
        parallel_tool_calls=get_bool(body, "parallel_tool_calls", True), n=n)
    return req, sampling_params(body, mt, logprobs=(top or 0) if want_lp else None)
