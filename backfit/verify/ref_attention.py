"""Reference attention (dsv4-model.md section 5.4): q/kv paths, RoPE (+YaRN), compressors,
lightning indexer, sparse attention with sink, grouped output projection.

`attention` is the main tower's full-sequence causal prefill (with images, the window branch of
in-span positions also sees the whole image span: `window` bounds from ref_vision, dsv4-vision.md
11.2); `context_attention` is the drafters' (new rows over given KV rows, an explicit mask); both
share q_path / kv_path / attend / out_path.
Shapes: S = tokens, nh = heads, D = head_dim, R = RoPE dims (the
LAST R of every head), T = compressed entries (S // ratio), nI/DI = indexer heads/head dim.
"""

from __future__ import annotations

import math

import torch

from backfit.config import ModelConfig
from backfit.verify.qat import indexer_fake_fp4, kv_fake_fp8
from backfit.verify.ref_blocks import Numerics, rms_norm

__all__ = ["apply_rope", "attend", "attention", "compressor", "context_attention", "hadamard",
           "indexer", "kv_path", "out_path", "q_path", "rope_cos_sin", "rope_freqs",
           "sparse_attention", "yarn_range"]

QUERY_CHUNK = 256       # queries per attention block: memory O(chunk * (chunk + window + T))


# ---- RoPE ------------------------------------------------------------------------------------
def yarn_range(dim: int, base: float, orig_len: int, beta_fast: float,
               beta_slow: float) -> tuple[int, int]:
    """YaRN correction range (low, high) over the dim//2 frequency indices, within [0, dim-1]."""
    def corr(rot):
        return dim * math.log(orig_len / (rot * 2 * math.pi)) / (2 * math.log(base))
    return max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)


