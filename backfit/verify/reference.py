"""Independent plain-torch DeepSeek-V4 forward on the ORIGINAL checkpoint (dsv4-model.md s5).

Weights are read and dequantized on the fly (FP8 128x128 blocks, MXFP4 1x32 groups) one layer at
a time: a layer's tensors are built when the layer runs over the whole sequence and dropped after,
and routed experts are dequantized one expert at a time. So a 160 GB checkpoint needs roughly one
layer of FP32 attention weights plus one expert in memory (plus, once a drafter ran, the
drafter blocks' non-expert weights, kept for the next draft).

    ref = Reference(ckpt_dir)                      # float32, no fake quant: the exact semantics
    out = ref.forward(tokens, capture=True)        # logits [S, V]; hidden (per layer); final
    mtp = ref.mtp_logits(tokens)                   # Flash mtp.0: row t predicts token t + 2
    p = splice([ids_a, prepare(png_bytes, ref.cfg.vision), ids_b], ref.cfg.vocab_size)
    out = ref.forward(p.ids, images=p.images)      # Vision-Exp image prompt (backfit.vision)

dtype=torch.bfloat16 rounds activations where DeepSeek's reference stores BF16 (router, mHC,
compressor pooling, norms and the head stay FP32); qat=True adds the section 4.5 fake-quant points.
Full-sequence causal prefill only.

Drafters (speculative decoding, shared/docs/spec-decoding.md). Notation: the prefix is tokens
x_0..x_p (n = p + 1 tokens), x_{p+1} = `next_token` is the token the target just chose after it.

    pre = ref.prefix(tokens)                       # main tower once over tokens [S] -> Prefix
    d = ref.mtp_draft(pre, next_token, k, tokens=None, length=None)      # Flash -> MTPDraft
    d = ref.dspark_draft(pre, next_token, tokens=None, length=None)      # 0731  -> DSparkDraft

`length` = n (default S): draft after tokens[:n], reusing the one tower run (it is causal), so
drafts at many prefix lengths of one long sequence cost one tower pass plus the drafter blocks.
A token sequence may be passed instead of a Prefix. `tokens` = the draft tokens to feed back
(teacher forcing, e.g. the runtime's sampled drafts); rows past len(tokens) continue greedily
(argmax). All logits are float32 [rows, V]; row j is the draft for position p + 2 + j, so a
k-token draft uses rows 0..k-1 (DSpark: k <= dspark_block_size).

MTPDraft(logits [k, V], tokens [k], positions [k]) -- Flash mtp.0 chained (vLLM semantics):
  row j = 0: input (X_p, x_{p+1}) at position p; its logits equal mtp_logits row p (-> d_1);
  row j >= 1: input (Y_{j-1}, d_j) at position p + j, Y_{j-1} = the MTP block's own output
    streams (before hc_head) of row j - 1, d_j = row j - 1's draft (argmax, or tokens[j - 1]);
  the MTP window at position q sees its own KV at positions (q - W, q], W = sliding_window:
    positions < p from the prefix's MTP pass (true X_t and true x_{t+1}), p .. q - 1 from the
    chain's earlier steps, q itself. KV gets the target's fake FP8 iff qat.
DSparkDraft(logits [B, V], base [B, V], confidence [B], tokens [B], hidden [B, H], positions [B])
  -- 0731 DSpark, B = dspark_block_size (5):
  taps = mean over the 4 streams of X AFTER each layer in dspark_target_layer_ids, concatenated;
  main_x_t = main_norm(main_proj(taps_t)) (mtp.0); stage s's ring = main_kv_s(t) =
  kv_norm_s(wkv_s(main_x_t)), RoPE at t, for t = max(0, p - W + 1) .. p (the last W target rows,
  W = sliding_window = 128 in the real model); block [x_{p+1}, n, n, n, n] (n =
  dspark_noise_token_id) at positions p + 1 .. p + B, each stage a V4 block whose attention lets
  every block row see every ring slot and every block row (non-causal); stages in order; then
  hd = hc_head(X) of the last stage, base = head(norm(hd)), the Markov loop and confidence of
  ref_drafters.markov_head. confidence is a raw logit: consumers apply sigmoid and a cumulative
  product along the block (spec-decoding.md 2). [U] draft KV precision: the ring and block KV get
  the target's KV fake FP8 (section 4.5 item 2) iff `dspark_kv_qat`, which defaults to `qat`
  (DeepSeek's 0731 model.py as read by third parties applies the same act_quant(kv, 64) to both,
  and vLLM stores draft KV through the target's own quantize path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from backfit.checkpoint import SafetensorsDir
from backfit.config import ModelConfig
from backfit.quant import dequant_fp8_block, dequant_mxfp4
from backfit.verify.ref_attention import attention
from backfit.verify.ref_blocks import MoEStats, Numerics, hc_head, hc_post, hc_pre, moe, rms_norm
from backfit.verify.ref_drafters import (
    DSparkDraft,
    MTPDraft,
    block_attention,
    block_kv,
    dspark_main_x,
    dspark_ring_kv,
    markov_head,
    mtp_input,
    window_attention,
)
from backfit.verify.ref_vision import ImageRows, embed_with_images

__all__ = ["DSparkDraft", "LayerParams", "MTPDraft", "Prefix", "Reference", "decoder_layer"]

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
                  stats: MoEStats | None = None, attn=None,
                  image: ImageRows | None = None) -> torch.Tensor:
    """One block (section 5.3) over the whole sequence: X [S, N, H] -> X' [S, N, H].

    attn(x [S, H] after attn_norm) -> [S, H] replaces the causal prefill attention (drafters);
    image: an image prompt's bias_vl rows and window bounds (ref_vision.py)."""
    eps = cfg.rms_norm_eps
    if attn is None:
        def attn(x):
            return attention(x, P, cfg, ratio, nx, image.window if image else None)
    u, post, M = hc_pre(X, P["hc_attn_fn"], P["hc_attn_base"], P["hc_attn_scale"], cfg)
    a = attn(rms_norm(u, P["attn_norm.weight"], eps))
    X = hc_post(a, X, post, M)
    u, post, M = hc_pre(X, P["hc_ffn_fn"], P["hc_ffn_base"], P["hc_ffn_scale"], cfg)
    f = moe(rms_norm(u, P["ffn_norm.weight"], eps), tokens, P, cfg, hashed, nx, stats,
            image.is_image if image else None)
    return hc_post(f, X, post, M)


