"""x-request-id through a router: the caller's id (what a router forwards: 1-128 visible ASCII
characters) is echoed on the response, else the handler's own id (chatcmpl-..., resp_...,
Anthropic's request-id msg_...) or a fresh req-...; and one log line per request (INFO for
POST, the API; DEBUG for GET: probes, /metrics, /v1/models): method, path, status ("cancelled":
the client went away first), seconds, request_id= and, where it differs, id= the completion's
own id, so a request is found in the log by either.

    app = web.Application(middlewares=[request_ids, ...])
    app.on_response_prepare.append(on_prepare)     (streams send their headers in the handler)
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from aiohttp import web

__all__ = ["RID_IN", "on_prepare", "request_ids"]

log = logging.getLogger("backfit.server")
_RID = re.compile(r"[\x21-\x7e]{1,128}")
RID_IN = web.RequestKey("request_id_in", str)       # the caller's x-request-id, when valid
RID_OUT = web.RequestKey("request_id_out", tuple)   # (x-request-id sent, the handler's own id)


def _stamp(request: web.Request, resp: web.StreamResponse) -> None:
    """x-request-id on the response, once: the caller's, else the handler's own, else new."""
    if RID_OUT in request:
        return
    own = resp.headers.get("x-request-id") or resp.headers.get("request-id")
    rid = request.get(RID_IN) or own or f"req-{uuid.uuid4().hex}"
    resp.headers["x-request-id"] = rid
    request[RID_OUT] = (rid, own)


async def on_prepare(request: web.Request, resp: web.StreamResponse) -> None:
    _stamp(request, resp)


@web.middleware
async def request_ids(request: web.Request, handler):
    given = request.headers.get("x-request-id", "")
    if _RID.fullmatch(given):
        request[RID_IN] = given
    t0, status = time.monotonic(), "cancelled"
    try:
        resp = await handler(request)
        if not resp.prepared:
            _stamp(request, resp)
        status = resp.status
        return resp
    finally:
        rid, own = request.get(RID_OUT, (request.get(RID_IN, "-"), None))
        log.log(logging.INFO if request.method == "POST" else logging.DEBUG,
                "%s %s %s %.3f s request_id=%s%s", request.method, request.path, status,
                time.monotonic() - t0, rid, f" id={own}" if own and own != rid else "")
