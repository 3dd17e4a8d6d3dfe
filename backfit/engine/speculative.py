"""The engine's side of speculative decoding: the verify rows' sampling batch, the acceptance
(runtime/speculative.py) read back to the host, and the counters /metrics exposes as vLLM does.

A speculative step is never overlapped with the next one (its accepted length decides the next
step's positions): LLMEngine reads it before scheduling again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backfit.runtime.sampling import SamplingBatch
from backfit.runtime.speculative import accept

__all__ = ["SpecStats", "VerifyResult", "verify"]


@dataclass
class SpecStats:
    """vllm:spec_decode_* counters: drafts (verify passes of a request), drafted and accepted
    tokens, and accepted tokens by draft position (position 0 = the first drafted token)."""

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.accepted_per_pos = [0] * self.k

    def add(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify pass (accepted drafts + the bonus); 0 before any."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class VerifyResult:
    """Per verifying sequence (in row order): the emitted tokens t_0 .. t_a and, where asked,
    each one's (raw logprob, top-n list)."""

    tokens: list[list[int]]
    logprobs: list[list[tuple[float, list | None]] | None]
    drafted: list[int]


def verify(logits: torch.Tensor, items: list, draft, vocab_size: int, eos_token_id,
           generator: torch.Generator | None) -> VerifyResult:
    """logits [Σ (1 + k_i), V] of the verifying ScheduledSeqs `items` (row order), draft: the
    runner's Draft (ids [S, K] on the device, K >= every k_i) -> the emitted tokens, read back.
    Row j of item i samples as the non-speculative sampler would after d_1 .. d_j: its history
    is the request's output followed by those drafts (the ids are read back first only when the
    request uses penalties; bans and seeds need only the count)."""
    ks = [it.draft for it in items]
    K1 = max(ks) + 1
    need_ids = any(it.seq.params.has_penalties for it in items)
    ids_host = draft.ids[:, :K1 - 1].tolist() if need_ids else None
    params, outs, prompts = [], [], []
    for i, it in enumerate(items):
        seq = it.seq
        for j in range(it.draft + 1):
            drafted = ids_host[i][:j] if ids_host is not None else [0] * j
            params.append(seq.params)
            outs.append(seq.output_ids + drafted)
            prompts.append(seq.prompt_ids)
    sb = SamplingBatch.build(params, outs, prompts, vocab_size, logits.device, eos_token_id,
                             generator)
    probs = None if draft.probs is None else draft.probs[:, :K1 - 1]
    out = accept(logits, sb, [k + 1 for k in ks], draft.ids[:, :K1 - 1], probs)
    acc = out.accepted.tolist()
    toks = out.tokens.tolist()
    lps = out.logprobs.tolist() if out.logprobs is not None else None
    top_i = out.top_ids.tolist() if out.top_ids is not None else None
    top_l = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    tokens, logprobs = [], []
    for i, it in enumerate(items):
        n = acc[i] + 1
        tokens.append(toks[i][:n])
        want = it.seq.params.logprobs
        if want is None or lps is None:
            logprobs.append(None)
            continue
        logprobs.append([(lps[i][j], list(zip(top_i[i][j][:want], top_l[i][j][:want]))
                          if want and top_i is not None else []) for j in range(n)])
    return VerifyResult(tokens, logprobs, ks)
