"""A drafter's pick of its next token over the whole vocabulary (runtime.model.draft.common.pick)
in three launches split over the vocabulary, Triton, SM80-safe, no host sync (CUDA-graph safe).

For S rows of logits l [S, V] FP32, temperatures T [S] (0: greedy) and Exp(1) draws E [S, V]:
  ids   = argmax_v l                            greedy rows (the first index of the maximum)
  q     = softmax(l / max(T, 1e-5))             [S, V] FP32, what a sampled draft is drawn from
  drawn = argmax_v q / E                        the exponential race: a draw from q
  out   = drawn where T > 0, else ids
The torch form (a softmax and two argmax launches over [S, V]) runs each as one thread block a
row: ~110 µs a pick at V = 129,280 on an H100, five picks a DSpark step. Here:
  _pick_stats_kernel  program (row s, chunk b of CH entries): the chunk's max of l and its first
                      index, and its softmax partials (max m_b of l / T, Σ exp(l / T − m_b))
  _pick_probs_kernel  program (s, b): M = max_b m_b, Z = Σ_b exp(m_b − M)·sum_b; q of the chunk
                      = exp(l / T − M) / Z, and its max of q / E with its first index
  _pick_ids_kernel    program s: the chunks' maxima -> ids, drawn, out
q is the distribution `drawn` is drawn from, bit for bit (the acceptance rule needs exactly
that); it differs from torch.softmax's by FP32 rounding (another summation order). Greedy ids
equal torch.argmax's (ties: the first index).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["pick_tokens", "PICK_CH"]

PICK_CH = 4096          # vocabulary entries a program (32 chunks a row at V = 129,280)
_BV = 1024              # entries a loop step


@triton.jit
def _pick_stats_kernel(L, T, STATS, IDX, V, NB, CH, BV: tl.constexpr):
    """STATS[s, b] = (max l, m_b, sum_b) FP32, IDX[s, b] = the first index of max l."""
    s, b = tl.program_id(0).to(tl.int64), tl.program_id(1)
    t = tl.maximum(tl.load(T + s), 1e-5)
    lo = b * CH
    best = tl.full((), float("-inf"), tl.float32)
    at = lo
    m = tl.full((), float("-inf"), tl.float32)
    acc = tl.zeros((), tl.float32)
    for k0 in range(lo, tl.minimum(lo + CH, V), BV):
        kk = k0 + tl.arange(0, BV)
        ok = kk < tl.minimum(lo + CH, V)
        x = tl.load(L + s * V + kk, mask=ok, other=float("-inf"))
        xm = tl.max(x, axis=0)
        xi = tl.argmax(x, axis=0, tie_break_left=True) + k0
        at = tl.where(xm > best, xi, at)                   # strictly greater: the first stays
        best = tl.maximum(best, xm)
        y = tl.where(ok, tl.math.div_rn(x, tl.full((BV,), 1.0, tl.float32) * t), float("-inf"))
        m_new = tl.maximum(m, tl.max(y, axis=0))
        acc = acc * tl.exp(m - m_new) + tl.sum(tl.where(ok, tl.exp(y - m_new), 0.0), axis=0)
        m = m_new
    base = (s * NB + b) * 3
    tl.store(STATS + base, best)
    tl.store(STATS + base + 1, m)
    tl.store(STATS + base + 2, acc)
    tl.store(IDX + s * NB + b, at)


@triton.jit
def _pick_probs_kernel(L, T, E, sE, STATS, Q, RACE, RIDX, V, NB, CH, NBP: tl.constexpr,
                       BV: tl.constexpr):
    """Q[s, chunk b] = exp(l / T − M) / Z; RACE[s, b] / RIDX[s, b]: max of q / E, first index."""
    s, b = tl.program_id(0).to(tl.int64), tl.program_id(1)
    t = tl.maximum(tl.load(T + s), 1e-5)
    j = tl.arange(0, NBP)
    jok = j < NB
    mb = tl.load(STATS + (s * NB + j) * 3 + 1, mask=jok, other=float("-inf"))
    sb = tl.load(STATS + (s * NB + j) * 3 + 2, mask=jok, other=0.0)
    M = tl.max(mb, axis=0)
    Z = tl.sum(tl.where(jok, sb * tl.exp(mb - M), 0.0), axis=0)
    lo = b * CH
    best = tl.full((), -1.0, tl.float32)
    at = lo
    for k0 in range(lo, tl.minimum(lo + CH, V), BV):
        kk = k0 + tl.arange(0, BV)
        ok = kk < tl.minimum(lo + CH, V)
        x = tl.load(L + s * V + kk, mask=ok, other=0.0)
        y = tl.math.div_rn(x, tl.full((BV,), 1.0, tl.float32) * t)
        q = tl.math.div_rn(tl.exp(y - M), tl.full((BV,), 1.0, tl.float32) * Z)
        tl.store(Q + s * V + kk, q, mask=ok)
        e = tl.load(E + s * sE + kk, mask=ok, other=1.0)
        r = tl.where(ok, tl.math.div_rn(q, e), -1.0)
        rm = tl.max(r, axis=0)
        ri = tl.argmax(r, axis=0, tie_break_left=True) + k0
        at = tl.where(rm > best, ri, at)
        best = tl.maximum(best, rm)
    tl.store(RACE + s * NB + b, best)
    tl.store(RIDX + s * NB + b, at)


@triton.jit
def _pick_ids_kernel(T, STATS, IDX, RACE, RIDX, OUT, NB, NBP: tl.constexpr):
    """OUT[s] = the race's winner where T[s] > 0, else the first index of max l."""
    s = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NBP)
    jok = j < NB
    lm = tl.load(STATS + (s * NB + j) * 3, mask=jok, other=float("-inf"))
    rm = tl.load(RACE + s * NB + j, mask=jok, other=-2.0)
    greedy = tl.load(IDX + s * NB + tl.argmax(lm, axis=0, tie_break_left=True))   # first chunk
    drawn = tl.load(RIDX + s * NB + tl.argmax(rm, axis=0, tie_break_left=True))   # with the max
    tl.store(OUT + s, tl.where(tl.load(T + s) > 0, drawn, greedy).to(tl.int64))


