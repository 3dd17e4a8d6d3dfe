"""Per-request sampling parameters (vLLM names and defaults), validated once; no torch.

The runtime sampler (`backfit.runtime.sampling`) reads these fields by name (duck-typed), so the
runtime never imports the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SamplingParams", "MAX_LOGPROBS", "SAMPLING_EPS"]

MAX_LOGPROBS = 20        # OpenAI's top_logprobs ceiling; larger requests are capped to it
SAMPLING_EPS = 1e-5      # temperature below this is greedy (as in vLLM: 1/T would overflow)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop. Lists become tuples and logit_bias a sorted tuple of
    (token id, bias) pairs, so the object is hashable and cannot change after validation."""

    max_tokens: int | None = 16          # None: up to the context limit
    min_tokens: int = 0                  # stop tokens (eos, stop_token_ids) masked before this
    temperature: float = 1.0             # 0 (< SAMPLING_EPS): greedy
    top_k: int = 0                       # 0 or -1: off (stored as 0)
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0        # on output tokens
    frequency_penalty: float = 0.0       # on output tokens, times their count
    repetition_penalty: float = 1.0      # on prompt + output tokens (vLLM / CTRL form)
    logit_bias: tuple[tuple[int, float], ...] = ()   # a dict {id: bias} is accepted
    stop: tuple[str, ...] = ()           # a single str is accepted
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None          # top-n alternatives per generated token; 0: sampled only
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_boundaries: tuple[int, ...] = ()   # prompt token counts where later requests will
    #                                          diverge (the end of the system prompt and tools):
    #                                          the prefix cache snapshots the block boundary at
    #                                          or before each, and before any image block that
    #                                          boundary would cut (docs/ENGINE.md §3)

    def __post_init__(self):
        set_ = lambda name, v: object.__setattr__(self, name, v)   # noqa: E731 (frozen)
        mt = self.max_tokens
        if mt is not None and not (_is_int(mt) and mt >= 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {mt!r}")
        if not (_is_int(self.min_tokens) and self.min_tokens >= 0):
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if mt is not None and self.min_tokens > mt:
            raise ValueError(f"min_tokens must be <= max_tokens ({mt}), got {self.min_tokens}")
        if not (_is_num(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (_is_int(self.top_k) and self.top_k >= -1):
            raise ValueError(f"top_k must be an integer >= 1, or 0/-1 (off), got {self.top_k!r}")
        set_("top_k", max(self.top_k, 0))
        if not (_is_num(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (_is_num(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (_is_num(v) and -2 <= v <= 2):
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not (_is_num(rp) and 0 < rp <= 2):
            raise ValueError(f"repetition_penalty must be in (0, 2], got {rp!r}")
        set_("logit_bias", self._logit_bias(self.logit_bias))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {stop!r}")
        set_("stop", stop)
        ids = tuple(self.stop_token_ids or ())
        if not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids must be integers >= 0, got {ids!r}")
        set_("stop_token_ids", ids)
        cb = tuple(self.cache_boundaries or ())
        if not all(_is_int(i) and i >= 1 for i in cb):
            raise ValueError(f"cache_boundaries must be token counts >= 1, got {cb!r}")
        set_("cache_boundaries", tuple(sorted(set(cb))))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not (_is_int(v) and v >= 0):
                raise ValueError(f"{name} must be an integer >= 0 or None, got {v!r}")
            if v is not None:
                set_(name, min(v, MAX_LOGPROBS))

    @staticmethod
    def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
        """{id: bias} (ids may be decimal strings, as JSON sends) -> sorted ((id, bias), ...)."""
        items = bias.items() if isinstance(bias, dict) else (bias or ())
        out = {}
        for k, v in items:
            try:
                tid = int(k) if isinstance(k, str) else k
            except ValueError:
                tid = k
            if not (_is_int(tid) and tid >= 0):
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {k!r}")
            if not (_is_num(v) and -100 <= v <= 100):
                raise ValueError(f"logit_bias values must be in [-100, 100], got {v!r} for {k!r}")
            out[tid] = float(v)
        return tuple(sorted(out.items()))

    @property
    def greedy(self) -> bool:
        """Argmax decoding (after penalties and bias); top-k/top-p/min-p and seed are unused."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def all_stop_token_ids(self, eos_token_id: int | None) -> tuple[int, ...]:
        """stop_token_ids + eos (unless ignore_eos): what min_tokens bans, what ends a request."""
        eos = () if self.ignore_eos or eos_token_id is None else (eos_token_id,)
        return tuple(dict.fromkeys(eos + self.stop_token_ids))
