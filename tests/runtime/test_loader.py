"""Loader: every manifest tensor consumed, every model tensor filled, loud failures otherwise."""

import json
import os
from pathlib import Path

import pytest
import torch

from backfit.config import ModelConfig
from backfit.formats import load_manifest
from backfit.runtime.layers import Linear
from backfit.runtime.loader import LoadError, expected_names, load_model
from backfit.runtime.model.transformer import Transformer


def _fresh(root: Path, **kw) -> Transformer:
    return Transformer(ModelConfig.from_file(root / "config.json"), torch.float32, **kw)


def test_loader_consumes_everything(bf16_tp1, tp1_process):
    model = _fresh(bf16_tp1)
    manifest = load_manifest(bf16_tp1)
    report = load_model(model, bf16_tp1)
    names = expected_names(model)
    loaded_weights = {n for n, t in manifest["tensors"].items() if t["role"] != "scale"}
    assert names == loaded_weights                                   # nothing extra, nothing missing
    assert report["tensors"] == len(loaded_weights) and report["skipped"] == 0
    assert report["files"] == len(list((bf16_tp1 / "rank0").glob("*.safetensors")))
    for n, mod in model.named_modules():
        if isinstance(mod, Linear):
            assert mod.loaded, n
    # a norm weight arrives as BF16 and is held in FP32 (the reference keeps norms in FP32)
    assert model.layers[0].attn_norm.weight.dtype == torch.float32


def test_int8_dir_loads_all_schemes(int8_dirs, tp1_process):
    model = _fresh(int8_dirs[1])
    load_model(model, int8_dirs[1])
    schemes = {m.scheme for m in model.modules() if isinstance(m, Linear)}
    assert schemes == {"int8_g128", "int8_mx32", "bf16", "copy"}     # wo_a is always bf16
    assert model.layers[3].ffn.experts[0].w1.scale.dtype == torch.uint8


def test_skipping_mtp_is_explicit(bf16_tp1, tp1_process):
    model = _fresh(bf16_tp1, mtp=False)
    report = load_model(model, bf16_tp1)
    n_mtp = sum(1 for n in load_manifest(bf16_tp1)["tensors"] if n.startswith("mtp."))
    assert report["skipped"] == n_mtp > 0


def _broken_copy(src: Path, dst: Path, edit_manifest, edit_index) -> Path:
    """A converted dir whose safetensors files are symlinks; manifest and index edited."""
    (dst / "rank0").mkdir(parents=True)
    os.symlink(src / "config.json", dst / "config.json")
    for f in (src / "rank0").glob("*.safetensors"):
        os.symlink(f, dst / "rank0" / f.name)
    m = json.loads((src / "manifest.json").read_text())
    edit_manifest(m["tensors"])
    (dst / "manifest.json").write_text(json.dumps(m))
    idx = json.loads((src / "rank0" / "model.safetensors.index.json").read_text())
    edit_index(idx["weight_map"])
    (dst / "rank0" / "model.safetensors.index.json").write_text(json.dumps(idx))
    return dst


def test_manifest_missing_a_tensor_fails(bf16_tp1, tp1_process, tmp_path):
    victim = "layers.3.attn.attn_sink"
    bad = _broken_copy(bf16_tp1, tmp_path / "a", lambda t: t.pop(victim), lambda w: None)
    with pytest.raises(LoadError, match="index and manifest disagree"):
        load_model(_fresh(bad), bad)
    # removed from both: the model is left with an unfilled tensor
    bad = _broken_copy(bf16_tp1, tmp_path / "b", lambda t: t.pop(victim), lambda w: w.pop(victim))
    with pytest.raises(LoadError, match=r"model tensors not in .*layers\.3\.attn\.attn_sink"):
        load_model(_fresh(bad), bad)


def test_shape_or_scheme_mismatch_fails(bf16_tp1, tp1_process, tmp_path):
    name = "layers.2.attn.wq_a.weight"

    def wrong_shape(t):
        t[name]["shape"] = [t[name]["shape"][0] * 2, t[name]["shape"][1]]
    bad = _broken_copy(bf16_tp1, tmp_path / "a", wrong_shape, lambda w: None)
    with pytest.raises(LoadError, match="wq_a"):
        load_model(_fresh(bad), bad)

    def wrong_scheme(t):
        t[name]["scheme"] = "int8_g128"                  # claims a scale that is not there
    bad = _broken_copy(bf16_tp1, tmp_path / "b", wrong_scheme, lambda w: None)
    with pytest.raises(LoadError, match="scale"):
        load_model(_fresh(bad), bad)
