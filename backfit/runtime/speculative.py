"""Accepting drafted tokens (speculative decoding), on the device, lossless.

A verify step runs, per sequence i with k_i drafted tokens d_1..d_k, the target model over the
rows [x, d_1, ..., d_k] (x: the last token, not yet in the cache). Row j's logits give the target
distribution of the token after d_j (row 0: after x). Each row is one row of a SamplingBatch whose
history is the request's output followed by d_1..d_j, so penalties, min_tokens bans and seeds see
exactly what the non-speculative sampler would have seen had it produced d_1..d_j itself.

  greedy rows   t_j = argmax of the processed logits (runtime.sampling.process_logits): d_{j+1}
                is accepted while d_{j+1} == t_j; the first row that disagrees (or row k) emits
                t_j. The emitted tokens are t_0 .. t_a: the non-speculative greedy output.
  sampled rows  p_j = the distribution `sample` draws from (temperature, top-k, top-p, min-p over
                the processed logits: runtime.sampling.target_probs), q_j the drafter's (one-hot
                at d_{j+1} for a greedy drafter). d_{j+1} is accepted with probability
                min(1, p_j(d) / q_j(d)); at the first rejection a token is drawn from
                max(0, p_j - q_j) renormalised (from p_j when that is all zero); when all k are
                accepted the bonus token is drawn from p_k. Every emitted token is then
                distributed as p (Leviathan et al. 2023; Chen et al. 2023).

Guards: a row whose logits hold NaN or are all -inf emits what `sample` emits for it (argmax of
the processed row, clamped to the vocabulary) and accepts nothing after it; probabilities are
computed in FP32 and a draft id outside the vocabulary is never read (clamped, then rejected).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backfit.runtime.sampling import SamplingBatch, exponentials, process_logits, \
    target_probs, uniforms

__all__ = ["AcceptOutput", "accept"]


@dataclass
class AcceptOutput:
    """Device tensors for S sequences: accepted [S] int64 (drafts accepted, 0..k_i), tokens
    [S, K + 1] int64 (emitted tokens t_0 .. t_{accepted}; later columns are undefined),
    logprobs [S, K + 1] fp32 raw logprob of each emitted token (None when no row asks), and
    top_ids / top_logprobs [S, K + 1, n] or None."""

    accepted: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


def _grid(rows_per_seq: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row index [S, K + 1] of (sequence i, draft position j) into the flat verify rows (padded
    positions point at the sequence's last row)."""
    K1, start, flat = max(rows_per_seq), 0, []
    for n in rows_per_seq:
        flat.append([start + min(j, n - 1) for j in range(K1)])
        start += n
    return torch.tensor(flat, dtype=torch.int64).to(device, non_blocking=True)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What a rejected row draws from: max(0, p - q) (unnormalised; the exponential race needs
    no sum), or p where that is all zero (p == q)."""
    r = (p - q).clamp_(min=0)
    return torch.where(r.sum(-1, keepdim=True) > 0, r, p)


def accept(logits: torch.Tensor, batch: SamplingBatch, rows_per_seq: list[int],
           draft_ids: torch.Tensor, draft_probs: torch.Tensor | None = None) -> AcceptOutput:
    """logits [N, V] of the verify rows (N = Σ rows_per_seq, sequence after sequence, each
    1 + k_i rows), batch: their SamplingBatch (one row each), draft_ids [S, K] int64 (K = the
    largest k_i; columns past k_i ignored), draft_probs [S, K, V] fp32: the drafter's
    distribution each draft was drawn from (None: greedy drafts, q one-hot)."""
    N, V = logits.shape
    S, K1 = len(rows_per_seq), max(rows_per_seq)
    if sum(rows_per_seq) != N or draft_ids.shape != (S, K1 - 1):
        raise ValueError(f"accept: {N} logits rows for rows {rows_per_seq}, draft ids "
                         f"{tuple(draft_ids.shape)}")
    dev = logits.device
    idx = _grid(rows_per_seq, dev)                                       # [S, K1]
    lens = torch.tensor(rows_per_seq).to(dev, non_blocking=True)
    col = torch.arange(K1, device=dev)[None, :]
    x = process_logits(logits, batch)                                    # [N, V] fp32
    bad = (~torch.isfinite(x).any(-1)) | torch.isnan(x).any(-1)         # [N]
    t = x.argmax(-1).clamp_(0, V - 1)[idx]                               # [S, K1] greedy choice
    dd = draft_ids.to(dev).long()
    in_vocab = torch.cat([(dd >= 0) & (dd < V), torch.zeros(S, 1, dtype=torch.bool,
                                                                 device=dev)], 1)
    d = torch.cat([dd.clamp(0, V - 1), torch.zeros(S, 1, dtype=torch.int64, device=dev)], 1)
    ok = (d == t) & in_vocab                                             # greedy acceptance
    if not batch.all_greedy:
        pj = target_probs(x, batch)[idx]                                 # [S, K1, V]
        p_d = pj.gather(2, d[:, :, None])[:, :, 0]
        if draft_probs is None:                                          # greedy drafts
            q = torch.zeros_like(pj).scatter_(2, d[:, :, None], 1.0)
        else:
            q = torch.cat([draft_probs.to(dev).float(), torch.zeros(S, 1, V, device=dev)], 1)
        q = torch.where(in_vocab[:, :, None], q, torch.zeros((), device=dev))
        q_d = q.gather(2, d[:, :, None])[:, :, 0]
        u = uniforms(N, batch, dev)[idx]                                 # [S, K1]
        ok_s = (u * q_d < p_d) & in_vocab                                # u < p/q, no division
        residual = _residual(pj, q)
        bonus = col == (lens - 1)[:, None]                               # all k accepted
        dist = torch.where(bonus[:, :, None], pj, residual)
        drawn = (dist / exponentials((N, V), batch, dev)[idx]).argmax(-1)
        drawn = torch.where(torch.isfinite(dist).all(-1), drawn, t)      # NaN rows: sample's
        sampled = ~batch.greedy[idx]                                     # [S, K1]
        ok = torch.where(sampled, ok_s, ok)
        t = torch.where(sampled, drawn, t)
    ok = ok & (col < (lens - 1)[:, None]) & ~bad[idx]                    # rows with a draft
    accepted = torch.cumprod(ok.long(), 1).sum(1)                        # the leading run
    emitted = torch.where(col < accepted[:, None], d, t)
    out = AcceptOutput(accepted, emitted, None, None, None)
    n_lp = [k for k in batch.num_logprobs if k is not None]
    if n_lp:
        raw = logits.float()[idx]                                        # [S, K1, V]
        lse = torch.logsumexp(raw, -1)
        out.logprobs = raw.gather(2, emitted[:, :, None])[:, :, 0] - lse
        n = max(n_lp)
        if n:
            vals, out.top_ids = raw.topk(n, dim=-1)
            out.top_logprobs = vals - lse[:, :, None]
    return out
