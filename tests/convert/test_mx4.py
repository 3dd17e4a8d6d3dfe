"""The 4-bit expert scheme mx4_e2m1: decoder bit-exact on its whole domain, the written bytes are
the MXFP4 source bytes re-sharded, `exact` measured, TP refusals, and `backfit verify` passes."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from support import one_thread

from backfit.checkpoint import SafetensorsDir, TensorEntry
from backfit.cli import main
from backfit.config import ModelConfig
from backfit.convert import transforms
from backfit.convert.plan import ConvertError, plan_conversion
from backfit.formats import SCHEMES, load_manifest, rank_dir
from backfit.inventory import expected_tensors
from backfit.quant import E2M1_LUT, dequant_mx4, dequant_mxfp4
from backfit.synthetic import tiny_config_dict

TP = 2


@pytest.fixture(scope="module")
def mx4_tp2(tiny_converted):
    with one_thread():
        return tiny_converted(TP, "mx4")


def _grid() -> tuple[torch.Tensor, torch.Tensor]:
    """Every packed byte (16 x 16 code pairs) under every exponent byte 0..254, one per row:
    w [255, 256] uint8, s [255, 16] (16 groups of 32 inputs = the 256 bytes of a row)."""
    w = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(255, 1)
    s = torch.arange(255, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 16)
    return w, s


def test_decoder_equals_mxfp4_source_for_every_code_and_exponent():
    w, s = _grid()
    got = dequant_mx4(w, s)                                                  # [255, 512]
    assert got.shape == (255, 512) and got.dtype == torch.float32
    # bit for bit (signed zeros and the overflowing infs included) against the reference
    assert torch.equal(got.view(torch.int32), dequant_mxfp4(w, s).view(torch.int32))
    # and against the closed form, in Python floats: low nibble = input 2j, high = 2j+1
    vals = [0, .5, 1, 1.5, 2, 3, 4, 6]
    for e in range(255):
        for byte in (0x00, 0x01, 0x10, 0x7F, 0x87, 0xF8, 0xFF, 0x3A):
            for j, code in enumerate((byte & 15, byte >> 4)):
                sign = -1.0 if code & 8 else 1.0
                want = sign * math.ldexp(vals[code & 7], e - 127)     # float64: no overflow
                if abs(want) >= 2.0 ** 128:                             # float32 overflows
                    want = math.copysign(math.inf, want)
                g = got[e, 2 * byte + j].item()
                assert g == want and math.copysign(1, g) == sign, (e, hex(byte), j, g, want)
    # every finite value is exact in bf16 too (the activation dtype of the GPU path)
    fin = torch.isfinite(got)
    assert fin[:253].all() and not fin[253:].all()                # e >= 253: 4 * 2^126 = inf
    assert torch.equal(got[fin].bfloat16().float(), got[fin])
    assert E2M1_LUT.numel() == 16


def test_exact_flag_is_measured():
    assert transforms.mx4_decoder_exact() is True
    w, s = _grid()
    w8 = w.view(torch.int8)                                            # the source dtype
    assert transforms.mx4_exact(w8, s, w.clone(), s.clone())
    bad = w.clone()
    bad[3, 5] ^= 0x10                                                  # one flipped code bit
    assert not transforms.mx4_exact(w8, s, bad, s)
    assert not transforms.mx4_exact(w8, s, w, s + 1)
    assert not transforms.mx4_exact(w8, s, w.view(torch.int8), s)      # wrong dtype


def _gather(root: Path, name: str, dim) -> tuple[list[torch.Tensor], torch.Tensor]:
    index = json.loads((rank_dir(root, 0) / "model.safetensors.index.json").read_text())
    parts = []
    for r in range(TP):
        with safe_open(rank_dir(root, r) / index["weight_map"][name], framework="pt") as f:
            parts.append(f.get_tensor(name))
    return parts, (parts[0] if dim is None else torch.cat(parts, dim=dim))


def test_conversion_writes_the_source_bytes_resharded(tiny_flash, mx4_tp2):
    m, src = load_manifest(mx4_tp2), SafetensorsDir(tiny_flash)
    assert m["schemes"]["experts"] == "mx4" and m["schemes"]["linears"] == "int8"
    assert "mx4_e2m1" in m["schemes"]["meaning"] == SCHEMES
    experts = {n: t for n, t in m["tensors"].items() if t["role"] == "weight"
               and t["scheme"] == "mx4_e2m1"}
    assert len(experts) == 7 * 16 * 3 and not any(t["scheme"] == "int8_mx32"
                                                  for t in m["tensors"].values())
    for name, t in experts.items():
        base, dim = name[: -len(".weight")], t["shard_dim"]
        assert dim == (1 if ".w2." in name else 0), name
        w, s = src.read(name), src.read(base + ".scale")
        ts = m["tensors"][base + ".scale"]
        assert (t["dtype"], ts["dtype"], ts["scheme"]) == ("U8", "U8", "mx4_e2m1")
        assert t["shape"] == list(w.shape) and ts["shape"] == list(s.shape)   # [N, K/2], [N, K/32]
        qs, q = _gather(mx4_tp2, name, dim)
        es, e = _gather(mx4_tp2, base + ".scale", dim)
        assert q.dtype == e.dtype == torch.uint8
        assert torch.equal(q, w.view(torch.uint8)) and torch.equal(e, s), name
        for r in range(TP):                                            # rank r = r-th chunk
            assert torch.equal(qs[r], w.view(torch.uint8).chunk(TP, dim)[r])
            assert torch.equal(es[r], s.chunk(TP, dim)[r])
            assert qs[r].shape[1] * 2 == es[r].shape[1] * 32           # whole groups per rank
        assert torch.equal(dequant_mx4(q, e), dequant_mxfp4(w, s)), name
        assert t["exact"] is True and t["rel_err"] == 0.0
    assert m["summary"]["experts_exact"] is True


def test_mx4_halves_the_expert_bytes(tiny_converted, mx4_tp2):
    """Per rank, the int8 conversion minus the mx4 one is exactly half the INT8 expert codes."""
    i8 = load_manifest(tiny_converted(TP, "int8"))
    m = load_manifest(mx4_tp2)
    codes = sum(math.prod(t["shape"]) // TP for t in i8["tensors"].values()
                if t["scheme"] == "int8_mx32" and t["role"] == "weight")
    for r in range(TP):
        assert i8["ranks"][r]["bytes"] - m["ranks"][r]["bytes"] == codes // 2


def _entries(**dims) -> tuple[dict, ModelConfig]:
    cfg = ModelConfig.from_dict(tiny_config_dict("flash", vocab_size=1024, **dims))
    ents = {n: TensorEntry(Path("model-x.safetensors"), n, t.dtype, t.shape, 0, t.nbytes)
            for n, t in expected_tensors(cfg).items()}
    return ents, cfg


def test_plan_refuses_a_w2_shard_that_splits_a_group():
    """moe_intermediate_size 96 = 3 groups of 32: at tp 2 each w2 shard would hold 48 inputs
    (24 packed bytes, an even split of bytes) and cut a group in two."""
    ents, cfg = _entries(moe_intermediate_size=96)
    plan_conversion(ents, cfg, 1, experts="mx4")                        # tp 1 is fine
    # the packed w2 [256, 48] splits evenly; its exponents [256, 3] do not, and say so
    with pytest.raises(ConvertError, match=r"^--tp 2: layers\.\d+\.ffn\.experts\.\d+\.w2\.scale: "
                                           r"dim 1 of size 3 is not divisible by 2$"):
        plan_conversion(ents, cfg, 2, experts="mx4")
    with pytest.raises(ConvertError, match=r"--experts 'mx5': choose one of int8, bf16, mx4"):
        plan_conversion(ents, cfg, 1, experts="mx5")


def test_convert_help_says_which_scheme_suits_what():
    out = CliRunner().invoke(main, ["convert", "--help"], terminal_width=200).output
    out = " ".join(out.split())                                   # help text re-wrapped
    assert "[int8|mx4|bf16]" in out and "Both run the Triton fused MoE" in out
    assert "half the expert bytes" in out and "mx4 for decode-heavy serving" in out
    assert "int8 for prefill-heavy work" in out


def test_verify_passes_on_mx4(tiny_flash, mx4_tp2, tmp_path):
    """`backfit verify` (conversion thresholds, tp 2, real CLI process) on the mx4 conversion;
    the weight gate holds every mx4_e2m1 tensor to rel error 0."""
    r = subprocess.run([sys.executable, "-m", "backfit.cli", "verify", str(tiny_flash),
                        str(mx4_tp2), "--tp", str(TP), "--json", str(tmp_path / "r.json")],
                       check=False, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "conversion check: PASS" in r.stdout
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["check"] == "conversion" and rep["tp"] == TP and rep["positions"] >= 512
    assert rep["gates"] == {"weights": [], "hidden": [], "logits": []}
