"""The expected tensor inventory (name -> dtype, shape) of an original DeepSeek-V4 checkpoint.

Pure function of ModelConfig, following dsv4-model.md section 3 (and dsv4-vision.md section 3 for
a Vision-Exp config: the ViT, aligner and sentinel tensors, `ffn.gate.bias_vl` in every MoE gate,
`ffn.gate.bias` on the hash layers too). It is what the checkpoint generator writes and what the
converter validates a source against. No torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from backfit.config import ModelConfig

__all__ = ["TensorInfo", "expected_tensors", "DTYPE_BYTES", "shard_of", "shard_names",
           "VISION_PREFIXES", "is_vision_tensor"]

# top-level names of the vision side (dsv4-vision.md section 3): no `model.` prefix
VISION_PREFIXES = ("vision.", "aligner.", "image_")

DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1,
               "I32": 4, "I64": 8}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def _layer(t: dict, c: ModelConfig, p: str, ratio: int, hashed: bool) -> None:
    H, hc, B = c.hidden_size, c.hc_mult, c.fp8_block
    mix = (2 + hc) * hc

    def add(name, shape, dtype):
        t[name] = TensorInfo(dtype, tuple(shape))

    def fp8(name, o, i):
        add(name + ".weight", (o, i), "F8_E4M3")
        add(name + ".scale", (math.ceil(o / B), math.ceil(i / B)), "F8_E8M0")

    def fp4(name, o, i):
        add(name + ".weight", (o, i // 2), "I8")
        add(name + ".scale", (o, i // c.fp4_group), "F8_E8M0")

    add(f"{p}.attn_norm.weight", (H,), "BF16")
    add(f"{p}.ffn_norm.weight", (H,), "BF16")
    for b in ("attn", "ffn"):
        add(f"{p}.hc_{b}_fn", (mix, hc * H), "F32")
        add(f"{p}.hc_{b}_base", (mix,), "F32")
        add(f"{p}.hc_{b}_scale", (3,), "F32")
    a, NH, HD = f"{p}.attn", c.num_attention_heads, c.head_dim
    fp8(a + ".wq_a", c.q_lora_rank, H)
    add(a + ".q_norm.weight", (c.q_lora_rank,), "BF16")
    fp8(a + ".wq_b", NH * HD, c.q_lora_rank)
    fp8(a + ".wkv", HD, H)
    add(a + ".kv_norm.weight", (HD,), "BF16")
    add(a + ".attn_sink", (NH,), "F32")
    fp8(a + ".wo_a", c.o_groups * c.o_lora_rank, NH * HD // c.o_groups)
    fp8(a + ".wo_b", H, c.o_groups * c.o_lora_rank)
    if ratio:
        k = 2 if ratio == 4 else 1                        # CSA pools overlapping windows: 2x width
        add(a + ".compressor.wkv.weight", (k * HD, H), "BF16")
        add(a + ".compressor.wgate.weight", (k * HD, H), "BF16")
        add(a + ".compressor.ape", (ratio, k * HD), "F32")
        add(a + ".compressor.norm.weight", (HD,), "BF16")
    if ratio == 4:
        IH, IHD = c.index_n_heads, c.index_head_dim
        fp8(a + ".indexer.wq_b", IH * IHD, c.q_lora_rank)
        add(a + ".indexer.weights_proj.weight", (IH, H), "BF16")
        add(a + ".indexer.compressor.wkv.weight", (2 * IHD, H), "BF16")
        add(a + ".indexer.compressor.wgate.weight", (2 * IHD, H), "BF16")
        add(a + ".indexer.compressor.ape", (4, 2 * IHD), "F32")
        add(a + ".indexer.compressor.norm.weight", (IHD,), "BF16")
    f, E, I = f"{p}.ffn", c.n_routed_experts, c.moe_intermediate_size
    add(f + ".gate.weight", (E, H), "BF16")
    if hashed:
        add(f + ".gate.tid2eid", (c.vocab_size, c.num_experts_per_tok), "I64")
    if not hashed or c.vision:            # Vision-Exp hash layers carry an (unused) bias too
        add(f + ".gate.bias", (E,), "F32")
    if c.vision:                          # selection bias of image-block rows
        add(f + ".gate.bias_vl", (E,), "F32")
    fp8(f + ".shared_experts.w1", I, H)
    fp8(f + ".shared_experts.w3", I, H)
    fp8(f + ".shared_experts.w2", H, I)
    for e in range(E):
        fp4(f"{f}.experts.{e}.w1", I, H)
        fp4(f"{f}.experts.{e}.w3", I, H)
        fp4(f"{f}.experts.{e}.w2", H, I)


def _hc_head(t: dict, c: ModelConfig, p: str) -> None:
    t[p + "hc_head_fn"] = TensorInfo("F32", (c.hc_mult, c.hc_mult * c.hidden_size))
    t[p + "hc_head_base"] = TensorInfo("F32", (c.hc_mult,))
    t[p + "hc_head_scale"] = TensorInfo("F32", (1,))


def _vision(t: dict, c: ModelConfig) -> None:
    """ViT blocks, final norm, aligner and the four LM-space sentinels, all BF16."""
    v, H = c.vision, c.hidden_size
    D = v.dim

    def bf16(name, *shape):
        t[name] = TensorInfo("BF16", shape)

    bf16("vision.patch_embed.proj.weight", D, v.patch_dim)
    bf16("vision.patch_embed.proj.bias", D)
    for b in range(v.n_layers):
        p = f"vision.blocks.{b}."
        bf16(p + "norm1.weight", D)
        bf16(p + "attn.wqkv.weight", 3 * D, D)         # rows [q | k | v], heads contiguous
        bf16(p + "attn.wqkv.bias", 3 * D)
        bf16(p + "attn.wo.weight", D, D)
        bf16(p + "attn.wo.bias", D)
        bf16(p + "norm2.weight", D)
        bf16(p + "mlp.w1.weight", 2 * v.inter_dim, D)  # rows [gate | up], no bias
        bf16(p + "mlp.w2.weight", D, v.inter_dim)
    bf16("vision.norm.weight", D)
    bf16("aligner.w1.weight", H, v.aligner_dim)
    bf16("aligner.w1.bias", H)
    bf16("aligner.w2.weight", H, H)
    bf16("aligner.w2.bias", H)
    for s in ("image_start", "image_pad", "image_newline", "image_end"):
        bf16(s, H)


def is_vision_tensor(name: str) -> bool:
    """True for the tensors a Vision-Exp checkpoint adds (tower, aligner, sentinels, bias_vl)."""
    return name.startswith(VISION_PREFIXES) or name.endswith(".gate.bias_vl")


def expected_tensors(c: ModelConfig) -> dict[str, TensorInfo]:
    """Every tensor of the original checkpoint, in on-disk shard order."""
    t: dict[str, TensorInfo] = {}
    H, V = c.hidden_size, c.vocab_size
    t["embed.weight"] = TensorInfo("BF16", (V, H))
    for layer in range(c.num_hidden_layers):
        _layer(t, c, f"layers.{layer}", c.ratio(layer), c.is_hash_layer(layer))
    t["norm.weight"] = TensorInfo("BF16", (H,))
    t["head.weight"] = TensorInfo("BF16", (V, H))
    _hc_head(t, c, "")
    if c.vision:                                          # in the tail shard (shard_of)
        _vision(t, c)
    bf16 = lambda name, shape: t.__setitem__(name, TensorInfo("BF16", tuple(shape)))  # noqa: E731

    def fp8(name, o, i):
        t[name + ".weight"] = TensorInfo("F8_E4M3", (o, i))
        t[name + ".scale"] = TensorInfo("F8_E8M0", (math.ceil(o / c.fp8_block), math.ceil(i / c.fp8_block)))

    if c.variant == "flash":
        for s in range(c.num_mtp_stages):
            p = f"mtp.{s}"
            _layer(t, c, p, 0, False)
            bf16(p + ".norm.weight", (H,))
            _hc_head(t, c, p + ".")
            bf16(p + ".enorm.weight", (H,))
            bf16(p + ".hnorm.weight", (H,))
            fp8(p + ".e_proj", H, H)
            fp8(p + ".h_proj", H, H)
    else:
        for s in range(c.num_mtp_stages):
            _layer(t, c, f"mtp.{s}", 0, False)
        fp8("mtp.0.main_proj", H, len(c.dspark_target_layer_ids) * H)
        bf16("mtp.0.main_norm.weight", (H,))
        last = f"mtp.{c.num_mtp_stages - 1}"
        bf16(last + ".norm.weight", (H,))
        _hc_head(t, c, last + ".")
        bf16(last + ".markov_head.markov_w1.weight", (V, c.dspark_markov_rank))
        bf16(last + ".markov_head.markov_w2.weight", (V, c.dspark_markov_rank))
        bf16(last + ".confidence_head.proj.weight", (1, H + c.dspark_markov_rank))
    return t


def shard_of(name: str, c: ModelConfig) -> int:
    """1-based shard index of a tensor in the official layout: embed | one per layer | tail | mtp."""
    if name == "embed.weight":
        return 1
    head, _, rest = name.partition(".")
    if head == "layers":
        return int(rest.split(".", 1)[0]) + 2
    if head == "mtp":
        return c.num_hidden_layers + 3 + int(rest.split(".", 1)[0])
    return c.num_hidden_layers + 2                 # norm, head, hc_head_*, vision, aligner, image_*


def shard_names(c: ModelConfig) -> list[str]:
    n = c.num_hidden_layers + 2 + c.num_mtp_stages
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
