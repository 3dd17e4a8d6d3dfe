"""DeepSeek-V4 transformer: embed -> 4 streams -> blocks (mHC around attention and MoE) ->
hc_head collapse -> norm -> head. dsv4-model.md 5.1-5.7.

Vision-Exp (cfg.vision): the image tower `vision` + `aligner` and the four sentinels `image_*`
(runtime.model.vision) are part of the model; a batch with images (ForwardBatch.images,
runtime/images.py) has its image-block rows (ids >= vocab_size, never used to index the
embedding) overwritten by the sentinels and aligner rows before the hc expansion
(dsv4-vision.md section 10).

forward(batch, cache) runs any mix of prefill chunks and decode steps: each sequence's chunk
continues its cache entry (DecodeState or the paged pools; none = one full-sequence forward). Logits are FP32
over the full vocabulary (all-gathered across ranks), for every token or each sequence's last.
"""

from __future__ import annotations

import torch
from torch import nn

from backfit.config import ModelConfig
from backfit.runtime.batch import ForwardBatch
from backfit.runtime.layers import ParallelHead, RMSNorm, VocabParallelEmbedding
from backfit.runtime.model.block import Block
from backfit.runtime.model.draft import build_drafter
from backfit.runtime.model.hyper import add_hc_buffers, decode_kernels, hc_head
from backfit.runtime.state import DecodeState

__all__ = ["Transformer"]


class Transformer(nn.Module):
    """The main tower, and with mtp=True the checkpoint's drafter blocks under `mtp` (Flash: the
    MTP block mtp.0; 0731: the three DSpark stages mtp.0..2; runtime.model.draft)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, mtp: bool = True):
        super().__init__()
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"activation dtype must be float32 or bfloat16, got {dtype}")
        self.cfg, self.dtype = cfg, dtype
        d, S = cfg.hidden_size, cfg.hc_mult
        self.embed = VocabParallelEmbedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(Block(cfg, cfg.ratio(i), cfg.is_hash_layer(i))
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = ParallelHead(d, cfg.vocab_size)
        add_hc_buffers(self, "hc_head", S, S, d)
        if cfg.vision is not None:                # replicated on every rank, BF16 as on disk
            from backfit.runtime.model.vision import Aligner, VisionTower, add_sentinels
            self.vision = VisionTower(cfg.vision)
            self.aligner = Aligner(cfg.vision, d)
            add_sentinels(self, cfg)
        # checkpoint prefixes this model deliberately does not hold (the loader reports them)
        self.skipped_prefixes: tuple[str, ...] = ()
        self._head_part = None    # (streams, their hc_head partials) of the last hidden()
        self.mtp = build_drafter(cfg) if mtp else nn.ModuleList()
        if cfg.num_mtp_stages and not len(self.mtp):
            self.skipped_prefixes = ("mtp.",)
        # DSpark's taps: the mean over the streams after these layers, kept by hidden() as
        # `taps` [T, n·d] for the drafter's context pass (None when no DSpark stages)
        self.tap_layers = tuple(cfg.dspark_target_layer_ids or ()) if len(self.mtp) and \
            cfg.variant == "0731" else ()
        self.taps: torch.Tensor | None = None

    def prepare_kernels(self) -> None:
        """Post-load step of the triton path (after load_model): every layer's fused projections
        and stacked experts (Attention / MoE.prepare_kernels); the weights become views."""
        for layer in (*self.layers, *self.mtp):         # the drafter's blocks too
            layer.attn.prepare_kernels()
            layer.ffn.prepare_kernels()

    def new_state(self, device: str | torch.device | None = None) -> DecodeState:
        device = device if device is not None else self.embed.weight.device
        return DecodeState(self.cfg, self.dtype, device, mtp_layers=len(self.mtp))

    def hidden(self, batch: ForwardBatch, cache=None) -> torch.Tensor:
        """Streams after the last block (before hc_head): [T, hc_mult, d]; advances the cache.

        cache: a DecodeState or the engine's PagedCache (anything with bind(batch)); None = a
        fresh DecodeState (one full-sequence forward).
        """
        cache = cache if cache is not None else self.new_state()
        bound = cache.bind(batch)
        X = self.embed_streams(batch)                                   # [T, 4, d]: copies
        # mhc_decode path: each layer's last hc_post also computes the next layer's hc_attn
        # partials (carried in hc), the last layer's those of hc_head, kept with the streams in
        # _head_part for logits(X) of this very X; the torch path and prefill ignore hc
        k = decode_kernels(X)
        hc = {"part": None, "u": None} if k is not None else None
        n, taps = len(self.layers), []
        for i, layer in enumerate(self.layers):
            if hc is not None:
                nxt = self.layers[i + 1] if i + 1 < n else None
                hc["next_fn"] = nxt.hc_attn_fn if nxt is not None else self.hc_head_fn
                hc["next_pre"] = nxt.pre_args(k, "attn") if nxt is not None else None
            X = layer(X, batch, bound.layer(i), hc=hc)
            if i in self.tap_layers:
                taps.append(X.float().mean(1).to(X.dtype))             # [T, d]
        self.taps = torch.cat(taps, -1) if taps else None
        self._head_part = (X, hc["part"]) if hc is not None else None
        bound.commit()
        return X

    def embed_streams(self, batch: ForwardBatch) -> torch.Tensor:
        """The batch's embedding as the hc_mult streams [T, S, d]; with images (batch.images)
        the image-block rows are looked up at id 0 and then overwritten by their rows."""
        img = batch.images
        if img is None:
            return self.embed.streams(batch.tokens, self.dtype, self.cfg.hc_mult)
        ids = batch.tokens.masked_fill(batch.tokens >= self.cfg.vocab_size, 0)
        X = self.embed.streams(ids, self.dtype, self.cfg.hc_mult)
        X[img.at] = img.rows.to(X.dtype)[:, None, :].expand(-1, X.shape[1], -1)
        return X

    def piece(self, i: int, X, o, carry, tokens: torch.Tensor, pos: torch.Tensor):
        """Piece i (0 .. L) of a prefill / mixed forward in runtime/prefill_graphs.py's split,
        cache-free: piece 0 embeds the tokens, piece i > 0 finishes layer i-1 from its
        attention core's o (attn_out, with carry = its hc_attn (post, M)); every piece but the
        last then starts layer i (attn_in) -> (X, carry, attn.pre's tensors); the last returns
        (X, None, None). hidden() for such a batch is these pieces with each layer's attn.core
        between them (the same calls in the same order)."""
        if i == 0:
            X = self.embed.streams(tokens, self.dtype, self.cfg.hc_mult)       # [T, S, d]
            #   (image steps never come here: the runner runs them eagerly)
        else:
            X = self.layers[i - 1].attn_out(X, o, *carry, pos, tokens)
        if i == len(self.layers):
            return X, None, None
        post, M, pre = self.layers[i].attn_in(X, pos)
        return X, (post, M), pre

    def logits(self, X: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Streams [T, hc_mult, d] -> FP32 logits [T, vocab], or [n, vocab] of rows [n] (int64,
        on X's device) only. Pass rows rather than X[rows]: the hc_head partials of an X straight
        from hidden (carried by its last hc_post) are gathered with it, so every path (graph,
        eager, any rows) runs the same one-launch head and gives the same bits."""
        c = self.cfg
        hp = getattr(self, "_head_part", None)
        part = hp[1] if hp is not None and hp[0] is X else None       # X straight from hidden
        if rows is not None:
            X, part = X[rows], (part[rows] if part is not None else None)
        if (k := decode_kernels(X)) is not None:      # hc_head + norm: 1 launch (2 without part)
            return self.head(k.hc_head(X, self.hc_head_fn, self.hc_head_scale, self.hc_head_base,
                                       c.hc_eps, c.rms_norm_eps, part=part,
                                       norm=(self.norm.weight, self.norm.eps)))
        h = hc_head(X, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, c.hc_eps, c.rms_norm_eps)
        return self.head(self.norm(h))

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, cache=None, last_only: bool = False) -> torch.Tensor:
        """-> logits [T, vocab] (every token) or [num_seqs, vocab] (last token of each sequence)."""
        X = self.hidden(batch, cache)
        every = not last_only or len(batch.seq_lens) == X.shape[0]
        return self.logits(X, None if every else batch.last_rows())
