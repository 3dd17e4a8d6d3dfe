"""The decode step's query folds on a GPU (marker gpu), end to end on the tiny model: the CSA
indexer's query RoPE inside its score kernel (attention_decode.INDEX_ROPE_IN_SCORES), the
scale-free q_norm in both wq_b GEMVs with its 1/rms in the query's RMS + RoPE launch
(Q_NORM_SCALE_FREE), against twin runners with both off. GEMV_TABLE rows for the
tiny wq_b shapes (4,096 and 2,048 x 128) make the folds apply, as they do at a TP-4 rank's real
shapes. The folds round q differently (bf16 ulps), so the logits are held to a small relative
error and the same argmax; tests/runtime/kernels/test_kernel_path_e2e.py checks the same wiring
under the interpreter against the torch path."""

import importlib

import pytest
import torch
from support import prefill_then_decode

# each switch's (on, off) values
SWITCHES = dict(INDEX_ROPE_IN_SCORES=(64, 0), Q_NORM_SCALE_FREE=(True, False))
TINY_ROWS = [("int8", (n, n), (128, 128), (1, 2), dict(variant="cuda", BN=8, BK=128, num_warps=4,
                                                       MAGIC=True, num_stages=1))
             for n in (4096, 2048)]


def test_switches_exist():
    mod = importlib.import_module("backfit.runtime.model.attention_decode")
    for name, (on, _) in SWITCHES.items():
        assert type(getattr(mod, name)) is type(on), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_folds_match_the_unfolded_step(tiny_converted, tp1_process, monkeypatch):
    from backfit.runtime import kernels as kpkg
    from backfit.runtime.kernels.linear import gemv
    from backfit.runtime.layers import Linear
    from backfit.runtime.runner import ModelRunner, RunnerConfig
    if kpkg._backend not in (None, "triton"):
        pytest.skip("this process already runs the torch backend")
    dec = importlib.import_module("backfit.runtime.model.attention_decode")
    monkeypatch.setattr(gemv, "GEMV_TABLE", gemv.GEMV_TABLE + TINY_ROWS)
    weighted, real = [], Linear.forward_weighted
    monkeypatch.setattr(Linear, "forward_weighted",
                        lambda self, x, n: weighted.append(x.shape[0]) or real(self, x, n))
    conv = tiny_converted(1, "int8")
    rc = RunnerConfig(str(conv), device="cuda", kernels="triton", max_num_seqs=4,
                      max_model_len=256, block_size=16, num_blocks=72, enforce_eager=True)
    on, off = ModelRunner(rc), ModelRunner(rc)

    def forward(runner, step, flag: bool) -> torch.Tensor:
        for name, values in SWITCHES.items():
            monkeypatch.setattr(dec, name, values[0] if flag else values[1])
        return runner.forward(step).logits.float()
    g = torch.Generator().manual_seed(5)
    for n in (1, 2):
        for k, (prefill, step) in enumerate(prefill_then_decode(n, g)):
            got, want = forward(on, step, True), forward(off, step, False)
            rel = ((got - want).norm() / want.norm()).item()
            assert prefill or rel < 3e-2 and torch.equal(got.argmax(-1), want.argmax(-1)), \
                (n, k, rel)
    assert weighted and set(weighted) == {1, 2}          # the scale-free fold really ran
