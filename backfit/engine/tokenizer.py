"""Tokenizer loading, incremental detokenization and stop conditions; no torch.

- `IncrementalDetokenizer` turns one id at a time into text deltas with vLLM's prefix/read
  offsets: each step decodes only the ids since the last emitted text plus the few before them
  (`prefix_offset..read_offset`), so the cost per token does not grow with the output. A delta
  that ends in U+FFFD is an incomplete UTF-8 character (byte-level BPE splits characters across
  ids) and is held back until the next id completes it.
- `StopChecker` finds stop strings in the text stream even when split across ids, never lets out
  a stop string (unless include_stop_str_in_output) or anything after it, and holds back the
  longest suffix that could still begin one (released by `flush` when the request ends).
- `TextStream` is one request's output: ids in, `StreamDelta`s out, with eos, stop_token_ids,
  stop strings, min_tokens and max_tokens applied in vLLM's way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["load_tokenizer", "IncrementalDetokenizer", "StopChecker", "TextStream", "StreamDelta"]


def load_tokenizer(path: str | Path):
    """tokenizers.Tokenizer from DIR/tokenizer.json (or the file itself)."""
    from tokenizers import Tokenizer

    p = Path(path)
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {f} (the converted directory carries the "
                                f"checkpoint's tokenizer.json; copy it there)")
    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:                      # tokenizers raises a bare Exception
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{f}: not a valid tokenizers file ({reason})") from None


class IncrementalDetokenizer:
    """push(id) -> new text; flush() -> held-back text at the end. Counters `decode_calls` and
    `decoded_ids` record the work done (tests check that it stays O(1) per id)."""

    PROMPT_CONTEXT = 5   # last prompt ids kept as left context (as vLLM's initial offset)
    MAX_PENDING = 32     # ids held while the text ends mid-character; valid text finds a character
    #                      boundary long before (a character is <= 4 bytes), so this only bounds
    #                      the work on invalid UTF-8 from the model, which then comes out as U+FFFD
    MAX_WINDOW = 16      # ids decoding to nothing (skipped specials) widen the window this far

    def __init__(self, tokenizer, prompt_ids=(), skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids = list(prompt_ids)[-self.PROMPT_CONTEXT:]
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self._prefix_text: str | None = None            # decode(ids[prefix_offset:read_offset])
        self.decode_calls = self.decoded_ids = 0

    def _decode(self, start: int, end: int | None = None) -> str:
        ids = self.ids[start:end]
        self.decode_calls += 1
        self.decoded_ids += len(ids)
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def _window(self) -> tuple[str, str]:
        """(text of prefix_offset..read_offset, text of prefix_offset..end)."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self.prefix_offset, self.read_offset)
        return self._prefix_text, self._decode(self.prefix_offset)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix, text = self._window()
        pending = len(self.ids) - self.read_offset
        if text.endswith("\ufffd") and pending < self.MAX_PENDING:
            return ""                                   # an incomplete character: wait
        if len(text) <= len(prefix):                    # the id added no text (a skipped special)
            self.read_offset, self._prefix_text = len(self.ids), text
            if len(self.ids) - self.prefix_offset > self.MAX_WINDOW:
                self.prefix_offset, self._prefix_text = self.read_offset, None
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._prefix_text = None
        self._trim()
        return text[len(prefix):]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character comes out as U+FFFD)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix, text = self._window()
        self.prefix_offset = self.read_offset = len(self.ids)
        self._prefix_text = None
        return text[len(prefix):]

    def _trim(self):
        """Drop ids before prefix_offset once they pile up (amortised O(1); memory stays small)."""
        if self.prefix_offset > 4096:
            del self.ids[:self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0


class StopChecker:
    """push(delta, check) -> text safe to emit; `matched` is the stop string once one is found.

    The match that ends first in the stream wins (ties: the longer one), so the result does not
    depend on how the text was cut into deltas. With check=False (before min_tokens) the text is
    not searched, and a later match must end after it. The longest suffix that is a proper prefix
    of a stop string is always held back (also with include_stop_str_in_output)."""

    def __init__(self, stop=(), include_stop_str_in_output: bool = False):
        self.stop = tuple(stop)
        self.include = include_stop_str_in_output
        self.held = ""              # text not emitted yet: a possible start of a stop string
        self.unchecked = 0          # leading characters of `held` that were never searched
        self.matched: str | None = None

    def push(self, delta: str, check: bool = True) -> str:
        if self.matched is not None or not (delta or self.held):
            return ""
        if not self.stop:
            return delta
        text = self.held + delta
        if check:
            best = None             # (end, start, stop) of the earliest-ending match
            for s in self.stop:
                i = text.find(s, max(0, self.unchecked - len(s) + 1))
                if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                    best = (i + len(s), i, s)
            if best is not None:
                self.matched, self.held = best[2], ""
                return text[:best[0]] if self.include else text[:best[1]]
        hold = self._hold(text)
        cut = len(text) - hold
        self.held = text[cut:]
        self.unchecked = 0 if check else hold
        return text[:cut]

    def _hold(self, text: str) -> int:
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        """Release the held-back text when the request ends without a match."""
        out, self.held, self.unchecked = ("" if self.matched else self.held), "", 0
        return out


@dataclass
class StreamDelta:
    """New text for the client and, on the last one, why the request finished."""

    text: str
    finished: bool = False
    finish_reason: str | None = None          # "stop" | "length"
    stop_reason: str | int | None = None      # the stop string or stop token id; None for eos


class TextStream:
    """One request's output stream over the tokenizer and its sampling params (duck-typed:
    stop, stop_token_ids, ignore_eos, min_tokens, max_tokens, include_stop_str_in_output,
    skip_special_tokens). `limit` caps max_tokens=None (the room left in the context)."""

    def __init__(self, tokenizer, params, eos_token_id: int | None, prompt_ids=(),
                 limit: int | None = None):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.stops = StopChecker(params.stop, params.include_stop_str_in_output)
        self.eos = None if params.ignore_eos else eos_token_id
        self.stop_ids = set(params.stop_token_ids) | ({self.eos} if self.eos is not None else set())
        self.include = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.max_tokens = params.max_tokens if params.max_tokens is not None else limit
        self.num_tokens, self.finished, self._pieces = 0, False, []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def append(self, token_id: int) -> StreamDelta:
        """Feed the next sampled id; returns the text it releases and whether the request ends."""
        if self.finished:
            raise RuntimeError("TextStream.append after the request finished")
        self.num_tokens += 1
        check = self.num_tokens > self.min_tokens       # vLLM: no stop before min_tokens
        stop_id = check and token_id in self.stop_ids
        text = ""
        if not stop_id or self.include:                 # a stop token's own text is not output
            text = self.stops.push(self.detok.push(token_id), check)
        reason = stop_reason = None
        if self.stops.matched is not None:
            reason, stop_reason = "stop", self.stops.matched
        elif stop_id:
            reason, stop_reason = "stop", (None if token_id == self.eos else token_id)
        elif self.max_tokens is not None and self.num_tokens >= self.max_tokens:
            reason = "length"
        if reason is not None:
            text += self._close(check)
            if self.stops.matched is not None:          # the held bytes completed a stop string
                reason, stop_reason = "stop", self.stops.matched
            self.finished = True
        self._pieces.append(text)
        return StreamDelta(text, self.finished, reason, stop_reason)

    def finish(self, reason: str = "length") -> StreamDelta:
        """End the request from outside (context limit, abort): release the held-back text."""
        if self.finished:
            return StreamDelta("", True)
        text = self._close(self.num_tokens > self.min_tokens)
        stop_reason = self.stops.matched
        reason = "stop" if stop_reason is not None else reason
        self.finished = True
        self._pieces.append(text)
        return StreamDelta(text, True, reason, stop_reason)

    def _close(self, check: bool) -> str:
        tail = "" if self.stops.matched is not None else self.stops.push(self.detok.flush(), check)
        return tail + self.stops.flush()
