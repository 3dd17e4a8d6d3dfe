"""Our inventory rules at full DeepSeek-V4-Flash size, without allocating a single tensor."""

import importlib.util
import json
import math

import pytest

from backfit.config import ModelConfig
from backfit.inventory import TensorInfo, expected_tensors, shard_names, shard_of

from support import SHARED

PUBLISHED = {"flash": (69187, 159_609_485_896, 46), "0731": (72317, 166_878_536_440, 48)}


FLASH_DIMS = dict(hidden_size=4096, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64,
                  q_lora_rank=1024, o_groups=8, o_lora_rank=1024, n_routed_experts=256,
                  num_experts_per_tok=6, moe_intermediate_size=2048, index_n_heads=64,
                  index_head_dim=128, index_topk=512, sliding_window=128,
                  main_ratios=[0, 0] + [4, 128] * 20 + [4])


def _config(variant):
    """The published config from shared/ when present, else the same values written by us."""
    name = "deepseek-v4-flash.json" if variant == "flash" else "deepseek-v4-flash-0731.json"
    path = SHARED / "tools" / "configs" / name
    if path.exists():
        return ModelConfig.from_file(path)
    from backfit.synthetic import tiny_config_dict
    d = tiny_config_dict(variant, **FLASH_DIMS)
    if variant == "0731":
        d.update(dspark_target_layer_ids=[40, 41, 42], dspark_markov_rank=256)
    return ModelConfig.from_dict(d)


@pytest.mark.parametrize("variant", ["flash", "0731"])
def test_full_size_inventory_matches_published_totals(variant):
    cfg = _config(variant)
    inv = expected_tensors(cfg)
    n, total, shards = PUBLISHED[variant]
    assert cfg.variant == variant
    assert len(inv) == n
    assert sum(t.nbytes for t in inv.values()) == total
    assert len(shard_names(cfg)) == shards


@pytest.mark.parametrize("variant", ["flash", "0731"])
def test_full_size_inventory_matches_shared_tool(variant):
    tool = SHARED / "tools" / "dsv4_inventory.py"
    if not tool.exists():
        pytest.skip("shared inventory tool not available")
    spec = importlib.util.spec_from_file_location("dsv4_inventory", tool)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ref = mod.inventory(mod.FLASH, variant)
    ours = expected_tensors(_config(variant))
    assert list(ours) == list(ref)                                  # same names, same order
    for name, (dtype, shape) in ref.items():
        assert (ours[name].dtype, ours[name].shape) == (dtype, tuple(shape)), name


def test_builtin_flash_dims_equal_the_published_config():
    path = SHARED / "tools" / "configs" / "deepseek-v4-flash.json"
    if not path.exists():
        pytest.skip("shared configs not available")
    from backfit.synthetic import tiny_config_dict
    assert tiny_config_dict("flash", **FLASH_DIMS) == json.loads(path.read_text())


def test_full_size_shard_layout():
    cfg = _config("flash")
    inv = expected_tensors(cfg)
    by_shard = {}
    for name in inv:
        by_shard.setdefault(shard_of(name, cfg), []).append(name)
    assert by_shard[1] == ["embed.weight"]
    assert all(n.startswith("layers.0.") for n in by_shard[2])
    assert all(n.startswith("layers.42.") for n in by_shard[44])
    assert sorted(by_shard[45]) == ["hc_head_base", "hc_head_fn", "hc_head_scale", "head.weight",
                                    "norm.weight"]
    assert all(n.startswith("mtp.0.") for n in by_shard[46]) and len(by_shard[46]) == 1575
    # per-layer tensor counts of the published index: hash ratio-0, ratio-4, ratio-128
    assert [len(by_shard[i]) for i in (2, 4, 5)] == [1565, 1576, 1569]
    # shard 1 size: 8-byte prefix + 88-byte header + payload
    assert inv["embed.weight"].nbytes == 1_059_061_760


