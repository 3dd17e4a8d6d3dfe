"""The tiny checkpoint is in the exact original on-disk format and has realistic statistics."""

import json
import struct

import pytest
import torch
from safetensors import safe_open
from support import SHARED

from backfit.checkpoint import SafetensorsDir
from backfit.config import ModelConfig
from backfit.inventory import expected_tensors, shard_names, shard_of
from backfit.quant import dequant_fp8_block
from backfit.synthetic import tiny_config_dict, write_checkpoint


def _check_format(root):
    cfg = ModelConfig.from_file(root / "config.json")
    inv = expected_tensors(cfg)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in inv.values())
    names = shard_names(cfg)
    assert index["weight_map"] == {n: names[shard_of(n, cfg) - 1] for n in inv}
    assert sorted(p.name for p in root.glob("*.safetensors")) == names
    src = SafetensorsDir(root)
    assert set(src.entries) == set(inv)
    for name, info in inv.items():
        assert (src.entries[name].dtype, src.entries[name].shape) == (info.dtype, info.shape), name
    # readable by the real safetensors library, with its float8 dtypes
    with safe_open(root / names[2], framework="pt") as f:
        t = f.get_tensor("layers.1.attn.wq_a.weight")
        assert t.dtype == torch.float8_e4m3fn
        assert f.get_tensor("layers.1.attn.wq_a.scale").dtype == torch.float8_e8m0fnu
        assert f.get_tensor("layers.1.ffn.experts.0.w1.weight").dtype == torch.int8
        assert f.metadata() == {"format": "pt"}
    return cfg, src


def test_flash_format(tiny_flash):
    cfg, src = _check_format(tiny_flash)
    assert cfg.variant == "flash" and cfg.num_mtp_stages == 1
    assert [cfg.ratio(i) for i in range(cfg.num_hidden_layers)] == [0, 0, 4, 8, 4, 8]
    assert "layers.2.ffn.gate.tid2eid" in src.entries and "layers.3.ffn.gate.bias" in src.entries
    assert "layers.2.attn.indexer.wq_b.weight" in src.entries
    assert cfg.index_n_heads >= 16 and cfg.sliding_window == 16


