"""The attention core on the torch path (dsv4-model.md 5.4): one sequence chunk at a time against
the layer cache's interface (runtime/state.py), plain torch, FP32 scores; the reference the
Triton kernels (Attention._kernels) are tested against. Attention.core calls torch_core where
the kernels do not run (the torch backend, or a cache without paged pools).
"""

from __future__ import annotations

import torch

from backfit.runtime.batch import ForwardBatch, SeqSlice

__all__ = ["torch_core"]


def torch_core(attn, pre: tuple, batch: ForwardBatch, cache) -> torch.Tensor:
    """Attention.core on the torch path: pre's tensors -> o [T, Hl, D] FP32, rotated; per
    sequence: the compressors' updates (their entries read back), then `attend`."""
    q, kv, comp, icomp, qI, wI = pre
    pos, img = batch.positions, batch.images
    o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for s in batch.slices():
        r = slice(s.lo, s.hi)
        span = None if img is None else (img.span_lo[r].long(), img.span_hi[r].long())
        extra = None
        if comp is not None:
            entries = attn.compressor.update(cache, s.index, "comp", comp[0][r], comp[1][r],
                                             s.start, q.dtype)
            extra = (entries, None)
            if attn.indexer is not None:
                keys = attn.indexer.compressor.update(cache, s.index, "index", icomp[0][r],
                                                      icomp[1][r], s.start, q.dtype)
                extra = (entries, (qI[r], wI[r], keys))
        o[r] = attend(attn, q[r], kv[r], pos[r], s, cache, extra, span)
    return o


def attend(attn, q, kv, pos, s: SeqSlice, cache, extra, span=None) -> torch.Tensor:
    """One sequence chunk: q [n, Hl, D], kv [n, D], pos [n] -> o [n, Hl, D] FP32.

    Queries are processed q_chunk at a time so a long prefill never materialises
    [n, H, n] scores: a query block only needs the window keys from its first position - W + 1.
    span: (lo, hi) [n] long, the in-span keys each query sees too (BatchImages; all of them
    in this chunk), or None.
    """
    W, n = attn.window, s.n
    lo = max(0, s.start - W + 1)                                  # oldest position still visible
    prev, prev_pos = cache.window(s.index, s.start)               # [lo .. start-1]
    keys = torch.cat((prev.to(kv.dtype), kv)).float()             # [Wn, D], positions lo ..
    kpos = torch.cat((prev_pos, pos))
    cache.write_window(s.index, pos, kv)                          # (after reading it above)
    o = torch.empty(n, attn.local_heads, keys.shape[1], dtype=torch.float32, device=kv.device)
    for a in range(0, n, attn.q_chunk):
        b = min(n, a + attn.q_chunk)
        k0 = max(0, s.start + a - W + 1 - lo)                     # first key any row can see
        k1 = s.start + b - lo                                     # one past the last row's own
        sp = None
        if span is not None:                                      # in-span keys, in this chunk
            sp = (span[0][a:b], span[1][a:b])
            k0, k1 = min(k0, int(sp[0].min()) - lo), max(k1, int(sp[1].max()) + 1 - lo)
        ex = None
        if extra is not None and extra[0].shape[0] > 0:
            ex = (extra[0], None if extra[1] is None else
                  (extra[1][0][a:b], extra[1][1][a:b], extra[1][2]))
        o[a:b] = scores_core(attn, q[a:b].float(), keys[k0:k1], kpos[k0:k1], pos[a:b], ex, sp)
    return o


def scores_core(attn, qf, keys, kpos, pos, extra, span=None) -> torch.Tensor:
    """qf [n, Hl, D] FP32, window keys [Wn, D] at kpos, extra (entries, indexer inputs), span
    (lo, hi) [n]: window keys lo .. hi are visible too (or None)."""
    n, W = qf.shape[0], attn.window
    wmask = (kpos[None] <= pos[:, None]) & (kpos[None] > pos[:, None] - W)   # [n, Wn]
    if span is not None:
        wmask |= (kpos[None] >= span[0][:, None]) & (kpos[None] <= span[1][:, None])
    scores = [torch.einsum("nhd,kd->nhk", qf, keys) * attn.scale]
    masks = [wmask[:, None, :]]
    comp = None
    if extra is not None:
        entries = extra[0].float()                                # [E, D] compressed KV
        E = entries.shape[0]
        valid = torch.arange(E, device=qf.device)[None] < ((pos + 1) // attn.ratio)[:, None]
        if extra[1] is None:                                      # HCA: all complete entries
            scores.append(torch.einsum("nhd,ed->nhe", qf, entries) * attn.scale)
            masks.append(valid[:, None, :])
            comp = ("nhe,ed->nhd", entries)
        else:                                                     # CSA: indexer top-k
            qI, wI, ikeys = extra[1]
            sel, ok = attn.indexer.select(qI, wI, ikeys, valid)  # [n, k]
            picked = entries[sel]                                 # [n, k, D]
            scores.append(torch.einsum("nhd,nkd->nhk", qf, picked) * attn.scale)
            masks.append(ok[:, None, :])
            comp = ("nhk,nkd->nhd", picked)
    s_all = torch.cat(scores, -1).masked_fill(~torch.cat(masks, -1), float("-inf"))
    sink = attn.attn_sink.view(1, -1, 1).expand(n, -1, 1)         # per-head logit, denominator only
    p = torch.softmax(torch.cat((s_all, sink), -1), dim=-1)[..., :-1]   # [n, Hl, keys]
    Wn = keys.shape[0]
    o = torch.einsum("nhk,kd->nhd", p[..., :Wn], keys)
    if comp is not None:
        o = o + torch.einsum(comp[0], p[..., Wn:], comp[1])
    return o
