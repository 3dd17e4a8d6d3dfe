"""Vision-Exp through the converter: the tower, aligner, sentinels and every bias_vl pass through
unchanged and replicated; a missing, extra, misshapen or mistyped vision tensor is one error
line naming it (dsv4-vision.md section 3, docs/FORMAT.md "Vision-Exp tensors")."""

import json
import struct

import pytest
import torch

from backfit.checkpoint import SafetensorsDir, read_header, read_tensor
from backfit.convert.plan import ConvertError
from backfit.convert.run import convert
from backfit.formats import rank_dir
from backfit.inventory import is_vision_tensor
from backfit.verify.weights import check_weights

from support import clone_checkpoint, materialize

TAIL = "model-00008-of-00011.safetensors"          # norm, head, hc_head and the vision side
LAYER0 = "model-00002-of-00011.safetensors"


@pytest.fixture(scope="module")
def converted(tiny_vision, tmp_path_factory):
    dst = tmp_path_factory.mktemp("vision") / "tp2"
    return convert(tiny_vision, dst, tp=2, progress=False), dst


def test_vision_tensors_pass_through_replicated(tiny_vision, converted):
    m, dst = converted
    src = SafetensorsDir(tiny_vision)
    vision = [n for n in src.entries if is_vision_tensor(n)]
    assert len(vision) == 3 + 8 * 2 + 4 + 4 + 9           # tower, aligner, image_*, bias_vl
    headers = {}
    for name in vision + ["layers.1.ffn.gate.bias"]:
        t = m["tensors"][name]
        assert (t["scheme"], t["role"], t["shard_dim"]) == ("copy", "tensor", None), name
        assert t["dtype"] == src.entries[name].dtype and t["shape"] == list(src.entries[name].shape)
        want = src.read(name)
        for r in range(2):                                           # every rank: the whole tensor
            key = (r, t["file"])
            headers.setdefault(key, read_header(rank_dir(dst, r) / t["file"]))
            assert torch.equal(read_tensor(headers[key][name]), want), (name, r)
    assert m["model"]["vision"]["n_layers"] == 2 and m["model"]["vision"]["norm_eps"] == 1e-6
    assert m["model"]["vision"]["max_n_token"] == 384
    rows, problems = check_weights(tiny_vision, dst)                 # `backfit verify`'s gate
    assert problems == [] and len(rows) > len(vision)


def test_text_only_manifest_says_no_vision(tiny_converted):
    from backfit.formats import load_manifest
    assert load_manifest(tiny_converted(1))["model"]["vision"] is None


# ---- bad input ---------------------------------------------------------------------------------
def _edit_header(path, edit):
    """Rewrite a shard's JSON header through edit(header) (payload unchanged, header re-padded)."""
    raw = materialize(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    h = edit(json.loads(raw[8:8 + n]))
    head = json.dumps(h, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + n:])


def _edit_index(src, edit):
    path = materialize(src / "model.safetensors.index.json")
    idx = json.loads(path.read_text())
    edit(idx["weight_map"])
    path.write_text(json.dumps(idx))


def _fails(src, tmp_path, *needles):
    with pytest.raises(ConvertError) as e:
        convert(src, tmp_path / "dst", tp=2, progress=False)
    line = str(e.value)
    assert "\n" not in line and all(n in line for n in needles), line
    assert not (tmp_path / "dst").exists()


@pytest.fixture
def src(tiny_vision, tmp_path):
    return clone_checkpoint(tiny_vision, tmp_path / "src")


def test_missing_vision_tensor(src, tmp_path):
    name = "vision.blocks.1.attn.wo.bias"
    _edit_header(src / TAIL, lambda h: {k: v for k, v in h.items() if k != name})
    _edit_index(src, lambda wm: wm.pop(name))
    _fails(src, tmp_path, name, "missing tensor")


def test_missing_bias_vl(src, tmp_path):
    name = "layers.0.ffn.gate.bias_vl"
    _edit_header(src / LAYER0, lambda h: {k: v for k, v in h.items() if k != name})
    _edit_index(src, lambda wm: wm.pop(name))
    _fails(src, tmp_path, name, "missing tensor")


def test_extra_vision_block(src, tmp_path):
    name = "vision.blocks.2.norm1.weight"                 # a third block: config says 2
    _edit_header(src / TAIL, lambda h: {**h, name: h["vision.blocks.1.norm1.weight"]})
    _edit_index(src, lambda wm: wm.__setitem__(name, TAIL))
    _fails(src, tmp_path, name, "unknown tensor")


def test_wrong_vision_shape(src, tmp_path):
    def edit(h):                                          # same bytes, transposed
        h["aligner.w1.weight"]["shape"] = h["aligner.w1.weight"]["shape"][::-1]
        return h
    _edit_header(src / TAIL, edit)
    _fails(src, tmp_path, "aligner.w1.weight", "shape [1152, 256]", "[256, 1152]")


def test_wrong_vision_dtype(src, tmp_path):
    def edit(h):                                          # same bytes, declared F16
        h["image_pad"]["dtype"] = "F16"
        return h
    _edit_header(src / TAIL, edit)
    _fails(src, tmp_path, "image_pad", "dtype F16", "BF16")


def test_vision_tensors_with_a_text_only_config(src, tmp_path):
    cfg = json.loads(materialize(src / "config.json").read_text())
    cfg["vision_n_layers"] = 0
    (src / "config.json").write_text(json.dumps(cfg))
    _fails(src, tmp_path, "a Vision-Exp tensor", "vision_n_layers")