def test_0731_format(tiny_0731):
    cfg, src = _check_format(tiny_0731)
    assert cfg.variant == "0731" and cfg.num_mtp_stages == 3
    # the DSpark extras of dsv4-model.md 3.5 at the tiny dims, written out here (not derived from
    # inventory.py): main_proj/main_norm on the first stage, head machinery on the last only
    H, V, r, B = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank, cfg.fp8_block
    extras = {"mtp.0.main_proj.weight": ("F8_E4M3", (H, 3 * H)),
              "mtp.0.main_proj.scale": ("F8_E8M0", (H // B, 3 * H // B)),
              "mtp.0.main_norm.weight": ("BF16", (H,)), "mtp.2.norm.weight": ("BF16", (H,)),
              "mtp.2.hc_head_fn": ("F32", (4, 4 * H)), "mtp.2.hc_head_base": ("F32", (4,)),
              "mtp.2.hc_head_scale": ("F32", (1,)),
              "mtp.2.markov_head.markov_w1.weight": ("BF16", (V, r)),
              "mtp.2.markov_head.markov_w2.weight": ("BF16", (V, r)),
              "mtp.2.confidence_head.proj.weight": ("BF16", (1, H + r))}
    for name, want in extras.items():
        assert (src.entries[name].dtype, src.entries[name].shape) == want, name
    # a stage = a window-only layer (layers.1) with a scored router (bias, not tid2eid)
    per_layer = {n.split(".", 2)[2] for n in src.entries if n.startswith("layers.1.")}
    per_layer = per_layer - {"ffn.gate.tid2eid"} | {"ffn.gate.bias"}
    for s in range(3):                                      # each stage: its extras, nothing else
        own = {n.split(".", 2)[2] for n in extras if n.startswith(f"mtp.{s}.")}
        rest = {n.split(".", 2)[2] for n in src.entries if n.startswith(f"mtp.{s}.")}
        assert rest == per_layer | own, s


def test_config_has_real_key_set():
    real = SHARED / "tools" / "configs"
    if not real.exists():
        pytest.skip("shared configs not available")
    for variant, name in (("flash", "deepseek-v4-flash.json"), ("0731", "deepseek-v4-flash-0731.json")):
        ours = tiny_config_dict(variant)
        ref = json.loads((real / name).read_text())
        assert list(ours) == list(ref), variant                      # same keys, same order
        assert ours["quantization_config"] == ref["quantization_config"]


def test_deterministic_from_seed(tmp_path, tiny_flash):
    a = write_checkpoint(tmp_path / "a", seed=0, small_vocab=True, tokenizer=False)
    b = write_checkpoint(tmp_path / "b", seed=1, small_vocab=True, tokenizer=False)
    f = "model-00004-of-00009.safetensors"
    assert (a / f).read_bytes() == (tiny_flash / f).read_bytes()
    assert (a / f).read_bytes() != (b / f).read_bytes()


def test_header_layout_is_plain_safetensors(tiny_flash):
    raw = (tiny_flash / "model-00001-of-00009.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert n % 8 == 0 and list(header) == ["__metadata__", "embed.weight"]


def test_weights_look_trained(tiny_flash):
    src = SafetensorsDir(tiny_flash)
    # FP8 tiles use many block exponents, no NaN scales, and heavy tails
    exps = torch.cat([src.read(n).flatten() for n in src.entries if n.endswith(".scale")])
    assert exps.max() < 255 and len(exps.unique()) >= 10
    w = dequant_fp8_block(src.read("layers.3.attn.wq_b.weight"), src.read("layers.3.attn.wq_b.scale"))
    kurt = ((w - w.mean()) ** 4).mean() / w.var() ** 2
    assert kurt > 5                                                  # Gaussian would be 3
    # hash table: distinct experts per token, in range
    t = src.read("layers.0.ffn.gate.tid2eid")
    assert t.min() >= 0 and t.max() < 16 and (t.sort(1).values.diff(1) > 0).all()
    # the router bias changes the selected top-6 for a sizeable share of inputs
    gate = src.read("layers.3.ffn.gate.weight").float()
    bias = src.read("layers.3.ffn.gate.bias")
    x = torch.randn(2000, gate.shape[1], generator=torch.Generator().manual_seed(0))
    s = torch.nn.functional.softplus(x @ gate.T).sqrt()
    plain = s.topk(6).indices.sort(1).values
    biased = (s + bias).topk(6).indices.sort(1).values
    changed = (plain != biased).any(1).float().mean()
    assert 0.2 < changed < 1.0


def test_real_tokenizer(tiny_flash_real_vocab):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tiny_flash_real_vocab / "tokenizer.json"))
    assert tok.get_vocab_size() == 129280
    assert tok.token_to_id("<｜User｜>") == 128803 and tok.token_to_id("<｜end▁of▁sentence｜>") == 1
    cfg = ModelConfig.from_file(tiny_flash_real_vocab / "config.json")
    assert cfg.vocab_size == 129280


def test_small_vocab_tokenizer_roundtrip(tiny_flash):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tiny_flash / "tokenizer.json"))
    text = "héllo wörld, 你好 <｜User｜>"
    ids = tok.encode(text).ids
    assert max(ids) < 512 and tok.decode(ids, skip_special_tokens=False) == text


