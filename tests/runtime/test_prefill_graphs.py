"""Piecewise prefill graphs (runtime/prefill_graphs.py): the split and the padding on CPU, the
capture and replay on a GPU.

CPU: the padded sizes and the memory reserve; a runner whose prefill and mixed steps run the
pieces eagerly on padded static buffers (PrefillGraphs(graphs=False): the same code as the
graphs minus the capture) gives the logits of the plain eager forward (within the CPU BLAS's
rounding, PIECES_REL), step after step, for chunked prompts beside decode rows, with stale rows
left in the buffers by a larger step.
GPU (marker gpu): the captured pieces replay bit-equal to the same pieces run eagerly, the
start-up check catches a wrong piece, and greedy decoding through the engine with prefill
graphs equals the engine without them.
"""


import pytest
import torch

from backfit.runtime.cache.budget import PIECE_BYTES, prefill_graph_reserve, prefill_sizes

PREV = (8, 9)                 # the "sampled ids" the placeholders of _steps' 4th step stand for


def _forward(runner, step):
    """runner.forward(step), with the placeholders' ids on the runner's device where it has any."""
    holes = any(min(s.tokens) < 0 for s in step.seqs)
    return runner.forward(step, torch.tensor(PREV, device=runner.device) if holes else None)


def test_prefill_sizes():
    assert prefill_sizes(63) == []
    assert prefill_sizes(64) == [64]
    assert prefill_sizes(100) == [64, 100]
    assert prefill_sizes(2048) == [64, 128, 256, 512, 1024, 1536, 2048]
    assert prefill_sizes(1536) == [64, 128, 256, 512, 1024, 1536]
    assert prefill_sizes(8192)[-3:] == [2048, 4096, 8192]


def test_prefill_graph_reserve_grows_with_tokens(model_f32):
    cfg = model_f32.cfg
    small, big = (prefill_graph_reserve(cfg, 1, t, 256, 4) for t in (64, 2048))
    pieces = 7 * (cfg.num_hidden_layers + 1)
    assert big > small + (pieces - (cfg.num_hidden_layers + 1)) * PIECE_BYTES


def _steps(g):
    """Chunked prompts of 70 and 90 tokens (chunks of 40 / 50 / 20 beside decode rows), then a
    new 30-token prompt beside both decodes, whose tokens are the overlapped step's placeholders
    (-1 - r: the last step's sampled row r, `PREV`): every prefill shape the engine makes (a lone
    chunk, two chunks, chunks beside decode rows), from 70 tokens down to 32."""
    from backfit.runtime.runner import StepInput, StepSeq
    p = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (70, 90, 30)]
    tb = [tuple(range(8 * i, 8 * i + 8)) for i in range(3)]
    yield StepInput((StepSeq(0, 0, tb[0], 0, tuple(p[0][:40]), False),
                     StepSeq(1, 1, tb[1], 0, tuple(p[1][:30]), False)))
    yield StepInput((StepSeq(0, 0, tb[0], 40, tuple(p[0][40:]), True),
                     StepSeq(1, 1, tb[1], 30, tuple(p[1][30:80]), False)))
    yield StepInput((StepSeq(0, 0, tb[0], 70, (7,), True),
                     StepSeq(1, 1, tb[1], 80, tuple(p[1][80:]), True)))
    yield StepInput((StepSeq(0, 0, tb[0], 71, (-1,), True), StepSeq(1, 1, tb[1], 90, (-2,), True),
                     StepSeq(2, 2, tb[2], 0, tuple(p[2]), True)))
    yield StepInput((StepSeq(0, 0, tb[0], 72, (5,), True), StepSeq(1, 1, tb[1], 91, (6,), True),
                     StepSeq(2, 2, tb[2], 30, (4,), True)))


# The CPU forward with and without the pieces' padding runs its GEMMs at other row counts, and a
# CPU's BLAS may round a row differently by how many rows ride with it (oneDNN's AMX BF16
# kernels, MKL's small-M FP32 path; not the GPU, where the kernels are ours and the replay is
# held bit-equal below). So the CPU comparison has a bound: the relative Frobenius distance of a
# step's logits. Its floor, measured on the tiny model's steps below (bf16 activations): the same
# plain forward with oneDNN's BF16 GEMMs against ATen's own (torch.backends.mkldnn.enabled off),
# rel 0.89e-3 to 1.37e-3 (max |dlogit| 2.6e-2 at |logit| <= 27; AMD EPYC, 2026-12-06); an AMX
# Xeon's padded rows against unpadded ones moved the logits by ~5e-3 (max |dlogit|, 2026-12-05).
# A real fault moves them further: positions one off in the padded input, rel 1.9e-2 at the
# first sampled step; the cores' output copied one row off, 8.7e-2 (planted, 2026-12-06).
PIECES_REL = 5e-3


def _rel(got, want) -> float:
    return float((got - want).norm() / want.norm())


def test_pieces_equal_the_eager_forward_on_cpu(tiny_converted, tp1_process):
    from backfit.runtime.graphs import PrefillGraphs
    from backfit.runtime.runner import ModelRunner, RunnerConfig
    conv = tiny_converted(1, "int8")
    rc = RunnerConfig(str(conv), device="cpu", max_num_seqs=4, max_model_len=128,
                      block_size=16, num_blocks=40)
    plain, pieces = ModelRunner(rc), ModelRunner(rc)
    assert plain.prefill_graphs is None and plain.prefill_graph_tokens == 0    # CPU: off
    pieces.prefill_graphs = PrefillGraphs(pieces.model, 128, pieces.device, graphs=False)
    assert pieces.prefill_graphs.sizes == [64, 128]
    g = torch.Generator().manual_seed(0)
    for n, step in enumerate(_steps(g)):
        want, got = _forward(plain, step).logits, _forward(pieces, step).logits
        T = sum(len(s.tokens) for s in step.seqs)
        P = pieces.prefill_graphs.size_for(T)
        if any(len(s.tokens) > 1 for s in step.seqs):
            # padding rows are token 0 at position 0, not an earlier step's rows: a verify
            # step's draft placeholders (-1 - r) left there sent hash routing out of bounds
            assert not pieces.prefill_graphs.stage[:, T:P].any(), n
        if n == 0:                                          # nothing samples: the cache shows it
            assert got is None and want is None
            continue
        assert got.shape == want.shape
        assert _rel(got, want) < PIECES_REL, (n, _rel(got, want))
    assert pieces.prefill_graphs.steps == 4                 # the last step is pure decode


