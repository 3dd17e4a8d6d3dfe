"""Reference drafter pieces: Flash MTP (dsv4-model.md 5.8) and 0731 DSpark (5.9), plain FP32.

reference.py orchestrates them (Reference.mtp_draft / dspark_draft; its module docstring states
which positions and which KV each row uses); here are the pieces, each a function of its inputs and a
parameter source P (P[name] -> float32 tensor, as reference.LayerParams). Both drafters are
window-only (ratio 0) V4 blocks: RoPE base rope_theta, no YaRN (ref_attention.rope_freqs(cfg, 0)).

Shapes: B = DSpark block rows (dspark_block_size, 5), N = hc_mult streams, H = hidden_size,
D = head_dim, V = vocab, r = dspark_markov_rank, L = context KV rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from backfit.config import ModelConfig
from backfit.verify.ref_attention import context_attention, kv_path, rope_cos_sin, rope_freqs
from backfit.verify.ref_blocks import Numerics, hc_pre, rms_norm

__all__ = ["DSparkDraft", "MTPDraft", "block_kv", "dspark_main_x", "dspark_ring_kv",
           "markov_head", "mtp_input"]


class MTPDraft(NamedTuple):
    """Flash MTP chained over k steps after a prefix whose last position is p."""

    logits: torch.Tensor      # [k, V] float32; row j predicts the token at position p + 2 + j
    tokens: torch.Tensor      # [k] long: drafts d_1..d_k (argmax of each row, or the given ones)
    positions: torch.Tensor   # [k] long: the MTP row positions p .. p + k - 1


class DSparkDraft(NamedTuple):
    """DSpark's block after a prefix whose last position is p; row i drafts position p + 2 + i."""

    logits: torch.Tensor      # [B, V] float32: base_i + markov_w2 @ markov_w1[out_i]
    base: torch.Tensor        # [B, V] float32: head(norm(hd)) before the Markov term
    confidence: torch.Tensor  # [B] float32 raw logits (consumers: sigmoid, then cumulative product)
    tokens: torch.Tensor      # [B] long: out_1..out_B (argmax of logits_i, or the given ones)
    hidden: torch.Tensor      # [B, H]: hd = hc_head(X) of the last stage, before its norm
    positions: torch.Tensor   # [B] long: block row positions p + 1 .. p + B


# ---- Flash MTP ----------------------------------------------------------------------------------
def mtp_input(X: torch.Tensor, e: torch.Tensor, P, cfg: ModelConfig, nx: Numerics) -> torch.Tensor:
    """Streams X [T, N, H] and token embeddings e [T, H] -> the MTP block's input Y [T, N, H]:
    e_proj(enorm(e)) broadcast over the streams + h_proj(hnorm(X)) (hnorm per stream)."""
    eps = cfg.rms_norm_eps
    e = rms_norm(e, P["enorm.weight"], eps)
    h = rms_norm(X, P["hnorm.weight"], eps)
    return nx.lin(e, P["e_proj.weight"]).unsqueeze(1) + nx.lin(h, P["h_proj.weight"])


def block_kv(Y: torch.Tensor, pos: torch.Tensor, P, cfg: ModelConfig, nx: Numerics,
             fake_quant: bool) -> torch.Tensor:
    """The KV a window-only block writes for input streams Y [T, N, H] at positions pos [T]:
    kv_path(attn_norm(hc_pre(Y))) -> [T, D]. Row t depends on row t only, so a prefix's rows are
    computed once for every later draft."""
    u, _, _ = hc_pre(Y, P["hc_attn_fn"], P["hc_attn_base"], P["hc_attn_scale"], cfg)
    x = rms_norm(u, P["attn_norm.weight"], cfg.rms_norm_eps)
    cos, sin = rope_cos_sin(rope_freqs(cfg, 0), pos)
    return kv_path(x, P, cfg, cos, sin, nx, fake_quant)


