"""The Anthropic Messages event sequence (api-protocols §3.3): neutral events → SSE frames,
and the Message they fold to (the non-streaming reply). message_start (type, role,
stop_sequence present), ping, one content block open at a time with contiguous `index`
(thinking: thinking_delta × N, then signature_delta before its stop; text; tool_use: `input: {}`
then input_json_delta), message_delta (stop_reason, stop_sequence, cumulative usage with the
prefix-cache hit as cache_read_input_tokens), message_stop; `event: error` on a failure."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import uuid

from backfit.server.protocol import (
    ChatRequest, Finish, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallEnd,
    ToolCallStart, Usage,
)

__all__ = ["AnthropicRenderer", "signature"]

_SECRET = os.urandom(32)                 # thinking signatures: HMAC(secret, text), per process
_STOP = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}


def signature(text: str) -> str:
    """Opaque thinking-block signature (clients send it back; we accept any)."""
    mac = hmac.new(_SECRET, text.encode("utf-8", "replace"), hashlib.sha256).digest()
    return base64.b64encode(mac).decode()


def _hex() -> str:
    return uuid.uuid4().hex


class AnthropicRenderer:
    """Neutral events → [(event type, data)]; `message` is the Message object so far."""

    def __init__(self, req: ChatRequest, model: str, prompt_tokens: int, new_id=None):
        self.new_id = new_id or _hex
        self.hide = req.extra.get("display") == "omitted"
        self.parallel = req.parallel_tool_calls
        self.open: dict | None = None       # the content block being streamed
        self.args = ""                      # the open tool_use block's JSON text
        self.finish: Finish | None = None
        self.usage = Usage(prompt_tokens, 0)
        self.message = {"id": "msg_" + self.new_id(), "type": "message", "role": "assistant",
                        "model": model, "content": [], "stop_reason": None,
                        "stop_sequence": None, "usage": self._usage()}

    def _usage(self) -> dict:
        u = self.usage
        return {"input_tokens": u.prompt_tokens - u.cached_tokens,
                "output_tokens": u.completion_tokens, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": u.cached_tokens,
                "output_tokens_details": {"thinking_tokens": u.reasoning_tokens}}

    def start(self) -> list[tuple[str, dict]]:
        return [("message_start", {"type": "message_start",
                                   "message": json.loads(json.dumps(self.message))}),
                ("ping", {"type": "ping"})]

    def _start_block(self, block: dict) -> list:
        frames = self._stop_block()
        self.open = block
        self.message["content"].append(block)
        return frames + [("content_block_start", {
            "type": "content_block_start", "index": len(self.message["content"]) - 1,
            "content_block": json.loads(json.dumps(block))})]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return ("content_block_delta", {"type": "content_block_delta",
                                        "index": len(self.message["content"]) - 1,
                                        "delta": delta})

    def _stop_block(self) -> list:
        b = self.open
        if b is None:
            return []
        frames = []
        if b["type"] == "thinking":         # the signature comes last; the SDK replaces it
            b["signature"] = signature(b["thinking"])
            frames.append(self._delta({"type": "signature_delta", "signature": b["signature"]}))
        elif b["type"] == "tool_use":
            try:
                val = json.loads(self.args) if self.args else {}
            except ValueError:
                val = {}                    # a broken call (cut off): no input
            b["input"] = val if isinstance(val, dict) else {"input": val}
        self.open = None
        return frames + [("content_block_stop", {"type": "content_block_stop",
                                                 "index": len(self.message["content"]) - 1})]

    def feed(self, ev) -> list[tuple[str, dict]]:
        frames: list = []
        kind = self.open and self.open["type"]
        if isinstance(ev, ReasoningDelta) and ev.text:
            if kind != "thinking":
                frames += self._start_block({"type": "thinking", "thinking": "",
                                             "signature": ""})
            if not self.hide:               # display "omitted": an empty, signed block
                self.open["thinking"] += ev.text
                frames.append(self._delta({"type": "thinking_delta", "thinking": ev.text}))
        elif isinstance(ev, TextDelta) and ev.text:
            if kind != "text":
                frames += self._start_block({"type": "text", "text": ""})
            self.open["text"] += ev.text
            frames.append(self._delta({"type": "text_delta", "text": ev.text}))
        elif isinstance(ev, (ToolCallStart, ToolCallArgsDelta, ToolCallEnd)) and ev.index > 0 \
                and not self.parallel:
            pass                            # disable_parallel_tool_use: the first call only
        elif isinstance(ev, ToolCallStart):
            tid = "toolu_" + (ev.id[5:] if ev.id.startswith("call_") else ev.id)
            frames += self._start_block({"type": "tool_use", "id": tid, "name": ev.name,
                                         "input": {}})
            self.args = ""
        elif isinstance(ev, ToolCallArgsDelta) and kind == "tool_use" and ev.text:
            self.args += ev.text
            frames.append(self._delta({"type": "input_json_delta", "partial_json": ev.text}))
        elif isinstance(ev, ToolCallEnd):
            frames += self._stop_block()
        elif isinstance(ev, Usage):
            self.usage = ev
        elif isinstance(ev, Finish):
            self.finish = ev
        return frames

    def close(self) -> list[tuple[str, dict]]:
        """The open block's stop, message_delta and message_stop (or an error event)."""
        f = self.finish or Finish("error", error="the output stream ended without a finish")
        frames = self._stop_block()
        if f.reason not in _STOP:
            return frames + [self.error(f.error or f"generation ended: {f.reason}")]
        reason = "stop_sequence" if f.stop_sequence is not None else _STOP[f.reason]
        self.message.update(stop_reason=reason, stop_sequence=f.stop_sequence,
                            usage=self._usage())
        return frames + [
            ("message_delta", {"type": "message_delta",
                               "delta": {"stop_reason": reason, "stop_sequence": f.stop_sequence},
                               "usage": self._usage()}),
            ("message_stop", {"type": "message_stop"})]

    @staticmethod
    def error(message: str, type: str = "api_error") -> tuple[str, dict]:
        return "error", {"type": "error", "error": {"type": type, "message": message}}
