"""ModelConfig: DeepSeek-V4 `config.json` parsed once into a frozen dataclass (no torch)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

__all__ = ["ModelConfig", "ConfigError", "VisionConfig", "VISION_KEYS"]


class ConfigError(ValueError):
    """config.json is missing, unreadable or inconsistent."""


# config.json key -> dataclass field (most keys are taken as they are)
_REQUIRED = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
    "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "n_routed_experts",
    "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size", "num_hash_layers",
    "index_n_heads", "index_head_dim", "index_topk", "sliding_window", "compress_ratios",
    "hc_mult", "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps", "rope_theta", "compress_rope_theta",
    "rope_scaling", "routed_scaling_factor", "swiglu_limit", "scoring_func",
)


# the 10 `vision_*` keys of DeepSeek-V4-Flash-Vision-Exp (dsv4-vision.md section 2), in order
VISION_KEYS = ("vision_n_layers", "vision_dim", "vision_n_heads", "vision_inter_dim",
               "vision_patch_size", "vision_rope_theta", "vision_downsample_ratio",
               "vision_max_n_token", "vision_min_pixels", "vision_max_wh_ratio")


@dataclass(frozen=True)
class VisionConfig:
    """The ViT + aligner of a Vision-Exp checkpoint (field = config key without `vision_`).

    norm_eps is not in config.json: the tower's RMSNorms hard-code 1e-6 whatever the LM's
    rms_norm_eps (1e-20 in Vision-Exp), dsv4-vision.md section 1.
    """

    n_layers: int
    dim: int
    n_heads: int
    inter_dim: int
    patch_size: int
    rope_theta: float
    downsample_ratio: int
    max_n_token: int
    min_pixels: int
    max_wh_ratio: int
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def patch_dim(self) -> int:
        """Flattened patch: 3 channels x patch x patch, channel-major (c, y, x)."""
        return 3 * self.patch_size ** 2

    @property
    def aligner_dim(self) -> int:
        """Aligner input: one ratio x ratio fold of ViT outputs, channel-major."""
        return self.dim * self.downsample_ratio ** 2

    @classmethod
    def from_dict(cls, d: dict, source: str) -> "VisionConfig | None":
        """None when vision_n_layers is absent or 0 (a text-only model), else all 10 keys."""
        if not d.get("vision_n_layers"):
            return None
        missing = [k for k in VISION_KEYS if k not in d]
        if missing:
            raise ConfigError(f"{source}: vision_n_layers > 0 but missing key(s) "
                              f"{', '.join(missing)}")
        v = cls(**{k.removeprefix("vision_"): d[k] for k in VISION_KEYS})
        if v.dim % v.n_heads or v.head_dim % 4:
            raise ConfigError(f"{source}: vision_dim / vision_n_heads must be a multiple of 4 "
                              f"(2-D RoPE: half the head per axis, in pairs)")
        if v.patch_size < 1 or v.downsample_ratio < 1 or v.max_wh_ratio < 1:
            raise ConfigError(f"{source}: vision_patch_size, vision_downsample_ratio and "
                              f"vision_max_wh_ratio must be positive")
        if v.max_n_token < 16:           # the budget search needs max_n_token - 3 >= 8
            raise ConfigError(f"{source}: vision_max_n_token {v.max_n_token} is below 16")
        return v


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    num_hash_layers: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: dict = field(hash=False)
    routed_scaling_factor: float
    swiglu_limit: float
    scoring_func: str
    bos_token_id: int = 0
    eos_token_id: int = 1
    fp8_block: int = 128
    fp4_group: int = 32
    dspark_block_size: int | None = None
    dspark_noise_token_id: int | None = None
    dspark_target_layer_ids: tuple[int, ...] | None = None
    dspark_markov_rank: int | None = None
    vision: VisionConfig | None = None       # None: text-only (vision_n_layers absent or 0)

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise ConfigError(f"{source}: missing key(s) {', '.join(missing)}")
        kw = {k: d[k] for k in cls.__dataclass_fields__ if k in d and k != "vision"}
        kw["vision"] = VisionConfig.from_dict(d, source)
        kw["compress_ratios"] = tuple(int(r) for r in d["compress_ratios"])
        if d.get("dspark_target_layer_ids") is not None:
            kw["dspark_target_layer_ids"] = tuple(d["dspark_target_layer_ids"])
        q = d.get("quantization_config") or {}
        if q:
            if q.get("fmt") != "e4m3" or q.get("scale_fmt") != "ue8m0":
                raise ConfigError(f"{source}: quantization_config must be e4m3 with ue8m0 scales, got {q}")
            bn, bk = q.get("weight_block_size", [128, 128])
            if bn != bk:
                raise ConfigError(f"{source}: non-square weight_block_size {q['weight_block_size']}")
            kw["fp8_block"] = int(bn)
        if d.get("expert_dtype", "fp4") != "fp4":
            raise ConfigError(f"{source}: expert_dtype {d['expert_dtype']!r} is not supported (need fp4)")
        cfg = cls(**kw)
        cfg._check(source)
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d, str(path))

    def _check(self, source: str) -> None:
        n = len(self.compress_ratios)
        if n < self.num_hidden_layers + 1:
            raise ConfigError(f"{source}: compress_ratios has {n} entries, need at least "
                              f"num_hidden_layers + 1 = {self.num_hidden_layers + 1}")
        if any(r not in (0, 4) and r < 8 for r in self.compress_ratios):
            raise ConfigError(f"{source}: compress_ratios values must be 0, 4 or >= 8")
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(f"{source}: num_attention_heads not divisible by o_groups")
        if self.head_dim <= self.qk_rope_head_dim:
            raise ConfigError(f"{source}: head_dim must exceed qk_rope_head_dim")

    # ---- derived layer schedule -------------------------------------------------------------
    @property
    def variant(self) -> str:
        """'0731' when DSpark keys are present, else 'flash'."""
        return "0731" if self.dspark_block_size is not None else "flash"

    @cached_property
    def num_mtp_stages(self) -> int:
        """Flash: 1 classic MTP block; 0731: one DSpark stage per extra compress_ratios entry."""
        return len(self.compress_ratios) - self.num_hidden_layers

    def ratio(self, layer: int) -> int:
        """Compression ratio of main layer `layer` (0 = window only, 4 = CSA, other = HCA)."""
        return self.compress_ratios[layer]

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim
