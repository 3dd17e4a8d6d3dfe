"""Every bad input: a one-line error naming file and tensor, exit 1, and no DST that looks complete."""

import errno
import json
import os
import struct
import subprocess
import sys

import pytest

from backfit.convert import run as run_mod
from backfit.convert.run import convert

from support import clone_checkpoint, materialize

LAYER3 = "model-00005-of-00009.safetensors"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "backfit.cli", "convert", *map(str, args), "--quiet"],
                          capture_output=True, text=True)


def _assert_fails(src, dst, *needles):
    r = _cli(src, dst)
    assert r.returncode == 1, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    assert not dst.exists()                                   # never a DST that looks complete
    return lines[0]


def _rewrite_header(path, edit):
    """Rewrite the JSON header of a safetensors file through `edit(header) -> header`."""
    raw = materialize(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = edit(json.loads(raw[8:8 + n]))
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new)) if len(new) <= n else b""
    assert len(new) == n, "edited header must keep its length"
    path.write_bytes(raw[:8] + new + raw[8 + n:])


@pytest.fixture
def src(tiny_flash, tmp_path):
    return clone_checkpoint(tiny_flash, tmp_path / "src")


def test_missing_shard(src, tmp_path):
    (src / LAYER3).unlink()
    _assert_fails(src, tmp_path / "dst", LAYER3, "missing shard", "layers.3.")


def test_truncated_file(src, tmp_path):
    data = materialize(src / LAYER3).read_bytes()
    (src / LAYER3).write_bytes(data[: len(data) - 1000])
    _assert_fails(src, tmp_path / "dst", LAYER3, "truncated", "layers.3.")


def test_corrupt_header(src, tmp_path):
    raw = materialize(src / LAYER3).read_bytes()
    (src / LAYER3).write_bytes(raw[:8] + b"{not json" + raw[17:])
    _assert_fails(src, tmp_path / "dst", LAYER3, "corrupt header")


def test_wrong_dtype(src, tmp_path):
    def edit(h):
        h["layers.3.attn.wkv.weight"]["dtype"] = "I8"
        return h
    _rewrite_header(src / LAYER3, edit)
    _assert_fails(src, tmp_path / "dst", LAYER3, "layers.3.attn.wkv.weight", "dtype I8", "F8_E4M3")


def test_wrong_shape(src, tmp_path):
    def edit(h):
        t = h["layers.3.attn.wq_a.weight"]
        t["shape"] = [t["shape"][1], t["shape"][0]]            # same bytes, transposed shape
        return h
    _rewrite_header(src / LAYER3, edit)
    _assert_fails(src, tmp_path / "dst", LAYER3, "layers.3.attn.wq_a.weight", "shape [256, 128]",
                  "[128, 256]")


def _rename(src, old, new=None):
    """Rename tensor `old` to `new` (or drop it when new is None) in LAYER3 and in the index."""
    def edit(h):
        t = h.pop(old)
        if new:
            h[new] = t
        return h
    _rewrite_header(src / LAYER3, edit)
    idx = json.loads((materialize(src / "model.safetensors.index.json")).read_text())
    fname = idx["weight_map"].pop(old)
    if new:
        idx["weight_map"][new] = fname
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))


def test_missing_scale(src, tmp_path):
    _rename(src, "layers.3.attn.wkv.scale")
    _assert_fails(src, tmp_path / "dst", LAYER3, "layers.3.attn.wkv.scale", "missing scale")


def _poke(src, name, offset, data: bytes):
    """Overwrite bytes of tensor `name`'s payload in LAYER3, from byte `offset` of the tensor."""
    path = materialize(src / LAYER3)
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    start = 8 + n + json.loads(raw[8:8 + n])[name]["data_offsets"][0] + offset
    raw[start:start + len(data)] = data
    path.write_bytes(bytes(raw))


def test_ue8m0_nan(src, tmp_path):
    _poke(src, "layers.3.ffn.experts.9.w2.scale", 5, b"\xff")
    _assert_fails(src, tmp_path / "dst", LAYER3, "layers.3.ffn.experts.9.w2.scale", "NaN", "[0, 5]")


@pytest.mark.parametrize("code,at", [(0x7F, (1, 2)), (0xFF, (200, 17))])
def test_e4m3_nan_byte(src, tmp_path, code, at):
    _poke(src, "layers.3.attn.wkv.weight", at[0] * 256 + at[1], bytes([code]))   # [256, 256]
    _assert_fails(src, tmp_path / "dst", LAYER3, "layers.3.attn.wkv.weight", "e4m3 NaN",
                  str(list(at)))


@pytest.mark.parametrize("name,offset,data,needles", [
    # BF16 [128]: a quiet NaN (0x7FC0) at element 7
    ("layers.3.attn.q_norm.weight", 7 * 2, b"\xc0\x7f", ("nan", "at [7]")),
    # F32 [24, 1024]: +Inf (0x7F800000) at [2, 3]
    ("layers.3.hc_attn_fn", (2 * 1024 + 3) * 4, b"\x00\x00\x80\x7f", ("inf", "at [2, 3]")),
])
def test_non_finite_copied_tensor(src, tmp_path, name, offset, data, needles):
    _poke(src, name, offset, data)
    _assert_fails(src, tmp_path / "dst", LAYER3, name, "non-finite", *needles)


def test_inf_from_dequantization(src, tmp_path):
    # scale byte 250 = 2^123 on tile [0, 1] of wq_a [128, 256]: e4m3 codes >= 2^5 overflow float32
    _poke(src, "layers.3.attn.wq_a.scale", 1, bytes([250]))
    line = _assert_fails(src, tmp_path / "dst", LAYER3, "layers.3.attn.wq_a.weight",
                         "FP8 x scale gives inf", "scale byte 250 at [0, 1]")
    col = int(line.split(" at [")[1].split("]")[0].split(", ")[1])
    assert 128 <= col < 256, line                            # the first bad value is in that tile


@pytest.mark.parametrize("name,offset,byte,at", [
    ("layers.3.ffn.experts.4.w1.scale", 3 * 8 + 1, 200, "[3, 1]"),   # [1024, 8]: 2^73, finite
    ("layers.3.attn.wkv.scale", 3, 160, "[1, 1]"),                    # [2, 2]: first byte refused
])
def test_scale_byte_out_of_range(src, tmp_path, name, offset, byte, at):
    _poke(src, name, offset, bytes([byte]))
    _assert_fails(src, tmp_path / "dst", LAYER3, name, f"UE8M0 scale byte {byte}", at,
                  "outside the accepted 0..159")


def test_scale_bytes_at_the_accepted_edges_convert(src, tmp_path):
    _poke(src, "layers.3.ffn.experts.4.w1.scale", 0, bytes([159]))
    _poke(src, "layers.3.attn.wkv.scale", 0, bytes([0]))
    m = convert(src, tmp_path / "dst", tp=1, progress=False)
    assert m["tensors"]["layers.3.ffn.experts.4.w1.weight"]["exact"] is True
    assert 0 < m["tensors"]["layers.3.attn.wkv.weight"]["rel_err"] < 0.02


def _add_to_header(src, new, like):
    """Give LAYER3 a header entry `new` that points at the bytes of its tensor `like`."""
    path = materialize(src / LAYER3)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    h = json.loads(raw[8:8 + n])
    h[new] = dict(h[like])
    head = json.dumps(h, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + n:])


def test_shard_tensor_missing_from_index(src, tmp_path):
    _add_to_header(src, "layers.3.attn.q_norm2.weight", "layers.3.attn.q_norm.weight")
    _assert_fails(src, tmp_path / "dst", LAYER3, "layers.3.attn.q_norm2.weight",
                  "in the file but not in", "model.safetensors.index.json")


def test_shard_tensor_listed_for_another_shard(src, tmp_path):
    # the index puts layers.2.* in shard 4; a copy of it in shard 5 is a mixed-up download
    _add_to_header(src, "layers.2.attn_norm.weight", "layers.3.attn_norm.weight")
    _assert_fails(src, tmp_path / "dst", LAYER3, "layers.2.attn_norm.weight",
                  "model.safetensors.index.json lists it in model-00004-of-00009.safetensors")


def test_unknown_tensor_name(src, tmp_path):
    _rename(src, "layers.3.attn.q_norm.weight", "layers.3.attn.wq_c.weight")
    _assert_fails(src, tmp_path / "dst", LAYER3, "layers.3.attn.wq_c.weight", "unknown tensor")


@pytest.mark.parametrize("key,value,needle", [
    ("hidden_size", 512, "embed.weight"),
    ("num_hidden_layers", 7, "missing tensor"),
    ("n_routed_experts", 8, "layers.0.ffn.gate.weight"),
])
def test_config_disagrees_with_tensors(src, tmp_path, key, value, needle):
    cfg = json.loads(materialize(src / "config.json").read_text())
    cfg[key] = value
    if key == "num_hidden_layers":
        cfg["compress_ratios"] = [0, 0, 4, 8, 4, 8, 4, 0]
    (src / "config.json").write_text(json.dumps(cfg))
    line = _assert_fails(src, tmp_path / "dst", needle)
    assert "config.json" in line


def test_dst_already_present(src, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("user data")
    r = _cli(src, dst)
    assert r.returncode == 1 and "already exists" in r.stderr and "--force" in r.stderr
    assert (dst / "keep.txt").read_text() == "user data"


def test_force_replaces_only_when_done(src, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "old.txt").write_text("x")
    convert(src, dst, tp=1, force=True, progress=False)
    assert (dst / "manifest.json").exists() and not (dst / "old.txt").exists()


def test_out_of_disk_space_preflight(src, tmp_path, monkeypatch):
    monkeypatch.setattr(run_mod.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    with pytest.raises(run_mod.ConvertError, match="out of disk space") as e:
        convert(src, tmp_path / "dst", tp=2, progress=False)
    assert "dst.partial" in str(e.value) and not (tmp_path / "dst").exists()


def test_out_of_disk_space_mid_write(src, tmp_path, monkeypatch):
    import backfit.checkpoint as ck
    real, calls = os.pwrite, {"n": 0}

    def full_disk(fd, data, off):
        calls["n"] += 1
        if calls["n"] > 200:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, off)

    monkeypatch.setattr(ck.os, "pwrite", full_disk)
    with pytest.raises(run_mod.ConvertError, match="out of disk space") as e:
        convert(src, tmp_path / "dst", tp=2, progress=False)
    assert "No space left" in str(e.value) and not (tmp_path / "dst").exists()
    monkeypatch.setattr(ck.os, "pwrite", real)
    convert(src, tmp_path / "dst", tp=2, progress=False)            # resumes once space is back
    assert (tmp_path / "dst" / "manifest.json").exists()


def test_bad_tp_and_missing_source(tmp_path):
    r = _cli(tmp_path / "nope", tmp_path / "dst")
    assert r.returncode == 1 and "no such directory" in r.stderr
    r = subprocess.run([sys.executable, "-m", "backfit.cli", "convert", "a", "b", "--tp", "3"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--tp" in r.stderr
