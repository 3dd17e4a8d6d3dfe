"""DeepSeek-V4 prompt encoding: neutral messages + tools + thinking/effort → token ids.

Follows the official `encoding/encoding_dsv4.py` (`encode_messages`, dsv4-model.md §7.2,
api-protocols.md §5.1-§5.3): BOS; system text bare (+ `## Tools` block, + `## Response Format`);
`<｜User｜>`; tool results merged into the user turn as `<tool_result>…</tool_result>` blocks,
sorted into the call order of the preceding assistant turn; before each assistant turn and after
the last message `<｜Assistant｜>` + `<think>` (thinking) or `</think>` (chat); assistant history =
`[reasoning</think>] content [\\n\\n<｜DSML｜tool_calls>…] <｜end▁of▁sentence｜>`; history
reasoning dropped unless any message carries tools; effort text prepended at index 0.

Safety (api-protocols §5.7): the prompt is built as segments, each either one of the template's
own control tokens or text. Text segments (system/user/tool/document text, history reasoning,
tool schemas, argument values) are tokenized by a copy of the tokenizer with **no added tokens**,
so `<｜end▁of▁sentence｜>`, `<｜User｜>`, `</think>` or `｜DSML｜` typed by a user become ordinary
byte-level tokens. (`encode_special_tokens` is not enough: in DSV4's tokenizer.json only BOS/EOS/
pad and a few reserved ids are `special`, `<｜User｜>`/`<think>`/`｜DSML｜` are plain added tokens.)
Control tokens sit only at template boundaries, so on text without control strings the ids equal
the reference's `tokenizer.encode(encode_messages(...))`.

Unconfirmed in the spec, and what we chose:
- Effort rendering depends on the checkpoint's encoder. profile "flash" (original encoder:
  None/high/max, only max adds "Absolute maximum…") and "0731" (low=""/high="Absolute maximum…"/
  max="Beyond maximum…", default low) [U for 0731]. Client levels map: none → chat mode;
  minimal/low/medium/high → high (flash) and minimal/low → low, medium/high → high (0731);
  xhigh/max → max; no effort given → the encoder's own default (None / low).
- tool_choice "none" hides the tools from the model (DSML would otherwise show up as text);
  a named choice renders only that tool, "required" all of them; both are enforced by forcing
  the call's opener (`Prompt.forced`, continued by `server.bridge` after the reasoning):
  `\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="` (+ the name and `">\n` when named).
  A reasoning budget (Anthropic's `budget_tokens`) closes the reasoning with a forced
  `</think>` once it is spent.
- Request tools and response_format go on a leading system message; one empty system message
  is inserted at index 0 when the conversation does not start with one (vLLM's choice; never on
  a mid-conversation system message). `{"type": "text"}` means no format.
- System messages anywhere (Claude Code's `[user, system]`, Codex's instructions + developer
  items): a system message renders as the encoder renders one, its text bare where it stands,
  but where that would glue it to the text before it (a user turn's, another system
  message's, or an image) "\n\n" goes between (the encoder's own separator between blocks of
  one turn).
  The generation prefix `<｜Assistant｜>` + `<think>`/`</think>` goes before every assistant
  turn that does not already follow one, and after the last message unless it is a prefill:
  `[user, system]` ends `<｜User｜>u\n\ns<｜Assistant｜><think>` (the reference would end
  on the system text, and put no prefix before an assistant turn after a system message).
  A system message is not a user turn for dropping history reasoning.
- History tool-call arguments: decoded once more if double-encoded; a non-object JSON value
  becomes `{"arguments": value}` and non-JSON text `{"arguments": raw}` (the reference's own
  fallback; we never reject a replayed history).
- A control string that the tokenizer lacks (the tiny 512-id tokenizer has no `｜DSML｜`) is
  tokenized as text; BOS/EOS/User/Assistant/think tokens are required.
- A final assistant message renders as a closed turn followed by the generation prefix (a
  new turn: the reference stops after its EOS); front ends set `prefix=True` to continue it
  instead (Anthropic prefill), which renders it without EOS and without the prefix.
- Quick-instruction `task` tokens, tools on a `developer` message and the encoder's `context`
  argument are not supported (front ends map `developer` to `system`).
- Images (Vision-Exp, server/images.py): an image part of a user or tool message renders where
  the Vision-Exp encoder writes `<｜deepseek_image｜>` (a message with images has its parts
  joined by a blank line, dsv4-vision.md §5); its block is spliced into the ids there
  (backfit.vision.splice). The placeholder string in any text stays text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from backfit.server.chat_template import (
    ASSISTANT,
    BOS,
    CLIENT_EFFORT,
    CONTROL_TOKENS,
    DSML,
    EFFORT_PROMPTS,
    EOS,
    LATEST_REMINDER,
    REQUIRED_TOKENS,
    RESPONSE_FORMAT,
    THINK_END,
    THINK_START,
    TOOLS_HEAD,
    TOOLS_TAIL,
    USER,
)
from backfit.server.chat_segments import CONTROL, IMAGE, Segments, content_text
from backfit.server.chat_turns import (
    USER_SIDE,
    arguments,
    last_user,
    merge_tool_messages,
    sort_tool_results,
)
from backfit.server.protocol import ChatRequest, Message, Tool

__all__ = [
    "BOS", "EOS", "USER", "ASSISTANT", "LATEST_REMINDER", "THINK_START", "THINK_END", "DSML",
    "CONTROL_TOKENS", "EFFORT_PROMPTS", "Forced", "Prompt", "ChatEncoder", "resolve_reasoning",
    "request_tools", "render_tools_text",
]

def _to_json(value: Any) -> str:
    """The reference's to_json: ensure_ascii=False, default separators (", ", ": ")."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, UnicodeEncodeError):
        return json.dumps(value, ensure_ascii=True)


