"""One incremental parser for DeepSeek-V4 output text → neutral events (streaming and not).

States (api-protocols §5.5): REASONING → CONTENT → BLOCK → INVOKE → PARAMS → PARAM → VALUE →
back to BLOCK / AFTER → CONTENT; JSON for a direct `{...}` invoke body (SGLang accepts it);
RAW after malformed DSML; DONE after EOS text or a stop string.
The model text is `{reasoning}</think>{content}\\n\\n<｜DSML｜tool_calls>\\n<｜DSML｜invoke
name="f">\\n<｜DSML｜parameter name="p" string="true|false">v</｜DSML｜parameter>\\n
</｜DSML｜invoke>\\n</｜DSML｜tool_calls>` (dsv4-model.md §7.4). Arguments are built as the
reference decoder does: `{"p": "v", "n": 3}` (to_json(key) + ": " + value, joined by ", ").

Split invariance: every decision is taken at the earliest position where a marker matches fully
or could still match (a suffix that is a proper prefix of a marker is held back), so the events
fold to the same message however the text is cut; `feed(bytes)` also holds back partial UTF-8.
String values (`string="true"`) stream as JSON-escaped fragments as they arrive; `string="false"`
values are buffered to their close tag and checked.

Choices where the spec is silent or the model misbehaves (documented behaviour, tested):
- `<｜DSML｜tool_calls>` is also accepted without the "\\n\\n" before it, and inside reasoning
  (ends the reasoning, as vLLM does); an orphan `<｜DSML｜invoke` in content (opener missing)
  opens an implicit block. Whitespace between tags is free; a missing `</｜DSML｜tool_calls>`
  at the end is accepted once every invoke closed. Text after a closed block is content.
- A `string="false"` value that is not JSON is passed as a JSON string and flagged (non-fatal).
- Malformed DSML (bad header, text between tags, duplicate parameter, an empty block): the
  current call, if started, ends with ToolCallEnd(error=...); the raw text since the last
  complete invoke (or the block opener) and everything after it is emitted as TextDelta, and
  Finish.error says why. DSML parsing stays off for the rest of the message.
- Stream cut inside a call (max tokens): the call ends with error set; no DSML is shown as text.
- EOS text, if the detokenizer passes it, ends the message. Stop strings given here apply to
  content only (not reasoning or arguments) and are stripped; the engine's TextStream applies
  them to the whole text instead; either way Finish.stop_sequence names the match (pass the
  engine's to finish()) and a stop string ends the message with reason "stop".
- Finish.reason is "tool_calls" only when >= 1 call completed and the engine stopped on EOS
  ("length" stays "length", pitfall #2). A call with error set was already streamed; the front
  ends decide how to show it (it must not be executed as if complete).
- Tool parsing only when `tools=True` (the request had tools and tool_choice != none).
- reasoning_tokens counts the tokens fed up to and including the chunk that ends the reasoning
  (exact when fed one token at a time).
"""

from __future__ import annotations

import codecs
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from backfit.server.protocol import (
    Event,
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)

__all__ = ["OutputParser", "ParsedCall", "ParsedMessage", "fold", "parse_text"]

EOS, THINK_END, D = "<｜end▁of▁sentence｜>", "</think>", "｜DSML｜"
OPEN, CLOSE = f"<{D}tool_calls>", f"</{D}tool_calls>"
INVOKE, INVOKE_END = f"<{D}invoke", f"</{D}invoke>"
PARAM, PARAM_END = f"<{D}parameter", f"</{D}parameter>"
_HEADER_MAX = 512          # chars allowed in an invoke/parameter header before its ">"
_INVOKE_RE = re.compile(r'\s*name="([^"]+)"\s*>', re.DOTALL)
_PARAM_RE = re.compile(r'\s*name="([^"]+)"\s+string="(true|false)"\s*>', re.DOTALL)


def _scan(buf: str, markers: list[str]) -> tuple[int, str | None]:
    """(pos, marker) of the earliest full match, or (pos, None) when text from pos could still
    become a marker (hold it back), or (len(buf), None) when nothing matches."""
    full, part = (len(buf), None), len(buf)
    for m in markers:
        p = buf.find(m)
        if p != -1 and (p < full[0] or (p == full[0] and len(m) > len(full[1] or ""))):
            full = (p, m)
        for k in range(min(len(m) - 1, len(buf)), 0, -1):
            if buf.endswith(m[:k]):
                part = min(part, len(buf) - k)
                break
    return (part, None) if part <= full[0] and part < len(buf) else full