def pick_tokens(logits: torch.Tensor, temperature: torch.Tensor,
                noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V] FP32, temperature [S] FP32, noise [S, V] FP32 (rows may be strided) ->
    (ids [S] int64, q [S, V] FP32): the module docstring's out and q."""
    S, V = logits.shape
    if logits.dtype != torch.float32 or not logits.is_contiguous() \
            or temperature.shape != (S,) or temperature.dtype != torch.float32 \
            or noise.shape != (S, V) or noise.dtype != torch.float32 or noise.stride(1) != 1:
        raise ValueError(f"pick_tokens: logits [S, V] FP32 contiguous, temperature [S] FP32, "
                         f"noise [S, V] FP32; got {logits.dtype}{list(logits.shape)}, "
                         f"{temperature.dtype}{list(temperature.shape)}, "
                         f"{noise.dtype}{list(noise.shape)}")
    dev = logits.device
    NB = triton.cdiv(V, PICK_CH)
    NBP = triton.next_power_of_2(NB)
    stats = torch.empty(S, NB, 3, dtype=torch.float32, device=dev)
    idx = torch.empty(S, NB, dtype=torch.int32, device=dev)
    race = torch.empty(S, NB, dtype=torch.float32, device=dev)
    ridx = torch.empty(S, NB, dtype=torch.int32, device=dev)
    q = torch.empty(S, V, dtype=torch.float32, device=dev)
    out = torch.empty(S, dtype=torch.int64, device=dev)
    if S:
        t = temperature.contiguous()
        _pick_stats_kernel[(S, NB)](logits, t, stats, idx, V, NB, PICK_CH, BV=_BV, num_warps=4)
        _pick_probs_kernel[(S, NB)](logits, t, noise, noise.stride(0), stats, q, race, ridx, V,
                                    NB, PICK_CH, NBP=NBP, BV=_BV, num_warps=4)
        _pick_ids_kernel[(S,)](t, stats, idx, race, ridx, out, NB, NBP=NBP, num_warps=1)
    return out, q