def resolve_reasoning(thinking: bool | None, effort: str | None,
                      profile: str = "flash") -> tuple[str, str | None]:
    """Client wishes → (thinking_mode "thinking"|"chat", encoder effort level); done once."""
    if profile not in EFFORT_PROMPTS:
        raise ValueError(f"unknown reasoning-effort profile {profile!r}")
    e = effort.strip().lower() if isinstance(effort, str) else effort
    if e is not None and e != "none" and e not in CLIENT_EFFORT[profile]:
        raise ValueError(f"reasoning_effort: unknown level {effort!r} "
                         "(expected none, minimal, low, medium, high, xhigh or max)")
    if thinking is False or e == "none":
        return "chat", None
    return "thinking", (CLIENT_EFFORT[profile][e] if e is not None else None)


def request_tools(req: ChatRequest) -> tuple[Tool, ...]:
    """The tools shown to the model: none for tool_choice "none", only the named one for a
    named choice (a nudge; the output is still validated by the parser)."""
    choice = req.tool_choice
    if choice == "none":
        return ()
    if choice == "required" and not req.tools:
        raise ValueError("tool_choice: a tool call is required, but no tools were given")
    if isinstance(choice, dict):
        name = choice.get("name") or (choice.get("function") or {}).get("name")
        named = tuple(t for t in req.tools if t.name == name)
        if not named:
            raise ValueError(f"tool_choice: no tool named {name!r} in tools")
        return named
    return req.tools


def render_tools_text(tools: tuple[Tool, ...] | list[Tool]) -> str:
    """The `## Tools` block as text (control strings included verbatim)."""
    return TOOLS_HEAD + "\n".join(_to_json(t.schema) for t in tools) + TOOLS_TAIL


@dataclass(frozen=True)
class Forced:
    """Output the model is made to produce: `ids` (detokenizing to `text`: the tool-call opener
    of tool_choice required / named, or nothing) right after the reasoning closes (`</think>`,
    id `think_end`), which is forced after `budget` reasoning tokens when a budget is set."""
    ids: tuple[int, ...]
    text: str
    think_end: int
    budget: int | None = None


@dataclass(frozen=True)
class Prompt:
    """An encoded prompt. `text` is the reference string; `reasoning_open` says the prompt ends
    inside `<think>`, so the output starts with reasoning (hand it to the parser); `forced`:
    the tool-call opener of a required / named tool_choice and the reasoning budget, or None.
    With images, ids hold each image's block (ids vocab_size + type, backfit.vision.splice)
    where the reference writes `<｜deepseek_image｜>`, and `images` says where.
    cache_boundary: ids before the first User token (system + tools; a prefix-cache snapshot)."""
    ids: list[int]
    text: str
    thinking_mode: str
    reasoning_effort: str | None
    reasoning_open: bool
    forced: Forced | None = None
    images: tuple = ()              # (ImageSpan, PreparedImage) of each image block in ids
    cache_boundary: int | None = None


