"""Neutral request and event types shared by the three protocol front ends.

Each front end (OpenAI Chat, OpenAI Responses, Anthropic Messages) turns its JSON into one
`ChatRequest`; `chat_format` turns that into token ids; `parser.OutputParser` turns the model's
text into the events below; each front end renders the same events in its own wire shape, and a
non-streaming reply is the fold of the stream (`parser.fold`). No protocol knowledge lives here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "ROLES", "ToolCall", "Tool", "Message", "ChatRequest",
    "TextDelta", "ReasoningDelta", "ToolCallStart", "ToolCallArgsDelta", "ToolCallEnd",
    "Finish", "Usage", "Event", "FinishReason",
]

# DSV4 encoder roles. `developer` is the encoder's internal user-like role (api-protocols §1.1):
# front ends map the client's `developer` to `system` before building a Message.
ROLES = ("system", "user", "assistant", "tool", "developer", "latest_reminder")


@dataclass(frozen=True)
class ToolCall:
    """A call in an assistant history turn; `arguments` is the JSON text (an object)."""
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Tool:
    """A function tool. `schema` is the OpenAI `function` object exactly as rendered into the
    prompt ({"name", "description"?, "parameters"?, ...}; key order kept: it is the prompt)."""
    name: str
    schema: dict[str, Any]

    @classmethod
    def function(cls, name: str, description: str | None = None,
                 parameters: dict[str, Any] | None = None) -> Tool:
        schema: dict[str, Any] = {"name": name}
        if description is not None:
            schema["description"] = description
        if parameters is not None:
            schema["parameters"] = parameters
        return cls(name, schema)


@dataclass(frozen=True)
class Message:
    """One conversation message in neutral form.

    content: text (parts already joined), or for `tool` messages optionally a list of parts
      ({"type": "text", "text": ...} or any other type, rendered as `[Unsupported <type>]`).
    reasoning: an assistant turn's chain of thought (`reasoning_content`, Responses reasoning
      items, Anthropic thinking blocks); None or "" renders as an empty reasoning.
    prefix: only on a final assistant message: continue it (rendered without EOS).
    """
    role: str
    content: str | list[dict[str, Any]] = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    prefix: bool = False

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r} (expected one of {', '.join(ROLES)})")


@dataclass(frozen=True)
class ChatRequest:
    """A chat request after front-end parsing. thinking/effort are the raw client wishes;
    `chat_format.resolve_reasoning` turns them into the encoder's (thinking_mode, effort) once."""
    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    tool_choice: str | dict[str, Any] = "auto"     # none | auto | required | {"name": ...}
    thinking: bool | None = None                   # None: the server default (thinking on)
    reasoning_effort: str | None = None            # none|minimal|low|medium|high|xhigh|max
    reasoning_budget: int | None = None            # tokens of reasoning, then </think> forced
    response_format: dict[str, Any] | None = None  # a json_schema/json_object spec, or None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    parallel_tool_calls: bool = True
    n: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tools_enabled(self) -> bool:
        """Parse DSML only when tools were offered and not switched off (api-protocols §5.5.5)."""
        return bool(self.tools) and self.tool_choice != "none"


# ---- output events (parser → front ends) ---------------------------------------------------

@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """First event of a call: `index` counts from 0 per message; id/name appear only here."""
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    """A fragment of the call's JSON arguments; the fragments concatenate to ToolCallEnd's."""
    index: int
    text: str


@dataclass(frozen=True)
class ToolCallEnd:
    """Last event of a call. `arguments` is the whole JSON text; `error` is None for a
    well-formed call, else why the call is broken (malformed or cut-off DSML)."""
    index: int
    arguments: str
    error: str | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    """Sampled tokens of the answer (after the reasoning), only when logprobs were asked:
    `items` = ((token id, logprob, top [(id, logprob), ...] or None), ...) in output order,
    yielded before the text events of the same tokens."""
    items: tuple[tuple[int, float, list | None], ...]


@dataclass(frozen=True)
class Finish:
    """reason: stop | tool_calls | length | abort | error (front ends map it to their own).
    stop_sequence: the user stop string that ended the text, if any.
    error: set when DSML was malformed and was passed through as text (see parser)."""
    reason: str
    stop_sequence: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Usage:
    """Token counts; reasoning_tokens are included in completion_tokens (api-protocols §1.5)."""
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


Event = (TextDelta | ReasoningDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd | Finish
         | Usage | TokenLogprobs)
FinishReason = Literal["stop", "tool_calls", "length", "abort", "error"]
