"""Image parts of the three protocols -> prepared images (dsv4-vision.md sections 5-6, 13).

The protocol parsers turn each image part into an ImageRef (a data: URL, an http(s) URL, or an
Anthropic base64 source as a data: URL) inside a message's content list
({"type": "image", "image": ImageRef}). Before encoding, ImageInput.resolve loads every image of
the request: base64 decoded, URLs fetched (aiohttp: http(s) only, no redirects, a total timeout,
at most max_bytes read, the host in --allowed-media-domains when that is set), then prepared
in worker threads (backfit.vision.prepare: decode, resize rules, grids) through a content-keyed
ImageCache; the parts then hold PreparedImages, which the encoder splices into the prompt.

Every failure is a BadRequest (400) naming the part (`messages[0].content[1]`, `input[2]...`):
more images than --limit-mm-per-prompt (checked before anything is loaded), a URL that is not
data: / http(s), a MIME type that is not image/*, bad base64, a fetch that fails, times out or
returns more than max_bytes, bytes Pillow cannot decode or an image of too many pixels. On a
text-only checkpoint the parsers make no ImageRefs: the Chat path answers 400 for an image part,
Responses and Anthropic render `[Unsupported <type>]` text (their behaviour without vision).

Image slots come only from image parts: a placeholder string such as `<｜deepseek_image｜>` in
any text is tokenized as plain text (chat_format) and is no image (section 13, B2-B4).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from backfit.config import VisionConfig
from backfit.server.http import BadRequest
from backfit.server.protocol import ChatRequest
from backfit.vision import ImageCache, ImageError, prepare

__all__ = ["DEFAULT_LIMIT", "ImageInput", "ImageRef", "MediaLimits", "content_parts",
           "image_part", "image_parts", "parse_limit"]

DEFAULT_LIMIT = 96                    # images a request (--limit-mm-per-prompt)
_DATA = re.compile(r"data:([\w.+-]+/[\w.+-]+)?((?:;[\w-]+=[\w.+-]+)*);base64,", re.I)


@dataclass(frozen=True)
class ImageRef:
    """An image part not loaded yet: url is a data: URL or an http(s) URL; where names the
    part in the request (for errors)."""
    url: str
    where: str


@dataclass(frozen=True)
class MediaLimits:
    max_images: int = DEFAULT_LIMIT           # --limit-mm-per-prompt {"image": N}
    max_bytes: int = 20 * 1024 * 1024         # encoded bytes of one image (fetched or inline)
    timeout_s: float = 10.0                   # one URL fetch, total
    allowed_domains: tuple[str, ...] | None = None    # --allowed-media-domains; None: any


def parse_limit(text: str) -> int:
    """--limit-mm-per-prompt: vLLM's JSON form '{"image": N}' (or a bare N) -> N >= 0."""
    import json
    try:
        v = json.loads(text)
    except ValueError:
        raise ValueError(f"--limit-mm-per-prompt {text!r}: expected JSON such as "
                         "'{\"image\": 96}'") from None
    if isinstance(v, dict):
        extra = set(v) - {"image"}
        if extra:
            raise ValueError(f"--limit-mm-per-prompt: only 'image' is supported, got "
                             f"{sorted(extra)}")
        v = v.get("image", DEFAULT_LIMIT)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"--limit-mm-per-prompt: the image count must be an integer >= 0, "
                         f"got {v!r}")
    return v


def image_part(ref: ImageRef) -> dict:
    return {"type": "image", "image": ref}


def content_parts(parts: list) -> str | list[dict]:
    """A message's parts (str or ImageRef, in order) -> its content: the text joined when there
    is no image; else a list of text and image parts (the encoder joins them with a blank
    line, as DeepSeek's encoder does for messages with images)."""
    if not any(isinstance(p, ImageRef) for p in parts):
        return "".join(parts)
    return [image_part(p) if isinstance(p, ImageRef) else {"type": "text", "text": p}
            for p in parts]


def image_parts(req: ChatRequest) -> list[tuple[int, int]]:
    """(message index, part index) of every image part of req, in prompt order."""
    return [(i, j) for i, m in enumerate(req.messages) if isinstance(m.content, list)
            for j, p in enumerate(m.content) if p.get("type") == "image"]