def test_published_config_key_set_is_what_we_parse():
    raw = json.loads((SHARED / "tools" / "configs" / "deepseek-v4-flash.json").read_text()) \
        if (SHARED / "tools" / "configs").exists() else pytest.skip("no shared configs")
    cfg = ModelConfig.from_dict(raw)
    assert cfg.num_mtp_stages == 1 and [cfg.ratio(i) for i in range(4)] == [0, 0, 4, 128]
    assert cfg.is_hash_layer(2) and not cfg.is_hash_layer(3)


def _vision_config():
    """Vision-Exp = the 0731 config + the section 1 diff (3 next-n layers, eps 1e-20, vision_*)."""
    from backfit.synthetic_vision import REAL_VISION
    path = SHARED / "tools" / "configs" / "deepseek-v4-flash-0731.json"
    if path.exists():
        raw = json.loads(path.read_text())
    else:
        from backfit.synthetic import tiny_config_dict
        raw = tiny_config_dict("0731", **FLASH_DIMS)
        raw.update(dspark_target_layer_ids=[40, 41, 42], dspark_markov_rank=256)
    raw.update(num_nextn_predict_layers=3, rms_norm_eps=1e-20, **REAL_VISION)
    return ModelConfig.from_dict(raw)


def test_full_size_vision_inventory_matches_the_spec():
    """dsv4-vision.md section 3: 0731's 72,317 tensors + 316 = 72,633 in the same 48 shards;
    167,811,372,792 bytes; the vision side by kind and its 466,393,088 parameters."""
    cfg, plain = _vision_config(), _config("0731")
    inv, base = expected_tensors(cfg), expected_tensors(plain)
    assert cfg.vision.n_layers == 32 and cfg.rms_norm_eps == 1e-20 and cfg.variant == "0731"
    assert len(inv) == 72_633 and len(shard_names(cfg)) == 48
    assert sum(t.nbytes for t in inv.values()) == 167_811_372_792
    extra = {n: t for n, t in inv.items() if n not in base}
    assert set(base) <= set(inv) and all(inv[n] == base[n] for n in base)
    kinds = {}
    for n in extra:
        k = ("bias_vl" if n.endswith("bias_vl") else "hash bias" if n.endswith("gate.bias")
             else n.split(".")[0] if "." in n else "image_*")
        kinds[k] = kinds.get(k, 0) + 1
    assert kinds == {"vision": 259, "aligner": 4, "image_*": 4, "bias_vl": 46, "hash bias": 3}
    lm = [n for n in extra if n.startswith(("layers", "mtp"))]
    tower = [n for n in extra if n not in lm]
    assert sum(math.prod(extra[n].shape) for n in tower) == 466_393_088
    assert all(extra[n].dtype == "BF16" for n in tower)
    assert all(extra[n] == TensorInfo("F32", (256,)) for n in lm)
    assert {n.split(".ffn")[0] for n in extra if n.endswith("gate.bias")} == \
        {"layers.0", "layers.1", "layers.2"}
    # the fused layouts of section 3
    assert inv["vision.blocks.31.attn.wqkv.weight"].shape == (3072, 1024)
    assert inv["vision.blocks.0.mlp.w1.weight"].shape == (5632, 1024)
    assert inv["vision.patch_embed.proj.weight"].shape == (1024, 588)
    assert inv["aligner.w1.weight"].shape == (4096, 9216)


def test_vision_keys_switch_on_vision_n_layers():
    from backfit.config import ConfigError
    from backfit.synthetic import tiny_config_dict
    raw = tiny_config_dict("vision")
    assert ModelConfig.from_dict(raw).vision.norm_eps == 1e-6       # the tower's own eps
    assert ModelConfig.from_dict(dict(raw, vision_n_layers=0)).vision is None
    del raw["vision_patch_size"]
    with pytest.raises(ConfigError, match="missing key.*vision_patch_size"):
        ModelConfig.from_dict(raw)
