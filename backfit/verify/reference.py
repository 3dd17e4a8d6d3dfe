"""Independent plain-torch DeepSeek-V4 forward on the ORIGINAL checkpoint (dsv4-model.md s5).

Weights are read and dequantized on the fly (FP8 128x128 blocks, MXFP4 1x32 groups) one layer at
a time: a layer's tensors are built when the layer runs over the whole sequence and dropped after,
and routed experts are dequantized one expert at a time. So a 160 GB checkpoint needs roughly one
layer of FP32 attention weights plus one expert in memory.

    ref = Reference(ckpt_dir)                      # float32, no fake quant: the exact semantics
    out = ref.forward(tokens, capture=True)        # logits [S, V]; hidden (per layer); final
    mtp = ref.mtp_logits(tokens)                   # Flash mtp.0: row t predicts token t + 2
    p = splice([ids_a, prepare(png_bytes, ref.cfg.vision), ids_b], ref.cfg.vocab_size)
    out = ref.forward(p.ids, images=p.images)      # Vision-Exp image prompt (backfit.vision)

dtype=torch.bfloat16 rounds activations where DeepSeek's reference stores BF16 (router, mHC,
compressor pooling, norms and the head stay FP32); qat=True adds the section 4.5 fake-quant points.
Full-sequence causal prefill only.
"""

from __future__ import annotations

from pathlib import Path

import torch

from backfit.checkpoint import SafetensorsDir
from backfit.config import ModelConfig
from backfit.quant import dequant_fp8_block, dequant_mxfp4
from backfit.verify.ref_attention import attention
from backfit.verify.ref_blocks import MoEStats, Numerics, hc_head, hc_post, hc_pre, moe, rms_norm
from backfit.verify.ref_vision import ImageRows, embed_with_images

__all__ = ["LayerParams", "Reference", "decoder_layer"]

HEAD_CHUNK = 16384      # vocab rows of head.weight upcast to FP32 at a time


class LayerParams:
    """Lazy, dequantizing view of the tensors under one prefix (`layers.3.`, `mtp.0.`, or ``).

    P[name] -> tensor (FP8/FP4 weights dequantized to float32, BF16 upcast to float32, F32 and
    I64 as stored), cached for the life of this object; P.expert(e) -> (w1, w3, w2), not cached.
    """

    def __init__(self, ckpt: SafetensorsDir, prefix: str, cfg: ModelConfig, device: torch.device):
        self.ckpt, self.prefix, self.cfg, self.device = ckpt, prefix, cfg, device
        self._cache: dict[str, torch.Tensor] = {}

    def __contains__(self, name: str) -> bool:
        return self.prefix + name in self.ckpt.entries

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            self._cache[name] = self.load(name)
        return self._cache[name]

    def load(self, name: str) -> torch.Tensor:
        full = self.prefix + name
        entry = self.ckpt.entries[full]
        t = self.ckpt.read(full, self.device)
        if entry.dtype in ("F8_E4M3", "I8"):
            s = self.ckpt.read(full.removesuffix(".weight") + ".scale", self.device)
            if entry.dtype == "I8":                                      # packed e2m1, 1x32 scales
                return dequant_mxfp4(t, s, self.cfg.fp4_group)
            return dequant_fp8_block(t, s, self.cfg.fp8_block)           # e4m3, 128x128 scales
        if entry.dtype in ("BF16", "F16"):
            return t.float()
        return t                                                         # F32, I64 (tid2eid)

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Routed expert e: (w1 gate [I, H], w3 up [I, H], w2 down [H, I]) float32."""
        base = f"ffn.experts.{e}."
        return tuple(self.load(base + w + ".weight") for w in ("w1", "w3", "w2"))


def decoder_layer(X: torch.Tensor, tokens: torch.Tensor, P: LayerParams, cfg: ModelConfig,
                  ratio: int, hashed: bool, nx: Numerics,
                  stats: MoEStats | None = None, image: ImageRows | None = None) -> torch.Tensor:
    """One block (section 5.3) over the whole sequence: X [S, N, H] -> X' [S, N, H].
    image: an image prompt's bias_vl rows and window bounds (ref_vision.py)."""
    eps = cfg.rms_norm_eps
    u, post, M = hc_pre(X, P["hc_attn_fn"], P["hc_attn_base"], P["hc_attn_scale"], cfg)
    a = attention(rms_norm(u, P["attn_norm.weight"], eps), P, cfg, ratio, nx,
                  image.window if image else None)
    X = hc_post(a, X, post, M)
    u, post, M = hc_pre(X, P["hc_ffn_fn"], P["hc_ffn_base"], P["hc_ffn_scale"], cfg)
    f = moe(rms_norm(u, P["ffn_norm.weight"], eps), tokens, P, cfg, hashed, nx, stats,
            image.is_image if image else None)
    return hc_post(f, X, post, M)