def _strict_json(text: str) -> bool:
    def no_constants(c):
        raise ValueError(c)
    try:
        json.loads(text, parse_constant=no_constants)
        return True
    except ValueError:
        return False


def _jstr(s: str) -> str:
    """JSON string body (no quotes); escaping is per character, so fragments concatenate."""
    return json.dumps(s, ensure_ascii=False)[1:-1]


class OutputParser:
    """feed(text or bytes) → events; finish(reason) → the last events and one Finish."""

    def __init__(self, reasoning: bool, tools: bool, stop: tuple[str, ...] | list[str] = (),
                 make_id: Callable[[], str] | None = None):
        self.tools = tools
        self.stop = [s for s in stop if s]
        self.make_id = make_id or (lambda: "call_" + uuid.uuid4().hex[:24])
        self.state = "REASONING" if reasoning else "CONTENT"
        self.buf = ""
        self.raw = ""                  # DSML consumed since the last complete invoke / opener
        self.errors: list[str] = []
        self.stop_sequence: str | None = None
        self.reasoning_tokens = 0
        self._tokens = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._out: list[Event] = []
        self._calls_ok = 0
        self._n_calls = 0
        self._block_calls = 0          # invokes completed in the current block
        self._call: dict | None = None  # {"index", "args", "names", "is_str", "value"}
        self._finished = False

    @property
    def done(self) -> bool:
        """EOS text or a stop string was seen: the caller should stop the engine request."""
        return self.state == "DONE"

    # ---- public ----------------------------------------------------------------------------

    def feed(self, delta: str | bytes, n_tokens: int = 0) -> list[Event]:
        self._tokens += n_tokens
        if isinstance(delta, bytes):
            delta = self._utf8.decode(delta)
        if self.state != "DONE":
            self.buf += delta
            self._run()
        return self._take()

    def finish(self, reason: str = "stop", stop_sequence: str | None = None) -> list[Event]:
        """End of output. reason: the engine's (stop | length | abort | error); stop_sequence:
        the stop string the engine matched, when stop strings are applied there instead."""
        if self._finished:
            return []
        self._finished = True
        self.buf += self._utf8.decode(b"", final=True)
        self._run()
        st, buf = self.state, self.buf
        self.buf = ""
        if st == "REASONING":
            self._emit(ReasoningDelta, buf)
            self.reasoning_tokens = self._tokens
        elif st in ("CONTENT", "RAW"):
            self._emit(TextDelta, buf)
        elif st == "BLOCK" and self._block_calls == 0:
            self._malformed("empty tool-call block", buf)
        elif st in ("INVOKE", "PARAMS", "PARAM", "VALUE", "JSON"):
            self._end_call("unterminated tool call (output ended inside it)")
            if st == "INVOKE":
                self.errors.append("unterminated tool call (output ended in its header)")
        self.stop_sequence = self.stop_sequence or stop_sequence
        if self.stop_sequence is not None:
            reason = "stop"
        elif reason == "stop" and self._calls_ok:
            reason = "tool_calls"
        self._out.append(Finish(reason, self.stop_sequence, "; ".join(self.errors) or None))
        self.state = "DONE"
        return self._take()

    # ---- machinery -------------------------------------------------------------------------

    def _take(self) -> list[Event]:
        out, self._out = self._out, []
        return out

    def _emit(self, kind, text: str):
        if text:
            self._out.append(kind(text))

    def _run(self):
        while self.buf and self.state != "DONE" and getattr(self, "_" + self.state)():
            pass
        if self.state == "DONE":
            self.buf = ""

    def _split(self, markers: list[str]) -> tuple[str, str | None]:
        """Take the text before the first marker (or before a possible one); consume a marker."""
        pos, m = _scan(self.buf, markers)
        head = self.buf[:pos]
        self.buf = self.buf[pos + len(m):] if m else self.buf[pos:]
        return head, m

    def _openers(self) -> list[str]:
        return ["\n\n" + OPEN, OPEN] if self.tools else []

    def _REASONING(self) -> bool:
        head, m = self._split([THINK_END, EOS] + self._openers())
        self._emit(ReasoningDelta, head)
        if m is None:
            return False
        self.reasoning_tokens = self._tokens
        self.state = {THINK_END: "CONTENT", EOS: "DONE"}.get(m, "BLOCK")
        if self.state == "BLOCK":               # the model opened its calls inside the reasoning
            self.raw, self._block_calls = m, 0
        return True

    def _CONTENT(self) -> bool:
        orphans = ["\n\n" + INVOKE, INVOKE] if self.tools else []
        head, m = self._split([EOS] + self.stop + self._openers() + orphans)
        self._emit(TextDelta, head)
        if m is None:
            return False
        if m == EOS:
            self.state = "DONE"
        elif m in self.stop:
            self.stop_sequence, self.state = m, "DONE"
        else:                                   # a block opener, or an orphan invoke
            self.raw, self._block_calls = m, 0
            self.state = "BLOCK" if m.endswith(OPEN) else "INVOKE"
        return True

    def _RAW(self) -> bool:
        head, m = self._split([EOS] + self.stop)
        self._emit(TextDelta, head)
        if m is not None:
            self.state = "DONE"
            if m != EOS:
                self.stop_sequence = m
        return False

    def _AFTER(self) -> bool:
        self.buf = self.buf.lstrip()
        if self.buf:
            self.state = "CONTENT"
        return bool(self.buf)

    def _expect(self, tags: list[str], what: str) -> str | None:
        """At a tag position: skip whitespace, then a whole tag (consumed) or None (wait)."""
        stripped = self.buf.lstrip()
        self.raw += self.buf[:len(self.buf) - len(stripped)]
        self.buf = stripped
        for t in tags:
            if self.buf.startswith(t):
                self.raw += t
                self.buf = self.buf[len(t):]
                return t
        if self.buf and not any(t.startswith(self.buf) for t in tags):
            self._malformed(f"expected {what}, got {self.buf[:1]!r}", "")
        return None

    def _BLOCK(self) -> bool:
        t = self._expect([INVOKE, CLOSE, EOS], f"{INVOKE} or {CLOSE}")
        if t is None:
            return self.state != "BLOCK"
        if t == INVOKE:
            self.state = "INVOKE"
        elif self._block_calls == 0:                # </tool_calls> or EOS right after the opener
            self.raw = self.raw[:-len(t)] if t == EOS else self.raw
            self._malformed("empty tool-call block", "")
            self.buf = EOS + self.buf if t == EOS else self.buf
        else:
            self.state = "AFTER" if t == CLOSE else "DONE"
        return True

    def _header(self, regex: re.Pattern) -> re.Match | None:
        """Parse an invoke/parameter header up to its ">"; None = wait (or malformed)."""
        j = self.buf.find(">")
        head = self.buf[:j + 1] if j != -1 else self.buf
        if "<" in head or len(head) > _HEADER_MAX:  # (message text independent of the cuts)
            self._malformed(f"bad tag header {head.split('<')[0][:40]!r}", "")
            return None
        if j == -1:
            return None
        match = regex.fullmatch(head)
        if match is None:
            self._malformed(f"bad tag header {head[:40]!r}", "")
            return None
        self.raw += head
        self.buf = self.buf[j + 1:]
        return match

    def _INVOKE(self) -> bool:
        match = self._header(_INVOKE_RE)
        if match is None:
            return self.state != "INVOKE"
        self._call = {"index": self._n_calls, "args": "", "names": set()}
        self._n_calls += 1
        self._out.append(ToolCallStart(self._call["index"], self.make_id(), match.group(1)))
        self.state = "PARAMS"
        return True

    def _PARAMS(self) -> bool:
        stripped = self.buf.lstrip()
        if not self._call["args"] and stripped.startswith("{"):
            self.raw += self.buf[:len(self.buf) - len(stripped)]
            self.buf, self.state = stripped, "JSON"  # a direct JSON body (as SGLang accepts)
            return True
        t = self._expect([PARAM, INVOKE_END], f"{PARAM} or {INVOKE_END}")
        if t is None:
            return self.state != "PARAMS"
        if t == PARAM:
            self.state = "PARAM"
        elif t == INVOKE_END:
            self._args("}" if self._call["args"] else "{}")
            self._end_call(None)
            self.raw, self.state = "", "BLOCK"
            self._block_calls += 1
            self._calls_ok += 1
        return True

    def _PARAM(self) -> bool:
        match = self._header(_PARAM_RE)
        if match is None:
            return self.state != "PARAM"
        name, is_str = match.group(1), match.group(2) == "true"
        if name in self._call["names"]:
            self._malformed(f"duplicate parameter {name!r}", "")
            return True
        self._call["names"].add(name)
        sep = ", " if self._call["args"] else "{"
        self._args(f"{sep}{json.dumps(name, ensure_ascii=False)}: " + ('"' if is_str else ""))
        self._call.update(is_str=is_str, value="")
        self.state = "VALUE"
        return True

    def _VALUE(self) -> bool:
        head, m = self._split([PARAM_END, EOS])
        c = self._call
        self.raw += head + (m or "")
        if c["is_str"]:
            if head:
                self._args(_jstr(head))
        else:
            c["value"] += head
        if m is None:
            return False
        if m == EOS:                                # cut off inside a value
            self.errors.append("unterminated tool call (EOS inside it)")
            self._end_call("unterminated tool call (EOS inside it)")
            self.state = "DONE"
            return False
        if c["is_str"]:
            self._args('"')
        elif _strict_json(c["value"]):
            self._args(c["value"])
        else:                                       # keep the JSON valid: pass it as a string
            self.errors.append(f"parameter value is not JSON, passed as a string: "
                               f"{c['value'][:40]!r}")
            self._args(json.dumps(c["value"], ensure_ascii=False))
        self.state = "PARAMS"
        return True

    def _JSON(self) -> bool:
        head, m = self._split([INVOKE_END])
        self.raw += head + (m or "")
        if head:
            self._args(head)
        if m is None:
            return False
        args = self._call["args"].rstrip()
        if not (_strict_json(args) and isinstance(json.loads(args), dict)):
            self._malformed("invoke body is not a JSON object", "")
            return True
        self._end_call(None)
        self.raw, self.state = "", "BLOCK"
        self._block_calls += 1
        self._calls_ok += 1
        return True

    def _args(self, text: str):
        self._call["args"] += text
        self._out.append(ToolCallArgsDelta(self._call["index"], text))

    def _end_call(self, error: str | None):
        if self._call is not None:
            self._out.append(ToolCallEnd(self._call["index"], self._call["args"], error))
            self._call = None

    def _malformed(self, why: str, extra: str):
        """Give up on DSML: end the open call, pass the raw text through, parse no more DSML."""
        self.errors.append("malformed DSML: " + why)
        self._end_call("malformed DSML: " + why)
        self._emit(TextDelta, self.raw + extra)
        self.raw, self.state = "", "RAW"


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""
    error: str | None = None