def test_forward_statistics_look_trained(tiny_flash):
    """Peaked logits (not flat), SwiGLU clamps that fire, a router bias that changes selections,
    layer updates that are a trained-like share of the stream, and layers that still decide many
    top-1s (docs/SYNTHETIC.md, "Robustness")."""
    from tokenizers import Tokenizer

    from backfit.verify.ref_blocks import MoEStats, rms_norm
    from backfit.verify.reference import Reference

    text = ("The harbour town woke slowly that morning. Fishermen hauled their nets onto the quay "
            "while the baker opened his shutters. def main():\n    return sum(range(10))\n") * 2
    ids = Tokenizer.from_file(str(tiny_flash / "tokenizer.json")).encode(text).ids[:200]
    ref = Reference(tiny_flash)
    ref.stats = MoEStats()
    out = ref.forward(torch.tensor(ids), capture=True)
    logits = out["logits"]
    top2 = logits.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    assert 1.0 < margin.median() < 20.0                   # random weights give ~0.1
    assert torch.softmax(logits, -1).max(-1).values.median() > 0.5
    for key in ("routed.gate", "routed.up", "shared.gate", "shared.up"):
        assert 0.0 < ref.stats.frac(key) < 0.05, key
    assert ref.stats.frac("bias_changed_selection") > 0.1
    # each layer changes a small share of the 4-stream residual (a chaotic random net: 34-300 %)
    prev = ref._embed(torch.tensor(ids)).unsqueeze(1).repeat(1, ref.cfg.hc_mult, 1)
    for X in out["hidden"]:
        assert 0.02 < ((X - prev).norm() / prev.norm()).item() < 0.3
        prev = X
    # ... and yet the layers matter: the embedding alone into the head misses many top-1s
    top = ref.params("")
    e = rms_norm(ref._embed(torch.tensor(ids)), top["norm.weight"], ref.cfg.rms_norm_eps)
    direct = e.float() @ ref.ckpt.read("head.weight").float().T
    assert (direct.argmax(-1) == logits.argmax(-1)).float().mean() < 0.8


def test_vision_format(tiny_vision):
    """dsv4-vision.md sections 1-3 on the tiny checkpoint: the 0731 layout underneath, the config
    diff, every vision-side tensor with its real name and dtype, bias_vl in every MoE gate (DSpark
    stages included), in the shards the index names."""
    cfg, src = _check_format(tiny_vision)
    raw = json.loads((tiny_vision / "config.json").read_text())
    assert raw["architectures"] == ["DeepseekV4ForCausalLM"] and cfg.variant == "0731"
    assert raw["num_nextn_predict_layers"] == 3 and raw["rms_norm_eps"] == 1e-20
    assert list(raw)[-10:] == [k for k in raw if k.startswith("vision_")]     # the 10 keys, last
    v = cfg.vision
    assert (v.patch_size, v.downsample_ratio, v.max_n_token) == (14, 3, 384)
    assert (v.min_pixels, v.max_wh_ratio, v.norm_eps) == (147456, 8, 1e-6)
    e = src.entries
    gates = [f"layers.{i}" for i in range(cfg.num_hidden_layers)] + \
        [f"mtp.{k}" for k in range(cfg.num_mtp_stages)]
    for p in gates:
        assert (e[p + ".ffn.gate.bias_vl"].dtype, e[p + ".ffn.gate.bias_vl"].shape) == ("F32", (8,))
        assert e[p + ".ffn.gate.bias"].dtype == "F32"                  # hash layers: unused bias
    assert "layers.0.ffn.gate.tid2eid" in e
    for s in ("image_start", "image_pad", "image_newline", "image_end"):
        assert (e[s].dtype, e[s].shape) == ("BF16", (cfg.hidden_size,))
    assert e["vision.patch_embed.proj.weight"].shape == (v.dim, 588)
    assert e["aligner.w1.weight"].shape == (cfg.hidden_size, 9 * v.dim)
    tower = [n for n in e if n.startswith(("vision.", "aligner."))]
    assert len(tower) == 3 + 8 * v.n_layers + 4 and all(e[n].dtype == "BF16" for n in tower)
    with safe_open(tiny_vision / e["image_pad"].file.name, framework="pt") as f:
        assert f.get_tensor("image_pad").dtype == torch.bfloat16


def test_vision_weights_look_trained(tiny_vision):
    """The sentinels sit at the embedding rows' scale and in the stream subspace those rows span;
    bias_vl is not the text bias (image rows route differently)."""
    src = SafetensorsDir(tiny_vision)
    emb = src.read("embed.weight").float()
    rms = emb.square().mean(1).sqrt().median()
    basis = torch.linalg.svd(emb, full_matrices=False).Vh[:32]        # the stream subspace S
    for s in ("image_start", "image_pad", "image_newline", "image_end"):
        x = src.read(s).float()
        assert 0.3 < x.square().mean().sqrt() / rms < 3, s
        assert (basis @ x).norm() / x.norm() > 0.9, s                 # ISOTROPIC 0.1 outside S
    for i in range(3, 6):
        assert not torch.equal(src.read(f"layers.{i}.ffn.gate.bias_vl"),
                               src.read(f"layers.{i}.ffn.gate.bias"))