@dataclass
class Prefix:
    """The main tower run once over `tokens`; drafts after any prefix length n <= S reuse it."""

    tokens: torch.Tensor                 # [S] long
    X: torch.Tensor                      # [S, N, H] main streams before hc_head
    taps: torch.Tensor | None            # [S, nT*H] DSpark main_hidden (0731), else None
    nx: Numerics                         # the numerics it was computed with
    cache: dict = field(default_factory=dict, repr=False)   # drafter context KV, built on use


class Reference:
    """FP32 (or BF16-at-reference-points) DeepSeek-V4 forward over an original-format checkpoint."""

    def __init__(self, ckpt_dir, dtype: torch.dtype = torch.float32, qat: bool = False,
                 device: str | torch.device = "cpu", dspark_kv_qat: bool | None = None):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
        self.dir = Path(ckpt_dir)
        self.cfg = ModelConfig.from_file(self.dir / "config.json")
        self.ckpt = SafetensorsDir(self.dir)
        self.device = torch.device(device)
        self.nx = Numerics(act=dtype, qat=qat)
        self.dspark_kv_qat = qat if dspark_kv_qat is None else dspark_kv_qat   # the [U] switch
        self.stats: MoEStats | None = None      # set to MoEStats() to count clamps / bias effects
        self._drafter: dict[str, LayerParams] = {}   # drafter blocks, kept between drafts

    def params(self, prefix: str) -> LayerParams:
        return LayerParams(self.ckpt, prefix, self.cfg, self.device)

    # ---- pieces shared by the main tower and the drafters -------------------------------------
    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [S] -> e [S, H] in the activation dtype (BF16 table read, indexed, dropped)."""
        return self.ckpt.read("embed.weight", self.device)[tokens].to(self.nx.act)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Normed hidden [S, H] -> FP32 logits [S, V] (head.weight upcast in chunks)."""
        head = self.ckpt.read("head.weight", self.device)                  # [V, H] BF16
        hf = h.float()
        return torch.cat([hf @ head[i:i + HEAD_CHUNK].float().T
                          for i in range(0, head.shape[0], HEAD_CHUNK)], dim=1)

    def _head(self, X: torch.Tensor, P: LayerParams,
              norm_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-head streams X [S, N, H] -> (post-norm hidden [S, H], FP32 logits [S, V])."""
        h = hc_head(X, P["hc_head_fn"], P["hc_head_base"], P["hc_head_scale"], self.cfg)
        h = rms_norm(h, norm_w, self.cfg.rms_norm_eps)
        return h, self._logits(h)

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
              taps: tuple[int, ...] = (), images=None) -> tuple[torch.Tensor, list, list]:
        """tokens [S] -> (pre-hc_head streams X [S, N, H], per-layer X list if capture,
        [mean over the streams of X after layer i, for i in taps] ([S, H] each)).
        images: the PreparedImages of an image prompt, in order (ref_vision.py)."""
        cfg, rows = self.cfg, None
        if images:
            e, rows = embed_with_images(self._embed, tokens, images, self.params, cfg, self.nx,
                                        self.device)
        else:
            e = self._embed(tokens)
        X = e.unsqueeze(1).repeat(1, cfg.hc_mult, 1)                    # [S, N, H], plain copies
        hidden, tapped = [], {}
        for layer in range(cfg.num_hidden_layers):
            P = self.params(f"layers.{layer}.")                           # built, used, dropped
            X = decoder_layer(X, tokens, P, cfg, cfg.ratio(layer), cfg.is_hash_layer(layer),
                              self.nx, self.stats, image=rows)
            del P
            if capture:
                hidden.append(X.clone())
            if layer in taps:                                             # AFTER the layer ran
                tapped[layer] = X.float().mean(dim=1).to(X.dtype)
        return X, hidden, [tapped[i] for i in taps]

    @torch.no_grad()
    def forward(self, tokens, capture: bool = False, images=None) -> dict:
        """tokens LongTensor [S] -> {'logits' [S, V] float32; with capture: 'hidden', 'final'}.

        images: for a Vision-Exp checkpoint, the PreparedImages of a prompt spliced by
        backfit.vision.splice (its .ids as tokens, its .images here)."""
        if images and self.cfg.vision is None:
            raise ValueError(f"{self.dir}: images given, but config.json has no vision tower")
        tokens = self._tokens(tokens, bool(images))
        X, hidden, _ = self.tower(tokens, capture, images=images)
        top = self.params("")
        final, logits = self._head(X, top, top["norm.weight"])
        out = {"logits": logits}
        if capture:
            out["hidden"], out["final"] = hidden, final
        return out

    # ---- Flash MTP block ------------------------------------------------------------------------
    def _need(self, variant: str, what: str) -> None:
        """The drafter `what` exists in this checkpoint (Flash: classic mtp.0; 0731: DSpark)."""
        c, kind = self.cfg, {"flash": "a Flash checkpoint with a classic mtp.0 block",
                             "0731": "a 0731 checkpoint with DSpark stages"}[variant]
        classic = "mtp.0.e_proj.weight" in self.ckpt.entries
        if c.variant != variant or classic != (variant == "flash"):
            raise ValueError(f"{what} needs {kind}; {self.dir} is {c.variant}")
        if any(c.compress_ratios[c.num_hidden_layers:]):
            raise ValueError(f"{self.dir / 'config.json'}: compress_ratios after the "
                             f"{c.num_hidden_layers} layers must be 0 (window-only drafter blocks)")

    @torch.no_grad()
    def mtp_logits(self, tokens, next_token: int | None = None) -> torch.Tensor:
        """Flash `mtp.0` (section 5.8): row t uses main-tower streams X_t (before hc_head) and
        token t+1 and predicts token t+2. Returns [S-1, V] float32, or [S, V] when `next_token`
        (the token after the last one, e.g. just sampled) is given."""
        self._need("flash", "mtp_logits")
        cfg = self.cfg
        tokens = self._tokens(tokens)
        X, _, _ = self.tower(tokens)
        nxt = tokens[1:]
        if next_token is not None:
            nxt = torch.cat([nxt, self._tokens([next_token])])
        n = nxt.numel()
        if n == 0:
            raise ValueError("mtp_logits needs at least 2 tokens (or next_token)")
        P = self.params("mtp.0.")
        Y = mtp_input(X[:n], self._embed(nxt), P, cfg, self.nx)            # [n, N, H]
        Y = decoder_layer(Y, nxt, P, cfg, 0, False, self.nx, self.stats)  # window only, scored
        _, logits = self._head(Y, P, P["norm.weight"])                     # own hc_head + norm
        return logits

    # ---- drafters (module docstring) -----------------------------------------------------------
    @torch.no_grad()
    def prefix(self, tokens) -> Prefix:
        """Run the main tower once over tokens [S] (with the DSpark taps on 0731)."""
        tokens = self._tokens(tokens)
        taps = self.cfg.dspark_target_layer_ids or ()
        X, _, tapped = self.tower(tokens, taps=taps)
        return Prefix(tokens, X, torch.cat(tapped, dim=-1) if taps else None, self.nx)

    def _draft_args(self, prefix, next_token: int, given, most: int,
                    length: int | None) -> tuple[Prefix, int, int, list[int]]:
        """-> (Prefix, p = last prefix position, x_{p+1}, given draft tokens), all checked."""
        pre = prefix if isinstance(prefix, Prefix) else self.prefix(prefix)
        if pre.nx != self.nx:
            raise ValueError(f"the Prefix was computed with other numerics ({pre.nx}) than this "
                             f"Reference's ({self.nx})")
        S = pre.tokens.numel()
        n = S if length is None else int(length)
        if not 1 <= n <= S:
            raise ValueError(f"length {n} outside 1..{S} (the Prefix's tokens)")
        given = [] if given is None or len(given) == 0 else self._tokens(given).tolist()
        if len(given) > most:
            raise ValueError(f"{len(given)} draft tokens given, at most {most}")
        return pre, n - 1, int(self._tokens([next_token])[0]), given

    def _draft_params(self, prefix: str) -> LayerParams:
        if prefix not in self._drafter:
            self._drafter[prefix] = self.params(prefix)
        return self._drafter[prefix]

    @torch.no_grad()
    def mtp_draft(self, prefix, next_token: int, k: int, tokens=None,
                  length: int | None = None) -> MTPDraft:
        """Flash mtp.0 chained k steps after tokens[:length] and x_{p+1} = next_token (module
        docstring). tokens: up to k draft tokens d_1.. to feed back instead of the argmax."""
        self._need("flash", "mtp_draft")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        pre, p, tok, given = self._draft_args(prefix, next_token, tokens, k, length)
        cfg, nx, dev = self.cfg, self.nx, self.device
        P = self._draft_params("mtp.0.")
        if "mtp_kv" not in pre.cache:     # row t = (X_t, x_{t+1}) at position t, t = 0..S-2
            S = pre.tokens.numel()
            Y = mtp_input(pre.X[:-1], self._embed(pre.tokens[1:]), P, cfg, nx)
            pre.cache["mtp_kv"] = block_kv(Y, torch.arange(S - 1, device=dev), P, cfg, nx, nx.qat)
        lo = max(0, p - cfg.sliding_window + 1)      # the oldest position step 1's window sees
        ctx, ctx_pos = pre.cache["mtp_kv"][lo:p], torch.arange(lo, p, device=dev)
        X, rows, out = pre.X[p:p + 1], [], []
        for j in range(k):                           # row at position p + j
            t = torch.tensor([tok], device=dev)
            Y = mtp_input(X, self._embed(t), P, cfg, nx)                    # [1, N, H]
            written: list[torch.Tensor] = []
            attn = window_attention(P, cfg, nx, p + j, ctx, ctx_pos, written)
            X = decoder_layer(Y, t, P, cfg, 0, False, nx, self.stats, attn=attn)   # fed back
            ctx = torch.cat([ctx, written[0].to(ctx.dtype)])
            ctx_pos = torch.cat([ctx_pos, torch.tensor([p + j], device=dev)])
            _, logits = self._head(X, P, P["norm.weight"])
            rows.append(logits[0])
            tok = given[j] if j < len(given) else int(logits[0].argmax())
            out.append(tok)
        return MTPDraft(torch.stack(rows), torch.tensor(out, device=dev),
                        torch.arange(p, p + k, device=dev))

    @torch.no_grad()
    def dspark_draft(self, prefix, next_token: int, tokens=None,
                     length: int | None = None) -> DSparkDraft:
        """0731 DSpark block after tokens[:length] and x_{p+1} = next_token (module docstring).
        tokens: up to dspark_block_size draft tokens out_1.. to feed the Markov loop instead of
        the argmax."""
        self._need("0731", "dspark_draft")
        cfg, nx, dev = self.cfg, self.nx, self.device
        B = cfg.dspark_block_size
        pre, p, tok, given = self._draft_args(prefix, next_token, tokens, B, length)
        stages = [self._draft_params(f"mtp.{s}.") for s in range(cfg.num_mtp_stages)]
        key = ("main_kv", self.dspark_kv_qat)         # per stage [S, D], target positions 0..S-1
        if key not in pre.cache:
            main_x = dspark_main_x(pre.taps, stages[0], cfg, nx)
            pre.cache[key] = [dspark_ring_kv(main_x, P, cfg, nx, self.dspark_kv_qat)
                              for P in stages]
        lo = max(0, p - cfg.sliding_window + 1)      # ring = the last W target rows lo..p
        block = torch.tensor([tok] + [cfg.dspark_noise_token_id] * (B - 1), device=dev)
        pos = torch.arange(p + 1, p + 1 + B, device=dev)                    # p + 1 .. p + B
        X = self._embed(block).unsqueeze(1).repeat(1, cfg.hc_mult, 1)     # [B, N, H]
        for P, main_kv in zip(stages, pre.cache[key]):                    # stages in order
            attn = block_attention(P, cfg, nx, pos, main_kv[lo:p + 1], self.dspark_kv_qat)
            X = decoder_layer(X, block, P, cfg, 0, False, nx, self.stats, attn=attn)
        last = stages[-1]
        hd = hc_head(X, last["hc_head_fn"], last["hc_head_base"], last["hc_head_scale"], cfg)
        base = self._logits(rms_norm(hd, last["norm.weight"], cfg.rms_norm_eps))   # [B, V]
        logits, confidence, out = markov_head(hd, base, last, tok, given)
        return DSparkDraft(logits, base, confidence, out, hd, pos)
