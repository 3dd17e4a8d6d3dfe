"""The decode step's indexer fold and stream placement on a GPU (marker gpu), end to end on the
tiny model, each against a twin runner with it off: the CSA indexer's query RoPE inside its
score kernel (attention_decode.INDEX_ROPE_IN_SCORES; its rotation equals the rope launch's bit
for bit, tests/runtime/kernels/test_indexer.py) and the indexer's compressor update on a side
stream of its own (INDEX_COMPRESS_BESIDE: the same launches in another order). The whole step's
logits must be equal, and the switch must really act."""

import importlib

import pytest
import torch
from support import prefill_then_decode


def test_switch_is_a_batch_size():
    mod = importlib.import_module("backfit.runtime.model.attention_decode")
    assert type(mod.INDEX_ROPE_IN_SCORES) is int and mod.INDEX_ROPE_IN_SCORES >= 0


def twin_runners(tiny_converted):
    """Two eager triton runners on the tiny int8 conversion (one with the switch under test on,
    one off), fed the same steps; skips where this process already runs the torch backend."""
    from backfit.runtime import kernels as kpkg
    from backfit.runtime.runner import ModelRunner, RunnerConfig
    if kpkg._backend not in (None, "triton"):
        pytest.skip("this process already runs the torch backend")
    rc = RunnerConfig(str(tiny_converted(1, "int8")), device="cuda", kernels="triton",
                      max_num_seqs=4, max_model_len=256, block_size=16, num_blocks=72,
                      enforce_eager=True)
    return ModelRunner(rc), ModelRunner(rc)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_fold_matches_the_unfolded_step(tiny_converted, tp1_process, monkeypatch):
    from backfit.runtime.kernels import attention as katt      # model.attention's import
    on, off = twin_runners(tiny_converted)
    dec = importlib.import_module("backfit.runtime.model.attention_decode")
    rotated, real = [], katt.indexer_scores
    monkeypatch.setattr(katt, "indexer_scores", lambda *a, q_rope=None, **k: rotated.append(
        q_rope is not None) or real(*a, q_rope=q_rope, **k))

    def forward(runner, step, batch: int) -> torch.Tensor:
        monkeypatch.setattr(dec, "INDEX_ROPE_IN_SCORES", batch)
        return runner.forward(step).logits.float()
    g = torch.Generator().manual_seed(5)
    for n in (1, 2):
        for k, (prefill, step) in enumerate(prefill_then_decode(n, g)):
            got, want = forward(on, step, 64), forward(off, step, 0)
            rel = ((got - want).norm() / want.norm()).item()
            assert torch.equal(got, want), (n, k, prefill, rel)
    assert any(rotated) and not all(rotated)             # the fold ran, and only where on


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_index_compress_beside_matches_the_chain_in_order(tiny_converted, tp1_process,
                                                           monkeypatch):
    on, off = twin_runners(tiny_converted)
    dec = importlib.import_module("backfit.runtime.model.attention_decode")
    names, real = [], dec.beside
    monkeypatch.setattr(dec, "beside", lambda dev, name, fn, after=None: names.append(name)
                        or real(dev, name, fn, after))

    def forward(runner, step, beside: bool) -> torch.Tensor:
        monkeypatch.setattr(dec, "INDEX_COMPRESS_BESIDE", beside)
        return runner.forward(step).logits.float()
    g = torch.Generator().manual_seed(7)
    for n in (1, 3):
        for k, (prefill, step) in enumerate(prefill_then_decode(n, g)):
            n0 = names.count("icomp")
            got = forward(on, step, True)
            ran = names.count("icomp") > n0
            want = forward(off, step, False)
            assert torch.equal(got, want), (n, k, prefill)
            assert prefill or ran, (n, k)                    # the side stream really ran
    assert names.count("icomp") and "index" in names
