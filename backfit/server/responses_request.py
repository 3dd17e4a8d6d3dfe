"""OpenAI Responses request → neutral `ChatRequest` (api-protocols §2.1; `openai_responses`
serves it).

`input` is a string or a list of items: messages (role system/developer → system, user,
assistant; text parts joined; on a Vision-Exp model `input_image` parts of user messages and
tool outputs are images (server/images.py); other parts → `[Unsupported <type>]`),
`function_call` / `custom_tool_call` (joined onto the assistant turn they follow),
`function_call_output` / `custom_tool_call_output` (→ tool results), `reasoning` (text from
`content`, else `summary`; `encrypted_content` ignored: attached to the next assistant turn).
Items of hosted tools that ran on OpenAI's side (`web_search_call`, `local_shell_call`,
`compaction`, ... in `HOSTED_ITEMS`) are dropped; `item_reference` (needs stored items) and any
other type are a 400 naming `input[i].type`. `instructions` is a leading system message.

Tools: flat `{"type":"function","name",...}` (the Chat wrapper accepted too); `custom` tools
(Codex's `apply_patch`) are shown as a function with one string parameter `input` (calls come
back as `custom_tool_call` items); a `namespace` entry (Codex's `multi_agent_v1`:
`{"type":"namespace","name","description","tools":[...]}`) contributes its functions, each
shown under its own name with the namespace's description in front of its own, and their calls
come back with `"namespace"` set (`extra["namespaces"]`: function name → namespace). Hosted
tools (`HOSTED_TOOLS`: web_search, file_search, local_shell, ...) run on OpenAI's servers, so
they are not shown to the model (not a 400: Codex sends web_search by default); any other type,
and two tools of one name, are a 400 naming the field. `previous_response_id` /
`conversation` need server state we do not keep: 400 naming them.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from backfit.server import http
from backfit.server.chat_format import resolve_reasoning
from backfit.server.http import BadRequest
from backfit.server.images import ImageRef, content_parts
from backfit.server.openai_request import parse_reasoning
from backfit.server.protocol import ChatRequest, Message, Tool, ToolCall

__all__ = ["HOSTED_ITEMS", "HOSTED_TOOLS", "parse_request", "reasoning_wishes"]

log = logging.getLogger(__name__)
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")
# hosted tools (run on OpenAI's side, or client shells the model here never calls) and the
# history items they leave: not shown to the model
HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter",
                "computer_use_preview", "computer", "image_generation", "local_shell", "shell",
                "apply_patch", "mcp", "tool_search")
HOSTED_ITEMS = ("web_search_call", "file_search_call", "computer_call", "computer_call_output",
                "code_interpreter_call", "image_generation_call", "local_shell_call",
                "local_shell_call_output", "shell_call", "shell_call_output", "apply_patch_call",
                "apply_patch_call_output", "mcp_call", "mcp_list_tools", "mcp_approval_request",
                "mcp_approval_response", "tool_search_call", "tool_search_output", "compaction")


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


def _parts_text(content: Any, param: str, images: bool = False) -> str | list[dict]:
    """A string, or parts [{type: input_text|output_text|..., text}] joined; others flagged.
    images (a vision model, a user message or tool output): input_image parts -> ImageRefs
    (server/images.py), the content then text and image parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{param} must be a string or an array of content parts", param)
    out: list = []
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
        elif p.get("type") == "input_image" and images:
            url = p.get("image_url")
            if not isinstance(url, str) or not url:
                raise BadRequest(f"{param}[{j}].image_url must be a data: or http(s) URL "
                                 "(file_id is not supported)", f"{param}[{j}].image_url")
            out.append(ImageRef(url, f"{param}[{j}]"))
        else:
            out.append(f"[Unsupported {str(p.get('type'))[:40]}]")
    return content_parts(out)


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


def _input_messages(items: Any, images: bool = False) -> list[Message]:
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
            text = _parts_text(it.get("content"), f"{p}.content", images and role == "user")
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
            turns.other(Message("tool", _parts_text(it.get("output"), f"{p}.output", images),
                                tool_call_id=call_id))
        elif kind == "reasoning":           # accepted with or without summary/content (§2.4)
            text = _parts_text(it.get("content"), f"{p}.content") or \
                _parts_text(it.get("summary"), f"{p}.summary")
            turns.assistant(reasoning=text)
        elif kind in HOSTED_ITEMS:          # a hosted tool's history: nothing to render
            log.debug("responses: dropped input item of type %r", kind)
        else:
            why = ("needs the stored item; send the item itself (this server keeps no state)"
                   if kind == "item_reference" else "is not a Responses input item type")
            raise BadRequest(f"{p}.type {str(kind)[:40]!r} {why}", f"{p}.type")
    turns.flush()
    return turns.out


def _function(f: dict, w: str, kind: str) -> Tool:
    """One function (or custom) tool entry at `w` (tools[i] or tools[i].tools[j]) -> Tool."""
    name = f.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{w}.name must be a non-empty string", f"{w}.name")
    desc = f.get("description")
    desc = desc if isinstance(desc, str) else None
    if kind == "custom":
        params = {"type": "object", "properties": {"input": {
            "type": "string", "description": "the raw input text for this tool"}},
            "required": ["input"]}
    else:
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise BadRequest(f"{w}.parameters must be an object", f"{w}.parameters")
    return Tool.function(name, desc, params)


