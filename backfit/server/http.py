"""HTTP helpers shared by every protocol: safe JSON bodies, `BadRequest`, SSE writers.

- `read_json(request)`: the body (64 MiB limit, set on the app as `client_max_size`) decoded as
  UTF-8 (invalid bytes are a 400, as the real APIs answer), parsed with lone surrogates
  (`"\\ud83d"`: valid JSON text, which json.loads accepts but `.encode()` rejects) replaced
  by U+FFFD, NaN/Infinity refused, and nesting past `MAX_DEPTH` refused, so no body can turn
  into a 500 later (api-protocols §0).
- `BadRequest(message, param)`: a client error; each protocol renders it in its own shape.
- Typed getters (`get_int`, `get_num`, `get_str`, `get_bool`, ...) raise BadRequest naming the
  field, so handlers validate in one line each.
- SSE: `sse_start` sends the headers at once (before the first token); `sse_data`,
  `sse_event` and `sse_comment` write one frame; a peer that went away raises `ClientGone`.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from aiohttp import web

__all__ = [  # noqa: RUF022 (grouped: limits, errors, body, getters, SSE, streams)
    "MAX_BODY", "MAX_DEPTH", "BadRequest", "ClientGone", "read_json", "clean_text", "dumps",
    "json_response", "get_int", "get_num", "get_str", "get_bool", "get_list", "get_dict",
    "sse_start", "sse_data", "sse_event", "sse_comment", "sse_end", "with_first", "close_stream",
]

MAX_BODY = 64 * 1024 * 1024        # bytes; aiohttp's default (1 MiB) 413s long agent histories
MAX_DEPTH = 64                     # JSON nesting; deeper bodies are 400, never a RecursionError
_SURROGATE = re.compile("[\ud800-\udfff]")


class BadRequest(ValueError):
    """A request the client must fix: HTTP 400 (or `status`), naming the offending `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


class ClientGone(ConnectionError):
    """The peer closed the connection while we were writing."""


def clean_text(s: str) -> str:
    """Lone surrogates -> U+FFFD (the rest of the server may then `.encode()` freely)."""
    return _SURROGATE.sub("\ufffd", s) if _SURROGATE.search(s) else s


def _clean(v: Any, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise BadRequest(f"JSON body nested deeper than {MAX_DEPTH} levels")
    if isinstance(v, str):
        return clean_text(v)
    if isinstance(v, list):
        return [_clean(x, depth + 1) for x in v]
    if isinstance(v, dict):
        return {clean_text(k): _clean(x, depth + 1) for k, x in v.items()}
    return v


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _depth_ok(text: str) -> bool:
    """Cheap pre-check before json.loads (whose recursion limit would raise RecursionError)."""
    depth = worst = 0
    in_str = esc = False
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return True
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            worst = max(worst, depth)
            if worst > MAX_DEPTH:
                return False
        elif ch in "]}":
            depth -= 1
    return True


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object, or BadRequest (413 past MAX_BODY)."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest(f"request body larger than {MAX_BODY} bytes", status=413) from None
    if not raw.strip():
        raise BadRequest("request body is empty (expected a JSON object)")
    try:
        text = raw.decode("utf-8").lstrip("\ufeff")                      # a BOM is harmless
    except UnicodeDecodeError as e:
        raise BadRequest(f"the request body is not valid UTF-8 (byte {e.start}: "
                         f"{raw[e.start:e.start + 4]!r})") from None
    if not _depth_ok(text):
        raise BadRequest(f"JSON body nested deeper than {MAX_DEPTH} levels")
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"invalid JSON body: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the JSON body must be an object, not {type(body).__name__}")
    return _clean(body)


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def json_response(obj: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(text=dumps(obj), status=status, headers=headers,
                        content_type="application/json")


# ---- typed getters: each raises BadRequest naming the field ------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def get_int(body: dict, name: str, default=None, lo: int | None = None, hi: int | None = None,
            param: str | None = None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**53:
        v = int(v)
    if not _is_int(v):
        raise BadRequest(f"{param or name} must be an integer, got {_show(v)}", param or name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise BadRequest(f"{param or name} must be {rng}, got {v}", param or name)
    return v


def get_num(body: dict, name: str, default=None, lo: float | None = None,
            hi: float | None = None):
    v = body.get(name)
    if v is None:
        return default
    if not ((isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)):
        raise BadRequest(f"{name} must be a number, got {_show(v)}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"{name} must be in [{lo}, {hi}], got {v}", name)
    return float(v)


def get_str(body: dict, name: str, default=None, choices: tuple[str, ...] | None = None):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise BadRequest(f"{name} must be a string, got {_show(v)}", name)
    if choices is not None and v not in choices:
        raise BadRequest(f"{name} must be one of {', '.join(choices)}, got {v!r}"[:300], name)
    return v


def get_bool(body: dict, name: str, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{name} must be true or false, got {_show(v)}", name)
    return v


def get_list(body: dict, name: str, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, list):
        raise BadRequest(f"{name} must be an array, got {_show(v)}", name)
    return v


def get_dict(body: dict, name: str, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, dict):
        raise BadRequest(f"{name} must be an object, got {_show(v)}", name)
    return v


def _show(v) -> str:
    s = json.dumps(v, ensure_ascii=False)
    return (s[:60] + "...") if len(s) > 60 else s


# ---- server-sent events ------------------------------------------------------------------------

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "Connection": "keep-alive", "X-Accel-Buffering": "no"}


async def sse_start(request: web.Request, headers: dict | None = None) -> web.StreamResponse:
    """Send the status and headers now (clients see the stream open before the first token)."""
    resp = web.StreamResponse(status=200, headers={**SSE_HEADERS, **(headers or {})})
    try:
        await resp.prepare(request)
    except (ConnectionError, RuntimeError) as e:
        raise ClientGone(str(e)) from None
    return resp


async def _write(resp: web.StreamResponse, frame: str) -> None:
    try:
        await resp.write(frame.encode("utf-8"))
    except (ConnectionError, RuntimeError) as e:     # ClientConnectionResetError is one
        raise ClientGone(str(e)) from None


async def sse_data(resp: web.StreamResponse, obj: Any) -> None:
    """`data: <json>` (Chat Completions, legacy Completions)."""
    await _write(resp, f"data: {obj if isinstance(obj, str) else dumps(obj)}\n\n")


async def sse_event(resp: web.StreamResponse, event: str, obj: Any) -> None:
    """`event: <type>` + `data: <json>` (Responses, Anthropic: the SDK dispatches on event)."""
    await _write(resp, f"event: {event}\ndata: {dumps(obj)}\n\n")


async def sse_comment(resp: web.StreamResponse, text: str = "ping") -> None:
    """A comment line: the keep-alive clients ignore."""
    await _write(resp, f": {text}\n\n")


async def sse_end(resp: web.StreamResponse) -> None:
    try:
        await resp.write_eof()
    except (ConnectionError, RuntimeError):
        pass


async def with_first(it, first):
    """The stream `it` with an already-received `first` event (None: none) put back in front."""
    if first is not None:
        yield first
    async for ev in it:
        yield ev


async def close_stream(it) -> None:
    """Close an event stream early: aborts its engine request if it is still running."""
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        await aclose()
