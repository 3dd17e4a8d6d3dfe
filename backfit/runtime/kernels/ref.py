"""Plain-torch references for every kernel op, with the runtime torch path's math.

linear_ref          = runtime.layers.Linear.forward: dequantize to x.dtype, F.linear.
linear_w8a8_ref     = what the W8A8 prefill kernel computes: x quantized per (token, 128) with
                      quant.quantize_int8_groups, both sides dequantized, product in FP32.
moe_routed_ref      = the routed part of runtime.model.moe.MoE.forward (per expert: g, u from
                      BF16 linears, clamp, silu(g)·u·w, BF16, w2), FP32 sum over the top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backfit.formats import MX_GROUP
from backfit.quant import dequant_int8_groups, dequant_int8_mx, quantize_int8_groups

__all__ = ["dequant_ref", "linear_ref", "act_quant_ref", "linear_w8a8_ref", "swiglu_ref",
           "moe_routed_ref"]


def dequant_ref(weight: torch.Tensor, scale: torch.Tensor | None, scheme: str,
                dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in `dtype`, exactly as Linear.dequantized."""
    if scheme == "int8_g128":
        w = dequant_int8_groups(weight, scale)
    elif scheme == "int8_mx32":
        w = dequant_int8_mx(weight, scale, MX_GROUP)
    elif scheme in ("bf16", "copy"):
        w = weight
    else:
        raise ValueError(f"unknown scheme {scheme!r}")
    return w.to(dtype)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
               scheme: str) -> torch.Tensor:
    """x [..., K] @ W^T in x.dtype (the torch path)."""
    return F.linear(x, dequant_ref(weight, scale, scheme, x.dtype))


def act_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int8 [M, K], scale fp32 [M, K/128]): absmax/127, round half to even."""
    return quantize_int8_groups(x.float(), 128)


def linear_w8a8_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A8 prefill math: (q_x·s_x) @ (q_w·s_w)^T in FP32 -> x.dtype; x [..., K]."""
    lead, k = x.shape[:-1], x.shape[-1]
    q, s = act_quant_ref(x.reshape(-1, k))
    y = dequant_int8_groups(q, s) @ dequant_int8_groups(weight, scale).T
    return y.to(x.dtype).reshape(*lead, -1)