def _tp_worker(rank: int, size: int, port: int, root: str, out: str) -> None:
    torch.set_num_threads(1)
    from backfit.runtime.distributed import destroy_distributed, init_distributed
    from backfit.runtime.graphs import PrefillGraphs
    from backfit.runtime.runner import ModelRunner, RunnerConfig
    init_distributed(rank, size, port)
    try:
        rc = RunnerConfig(root, device="cpu", max_num_seqs=4, max_model_len=128,
                          block_size=16, num_blocks=40)
        plain, pieces = ModelRunner(rc), ModelRunner(rc)
        pieces.prefill_graphs = PrefillGraphs(pieces.model, 128, pieces.device, graphs=False)
        g = torch.Generator().manual_seed(0)
        got = [(_forward(plain, st).logits, _forward(pieces, st).logits) for st in _steps(g)]
        torch.save(got[1:], f"{out}/pieces{rank}.pt")
    finally:
        destroy_distributed()


def test_pieces_equal_the_eager_forward_at_tp2(tiny_converted, tmp_path):
    """The same on two gloo ranks: the pieces' all-reduces (wo_b, the MoE, the embedding) meet
    in the same order as the plain forward's, padded rows included (within PIECES_REL); both
    ranks return the same gathered logits (bit for bit: the same gathered tensors)."""
    import torch.multiprocessing as mp
    from backfit.runtime.distributed import free_port
    mp.spawn(_tp_worker, args=(2, free_port(), str(tiny_converted(2, "int8")), str(tmp_path)),
             nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"pieces{r}.pt") for r in range(2))
    assert len(r0) == 4
    for (want, got), (want1, got1) in zip(r0, r1):
        assert _rel(got, want) < PIECES_REL and _rel(got1, want1) < PIECES_REL
        assert torch.equal(got, got1) and torch.equal(want, want1)


def test_prefill_graph_tokens_is_checked(tiny_converted, tp1_process):
    from backfit.runtime.runner import ModelRunner, RunnerConfig
    conv = tiny_converted(1, "int8")
    for bad in (-1, 1, 63):
        with pytest.raises(ValueError, match=f"--prefill-graph-tokens {bad}: 0 .* at least 64"):
            ModelRunner(RunnerConfig(str(conv), device="cpu", max_model_len=128, block_size=16,
                                     num_blocks=40, prefill_graph_tokens=bad))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefill_graphs_replay_equals_eager_pieces(tiny_converted, tp1_process):
    """A runner with prefill graphs against a twin running the same pieces eagerly (the same
    kernels at the same padded shapes: bit-equal logits, step after step) and against the plain
    eager forward (other kernels below 64 tokens (mhc's decode path) and at other shapes: BF16
    noise, measured on the H200: max |dlogit| 0.28, bounded by norm here; backfit verify
    --prefill-graphs judges the path against the reference); the start-up check passes the
    real pieces and fails a wrong one."""
    from backfit.runtime import kernels as kpkg
    from backfit.runtime.graphs import PrefillGraphs
    from backfit.runtime.runner import ModelRunner, RunnerConfig
    if kpkg._backend not in (None, "triton"):
        pytest.skip("this process already runs the torch backend")
    conv = tiny_converted(1, "int8")
    rc = RunnerConfig(str(conv), device="cuda", kernels="triton", max_num_seqs=4,
                      max_model_len=128, block_size=16, num_blocks=40, prefill_graph_tokens=128)
    graphed = ModelRunner(rc)
    pg = graphed.prefill_graphs
    assert pg is not None and pg.sizes == [64, 128] and pg.use_graphs
    eager = ModelRunner(RunnerConfig(**{**rc.__dict__, "enforce_eager": True}))
    assert eager.prefill_graphs is None and eager.prefill_graph_tokens == 0
    pieces = ModelRunner(RunnerConfig(**{**rc.__dict__, "enforce_eager": True}))
    pieces.prefill_graphs = PrefillGraphs(pieces.model, 128, pieces.device, graphs=False)
    assert pg.check() is None
    g_last, X, _ = pg.pieces[64][-1]
    bad, out = torch.cuda.CUDAGraph(), torch.empty_like(X)
    with torch.cuda.graph(bad):                         # a last piece that computes otherwise
        out.copy_(X * 1.05)
    pg.pieces[64][-1] = (bad, out, None)
    assert "prefill graphs' streams differ from the eager pieces'" in pg.check()
    pg.pieces[64][-1] = (g_last, X, None)
    g = torch.Generator().manual_seed(0)
    for n, step in enumerate(_steps(g)):
        got, same, want = (_forward(r, step).logits for r in (graphed, pieces, eager))
        if n == 0:
            continue
        assert torch.equal(got, same), n
        rel = float((got - want).norm() / want.norm())     # another kernel path: BF16 noise
        assert rel < 2e-2, (n, rel)                        # (verify: ~6e-3 from FP32, either)
    assert pg.steps == pieces.prefill_graphs.steps == 4