@dataclass
class ParsedMessage:
    """The fold of an event stream: what a non-streaming reply returns."""
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ParsedCall] = field(default_factory=list)
    finish: Finish | None = None


def fold(events: list[Event]) -> ParsedMessage:
    msg = ParsedMessage()
    for e in events:
        if isinstance(e, ReasoningDelta):
            msg.reasoning += e.text
        elif isinstance(e, TextDelta):
            msg.content += e.text
        elif isinstance(e, ToolCallStart):
            assert e.index == len(msg.tool_calls), "tool-call indices must be contiguous"
            msg.tool_calls.append(ParsedCall(e.id, e.name))
        elif isinstance(e, ToolCallArgsDelta):
            msg.tool_calls[e.index].arguments += e.text
        elif isinstance(e, ToolCallEnd):
            call = msg.tool_calls[e.index]
            assert call.arguments == e.arguments, "argument deltas must add up to the end's"
            call.error = e.error
        elif isinstance(e, Finish):
            msg.finish = e
    return msg


def parse_text(text: str, reasoning: bool, tools: bool, reason: str = "stop",
               **kw) -> ParsedMessage:
    """Non-streaming convenience: the same machine, fed once."""
    p = OutputParser(reasoning, tools, **kw)
    return fold(p.feed(text) + p.finish(reason))