def _tools(body: dict) -> tuple[tuple[Tool, ...], set[str], dict[str, str]]:
    """-> (tools shown to the model, names of the custom ones, function name -> namespace)."""
    tools, custom, namespaces, where = [], set(), {}, {}

    def add(tool: Tool, w: str) -> None:
        if tool.name in where:
            raise BadRequest(f"{w}.name {tool.name!r} is also the name of {where[tool.name]}: "
                             "tool names must be unique (namespaces included)", f"{w}.name")
        where[tool.name] = w
        tools.append(tool)

    for i, t in enumerate(http.get_list(body, "tools", [])):
        w = f"tools[{i}]"
        if not isinstance(t, dict):
            raise BadRequest(f"{w} must be an object", w)
        kind = t.get("type", "function")
        if kind in ("function", "custom"):
            f = t["function"] if kind == "function" and isinstance(t.get("function"), dict) \
                else t
            add(_function(f, w, kind), w)
            if kind == "custom":
                custom.add(tools[-1].name)
        elif kind == "namespace":
            ns, members = t.get("name"), t.get("tools")
            if not isinstance(ns, str) or not ns:
                raise BadRequest(f"{w}.name must be a non-empty string", f"{w}.name")
            if not isinstance(members, list) or not members:
                raise BadRequest(f"{w}.tools must be a non-empty array", f"{w}.tools")
            head = t.get("description")
            for j, m in enumerate(members):
                wj = f"{w}.tools[{j}]"
                if not isinstance(m, dict) or m.get("type", "function") != "function":
                    raise BadRequest(f"{wj}: a namespace holds function tools", f"{wj}.type")
                fn = _function(m, wj, "function")
                if isinstance(head, str) and head:
                    desc = f"({ns}: {head})" + (f" {fn.schema['description']}"
                                                if "description" in fn.schema else "")
                    fn = Tool(fn.name, {**fn.schema, "description": desc})
                add(fn, wj)
                namespaces[fn.name] = ns
        elif kind not in HOSTED_TOOLS:
            raise BadRequest(f"{w}.type {str(kind)[:40]!r} is not a tool type this server can "
                             "show the model (function, custom, namespace; hosted tools are "
                             "ignored)", f"{w}.type")
    return tuple(tools), custom, namespaces


def _tool_choice(v: Any, tools: tuple[Tool, ...]) -> tuple[str | dict, tuple[Tool, ...]]:
    """-> (the neutral choice, the tools it leaves shown: allowed_tools narrows them)."""
    if v is None:
        return "auto", tools
    if v in ("auto", "none", "required"):
        return v, tools
    if not isinstance(v, dict):
        raise BadRequest(f"tool_choice must be auto, none, required or an object, got "
                         f"{v!r}"[:200], "tool_choice")
    if v.get("type") in ("function", "custom"):
        if not isinstance(v.get("name"), str):
            raise BadRequest("tool_choice.name must be a string", "tool_choice.name")
        return {"name": v["name"]}, tools
    if v.get("type") == "allowed_tools":
        mode, allowed = v.get("mode", "auto"), v.get("tools")
        if mode not in ("auto", "required") or not isinstance(allowed, list):
            raise BadRequest("tool_choice: allowed_tools needs mode auto|required and tools",
                             "tool_choice")
        names = {a.get("name") for a in allowed if isinstance(a, dict)}
        return mode, tuple(t for t in tools if t.name in names)
    raise BadRequest(f"tool_choice type {str(v.get('type'))[:40]!r} cannot be honoured here "
                     "(hosted tools do not run on this server)", "tool_choice")


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


def parse_request(body: dict, images: bool = False) -> tuple[ChatRequest, set[str]]:
    """Responses JSON → (ChatRequest, names of the custom tools); BadRequest names the field.
    images: the model reads images (input_image parts of user messages and tool outputs)."""
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise BadRequest(f"{name} is not supported: this server keeps no conversation "
                             "state; send the whole input instead", name)
    if http.get_int(body, "n", 1) != 1:
        raise BadRequest("n > 1 is not supported", "n")
    if "input" not in body:
        raise BadRequest("input is required", "input")
    messages = _input_messages(body["input"], images)
    instructions = http.get_str(body, "instructions")
    if instructions:
        messages.insert(0, Message("system", instructions))
    if not messages:
        raise BadRequest("input must contain at least one message", "input")
    tools, custom, namespaces = _tools(body)
    choice, tools = _tool_choice(body.get("tool_choice"), tools)
    reasoning = http.get_dict(body, "reasoning", {})
    thinking, effort = reasoning_wishes(body, reasoning.get("effort"))
    stop = body.get("stop")
    stop = (stop,) if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, list)
                                 and all(isinstance(s, str) and s for s in stop)):
        raise BadRequest("stop must be a string or an array of strings", "stop")
    req = ChatRequest(
        messages=tuple(messages), tools=tools, tool_choice=choice,
        thinking=thinking, reasoning_effort=effort, response_format=_text_format(body),
        max_tokens=http.get_int(body, "max_output_tokens", lo=1),
        temperature=http.get_num(body, "temperature", lo=0, hi=2),
        top_p=http.get_num(body, "top_p", lo=0, hi=1), top_k=http.get_int(body, "top_k", lo=-1),
        seed=http.get_int(body, "seed", lo=-2**63, hi=2**64), stop=tuple(stop or ()),
        stream=http.get_bool(body, "stream", False),
        parallel_tool_calls=http.get_bool(body, "parallel_tool_calls", True),
        extra={"reasoning_summary": reasoning.get("summary"), "instructions": instructions,
               "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
               "tools_echo": [t for t in body.get("tools") or [] if isinstance(t, dict)],
               "namespaces": namespaces})
    return req, custom


