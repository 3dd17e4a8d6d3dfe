"""The Responses event sequence (api-protocols §2.3): neutral events → SSE frames, and the
Response object they fold to (the non-streaming reply). One output item is open at a time;
`output_index` is dense and in order; each `output_item.done` item is the one the terminal
response lists (same ids, pitfall #13); exactly one terminal event: completed, incomplete
(max_output_tokens, §2.6) or failed (error.code server_error)."""

from __future__ import annotations

import json
import time
import uuid

from backfit.server.protocol import (
    ChatRequest, Finish, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallEnd,
    ToolCallStart, Usage,
)

__all__ = ["ResponsesRenderer", "usage_json"]


def _now() -> int:
    return int(time.time())             # integer seconds: Go/Rust clients break on floats (§0)


def _hex() -> str:
    return uuid.uuid4().hex


def usage_json(u: Usage | None) -> dict:
    u = u or Usage(0, 0)
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.total_tokens}


class ResponsesRenderer:
    """Neutral events → [(event type, data)] frames; `response` is the Response object so far.
    One item is open at a time; `output_index` is its place in `output` (dense, in order)."""

    def __init__(self, req: ChatRequest, model: str, custom: set[str] = frozenset(), *,
                 created_at: int | None = None, new_id=None):
        self.req, self.custom, self.new_id = req, custom, new_id or _hex
        self.id = "resp_" + self.new_id()
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict | None = None       # the item being streamed (also in self.output)
        self.text = ""                      # the open item's text / arguments so far
        self.usage: Usage | None = None
        self.finish: Finish | None = None
        self.response = {
            "id": self.id, "object": "response", "created_at": created_at or _now(),
            "status": "in_progress", "model": model, "output": [], "error": None,
            "incomplete_details": None, "instructions": req.extra.get("instructions"),
            "max_output_tokens": req.max_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
            "tool_choice": req.tool_choice if isinstance(req.tool_choice, str)
            else {"type": "function", **req.tool_choice},
            "tools": req.extra.get("tools_echo", []),
            "reasoning": {"effort": req.reasoning_effort,
                          "summary": req.extra.get("reasoning_summary")},
            "metadata": req.extra.get("metadata", {}), "usage": None}

    def _ev(self, etype: str, **kw) -> tuple[str, dict]:
        data = {"type": etype, "sequence_number": self.seq, **kw}
        self.seq += 1
        return etype, data

    def _snapshot(self) -> dict:
        return json.loads(json.dumps(self.response))     # frozen copy for this event

    def start(self) -> list[tuple[str, dict]]:
        return [self._ev("response.created", response=self._snapshot()),
                self._ev("response.in_progress", response=self._snapshot())]

    # items: open / delta / close

    def _open(self, kind: str, **fields) -> list:
        frames = self._close_item()
        prefix = {"reasoning": "rs_", "message": "msg_", "function_call": "fc_",
                  "custom_tool_call": "ctc_"}[kind]
        item = {"type": kind, "id": prefix + self.new_id(), **fields, "status": "in_progress"}
        self.open, self.text = item, ""
        self.output.append(item)
        idx = len(self.output) - 1
        frames.append(self._ev("response.output_item.added", output_index=idx,
                               item=json.loads(json.dumps(item))))
        part = {"reasoning": {"type": "reasoning_text", "text": ""},
                "message": {"type": "output_text", "text": "", "annotations": [],
                            "logprobs": []}}.get(kind)
        if part is not None:
            frames.append(self._ev("response.content_part.added", output_index=idx,
                                   item_id=item["id"], content_index=0, part=part))
        return frames

    def _where(self) -> dict:
        return {"output_index": len(self.output) - 1, "item_id": self.open["id"]}

    def _close_item(self, status: str = "completed") -> list:
        item, text = self.open, self.text
        if item is None:
            return []
        frames, w = [], self._where()
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            frames += [self._ev("response.reasoning_text.done", **w, content_index=0, text=text),
                       self._ev("response.content_part.done", **w, content_index=0, part=part)]
            item.update(content=[part], encrypted_content=None)
        elif item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            frames += [self._ev("response.output_text.done", **w, content_index=0, text=text,
                                logprobs=[]),
                       self._ev("response.content_part.done", **w, content_index=0, part=part)]
            item["content"] = [part]
        elif item["type"] == "function_call":
            frames.append(self._ev("response.function_call_arguments.done", **w,
                                   name=item["name"], arguments=text))
            item["arguments"] = text
        else:                               # custom: unwrap {"input": "..."} (§2.5)
            try:
                raw = json.loads(text)
                raw = raw["input"] if isinstance(raw, dict) and "input" in raw else text
            except ValueError:
                raw = text
            raw = raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False)
            frames += [self._ev("response.custom_tool_call_input.delta", **w, delta=raw),
                       self._ev("response.custom_tool_call_input.done", **w, input=raw)]
            item["input"] = raw
        item["status"] = status
        frames.append(self._ev("response.output_item.done", output_index=w["output_index"],
                               item=json.loads(json.dumps(item))))
        self.open = None
        return frames

    def feed(self, ev) -> list[tuple[str, dict]]:
        frames: list = []
        kind = self.open and self.open["type"]
        if isinstance(ev, (ReasoningDelta, TextDelta)) and ev.text:
            want = "reasoning" if isinstance(ev, ReasoningDelta) else "message"
            if kind != want:
                frames += self._open(want, **({"summary": []} if want == "reasoning" else
                                              {"role": "assistant", "content": []}))
            self.text += ev.text
            etype = ("response.reasoning_text.delta" if want == "reasoning"
                     else "response.output_text.delta")
            extra = {} if want == "reasoning" else {"logprobs": []}
            frames.append(self._ev(etype, **self._where(), content_index=0, delta=ev.text,
                                   **extra))
        elif isinstance(ev, (ToolCallStart, ToolCallArgsDelta, ToolCallEnd)) and ev.index > 0 \
                and not self.req.parallel_tool_calls:
            pass                            # parallel_tool_calls false: the first call only
        elif isinstance(ev, ToolCallStart):
            if ev.name in self.custom:
                frames += self._open("custom_tool_call", call_id=ev.id, name=ev.name, input="")
            else:                           # a namespace's function: named with it
                ns = self.req.extra.get("namespaces", {}).get(ev.name)
                frames += self._open("function_call", call_id=ev.id, name=ev.name,
                                     **({"namespace": ns} if ns else {}), arguments="")
        elif isinstance(ev, ToolCallArgsDelta) and self.open is not None:
            self.text += ev.text
            if kind == "function_call" and ev.text:
                frames.append(self._ev("response.function_call_arguments.delta",
                                       **self._where(), delta=ev.text))
        elif isinstance(ev, ToolCallEnd):   # a broken call is shown, marked incomplete
            frames += self._close_item("incomplete" if ev.error else "completed")
        elif isinstance(ev, Usage):
            self.usage = ev
        elif isinstance(ev, Finish):
            self.finish = ev
        return frames

    def close(self) -> list[tuple[str, dict]]:
        """The open item's done events and exactly one terminal event."""
        f = self.finish or Finish("error", error="the output stream ended without a finish")
        if f.reason in ("abort", "error"):
            return self.fail(f.error or f"generation ended: {f.reason}")
        frames = self._close_item("incomplete" if f.reason == "length" else "completed")
        r = self.response
        r.update(output=self.output, usage=usage_json(self.usage))
        if f.reason == "length":
            r.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
            return frames + [self._ev("response.incomplete", response=self._snapshot())]
        r["status"] = "completed"
        return frames + [self._ev("response.completed", response=self._snapshot())]

    def fail(self, message: str, code: str = "server_error") -> list[tuple[str, dict]]:
        frames = self._close_item("incomplete")
        self.response.update(status="failed", output=self.output, usage=usage_json(self.usage),
                             error={"code": code, "message": message})
        return frames + [self._ev("response.failed", response=self._snapshot())]
