"""The decode step's folds and stream placement on a GPU (marker gpu), end to end on the
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


def fold_against_own_launch(tiny_converted, monkeypatch, rows, switch: str, launch: str,
                            seed: int) -> None:
    """A GEMV fold of attention_decode (switch) against its own rope_norm launch (launch), the
    tiny model's GEMV shape (rows(attn) -> (N, K)) given a GEMV_TABLE row of the cuda variant:
    the step's logits bit for bit at batch 1 and 2, and fewer `launch` calls (it really folds)."""
    from backfit.runtime.kernels.linear import gemv
    from backfit.runtime.kernels import rope_norm
    on, off = twin_runners(tiny_converted)
    N, K = rows(on.model.layers[0].attn)
    monkeypatch.setattr(gemv, "GEMV_TABLE", [("int8", (N, N), (K, K), (1, 2),
                                              dict(variant="cuda", BN=4, BK=128, num_warps=4))]
                        + gemv.GEMV_TABLE)
    dec = importlib.import_module("backfit.runtime.model.attention_decode")
    calls, real = [], getattr(rope_norm, launch)
    monkeypatch.setattr(rope_norm, launch, lambda *a, **k: calls.append(1) or real(*a, **k))

    def forward(runner, step, sizes) -> tuple[torch.Tensor, int]:
        monkeypatch.setattr(dec, switch, sizes)
        n0 = len(calls)
        return runner.forward(step).logits.float(), len(calls) - n0
    g = torch.Generator().manual_seed(seed)
    for n in (1, 2):
        for k, (prefill, step) in enumerate(prefill_then_decode(n, g)):
            (got, n_on), (want, n_off) = forward(on, step, (1, 2)), forward(off, step, ())
            assert torch.equal(got, want), (n, k, prefill)
            assert prefill or n_on < n_off, (n, k, n_on, n_off)      # the fold really ran


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_q_norm_in_wq_a_matches_its_own_launch(tiny_converted, tp1_process, monkeypatch):
    """Q_NORM_IN_WQ_A: q_norm run by the wq_a|wkv launch's last program (a GEMV_TABLE row for the
    tiny model's joint shape, on the cuda variant, added here) gives the step's logits of q_norm's
    own launch bit for bit at batch 1 and 2, and really folds (fewer rms_norm launches)."""
    fold_against_own_launch(tiny_converted, monkeypatch, lambda attn: (
        attn.wq_a.out_features + attn.wkv.out_features, attn.wq_a.in_features),
        "Q_NORM_IN_WQ_A", "rms_norm", 9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_q_rope_in_wq_b_matches_its_own_launch(tiny_converted, tp1_process, monkeypatch):
    """Q_ROPE_IN_WQ_B: the query's per-head RMS + RoPE run by the last program of each head in
    wq_b's launch (a GEMV_TABLE row for the tiny model's wq_b shape, on the cuda variant, added
    here) gives the step's logits of the rope launch bit for bit at batch 1 and 2, and really
    folds (fewer rope launches). Q_NORM_IN_WQ_B's fold off: it takes batch 2 otherwise."""
    dec = importlib.import_module("backfit.runtime.model.attention_decode")
    monkeypatch.setattr(dec, "Q_NORM_IN_WQ_B", ())
    fold_against_own_launch(tiny_converted, monkeypatch, lambda attn: (
        attn.wq_b.out_features, attn.wq_b.in_features), "Q_ROPE_IN_WQ_B", "rope", 13)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_joint_wq_b_matches_the_two_launches(tiny_converted, tp1_process, monkeypatch):
    """WQ_B_JOINT: a CSA layer's wq_b and its indexer's as one launch (rows of one weight, the
    indexer chain forked after it) give the step of the two launches: the same greedy tokens and
    logits within the linears' FP32 summation order (their tiles differ by shape), and the joint
    launch really runs at batch 1 only."""
    from backfit.runtime.layers import FusedProjection
    on, off = twin_runners(tiny_converted)
    dec = importlib.import_module("backfit.runtime.model.attention_decode")
    joints = {id(layer.attn.fused_b) for layer in on.model.layers} - {id(None)}
    assert joints                                                    # CSA layers fused their wq_b
    calls, real = [], FusedProjection.__call__
    monkeypatch.setattr(FusedProjection, "__call__", lambda self, x, *a: calls.append(
        id(self) in joints) or real(self, x, *a))

    def forward(runner, step, sizes) -> torch.Tensor:
        monkeypatch.setattr(dec, "WQ_B_JOINT", sizes)
        return runner.forward(step).logits.float()
    g = torch.Generator().manual_seed(11)
    for n in (1, 2):
        for k, (prefill, step) in enumerate(prefill_then_decode(n, g)):
            n0 = sum(calls)
            got = forward(on, step, (1,))
            joined = sum(calls) - n0
            want = forward(off, step, ())
            rel = ((got - want).norm() / want.norm()).item()
            assert rel < 1e-2 and torch.equal(got.argmax(-1), want.argmax(-1)), (n, k, rel)
            if not prefill:
                assert (joined > 0) == (n == 1), (n, k, joined)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_l2_prefetch_changes_no_logit(tiny_converted, tp1_process, monkeypatch):
    """model.prefetch.L2_PREFETCH: the weights prefetched into L2 on the "l2" stream at its four
    points leave the step's logits bit for bit as without, at batch 1 and 2, and every point
    really launches at a decode step (4 a layer but the first layer's "q")."""
    from backfit.runtime.kernels import prefetch as kpf
    on, off = twin_runners(tiny_converted)
    pf = importlib.import_module("backfit.runtime.model.prefetch")
    calls, real, real_rows = [], kpf.l2_prefetch, kpf.l2_prefetch_rows
    monkeypatch.setattr(kpf, "l2_prefetch", lambda ts, *a, **k: calls.append(len(ts))
                        or real(ts, *a, **k))
    monkeypatch.setattr(kpf, "l2_prefetch_rows", lambda ts, ids, *a, **k: calls.append(
        len(ts)) or real_rows(ts, ids, *a, **k))

    def forward(runner, step, points) -> tuple[torch.Tensor, int]:
        monkeypatch.setattr(pf, "L2_PREFETCH", points)
        n0 = len(calls)
        return runner.forward(step).logits.float(), len(calls) - n0
    L = len(on.model.layers)
    g = torch.Generator().manual_seed(15)
    for n in (1, 2):
        for k, (prefill, step) in enumerate(prefill_then_decode(n, g)):
            got, n_on = forward(on, step, ("o", "ffn", "down", "q"))
            want, n_off = forward(off, step, ())
            assert torch.equal(got, want), (n, k, prefill)
            assert n_off == 0 and (prefill or n_on == 4 * L - 1), (n, k, n_on)
