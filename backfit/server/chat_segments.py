"""The prompt under construction (chat_format's renderer writes it): text, the template's own
control tokens, and images.

    segs.text(s)          untrusted text (adjacent runs merged; tokenized without added tokens)
    segs.control(tok)     a template token (BOS, <｜User｜>, </think>, ...)
    segs.template(s)      a trusted constant that may contain control strings (the tools block)
    segs.image(img)       a PreparedImage: its block is spliced where DeepSeek's encoder writes
                          the placeholder <｜deepseek_image｜> (dsv4-vision.md section 5)
    segs.pieces(parts)    content_pieces' output: strings as text, images as images
    segs.rendered         the reference prompt string (images as the placeholder)

An image enters a prompt only through segs.image, i.e. from a structured image part; text never
becomes an image, whatever it quotes (section 13, B2-B4).
"""

from __future__ import annotations

from typing import Any

from backfit.server.chat_template import CONTROL_TOKENS

__all__ = ["CONTROL", "IMAGE", "IMAGE_PLACEHOLDER", "Segments", "TEXT", "content_pieces",
           "content_text"]

TEXT, CONTROL, IMAGE = 0, 1, 2
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"        # where the reference splices an image block


class Segments:
    """The prompt as [value, kind] items (kind TEXT, CONTROL or IMAGE)."""

    def __init__(self):
        self.items: list[list[Any]] = []

    def text(self, s: str):
        if not s:
            return
        if self.items and self.items[-1][1] == TEXT:
            self.items[-1][0] += s
        else:
            self.items.append([s, TEXT])

    def control(self, tok: str):
        self.items.append([tok, CONTROL])

    def image(self, img):
        if not hasattr(img, "block"):                      # an ImageRef never resolved
            raise ValueError("an image part was not loaded before encoding")
        self.items.append([img, IMAGE])

    def pieces(self, parts: list):
        for p in parts:
            if isinstance(p, str):
                self.text(p)
            else:
                self.image(p)

    def template(self, s: str):
        """A trusted constant that may contain control strings (the tools block)."""
        while s:
            hits = [(s.find(c), c) for c in CONTROL_TOKENS if c in s]
            if not hits:
                self.text(s)
                return
            pos, tok = min(hits)
            self.text(s[:pos])
            self.control(tok)
            s = s[pos + len(tok):]

    @property
    def rendered(self) -> str:
        return "".join(IMAGE_PLACEHOLDER if k == IMAGE else v for v, k in self.items)

    @property
    def has_images(self) -> bool:
        return any(k == IMAGE for _, k in self.items)


def content_pieces(content: str | list[dict[str, Any]]) -> list:
    """A message's content -> [str | image]: a string as it is; a list of parts joined with a
    blank line (DeepSeek's encoder for list content), text parts as their text, image parts as
    their (prepared) image, other parts (an image part without its image too) as
    `[Unsupported <type>]`."""
    if isinstance(content, str):
        return [content]
    out: list = []
    for k, p in enumerate(content):
        if k:
            out.append("\n\n")
        kind = p.get("type")
        out.append(p.get("text", "") if kind == "text" else p["image"] if "image" in p
                   else f"[Unsupported {kind}]")
    return out


def content_text(content: str | list[dict[str, Any]]) -> str:
    """content_pieces of content that holds no image, as one string."""
    parts = content_pieces(content)
    if not all(isinstance(p, str) for p in parts):
        raise ValueError("image parts are only accepted in user and tool messages")
    return "".join(parts)
