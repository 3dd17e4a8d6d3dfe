"""The conversation as the DSV4 encoder's turns (the reference's `merge_tool_messages` and
`sort_tool_results_by_call_order`): tool results (and user text after them) join one user turn,
sorted into the call order of the assistant turn before; history call arguments decoded back
into an object (the fallbacks are `chat_format`'s module docstring)."""

from __future__ import annotations

import json
from typing import Any

from backfit.server.chat_segments import content_pieces
from backfit.server.protocol import Message

__all__ = ["USER_SIDE", "arguments", "last_user", "merge_tool_messages", "sort_tool_results"]


def arguments(raw: str) -> dict[str, Any]:
    """History call arguments → dict (see module docstring for the fallbacks)."""
    try:
        value = json.loads(raw)
        if isinstance(value, str):                      # double-encoded JSON
            value = json.loads(value)
    except (TypeError, ValueError):
        return {"arguments": raw}
    return value if isinstance(value, dict) else {"arguments": value}


def merge_tool_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Reference merge_tool_messages: tool results (and user text) join the user turn before;
    each block keeps its content as content_pieces (text and images)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role in ("tool", "user"):
            block = {"type": "tool_result" if m.role == "tool" else "text",
                     "id": m.tool_call_id or "", "pieces": content_pieces(m.content)}
            if out and out[-1]["role"] == "user":
                out[-1]["blocks"].append(block)
            else:
                out.append({"role": "user", "blocks": [block]})
        else:
            out.append({"role": m.role, "msg": m})
    return out


def sort_tool_results(turns: list[dict[str, Any]]) -> None:
    """Reference sort_tool_results_by_call_order: results in the previous turn's call order."""
    order: dict[str, int] = {}
    for t in turns:
        if t["role"] == "assistant" and t["msg"].tool_calls:
            order = {c.id: i for i, c in enumerate(t["msg"].tool_calls) if c.id}
        elif t["role"] == "user":
            results = [b for b in t["blocks"] if b["type"] == "tool_result"]
            if len(results) > 1 and order:
                it = iter(sorted(results, key=lambda b: order.get(b["id"], 0)))
                t["blocks"] = [next(it) if b["type"] == "tool_result" else b for b in t["blocks"]]


USER_SIDE = ("user", "developer")   # the roles that start a user turn


def last_user(turns: list[dict[str, Any]]) -> int:
    return max((i for i, t in enumerate(turns) if t["role"] in USER_SIDE), default=-1)
