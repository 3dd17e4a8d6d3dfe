"""Runtime torch path for 4-bit experts (mx4_e2m1): Linear.load checks, the dequantized weight
equals the int8_mx32 one bit for bit, a converted mx4 model gives the int8_mx32 conversion's
logits, and the Triton MoE stacks mx4 experts for its 4-bit kernels."""

import pytest
import torch

from backfit.quant import mxfp4_to_int8
from backfit.runtime.batch import ForwardBatch
from backfit.runtime.layers import Linear
from backfit.runtime.loader import load_model
from backfit.runtime.model.transformer import Transformer


def _packed(n: int = 8, k: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed codes [n, k/2] and exponent bytes [n, k/32] in the accepted 100..140."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    s = torch.randint(100, 141, (n, k // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    return w, s


def test_load_checks_dtype_and_packed_shape():
    w, s = _packed()
    lin = Linear(64, 8)
    lin.load("mx4_e2m1", w, s, "x.weight")
    assert lin.scheme == "mx4_e2m1" and lin.dequantized(torch.float32).shape == (8, 64)
    with pytest.raises(ValueError, match=r"x\.weight: weight shape \[8, 64\], expected \[8, 32\]"):
        Linear(64, 8).load("mx4_e2m1", torch.zeros(8, 64, dtype=torch.uint8), s, "x.weight")
    with pytest.raises(ValueError, match="scheme mx4_e2m1 needs torch.uint8, got torch.int8"):
        Linear(64, 8).load("mx4_e2m1", w.view(torch.int8), s, "x.weight")
    with pytest.raises(ValueError, match=r"scale must be torch.uint8\[8, 2\]"):
        Linear(64, 8).load("mx4_e2m1", w, s[:, :1], "x.weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_equals_int8_mx32(dtype):
    """The same MXFP4 bytes through both schemes: identical weights in the activation dtype."""
    w, s = _packed(16, 128, seed=1)
    mx4, i8 = Linear(128, 16), Linear(128, 16)
    mx4.load("mx4_e2m1", w, s)
    i8.load("int8_mx32", *mxfp4_to_int8(w.view(torch.int8), s))
    a, b = mx4.dequantized(dtype), i8.dequantized(dtype)
    assert a.dtype == dtype and torch.equal(a, b)
    assert torch.equal(a.float(), mx4.dequantized(torch.float32))      # exact in bf16 too
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert torch.equal(mx4(x), i8(x))


@pytest.fixture(scope="module")
def mx4_and_int8(tiny_converted, tp1_process):
    return tiny_converted(1, "mx4"), tiny_converted(1, "int8")


def _model(root, dtype) -> Transformer:
    from backfit.config import ModelConfig
    m = Transformer(ModelConfig.from_file(root / "config.json"), dtype, mtp=False)
    load_model(m, root)
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_equal_the_int8_conversion(mx4_and_int8, dtype):
    """Same linears (int8_g128), same expert values: the two conversions run the same float ops
    on the same numbers, so the logits are bit-identical (tolerance 0, float32 and bf16), not
    merely within accumulation noise; prefill, then 4 decode steps through the state."""
    mx4_dir, i8_dir = mx4_and_int8
    tokens = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3))
    outs = []
    for root in (mx4_dir, i8_dir):
        m = _model(root, dtype)
        schemes = {e.w1.scheme for layer in m.layers for e in layer.ffn.experts}
        outs.append((schemes, _run(m, tokens)))
    (s_mx4, got), (s_i8, want) = outs
    assert s_mx4 == {"mx4_e2m1"} and s_i8 == {"int8_mx32"}
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert torch.equal(got, want)


def _run(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        st = model.new_state()
        outs = [model(ForwardBatch.single(tokens[:36]), st)]
        for p in range(36, 40):
            outs.append(model(ForwardBatch.single(tokens[p:p + 1], start=p), st))
    return torch.cat(outs)


def test_triton_moe_stacks_mx4_experts(mx4_and_int8):
    """prepare_kernels takes mx4 experts: packed codes [E, I, K/2] and exponents [E, I, K/32]
    stacked as uint8, the experts' tensors become views, their weights unchanged (the kernels
    themselves: tests/runtime/kernels/test_moe_mx4.py)."""
    ffn = _model(mx4_and_int8[0], torch.bfloat16).layers[0].ffn
    before = [ex.w2.dequantized(torch.float32) for ex in ffn.experts]
    assert ffn.prepare_kernels()
    w1, s1, _, _, w2, s2 = ffn.stacked
    E, lin = len(ffn.experts), ffn.experts[0].w1
    assert w1.dtype == s1.dtype == torch.uint8
    assert w1.shape == (E, lin.out_features, lin.in_features // 2)
    assert s1.shape == (E, lin.out_features, lin.in_features // 32)
    assert w2.shape[2] * 2 == s2.shape[2] * 32 == lin.out_features
    assert all(ex.w2.weight.data_ptr() == w2[e].data_ptr() for e, ex in enumerate(ffn.experts))
    assert all(torch.equal(ex.w2.dequantized(torch.float32), b)
               for ex, b in zip(ffn.experts, before))
