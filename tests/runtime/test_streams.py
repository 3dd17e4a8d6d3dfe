"""Side streams of the decode step (runtime/streams.py) change no bit, on a GPU (marker gpu):
twin eager runners on the triton kernels, one with every side stream on (the compressor update,
the CSA indexer chain (its compressor update beside its queries, forked after the FP32
projections; tests/runtime/test_decode_folds.py holds that switch alone) and the kv chain (norm,
RoPE, ring store) beside the query path, wq_a|wkv and the router launched before the side
chains that start with them, the shared expert, the Sinkhorn, launched after its sub-layer's
launches), one with all of them off (everything in order on one stream), fed the same prefill
and decode steps. The graphed path runs with them on and is held to the eager one by
tests/runtime/test_graphs.py."""

import pytest
import torch
from support import prefill_then_decode

SWITCHES = (("backfit.runtime.model.attention_decode", "SIDE_STREAMS"),
            ("backfit.runtime.model.attention_decode", "KV_BESIDE"),
            ("backfit.runtime.model.attention_decode", "INDEX_COMPRESS_BESIDE"),
            ("backfit.runtime.model.moe", "SHARED_STREAM"),
            ("backfit.runtime.model.moe", "ROUTER_FIRST"),
            ("backfit.runtime.kernels.mhc.decode", "SINKHORN_STREAM"),
            ("backfit.runtime.kernels.mhc.decode", "SINKHORN_LAST"))
# switches by batch size: (module, name, on = every batch size the test runs, off)
BY_BATCH = (("backfit.runtime.model.attention_decode", "QUERY_FIRST", (1, 3), ()),)


def test_switches_exist_and_default_on():
    import importlib
    for mod, name in SWITCHES:
        assert getattr(importlib.import_module(mod), name) is True, (mod, name)
    for mod, name, _, _ in BY_BATCH:
        assert 1 in getattr(importlib.import_module(mod), name), (mod, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_side_streams_equal_in_order(tiny_converted, tp1_process, monkeypatch):
    import importlib

    from backfit.runtime import kernels as kpkg
    from backfit.runtime.runner import ModelRunner, RunnerConfig
    if kpkg._backend not in (None, "triton"):
        pytest.skip("this process already runs the torch backend")
    conv = tiny_converted(1, "int8")
    rc = RunnerConfig(str(conv), device="cuda", kernels="triton", max_num_seqs=4,
                      max_model_len=256, block_size=16, num_blocks=72, enforce_eager=True)
    on, off = ModelRunner(rc), ModelRunner(rc)
    ratios = {layer.attn.ratio for layer in on.model.layers}
    assert 0 in ratios and 4 in ratios and max(ratios) > 4, ratios   # window, CSA, HCA layers

    def forward(runner, step, flag: bool) -> torch.Tensor:
        for mod, name in SWITCHES:
            monkeypatch.setattr(importlib.import_module(mod), name, flag)
        for mod, name, yes, no in BY_BATCH:
            monkeypatch.setattr(importlib.import_module(mod), name, yes if flag else no)
        return runner.forward(step).logits
    g = torch.Generator().manual_seed(3)
    for n in (1, 3):
        for k, (_, step) in enumerate(prefill_then_decode(n, g)):
            assert torch.equal(forward(on, step, True), forward(off, step, False)), (n, k)
