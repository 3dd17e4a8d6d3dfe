"""Chat Completions `logprobs` (api-protocols §1: "support them if the engine does"): the
engine's sampled-token logprobs (bridge.TokenLogprobs) → OpenAI's `{"content": [{token,
logprob, bytes, top_logprobs}], "refusal": null}`.

Which tokens: the answer's (content and tool-call markup) after the reasoning; reasoning tokens
and forced ones (a tool-call opener, a budget's `</think>`) carry none. `bytes` are the token's
exact bytes (DeepSeek-V4's tokenizer is byte-level BPE, so a token may hold part of a UTF-8
character); `token` is those bytes decoded with U+FFFD for an incomplete character.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

__all__ = ["TokenText"]


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte ↔ printable-character table (the ByteLevel pre-tokenizer's), inverted."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenText:
    """Token id → (text, bytes) over one `tokenizers.Tokenizer`; entries in OpenAI's shape."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.added = set(tokenizer.get_added_tokens_decoder())
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text_bytes(self, tid: int) -> tuple[str, list[int]]:
        got = self._cache.get(tid)
        if got is None:
            piece, dec = self.tok.id_to_token(tid) or "", _byte_decoder()
            if tid in self.added or not all(ch in dec for ch in piece):
                raw = piece.encode()                 # an added token: its text as written
            else:
                raw = bytes(dec[ch] for ch in piece)
            got = self._cache[tid] = (raw.decode("utf-8", errors="replace"), list(raw))
        return got

    def entry(self, tid: int, lp: float, top: list | None) -> dict[str, Any]:
        """One `logprobs.content` item; top: [(id, logprob), ...] (best first) or None."""
        text, raw = self.text_bytes(tid)
        alts = []
        for t, v in top or ():
            s, b = self.text_bytes(t)
            alts.append({"token": s, "logprob": v, "bytes": b})
        return {"token": text, "logprob": lp, "bytes": raw, "top_logprobs": alts}

    def entries(self, items) -> list[dict[str, Any]]:
        return [self.entry(t, lp, top) for t, lp, top in items]