class ChatEncoder:
    """DSV4 prompt encoder over a `tokenizers.Tokenizer` (real or the tiny 512-id one)."""

    def __init__(self, tokenizer, profile: str = "flash", default_thinking: bool | None = None,
                 default_effort: str | None = None, vocab_size: int | None = None):
        from tokenizers import Tokenizer

        if profile not in EFFORT_PROMPTS:
            raise ValueError(f"unknown reasoning-effort profile {profile!r}")
        resolve_reasoning(default_thinking, default_effort, profile)     # raises on a bad level
        self.profile = profile
        # the server's --default-chat-template-kwargs: for requests that do not say
        self.default_thinking, self.default_effort = default_thinking, default_effort
        self.tokenizer = tokenizer
        # the model's vocabulary (config.json): image-block ids are vocab_size + type
        self.vocab_size = vocab_size or tokenizer.get_vocab_size(with_added_tokens=True)
        cfg = json.loads(tokenizer.to_str())
        cfg["added_tokens"] = []            # text is never split on added tokens
        self.plain = Tokenizer.from_str(json.dumps(cfg))
        self.control_ids = {t: tokenizer.token_to_id(t) for t in CONTROL_TOKENS}
        missing = [t for t in REQUIRED_TOKENS if self.control_ids[t] is None]
        if missing:
            raise ValueError(f"tokenizer lacks the DSV4 chat tokens {missing}")

    @classmethod
    def from_file(cls, path: str | Path, profile: str = "flash",
                  vocab_size: int | None = None) -> ChatEncoder:
        from tokenizers import Tokenizer

        p = Path(path)
        return cls(Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p)), profile,
                   vocab_size=vocab_size)

    # ---- public entry points ---------------------------------------------------------------

    def encode_request(self, req: ChatRequest) -> Prompt:
        thinking = self.default_thinking if req.thinking is None else req.thinking
        effort = self.default_effort if req.reasoning_effort is None else req.reasoning_effort
        mode, effort = resolve_reasoning(thinking, effort, self.profile)
        tools = request_tools(req)
        prompt = self.encode_messages(req.messages, tools, mode, effort, req.response_format)
        budget = req.reasoning_budget if prompt.reasoning_open else None
        call = bool(tools) and req.tool_choice != "auto"
        if not (call or budget is not None) or req.messages[-1].prefix:
            return prompt                   # nothing to force (or a prefill to continue)
        segs = Segments()
        if call:                            # the name as text: it is the client's
            segs.template(f'\n\n<{DSML}tool_calls>\n<{DSML}invoke name="')
            if len(tools) == 1 and isinstance(req.tool_choice, dict):
                segs.text(f'{tools[0].name}">\n')
        forced = Forced(tuple(self._ids(segs)), segs.rendered, self.control_ids[THINK_END],
                        budget)
        return replace(prompt, forced=forced)

    def encode_messages(self, messages, tools=(), thinking_mode: str = "thinking",
                        reasoning_effort: str | None = None, response_format=None,
                        drop_thinking: bool = True) -> Prompt:
        if thinking_mode not in ("thinking", "chat"):
            raise ValueError(f"thinking_mode must be 'thinking' or 'chat', not {thinking_mode!r}")
        if reasoning_effort not in EFFORT_PROMPTS[self.profile]:
            raise ValueError(f"reasoning_effort {reasoning_effort!r} is not a level of the "
                             f"{self.profile!r} encoder")
        if not messages:
            raise ValueError("messages: at least one message is required")
        if response_format is not None and response_format.get("type") == "text":
            response_format = None
        segs = self._render(list(messages), tuple(tools), thinking_mode, reasoning_effort,
                            response_format, drop_thinking)
        thinks = [t for t, c in segs.items if c == CONTROL and t in (THINK_START, THINK_END)]
        ids, images = self._splice(segs)
        user = self.control_ids[USER]             # (image-block ids are >= vocab_size)
        return Prompt(ids=ids, text=segs.rendered, thinking_mode=thinking_mode,
                      reasoning_effort=reasoning_effort,
                      reasoning_open=bool(thinks) and thinks[-1] == THINK_START, images=images,
                      cache_boundary=ids.index(user) if user in ids else None)

    def encode_text(self, text: str) -> list[int]:
        """Untrusted text → ids, never control ids (every text segment of a chat prompt)."""
        return self.plain.encode(text, add_special_tokens=False).ids

    # ---- rendering -------------------------------------------------------------------------

    def _ids(self, segs: Segments) -> list[int]:
        """The ids of a prompt without images."""
        return self._runs(segs)[0]

    def _runs(self, segs: Segments) -> list:
        """The prompt as text-id runs and images between them (splice's segments)."""
        runs: list = [[]]
        pending = ""
        for s, kind in segs.items:
            tid = self.control_ids.get(s) if kind == CONTROL else None
            if tid is None and kind != IMAGE:   # text, or a control string this vocab lacks
                pending += s
                continue
            if pending:
                runs[-1] += self.encode_text(pending)
                pending = ""
            if kind == IMAGE:
                runs += [s, []]
            else:
                runs[-1].append(tid)
        if pending:
            runs[-1] += self.encode_text(pending)
        return runs

    def _splice(self, segs: Segments) -> tuple[list[int], tuple]:
        """(ids, (span, image) pairs): each image's block spliced between its text runs."""
        if not segs.has_images:
            return self._ids(segs), ()
        from backfit.vision import splice
        vp = splice(self._runs(segs), self.vocab_size)
        return list(vp.ids), tuple(zip(vp.spans, vp.images))

    def _render(self, messages: list[Message], tools, mode, effort, response_format,
                drop_thinking) -> Segments:
        # request-level tools/format go on a leading system message (one inserted at 0 if the
        # conversation does not start with one: never on a mid-conversation system message)
        if (tools or response_format) and messages[0].role != "system":
            messages.insert(0, Message("system", ""))
        turns = merge_tool_messages(messages)
        for t in turns:
            t["extras"] = t.get("msg") is messages[0] and bool(tools or response_format)
        sort_tool_results(turns)
        drop = drop_thinking and not tools
        if mode == "thinking" and drop:     # reference _drop_thinking_messages
            last = last_user(turns)
            turns = [t for i, t in enumerate(turns) if t["role"] != "developer" or i >= last]
        last_u = last_user(turns)

        def prefix(j: int) -> None:         # the generation prefix before turn j (or the end)
            segs.control(ASSISTANT)
            segs.control(THINK_START if mode == "thinking" and (not drop or j > last_u)
                         else THINK_END)

        segs = Segments()
        segs.control(BOS)
        at_prefix = False                   # the prompt ends with the generation prefix
        for i, t in enumerate(turns):
            role = t["role"]
            if i == 0 and mode == "thinking":
                segs.text(EFFORT_PROMPTS[self.profile][effort])
            if (role == "assistant" and not at_prefix) or (
                    role == "latest_reminder" and i and turns[i - 1]["role"] in USER_SIDE):
                prefix(i)
                at_prefix = True
            extras = (tools, response_format) if t["extras"] else ((), None)
            self._render_turn(segs, t, i > last_u, mode, drop, i > 0, *extras)
            at_prefix = at_prefix and role == "latest_reminder"
        if not at_prefix and not (turns[-1]["role"] == "assistant" and turns[-1]["msg"].prefix):
            prefix(len(turns))              # the generation prompt follows the last message
        return segs

    def _render_turn(self, segs, t, after_last_user, mode, drop, mid, tools, response_format):
        role = t["role"]
        if role in ("system", "developer"):
            if role == "developer":
                segs.control(USER)
            text = content_text(t["msg"].content)
            if mid and role == "system" and text and segs.items and \
                    segs.items[-1][1] != CONTROL:   # not glued to the text or image before it
                segs.text("\n\n")                 # (module doc)
            segs.text(text)
            if tools:
                segs.text("\n\n")
                segs.template(TOOLS_HEAD)
                segs.text("\n".join(_to_json(x.schema) for x in tools))
                segs.text(TOOLS_TAIL)
            if response_format:
                segs.text("\n\n" + RESPONSE_FORMAT + _to_json(response_format))
        elif role == "user":                # blocks joined by a blank line
            segs.control(USER)
            for k, b in enumerate(t["blocks"]):
                segs.text("\n\n" if k else "")
                tool = b["type"] == "tool_result"
                segs.text("<tool_result>" if tool else "")
                segs.pieces(b["pieces"])
                segs.text("</tool_result>" if tool else "")
        elif role == "latest_reminder":
            segs.control(LATEST_REMINDER)
            segs.text(content_text(t["msg"].content))
        else:                               # assistant
            m = t["msg"]
            if mode == "thinking" and (not drop or after_last_user):
                segs.text(m.reasoning or "")
                segs.control(THINK_END)
            segs.text(content_text(m.content))
            if m.tool_calls:
                self._render_calls(segs, m.tool_calls)
            if not m.prefix:
                segs.control(EOS)

    @staticmethod
    def _render_calls(segs, calls):
        # "\n\n<｜DSML｜tool_calls>\n" + invokes joined by "\n" + "\n</｜DSML｜tool_calls>"
        segs.text("\n\n<")
        segs.control(DSML)
        segs.text("tool_calls>\n")
        for k, call in enumerate(calls):
            if k:
                segs.text("\n")
            segs.text("<")
            segs.control(DSML)
            segs.text(f'invoke name="{call.name}">\n')
            for j, (key, v) in enumerate(arguments(call.arguments).items()):
                is_str = isinstance(v, str)
                segs.text(("\n" if j else "") + "<")
                segs.control(DSML)
                segs.text(f'parameter name="{key}" string="{"true" if is_str else "false"}">'
                          + (v if is_str else _to_json(v)) + "</")
                segs.control(DSML)
                segs.text("parameter>")
            segs.text("\n</")
            segs.control(DSML)
            segs.text("invoke>")
        segs.text("\n</")
        segs.control(DSML)
        segs.text("tool_calls>")
