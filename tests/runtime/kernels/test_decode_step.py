"""model.attention_decode.decode_step on the kernel path under the interpreter (CPU): its
in-order branch, which every attention layer takes off CUDA and a layer without a compressor
takes on CUDA too, for one decode token of the tiny model's window-only, HCA and CSA layers,
against the torch path's attention over the same paged pools. The whole model's kernel path is
test_kernel_path_e2e.py's (opt-in: minutes); this one holds the decode step's wiring in `make
test`, where nothing else runs it on a CPU.
The interpreter truncates FP32 -> BF16 casts: held to a relative error of 2e-2 (1.1-1.2e-2 seen;
an output 5 % off reads 4e-2)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

from backfit.config import ModelConfig  # noqa: E402
from backfit.runtime import kernels as kpkg  # noqa: E402
from backfit.runtime.batch import ForwardBatch  # noqa: E402
from backfit.runtime.cache.paged import PagedCache  # noqa: E402
from backfit.runtime.loader import load_model  # noqa: E402
from backfit.runtime.model.transformer import Transformer  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the interpreter's CPU run")


def test_decode_step_in_order_equals_the_torch_path(tiny_converted, tp1_process, monkeypatch):
    conv = tiny_converted(1, "int8")
    model = Transformer(ModelConfig.from_file(conv / "config.json"), torch.bfloat16, mtp=False)
    load_model(model, conv)
    ratios = model.cfg.compress_ratios[:len(model.layers)]
    kinds = {"window": 0, "csa": 4}                          # HCA: any other ratio
    layers = [ratios.index(0), ratios.index(4), next(i for i, r in enumerate(ratios)
                                                       if r not in kinds.values())]
    cache = PagedCache(model.cfg, 1, 4, 16, model.dtype)
    tables = [(2, 0, 3, 1)]
    prompt = torch.randint(3, 500, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    monkeypatch.setattr(kpkg, "_backend", "torch")
    model(ForwardBatch.build([(0, prompt, 0)], slots=[0], block_tables=tables), cache)
    batch = ForwardBatch.build([(0, [11], len(prompt))], slots=[0], block_tables=tables)
    gen = torch.Generator().manual_seed(4)
    model.prepare_kernels()
    for i in layers:
        attn = model.layers[i].attn
        x = torch.randn(1, model.cfg.hidden_size, generator=gen).bfloat16()
        monkeypatch.setattr(kpkg, "_backend", "torch")
        want = attn(x, batch, cache.bind(batch).layer(i)).float()
        monkeypatch.setattr(kpkg, "_backend", "triton")
        monkeypatch.setattr(kpkg, "_ANY_DEVICE", True)
        got = attn(x, batch, cache.bind(batch).layer(i)).float()
        monkeypatch.setattr(kpkg, "_ANY_DEVICE", False)
        rel = ((got - want).norm() / want.norm()).item()
        assert got.shape == want.shape and rel < 2e-2, (i, ratios[i], rel)   # 1.1-1.2e-2 seen