def swiglu_ref(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(g, L)) · clamp(u, ±L) in FP32: gate clamped above only, up on both sides."""
    return F.silu(g.float().clamp(max=limit)) * u.float().clamp(-limit, limit)


def moe_routed_ref(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                   w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                   w2: torch.Tensor, s2: torch.Tensor, limit: float) -> torch.Tensor:
    """Routed experts, FP32 [T, D]: x [T, K] bf16, idx/w [T, k], stacked int8_mx32 experts
    w1/w3 [E, I, K] + s1/s3 [E, I, K/32], w2 [E, D, I] + s2 [E, D, I/32]."""
    y = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(idx).tolist():
        rows, slot = torch.nonzero(idx == e, as_tuple=True)
        xe = x[rows]
        g = linear_ref(xe, w1[e], s1[e], "int8_mx32").float()       # BF16 linear, then FP32
        u = linear_ref(xe, w3[e], s3[e], "int8_mx32").float()
        h = swiglu_ref(g, u, limit) * w[rows, slot][:, None]         # weight before w2
        y.index_add_(0, rows, linear_ref(h.to(x.dtype), w2[e], s2[e], "int8_mx32").float())
    return y


# Attention and indexer over the paged pools (kernels.attention.decode, kernels.attention.indexer):
# decode_attention_ref = model.attention_torch.attend / scores_core for one query per sequence, gathering the window
# and the entries from the pools per sequence (int8 dequantized as cache.paged._Store.get);
# indexer_scores_ref / topk_select_ref = Indexer.select's scores over the paged keys, its top-k.
__all__ += ["pool_get_ref", "decode_attention_ref", "indexer_scores_ref", "topk_select_ref"]


def pool_get_ref(data: torch.Tensor, scale: torch.Tensor | None, idx: tuple,
                 dtype: torch.dtype) -> torch.Tensor:
    """Vectors data[idx] in `dtype`; int8: q · scale in FP32, then dtype (= _Store.get)."""
    if scale is None:
        return data[idx].to(dtype)
    return (data[idx].float() * scale[idx][..., None]).to(dtype)


def decode_attention_ref(q, kv, pos, sink, ring, ring_scale, slots, window, mode="window",
                         entries=None, entry_scale=None, tables=None, ratio=0, sel=None):
    """The torch path's decode attention: q [B, H, D], kv [B, D] act dtype -> o [B, H, D] FP32.

    Per sequence: keys = ring rows of positions max(0, p-W+1) .. p-1, then kv (in flight),
    then HCA entries j < (p+1)//ratio or CSA entries sel[b] (>= 0); scores (q·k)/sqrt(D) in FP32,
    softmax with the per-head sink logit in the denominator only (attention_torch.scores_core).
    """
    B, H, D = q.shape
    o = torch.empty(B, H, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        p = int(pos[b])
        prev = torch.arange(max(0, p - window + 1), p, device=q.device)
        keys = torch.cat((pool_get_ref(ring, ring_scale, (int(slots[b]), prev % ring.shape[1]),
                                       q.dtype), kv[b:b + 1])).float()
        if mode != "window":
            per = entries.shape[1]
            if mode == "hca":
                j = torch.arange((p + 1) // ratio, device=q.device)
            else:
                j = sel[b][sel[b] >= 0].long()
            blk = tables[b].long()[j // per]
            keys = torch.cat((keys, pool_get_ref(entries, entry_scale, (blk, j % per),
                                                 q.dtype).float()))
        s = torch.einsum("hd,kd->hk", q[b].float(), keys) * D ** -0.5
        pr = torch.softmax(torch.cat((s, sink.float()[:, None]), -1), dim=-1)[:, :-1]
        o[b] = pr @ keys
    return o


def indexer_scores_ref(qI, w, keys, tables, pos, seq=None) -> torch.Tensor:
    """Indexer.select's scores Σ_h w_h·ReLU(qI_h·K_j) over the paged keys: [B, nblk·PB] FP32,
    -inf for j >= (p+1)//4 (qI [B, H, d] FP32, w [B, H], keys [NB, PB, d], tables [B, nblk])."""
    B, PB = qI.shape[0], keys.shape[1]
    NC = tables.shape[1] * PB
    out = torch.full((B, NC), float("-inf"), dtype=torch.float32, device=qI.device)
    for b in range(B):
        n = (int(pos[b]) + 1) // 4
        j = torch.arange(n, device=qI.device)
        row = b if seq is None else int(seq[b])                             # prefill: its sequence
        k = keys[tables[row].long()[j // PB], j % PB].float()               # [n, d]
        dots = torch.einsum("hd,ed->he", qI[b].float(), k).relu()
        out[b, :n] = torch.einsum("h,he->e", w[b].float(), dots)
    return out


def topk_select_ref(scores: torch.Tensor, k: int) -> torch.Tensor:
    """sel [B, k] int32: torch.topk indices of the k largest (stable: ties keep the lower index),
    -1 where the score is -inf or past N."""
    B, N = scores.shape
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    kk = min(k, N)
    sel = torch.full((B, k), -1, dtype=torch.int32, device=scores.device)
    top = order.indices[:, :kk].to(torch.int32)
    sel[:, :kk] = torch.where(torch.isinf(order.values[:, :kk]) & (order.values[:, :kk] < 0),
                              torch.full_like(top, -1), top)
    return sel


def sparse_attention_ref(q, kv, pos, sink, ring, ring_scale, slots, window, mode="window",
                         entries=None, entry_scale=None, tables=None, ratio=0, sel=None,
                         seq=None, start=None, span=None):
    """Chunked prefill (attention_torch.attend over a chunk): query t of sequence seq[t], whose chunk
    starts at start[t] (row t - (pos[t] - start[t]) of kv), sees ring positions
    max(0, p-W+1) .. start-1, then the chunk's kv rows up to itself, then its entries. span
    (lo, hi) [T]: the chunk's rows at positions lo[t] .. hi[t] are window keys of t too."""
    T, H, D = q.shape
    o = torch.empty(T, H, D, dtype=torch.float32, device=q.device)
    for t in range(T):
        p, st, b = int(pos[t]), int(start[t]), int(seq[t])
        lo = max(0, p - window + 1)
        prev = torch.arange(min(lo, st), st, device=q.device)
        r0 = t - (p - st)
        first, last = max(lo, st), p                    # in-flight positions first .. last
        fly_pos = torch.arange(first, last + 1)
        if span is not None and int(span[0][t]) <= int(span[1][t]):
            a, z = int(span[0][t]), int(span[1][t])
            fly_pos = torch.unique(torch.cat((fly_pos, torch.arange(a, z + 1))))
        fly = kv[r0 + (fly_pos - st).to(q.device)]
        keys = torch.cat((pool_get_ref(ring, ring_scale, (int(slots[b]), prev % ring.shape[1]),
                                       q.dtype), fly)).float()
        if mode != "window":
            per = entries.shape[1]
            j = torch.arange((p + 1) // ratio, device=q.device) if mode == "hca" else \
                sel[t][sel[t] >= 0].long()
            blk = tables[b].long()[j // per]
            keys = torch.cat((keys, pool_get_ref(entries, entry_scale, (blk, j % per),
                                                 q.dtype).float()))
        s = torch.einsum("hd,kd->hk", q[t].float(), keys) * D ** -0.5
        pr = torch.softmax(torch.cat((s, sink.float()[:, None]), -1), dim=-1)[:, :-1]
        o[t] = pr @ keys
    return o


__all__ += ["sparse_attention_ref"]
