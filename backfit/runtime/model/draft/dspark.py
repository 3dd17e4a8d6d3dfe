"""DeepSeek-V4-Flash-0731's DSpark drafter: three stages `mtp.0..2` (dsv4-model.md 5.9).

  taps     the main tower's streams after each layer of dspark_target_layer_ids, averaged over
           the 4 streams and concatenated: [T, 3d] (Transformer.hidden keeps them in `taps`)
  main_x   main_norm(main_proj(taps)) (stage 0's weights), one vector per target position
  rings    stage s keeps main_kv_s(t) = RoPE_t(kv_norm_s(wkv_s(main_x_t))) in its cache layer
           (num_hidden_layers + s: W + K rows per slot, by position); `context` writes them for
           every row of every forward, so after a verify step the accepted rows are there (rows
           past the accepted ones sit at later positions: never read, rewritten later)
  block    after position p with x_{p+1}: tokens [x_{p+1}, n, n, n, n] (n = the noise token) at
           positions p+1 .. p+5, X = the 4 streams of their embeddings; each stage is a V4
           block whose attention takes q and kv from the block rows and lets every block row
           see the stage's ring at positions p-W+1 .. p and all 5 block rows (non-causal), with
           the sink, inverse RoPE, wo_a / wo_b; then hc_post and the stage's MoE
  head     hd = hc_head(X) (the last stage's), base = head(norm(hd)) FP32 for the 5 rows; then
           row by row: out_0 = x_{p+1}, m_i = markov_w1[out_i], logits_i = base_i + markov_w2 m_i,
           out_{i+1} = pick(logits_i), confidence_i = proj · [hd_i, m_i] (a raw logit)
Draft i (i < k <= 5) is out_{i+1}: the token at p + 2 + i.
"""

from __future__ import annotations

import torch
from torch import nn

from backfit.config import ModelConfig
from backfit.runtime.layers import Linear, RMSNorm
from backfit.runtime.model.block import Block
from backfit.runtime.model.draft.common import Draft, DraftRows, pick
from backfit.runtime.model.hyper import add_hc_buffers, hc_head

__all__ = ["DSparkDrafter", "DSparkStage"]


class DSparkStage(Block):
    """One DSpark stage: a window-only V4 block (scored router) plus, on the first stage, the
    taps' projection and, on the last, the head parts (checkpoint names `mtp.{s}.*`)."""

    def __init__(self, cfg: ModelConfig, first: bool, last: bool):
        super().__init__(cfg, ratio=0, hashed=False)
        d, r = cfg.hidden_size, cfg.dspark_markov_rank
        if first:
            self.main_proj = Linear(len(cfg.dspark_target_layer_ids) * d, d)
            self.main_norm = RMSNorm(d, cfg.rms_norm_eps)
        if last:
            self.norm = RMSNorm(d, cfg.rms_norm_eps)
            add_hc_buffers(self, "hc_head", cfg.hc_mult, cfg.hc_mult, d)
            self.markov_head = nn.Module()
            self.markov_head.markov_w1 = Linear(r, cfg.vocab_size)   # an embedding [V, r]
            self.markov_head.markov_w2 = Linear(r, cfg.vocab_size)   # a head [V, r]
            self.confidence_head = nn.Module()
            self.confidence_head.proj = Linear(d + r, 1)


def _block_attention(attn, q: torch.Tensor, kv: torch.Tensor, ring: torch.Tensor,
                     valid: torch.Tensor) -> torch.Tensor:
    """q [S, B, Hl, D], kv [S, B, D] of the block rows, ring [S, W, D] with valid [S, W] ->
    o [S, B, Hl, D] FP32, rotated: every block row over its sequence's valid ring rows and all
    B block rows (non-causal), the sink in the denominator. No host data (CUDA-graph safe)."""
    S, B = q.shape[:2]
    keys = torch.cat((ring.to(kv.dtype), kv), 1).float()                     # [S, W + B, D]
    ok = torch.cat((valid, torch.ones(S, B, dtype=torch.bool, device=q.device)), 1)
    s = torch.einsum("sbhd,skd->sbhk", q.float(), keys) * attn.scale
    s = s.masked_fill(~ok[:, None, None, :], float("-inf"))
    sink = attn.attn_sink.view(1, 1, -1, 1).expand(S, B, -1, 1)
    p = torch.softmax(torch.cat((s, sink), -1), -1)[..., :-1]
    return torch.einsum("sbhk,skd->sbhd", p, keys)


