"""Source rules and small units: no float8/float4, import edges, TPInfo, Linear schemes, RoPE."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backfit.quant import mxfp4_to_int8, quantize_int8_groups
from backfit.runtime.distributed import TPInfo
from backfit.runtime.layers import Linear, Rotary, yarn_inv_freq

RUNTIME = Path(__file__).resolve().parents[2] / "backfit" / "runtime"
ALLOWED = {"backfit.config", "backfit.formats", "backfit.checkpoint", "backfit.quant",
           "backfit.vision"}          # image preprocessing: upstream of the runtime


def _sources():
    files = sorted(RUNTIME.rglob("*.py"))
    assert len(files) >= 10
    return files


def test_no_float8_or_float4_anywhere():
    for f in _sources():
        text = f.read_text()
        for bad in ("float8", "float4"):
            assert bad not in text, f"{f}: mentions {bad}; the runtime must stay BF16/INT8 only"


def test_runtime_imports_only_leaves():
    for f in _sources():
        for node in ast.walk(ast.parse(f.read_text())):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            for m in mods:
                if m.startswith("backfit") and not m.startswith("backfit.runtime"):
                    assert m in ALLOWED, f"{f}: imports {m}"


def test_tp_info_set_once_and_read_only_when_set():
    code = ("from backfit.runtime import distributed as d\n"
            "try:\n d.get_tp_info(); print('no-raise')\nexcept RuntimeError: print('unset-raises')\n"
            "d.set_tp_info(0, 2)\n"
            "try:\n d.set_tp_info(0, 2); print('no-raise')\nexcept RuntimeError: print('twice-raises')\n"
            "print(d.get_tp_info())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["unset-raises", "twice-raises"], out
    assert "TPInfo(rank=0, size=2)" in out
    with pytest.raises(ValueError):
        TPInfo(2, 2)
    assert TPInfo(1, 4).shard(1024) == 256
    with pytest.raises(ValueError):
        TPInfo(0, 3).shard(1024)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_schemes(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g)
    x = torch.randn(5, 256, generator=g)
    q, s = quantize_int8_groups(w, 128)
    lin = Linear(256, 64)
    lin.load("int8_g128", q, s)
    # oracles written out from docs/FORMAT.md, not the quant.py code the runtime itself calls
    w_g128 = (q.float().view(64, 2, 128) * s[:, :, None]).view(64, 256)      # W = q * scale
    ref = x.to(dtype) @ w_g128.to(dtype).T
    torch.testing.assert_close(lin(x.to(dtype)), ref)
    packed = torch.randint(-128, 128, (64, 128), dtype=torch.int8, generator=g)
    exps = torch.randint(120, 130, (64, 8), dtype=torch.uint8, generator=g)
    qm, em = mxfp4_to_int8(packed, exps)
    lin.load("int8_mx32", qm, em)
    w_mx = (qm.float().view(64, 8, 32) * torch.exp2(em.float() - 128)[:, :, None]).view(64, 256)
    torch.testing.assert_close(lin(x.to(dtype)), x.to(dtype) @ w_mx.to(dtype).T)   # q * 2^(e-128)
    lin.load("bf16", w.bfloat16())
    torch.testing.assert_close(lin(x.to(dtype)), x.to(dtype) @ w.bfloat16().to(dtype).T)
    with pytest.raises(ValueError):
        lin.load("int8_g128", q, s[:, :1])           # wrong scale shape
    with pytest.raises(ValueError):
        lin.load("int8_mx32", qm, em.float())        # wrong scale dtype


def test_yarn_table_matches_spec():
    # dsv4-model.md 5.4.3: real dims, base 160000 -> low 15, high 25
    f = yarn_inv_freq(64, 160000.0, {"factor": 16, "original_max_position_embeddings": 65536,
                                     "beta_fast": 32, "beta_slow": 1})
    base = 160000.0 ** (-2 * torch.arange(32, dtype=torch.float64) / 64)
    torch.testing.assert_close(f[:16], base[:16])
    torch.testing.assert_close(f[25:], base[25:] / 16)
    assert ((f[16:25] < base[16:25]) & (f[16:25] > base[16:25] / 16)).all()


def test_rope_interleaved_and_inverse():
    rope = Rotary(64, 10000.0)
    x = torch.randn(3, 4, 256)
    pos = torch.tensor([0, 5, 1000])
    y = rope(x, pos)
    assert torch.equal(y[..., :192], x[..., :192])                       # nope dims untouched
    assert torch.equal(y[0], x[0])                                       # position 0: identity
    a, b = x[1, :, 192], x[1, :, 193]                                    # pair 0 rotates by 5·1 rad
    torch.testing.assert_close(y[1, :, 192], a * torch.cos(torch.tensor(5.)) - b * torch.sin(torch.tensor(5.)))
    torch.testing.assert_close(rope(y, pos, inverse=True), x, atol=1e-5, rtol=1e-5)