class ImageInput:
    """The server's image loader (a Vision-Exp checkpoint's): limits, a content-keyed
    ImageCache, one HTTP session."""

    def __init__(self, vision: VisionConfig, limits: MediaLimits = MediaLimits(),
                 cache_bytes: int = 512 * 1024 * 1024):
        self.vision, self.limits = vision, limits
        self.cache = ImageCache(cache_bytes)
        self._session = None

    async def resolve(self, req: ChatRequest) -> ChatRequest:
        """req with every ImageRef replaced by its PreparedImage (module notes)."""
        at = image_parts(req)
        if not at:
            return req
        first = req.messages[at[0][0]].content[at[0][1]]["image"]
        if len(at) > self.limits.max_images:
            raise BadRequest(f"{len(at)} images in the request; at most "
                             f"{self.limits.max_images} are allowed (--limit-mm-per-prompt)",
                             first.where)
        refs = [req.messages[i].content[j]["image"] for i, j in at]
        unique: dict[str, ImageRef] = {}                 # each URL loaded once
        for r in refs:
            unique.setdefault(r.url, r)
        gate = asyncio.Semaphore(8)
        loaded = dict(zip(unique, await asyncio.gather(*(self._load(r, gate)
                                                         for r in unique.values()))))
        return _replace_parts(req, {k: {"type": "image", "image": loaded[r.url]}
                                    for k, r in zip(at, refs)})

    async def _load(self, ref: ImageRef, gate: asyncio.Semaphore):
        async with gate:
            if ref.url[:5].lower() == "data:":
                data = _data_url(ref, self.limits.max_bytes)
            else:
                data = await self._fetch(ref)
            try:
                return await asyncio.to_thread(prepare, data, self.vision, self.cache)
            except ImageError as e:
                raise BadRequest(f"{ref.where}: {e}", ref.where) from None

    async def _fetch(self, ref: ImageRef) -> bytes:
        import aiohttp
        u, lim = urlsplit(ref.url), self.limits
        if u.scheme.lower() not in ("http", "https") or not u.hostname:
            raise BadRequest(f"{ref.where}: the image URL must be a data: URL or an http(s) "
                             f"URL, got {ref.url[:60]!r}", ref.where)
        host = u.hostname.lower()
        if lim.allowed_domains is not None and not any(
                host == d or host.endswith("." + d) for d in lim.allowed_domains):
            raise BadRequest(f"{ref.where}: images from {host} are not allowed "
                             f"(--allowed-media-domains)", ref.where)
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        try:
            async with self._session.get(ref.url, allow_redirects=False,
                                         timeout=aiohttp.ClientTimeout(total=lim.timeout_s)) as r:
                if r.status != 200:
                    why = " (redirects are not followed)" if 300 <= r.status < 400 else ""
                    raise BadRequest(f"{ref.where}: fetching the image URL gave HTTP "
                                     f"{r.status}{why}", ref.where)
                _check_mime(r.headers.get("Content-Type"), ref)
                if (r.content_length or 0) > lim.max_bytes:
                    raise _too_big(ref, r.content_length, lim.max_bytes)
                data = await r.content.read(lim.max_bytes + 1)
                if len(data) > lim.max_bytes or not r.content.at_eof():
                    raise _too_big(ref, None, lim.max_bytes)
                return data
        except asyncio.TimeoutError:
            raise BadRequest(f"{ref.where}: fetching the image URL timed out after "
                             f"{lim.timeout_s:g} s", ref.where) from None
        except aiohttp.ClientError as e:
            raise BadRequest(f"{ref.where}: fetching the image URL failed: "
                             f"{type(e).__name__}", ref.where) from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _too_big(ref: ImageRef, n: int | None, cap: int) -> BadRequest:
    size = f"{n:,} bytes" if n else "more"
    return BadRequest(f"{ref.where}: the image is {size}; at most {cap:,} bytes are accepted",
                      ref.where)


def _check_mime(mime: str | None, ref: ImageRef) -> None:
    if mime and not mime.split(";")[0].strip().lower().startswith("image/"):
        raise BadRequest(f"{ref.where}: media type {mime.split(';')[0][:40]!r} is not an image",
                         ref.where)


def _data_url(ref: ImageRef, max_bytes: int) -> bytes:
    m = _DATA.match(ref.url)
    if m is None:
        raise BadRequest(f"{ref.where}: a data: URL must be base64 "
                         f"(data:image/<type>;base64,...)", ref.where)
    _check_mime(m.group(1), ref)
    body = ref.url[m.end():]
    if len(body) // 4 * 3 > max_bytes:                # refused before decoding
        raise _too_big(ref, len(body) // 4 * 3, max_bytes)
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{ref.where}: the image data is not valid base64", ref.where) from None


def _replace_parts(req: ChatRequest, new: dict[tuple[int, int], dict]) -> ChatRequest:
    msgs = list(req.messages)
    for i in sorted({i for i, _ in new}):
        parts = list(msgs[i].content)
        for (mi, j), part in new.items():
            if mi == i:
                parts[j] = part
        msgs[i] = replace(msgs[i], content=parts)
    return replace(req, messages=tuple(msgs))