class DSparkDrafter:
    """DSpark over the runner's PagedCache (see the module notes)."""

    def __init__(self, model, cache):
        cfg = model.cfg
        self.model, self.cache, self.stages = model, cache, list(model.mtp)
        self.layers = [cfg.num_hidden_layers + s for s in range(len(self.stages))]
        self.block = cfg.dspark_block_size
        self.noise = cfg.dspark_noise_token_id
        self.window = cfg.sliding_window
        self.needs_streams = False

    def context(self, X_prev, taps: torch.Tensor, tokens, pos: torch.Tensor,
                slots: torch.Tensor) -> None:
        """Every stage's ring rows of a forward's rows: taps [n, n_t·d] at pos in slots (device
        tensors; X_prev, tokens: MTP's, unused)."""
        first = self.stages[0]
        main_x = first.main_norm(first.main_proj(taps))                        # [n, d]
        for stage, layer in zip(self.stages, self.layers):
            self.cache.store_ring(layer, slots, pos, stage.attn.kv(main_x, pos))

    @torch.no_grad()
    def draft(self, rows: DraftRows, X_last=None) -> Draft:
        """The block after each sequence's p -> its k drafts (X_last: MTP's, unused)."""
        model, B, W = self.model, self.block, self.window
        S, dev = rows.tokens.shape[0], rows.tokens.device
        if not 1 <= rows.k <= B:
            raise ValueError(f"DSpark drafts 1..{B} tokens a step, asked for {rows.k}")
        noise = torch.full((S, B - 1), self.noise, dtype=torch.int64, device=dev)
        tokens = torch.cat((rows.tokens[:, None].long(), noise), 1).flatten()   # [S·B]
        ar = torch.arange(B, device=dev)
        pos = (rows.last[:, None] + 1 + ar[None]).flatten()                     # p+1 .. p+B
        ring_pos = rows.last[:, None] - W + 1 + torch.arange(W, device=dev)[None]   # [S, W]
        valid = ring_pos >= 0
        X = model.embed.streams(tokens, model.dtype, model.cfg.hc_mult)       # [S·B, 4, d]
        for stage, layer in zip(self.stages, self.layers):
            ring = self.cache.ring_rows(layer, rows.slots[:, None].expand(S, W),
                                        ring_pos.clamp(min=0))                 # [S, W, D]
            post, M, pre = stage.attn_in(X, pos)
            q, kv = pre[0], pre[1]
            o = _block_attention(stage.attn, q.view(S, B, *q.shape[1:]), kv.view(S, B, -1),
                                 ring, valid)
            X = stage.attn_out(X, o.flatten(0, 1), post, M, pos, tokens)
        last, c = self.stages[-1], model.cfg
        hd = hc_head(X, last.hc_head_fn, last.hc_head_scale, last.hc_head_base, c.hc_eps,
                     c.rms_norm_eps)                                            # [S·B, d]
        base = model.head(last.norm(hd)).view(S, B, -1)                        # FP32
        hd = hd.view(S, B, -1).float()
        w1, w2 = last.markov_head.markov_w1, last.markov_head.markov_w2
        proj = last.confidence_head.proj.weight.float()[0]                      # [d + r]
        out, ids, qs, ls, conf = rows.tokens.long(), [], [], [], []
        for i in range(rows.k):
            m = w1.weight.index_select(0, out).float()                         # [S, r]
            logits = base[:, i] + w2.forward_f32(m)                            # [S, V]
            conf.append(torch.cat((hd[:, i], m), -1) @ proj)
            out, q = pick(logits, rows, i)
            ids.append(out), qs.append(q), ls.append(logits)
        probs = None if qs[0] is None else torch.stack(qs, 1)
        return Draft(torch.stack(ids, 1), probs, torch.stack(ls, 1), torch.stack(conf, 1))