def window_attention(P, cfg: ModelConfig, nx: Numerics, pos: int, ctx: torch.Tensor,
                     ctx_pos: torch.Tensor, written: list):
    """attn(x [1, H]) for one MTP row at position `pos` over context KV ctx [L, D] at positions
    ctx_pos [L]: the window (pos - W, pos] of the block's own KV ring. The row's own kv is
    appended to `written` (it joins the ring for the next chained step)."""
    keep = ctx_pos > pos - cfg.sliding_window
    ok = torch.cat([keep, torch.ones(1, dtype=torch.bool, device=ctx.device)])[None]   # [1, L+1]
    p = torch.tensor([pos], device=ctx.device)

    def attn(x: torch.Tensor) -> torch.Tensor:
        out, kv = context_attention(x, p, ctx, ok, P, cfg, nx, nx.qat)
        written.append(kv)
        return out
    return attn


# ---- 0731 DSpark ---------------------------------------------------------------------------------
def dspark_main_x(taps: torch.Tensor, P0, cfg: ModelConfig, nx: Numerics) -> torch.Tensor:
    """main_hidden [S, nT*H] (the taps concatenated) -> main_x = main_norm(main_proj(.)) [S, H],
    with the first stage's (mtp.0) main_proj (FP8 linear) and main_norm."""
    return rms_norm(nx.lin(taps, P0["main_proj.weight"]), P0["main_norm.weight"], cfg.rms_norm_eps)


def dspark_ring_kv(main_x: torch.Tensor, P, cfg: ModelConfig, nx: Numerics,
                   fake_quant: bool) -> torch.Tensor:
    """One stage's main_kv for every target position t = 0..S-1: kv_norm_s(wkv_s(main_x_t)),
    RoPE at t (ratio-0 table) [S, D]. No attn_norm: main_x is already main_norm'ed."""
    cos, sin = rope_cos_sin(rope_freqs(cfg, 0), torch.arange(main_x.shape[0], device=main_x.device))
    return kv_path(main_x, P, cfg, cos, sin, nx, fake_quant)


def block_attention(P, cfg: ModelConfig, nx: Numerics, pos: torch.Tensor, ring: torch.Tensor,
                    fake_quant: bool):
    """attn(x [B, H]) for the DSpark block rows at positions pos [B] over a stage's ring [L, D]:
    NON-causal, every block row sees every ring slot and every block row (incl. later ones)."""
    ok = torch.ones(pos.numel(), ring.shape[0] + pos.numel(), dtype=torch.bool, device=ring.device)

    def attn(x: torch.Tensor) -> torch.Tensor:
        return context_attention(x, pos, ring, ok, P, cfg, nx, fake_quant)[0]
    return attn


def markov_head(hd: torch.Tensor, base: torch.Tensor, P, first: int,
                given: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequential Markov correction and confidence of the last stage (5.9 item 6).

    hd [B, H] (hc_head output, before the norm), base [B, V] float32. out_0 = `first` (the token
    x_{p+1}); for i = 0..B-1: m_i = markov_w1[out_i] [r]; logits_i = base_i + markov_w2 @ m_i;
    out_{i+1} = given[i] if i < len(given) else argmax(logits_i);
    confidence_i = proj . concat(hd_i, m_i), a raw logit (no sigmoid, no bias tensor on disk).
    Returns (logits [B, V] float32, confidence [B] float32, out_1..out_B [B] long).
    """
    w1 = P["markov_head.markov_w1.weight"].float()                     # [V, r] (an embedding)
    w2 = P["markov_head.markov_w2.weight"].float()                     # [V, r] (a head)
    proj = P["confidence_head.proj.weight"].float()[0]                 # [H + r]
    out, rows, conf = [first], [], []
    for i in range(base.shape[0]):
        m = w1[out[i]]                                                  # [r]
        rows.append(base[i].float() + w2 @ m)                           # [V] FP32
        conf.append(proj @ torch.cat([hd[i].float(), m]))
        out.append(given[i] if i < len(given) else int(rows[i].argmax()))
    dev = base.device
    return torch.stack(rows), torch.stack(conf), torch.tensor(out[1:], dtype=torch.long, device=dev)