class Reference:
    """FP32 (or BF16-at-reference-points) DeepSeek-V4 forward over an original-format checkpoint."""

    def __init__(self, ckpt_dir, dtype: torch.dtype = torch.float32, qat: bool = False,
                 device: str | torch.device = "cpu"):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
        self.dir = Path(ckpt_dir)
        self.cfg = ModelConfig.from_file(self.dir / "config.json")
        self.ckpt = SafetensorsDir(self.dir)
        self.device = torch.device(device)
        self.nx = Numerics(act=dtype, qat=qat)
        self.stats: MoEStats | None = None      # set to MoEStats() to count clamps / bias effects

    def params(self, prefix: str) -> LayerParams:
        return LayerParams(self.ckpt, prefix, self.cfg, self.device)

    # ---- pieces shared by the main tower and the MTP block -----------------------------------
    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [S] -> e [S, H] in the activation dtype (BF16 table read, indexed, dropped)."""
        return self.ckpt.read("embed.weight", self.device)[tokens].to(self.nx.act)

    def _head(self, X: torch.Tensor, P: LayerParams,
              norm_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-head streams X [S, N, H] -> (post-norm hidden [S, H], FP32 logits [S, V])."""
        h = hc_head(X, P["hc_head_fn"], P["hc_head_base"], P["hc_head_scale"], self.cfg)
        h = rms_norm(h, norm_w, self.cfg.rms_norm_eps)
        head = self.ckpt.read("head.weight", self.device)                  # [V, H] BF16
        hf = h.float()
        logits = torch.cat([hf @ head[i:i + HEAD_CHUNK].float().T          # FP32 head, chunked
                            for i in range(0, head.shape[0], HEAD_CHUNK)], dim=1)
        return h, logits

    def _tokens(self, tokens, images: bool = False) -> torch.Tensor:
        """ids [S]; with images, ids vocab_size + type (backfit.vision) mark image blocks."""
        t = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        if t.numel() == 0:
            raise ValueError("empty token sequence")
        top = self.cfg.vocab_size + (5 if images else 0)
        if int(t.max()) >= top or int(t.min()) < 0:
            raise ValueError(f"token id out of range [0, {top})")
        return t

    # ---- main tower -------------------------------------------------------------------------
    @torch.no_grad()
    def tower(self, tokens: torch.Tensor, capture: bool = False,
              images=None) -> tuple[torch.Tensor, list]:
        """tokens [S] -> (pre-hc_head streams X [S, N, H], per-layer X list if capture).
        images: the PreparedImages of an image prompt, in order (ref_vision.py)."""
        cfg, rows = self.cfg, None
        if images:
            e, rows = embed_with_images(self._embed, tokens, images, self.params, cfg, self.nx,
                                        self.device)
        else:
            e = self._embed(tokens)
        X = e.unsqueeze(1).repeat(1, cfg.hc_mult, 1)                    # [S, N, H], plain copies
        hidden = []
        for layer in range(cfg.num_hidden_layers):
            P = self.params(f"layers.{layer}.")                           # built, used, dropped
            X = decoder_layer(X, tokens, P, cfg, cfg.ratio(layer), cfg.is_hash_layer(layer),
                              self.nx, self.stats, rows)
            del P
            if capture:
                hidden.append(X.clone())
        return X, hidden

    @torch.no_grad()
    def forward(self, tokens, capture: bool = False, images=None) -> dict:
        """tokens LongTensor [S] -> {'logits' [S, V] float32; with capture: 'hidden', 'final'}.

        images: for a Vision-Exp checkpoint, the PreparedImages of a prompt spliced by
        backfit.vision.splice (its .ids as tokens, its .images here)."""
        if images and self.cfg.vision is None:
            raise ValueError(f"{self.dir}: images given, but config.json has no vision tower")
        tokens = self._tokens(tokens, bool(images))
        X, hidden = self.tower(tokens, capture, images)
        top = self.params("")
        final, logits = self._head(X, top, top["norm.weight"])
        out = {"logits": logits}
        if capture:
            out["hidden"], out["final"] = hidden, final
        return out

    # ---- Flash MTP block ------------------------------------------------------------------------
    @torch.no_grad()
    def mtp_logits(self, tokens, next_token: int | None = None) -> torch.Tensor:
        """Flash `mtp.0` (section 5.8): row t uses main-tower streams X_t (before hc_head) and
        token t+1 and predicts token t+2. Returns [S-1, V] float32, or [S, V] when `next_token`
        (the token after the last one, e.g. just sampled) is given."""
        cfg = self.cfg
        if cfg.variant != "flash" or "mtp.0.e_proj.weight" not in self.ckpt.entries:
            raise ValueError("mtp_logits needs a Flash checkpoint with a classic mtp.0 block")
        tokens = self._tokens(tokens)
        X, _ = self.tower(tokens)
        nxt = tokens[1:]
        if next_token is not None:
            nxt = torch.cat([nxt, self._tokens([next_token])])
        n = nxt.numel()
        if n == 0:
            raise ValueError("mtp_logits needs at least 2 tokens (or next_token)")
        P, eps, nx = self.params("mtp.0."), cfg.rms_norm_eps, self.nx
        e = rms_norm(self._embed(nxt), P["enorm.weight"], eps)             # [n, H]
        h = rms_norm(X[:n], P["hnorm.weight"], eps)                        # per stream [n, N, H]
        Y = nx.lin(e, P["e_proj.weight"]).unsqueeze(1) + nx.lin(h, P["h_proj.weight"])
        ratio = cfg.compress_ratios[cfg.num_hidden_layers]                  # 0: window only
        Y = decoder_layer(Y, nxt, P, cfg, ratio, False, nx, self.stats)    # scored router
        _, logits = self._head(Y, P, P["norm.weight"])                     # own hc_head + norm
        return logits
