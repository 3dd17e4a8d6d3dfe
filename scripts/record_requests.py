"""A loopback recording proxy: forwards every request to a `backfit serve` (or any) upstream and
writes each one to OUT_DIR as NNN_<method>_<path>.json {method, path, query, headers, body}
(the API-key headers redacted), streaming the upstream's reply back unchanged. Used to record
what agent clients (Claude Code, Codex, OpenCode) really send: docs/TESTING.md, "Agent
clients against a live tiny server"; the server tests' fixtures are cut from these recordings.

    backfit serve /tmp/tiny --port 8001 &
    python scripts/record_requests.py --upstream http://127.0.0.1:8001 --port 8000 OUT_DIR
    ANTHROPIC_BASE_URL=http://127.0.0.1:8000 ANTHROPIC_AUTH_TOKEN=x claude -p "Say hi"

Only loopback addresses are accepted (upstream and listen).
"""

from __future__ import annotations

import argparse
import ipaddress
import itertools
import json
import urllib.parse
from pathlib import Path

import aiohttp
from aiohttp import web

SECRET_HEADERS = ("authorization", "x-api-key", "cookie")
HOP_HEADERS = ("host", "content-length", "transfer-encoding", "connection", "accept-encoding")


def _loopback(url: str) -> str:
    host = urllib.parse.urlparse(url).hostname or ""
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise SystemExit(f"{url}: only loopback addresses are accepted")
    return url.rstrip("/")


def build_app(upstream: str, out: Path) -> web.Application:
    counter = itertools.count(1)
    session: dict = {}

    async def proxy(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        headers = {k: ("<redacted>" if k.lower() in SECRET_HEADERS else v)
                   for k, v in request.headers.items()}
        name = f"{next(counter):03d}_{request.method}_{request.path.strip('/').replace('/', '_')}"
        (out / f"{name}.json").write_text(json.dumps(
            {"method": request.method, "path": request.path, "query": request.query_string,
             "headers": headers, "body": body}, indent=1, ensure_ascii=False) + "\n")
        if "s" not in session:
            session["s"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900))
        fwd = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        async with session["s"].request(request.method, upstream + request.path_qs, data=raw,
                                        headers=fwd) as up:
            resp = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in HOP_HEADERS})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def close(_app: web.Application) -> None:
        if "s" in session:
            await session.pop("s").close()

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", proxy)
    app.on_cleanup.append(close)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--upstream", default="http://127.0.0.1:8001")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    a = ap.parse_args()
    upstream = _loopback(a.upstream)
    _loopback(f"http://{a.host}:{a.port}")
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"recording to {out}: http://{a.host}:{a.port} -> {upstream}", flush=True)
    web.run_app(build_app(upstream, out), host=a.host, port=a.port, print=None)


if __name__ == "__main__":
    main()