def rope_freqs(cfg: ModelConfig, ratio: int) -> torch.Tensor:
    """[R/2] float32 inverse frequencies of a layer with compression `ratio`.

    Ratio 0: base rope_theta, no YaRN. Ratio != 0: base compress_rope_theta with YaRN
    interpolation (frequencies above `high` divided by factor, linear ramp in between) and no
    mscale. Float32 like the reference `precompute_freqs_cis`.
    """
    R = cfg.qk_rope_head_dim
    base = cfg.compress_rope_theta if ratio else cfg.rope_theta
    f = 1.0 / (float(base) ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
    if ratio:
        rs = cfg.rope_scaling
        low, high = yarn_range(R, float(base), rs["original_max_position_embeddings"],
                               rs["beta_fast"], rs["beta_slow"])
        if low == high:
            high += 0.001
        ramp = ((torch.arange(R // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        f = f / rs["factor"] * ramp + f * (1 - ramp)
    return f


def rope_cos_sin(freqs: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pos [P] int -> cos, sin [P, R/2] float32 (angle pos * f_i computed in float32)."""
    ang = torch.outer(pos.to(torch.float32), freqs.to(pos.device))
    return torch.cos(ang), torch.sin(ang)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               inverse: bool = False) -> torch.Tensor:
    """Interleaved (GPT-J) rotation of the last 2*cos.shape[-1] dims of x; returns x.dtype.

    x [..., D]; cos/sin broadcast to [..., R/2]. Pairs (2i, 2i+1) of the RoPE slice rotate by
    +angle, or by -angle with inverse=True (de-rotation of the attention output).
    """
    R = 2 * cos.shape[-1]
    nope, rope = x[..., :-R], x[..., -R:].float()
    a, b = rope[..., 0::2], rope[..., 1::2]                        # [..., R/2] each
    if inverse:
        sin = -sin
    rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat([nope, rot.to(x.dtype)], dim=-1)


# ---- lightning indexer pieces ------------------------------------------------------------------
def _sylvester(n: int, device) -> torch.Tensor:
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:                                          # [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if h.shape[0] != n:
        raise ValueError(f"Hadamard size {n} is not a power of two")
    return h


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] -> x @ H_n / sqrt(n), Sylvester-ordered Walsh-Hadamard; computed in x.dtype."""
    n = x.shape[-1]
    return torch.matmul(x, _sylvester(n, x.device).to(x.dtype)) * n ** -0.5


def compressor(x: torch.Tensor, P, pre: str, ratio: int, d: int, cfg: ModelConfig,
               freqs: torch.Tensor, nx: Numerics, indexer_key: bool = False) -> torch.Tensor:
    """Learned gated pooling: x [S, H] (attention input) -> entries E [T = S // ratio, d].

    HCA (ratio != 4): entry j pools tokens j*m .. j*m+m-1, softmax over the m slots per channel.
    CSA (ratio == 4, overlapped): wkv/wgate give 2d per token; entry j pools 8 slots, the first
    d channels of block j-1's tokens then the last d of block j's (j = 0: weight 0 for block -1).
    FP32 math with the BF16 weights upcast, as the reference; then norm, RoPE at pos j*m and the
    epilogue (fake FP8 on the non-RoPE dims, or Hadamard + fake FP4 for the indexer keys).
    """
    S, R = x.shape[0], cfg.qk_rope_head_dim
    T = S // ratio
    if T == 0:                                                           # no completed block yet
        return torch.zeros(0, d, dtype=nx.act, device=x.device)
    xf = x[:T * ratio].float()
    c = torch.nn.functional.linear(xf, P[pre + "wkv.weight"].float())   # [T*m, coff*d]
    z = torch.nn.functional.linear(xf, P[pre + "wgate.weight"].float())
    c = c.view(T, ratio, -1)
    z = z.view(T, ratio, -1) + P[pre + "ape"].float()                   # ape [m, coff*d] by t mod m
    if ratio == 4:                                                       # overlapped (coff = 2)
        c2 = c.new_zeros(T, 2 * ratio, d)
        z2 = z.new_full((T, 2 * ratio, d), float("-inf"))
        c2[:, ratio:], z2[:, ratio:] = c[..., d:], z[..., d:]            # block j, "current" half
        c2[1:, :ratio], z2[1:, :ratio] = c[:-1, :, :d], z[:-1, :, :d]    # block j-1, "overlap" half
        c, z = c2, z2
    E = (c * torch.softmax(z, dim=1)).sum(dim=1)                         # [T, d] FP32
    E = rms_norm(E.to(nx.act), P[pre + "norm.weight"], cfg.rms_norm_eps)
    cos, sin = rope_cos_sin(freqs, torch.arange(T, device=x.device) * ratio)   # block's first token
    E = apply_rope(E, cos, sin)
    if indexer_key:
        E = hadamard(E)
        return indexer_fake_fp4(E) if nx.qat else E
    return kv_fake_fp8(E, R) if nx.qat else E


def indexer(x: torch.Tensor, qr: torch.Tensor, P, cfg: ModelConfig, freqs: torch.Tensor,
            nx: Numerics) -> torch.Tensor:
    """Lightning indexer: -> selected compressed entries [S, min(index_topk, T)] (long, -1 = none).

    score[p, j] = sum_h w[p, h] * ReLU(qI[p, h] . K[j]) over valid j < (p + 1) // 4.
    """
    S, nI, DI, ratio = x.shape[0], cfg.index_n_heads, cfg.index_head_dim, 4
    K = compressor(x, P, "attn.indexer.compressor.", ratio, DI, cfg, freqs, nx, indexer_key=True)
    T = K.shape[0]
    if T == 0:
        return torch.empty(S, 0, dtype=torch.long, device=x.device)
    pos = torch.arange(S, device=x.device)
    q = nx.lin(qr, P["attn.indexer.wq_b.weight"]).view(S, nI, DI)       # [S, nI, DI]
    cos, sin = rope_cos_sin(freqs, pos)
    q = hadamard(apply_rope(q, cos[:, None], sin[:, None]))
    if nx.qat:
        q = indexer_fake_fp4(q)
    w = nx.lin_bf16(x, P["attn.indexer.weights_proj.weight"]) * (DI ** -0.5 * nI ** -0.5)  # [S, nI]
    limit = (pos + 1) // ratio                                           # entries j < limit valid
    Kq = K.to(q.dtype)
    out = torch.empty(S, min(cfg.index_topk, T), dtype=torch.long, device=x.device)
    # query blocks: [S, nI, T] at S = 65536 (verify --long-context) would be tens of GB
    for p0 in range(0, S, QUERY_CHUNK):
        p1 = min(S, p0 + QUERY_CHUNK)
        s = torch.einsum("shd,td->sht", q[p0:p1], Kq).relu()             # [s, nI, T]
        score = (s * w[p0:p1].unsqueeze(-1)).sum(dim=1).float()         # [s, T]
        valid = torch.arange(T, device=x.device)[None, :] < limit[p0:p1, None]
        score = score.masked_fill(~valid, float("-inf"))
        idx = torch.topk(score, out.shape[1], dim=-1).indices            # [s, k]
        out[p0:p1] = torch.where(idx < limit[p0:p1, None], idx, torch.full_like(idx, -1))
    return out


def attend(q: torch.Tensor, keys: torch.Tensor, ok: torch.Tensor,
           sink: torch.Tensor) -> torch.Tensor:
    """One softmax per head over the allowed keys plus the head's sink logit (section 5.4.8).

    q [S, nh, D]; keys [L, D] (K = V); ok [S, L] bool, which keys each query may use; sink [nh]
    is a logit in the denominator only. Returns [S, nh, D] float32.
    """
    S, nh, D = q.shape
    keys = keys.float()
    logits = torch.einsum("shd,td->sht", q.float(), keys) * D ** -0.5      # [S, nh, L]
    logits = logits.masked_fill(~ok[:, None, :], float("-inf"))
    sinks = sink.float().view(1, nh, 1).expand(S, nh, 1)
    probs = torch.softmax(torch.cat([logits, sinks], dim=-1), dim=-1)[..., :-1]  # drop sink
    return torch.einsum("sht,td->shd", probs, keys)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, comp: torch.Tensor | None,
                     comp_ok, sink: torch.Tensor, window: int,
                     bounds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One softmax over window KV and compressed entries, with a per-head sink in the denominator.

    q [S, nh, D]; kv [S, D] (window KV, K = V); comp [T, D] or None; comp_ok(p0, p1) -> bool
    [p1 - p0, T] = which compressed entries each query may use. bounds: None for the causal
    window of `window` keys, else (first, last) [S] long: the window keys of each query, both
    inclusive (image prompts, ref_vision.window_bounds). Returns [S, nh, D] float32.
    """
    S, nh, D = q.shape
    out = torch.empty(S, nh, D, dtype=torch.float32, device=q.device)
    for p0 in range(0, S, QUERY_CHUNK):
        p1 = min(S, p0 + QUERY_CHUNK)
        pq = torch.arange(p0, p1, device=q.device)[:, None]
        if bounds is None:
            lo, hi = max(0, p0 - window + 1), p1
        else:
            first, last = bounds[0][p0:p1, None], bounds[1][p0:p1, None]
            lo, hi = int(first.min()), int(last.max()) + 1
        keys = kv[lo:hi].float()                                         # [L, D]
        pk = torch.arange(lo, hi, device=q.device)[None, :]
        if bounds is None:
            ok = (pk <= pq) & (pk > pq - window)                         # window incl. itself
        else:
            ok = (pk >= first) & (pk <= last)
        if comp is not None and comp.shape[0]:
            keys = torch.cat([keys.float(), comp.float()], dim=0)        # [L + T, D]
            ok = torch.cat([ok, comp_ok(p0, p1)], dim=1)
        out[p0:p1] = attend(q[p0:p1], keys, ok, sink)
    return out


# ---- the three halves of a layer's attention -----------------------------------------------------
def q_path(x: torch.Tensor, P, cfg: ModelConfig, cos: torch.Tensor, sin: torch.Tensor,
           nx: Numerics) -> tuple[torch.Tensor, torch.Tensor]:
    """x [S, H] (after attn_norm) -> (q [S, nh, D] RoPE'd with cos/sin [S, R/2], qr [S, q_lora]).

    Low rank, then a per-head unweighted RMS over all D dims, then RoPE on the last R dims.
    """
    S, nh, D, eps = x.shape[0], cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
    qr = rms_norm(nx.lin(x, P["attn.wq_a.weight"]), P["attn.q_norm.weight"], eps)   # [S, q_lora]
    q = nx.lin(qr, P["attn.wq_b.weight"]).view(S, nh, D)
    q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)         # act dtype, as reference
    return apply_rope(q, cos[:, None], sin[:, None]), qr


def kv_path(x: torch.Tensor, P, cfg: ModelConfig, cos: torch.Tensor, sin: torch.Tensor,
            nx: Numerics, fake_quant: bool) -> torch.Tensor:
    """x [S, H] -> the single latent kv [S, D] (used as K and V): kv_norm(wkv x), RoPE on the
    last R dims, then (fake_quant) the section 4.5 FP8 round trip of the leading D - R dims."""
    kv = rms_norm(nx.lin(x, P["attn.wkv.weight"]), P["attn.kv_norm.weight"], cfg.rms_norm_eps)
    kv = apply_rope(kv, cos, sin)
    return kv_fake_fp8(kv, cfg.qk_rope_head_dim) if fake_quant else kv


def out_path(o: torch.Tensor, P, cfg: ModelConfig, cos: torch.Tensor, sin: torch.Tensor,
             nx: Numerics) -> torch.Tensor:
    """o [S, nh, D] float32 -> [S, H]: de-rotate by the QUERY position (cos/sin [S, R/2]), grouped
    wo_a (BF16 einsum, no act quant), wo_b."""
    S, g = o.shape[0], cfg.o_groups
    o = apply_rope(o.to(nx.act), cos[:, None], sin[:, None], inverse=True)
    wo_a = P["attn.wo_a.weight"].view(g, cfg.o_lora_rank, -1)            # [g, o_lora, nh*D/g]
    z = torch.einsum("sgd,grd->sgr", o.reshape(S, g, -1), wo_a.to(nx.act))   # [S, g, o_lora]
    return nx.lin(z.flatten(1), P["attn.wo_b.weight"])


def attention(x: torch.Tensor, P, cfg: ModelConfig, ratio: int, nx: Numerics,
              window: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [S, H] (after attn_norm) -> attention output [S, H] in nx.act, for a layer of `ratio`.

    window: per-query window key bounds for an image prompt (sparse_attention's `bounds`); the
    compressed entries and the indexer stay causal whatever it says."""
    S, D = x.shape[0], cfg.head_dim
    pos = torch.arange(S, device=x.device)
    freqs = rope_freqs(cfg, ratio)                                       # one table per layer
    cos, sin = rope_cos_sin(freqs, pos)                                  # [S, R/2]
    q, qr = q_path(x, P, cfg, cos, sin, nx)
    kv = kv_path(x, P, cfg, cos, sin, nx, nx.qat)                        # [S, D]

    comp, comp_ok = None, None
    if ratio:
        comp = compressor(x, P, "attn.compressor.", ratio, D, cfg, freqs, nx)       # [T, D]
        T = comp.shape[0]
        if ratio == 4:                                                   # CSA: indexer top-k
            sel = indexer(x, qr, P, cfg, freqs, nx)                      # [S, k], -1 = none
            hit = torch.zeros(S, T + 1, dtype=torch.bool, device=x.device)
            hit = hit.scatter_(1, torch.where(sel < 0, T, sel), True)[:, :T]   # [S, T]

            def comp_ok(p0, p1):
                return hit[p0:p1]
        else:                                                            # HCA: all completed ones

            def comp_ok(p0, p1):                                         # entry j < (p + 1) // m
                p = torch.arange(p0, p1, device=x.device)[:, None]
                return torch.arange(T, device=x.device)[None, :] < (p + 1) // ratio
    o = sparse_attention(q, kv, comp, comp_ok, P["attn.attn_sink"], cfg.sliding_window, window)
    return out_path(o, P, cfg, cos, sin, nx)


def context_attention(x: torch.Tensor, pos: torch.Tensor, ctx: torch.Tensor, ok: torch.Tensor,
                      P, cfg: ModelConfig, nx: Numerics,
                      kv_fake_quant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of T new rows over given context KV plus their own KV, window-only RoPE (ratio 0:
    rope_theta, no YaRN) -- the drafters' attention (sections 5.8, 5.9).

    x [T, H] (after attn_norm) at absolute positions pos [T]; ctx [L, D] KV rows already RoPE'd at
    their own positions; ok [T, L + T] bool: which of (the L context rows, then the T new rows)
    each query sees. Returns (output [T, H] in nx.act, the new rows' kv [T, D]).
    """
    cos, sin = rope_cos_sin(rope_freqs(cfg, 0), pos)                     # [T, R/2]
    q, _ = q_path(x, P, cfg, cos, sin, nx)
    kv = kv_path(x, P, cfg, cos, sin, nx, kv_fake_quant)
    o = attend(q, torch.cat([ctx.to(kv.dtype), kv]), ok, P["attn.attn_sink"])
    return out_path(o, P, cfg, cos, sin, nx), kv
