"""CUDA-graph decode (runtime/graphs/decode.py): the host side on CPU, capture and replay on a GPU.

CPU: the capture sizes, and the padding of a decode batch (padded rows use token 0 at position 0
in the scratch slot with every table entry the scratch block, so a replay never touches a real
sequence). GPU (marker gpu): a runner with graphs gives the same logits as the same runner
eager, step after step, for batches of 1, 3 and 4 sequences (a padded size and exact ones), and
the start-up check (DecodeGraphs.check) passes the real graph and fails a wrong one.
"""

import pytest
import torch

from backfit.runtime.cache.budget import capture_sizes, graph_reserve
from backfit.runtime.graphs.decode import pad_decode_inputs


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_graph_reserve_counts_every_size(model_f32):
    cfg = model_f32.cfg
    assert graph_reserve(cfg, 1, 256, 64) - graph_reserve(cfg, 1, 256, 63) > 0


def test_pad_decode_inputs():
    import numpy as np
    seqs = [(7, 40, 3, (5, 2, 9)), (8, 3, 0, (4,))]
    rows = pad_decode_inputs(seqs, 4, 5, scratch_slot=6, scratch_block=11)
    assert rows.dtype == np.int32 and rows.shape == (4, 8)
    assert rows[:, 0].tolist() == [7, 8, 0, 0] and rows[:, 1].tolist() == [40, 3, 0, 0]
    assert rows[:, 2].tolist() == [3, 0, 6, 6]
    assert rows[:, 3:].tolist() == [[5, 2, 9, 11, 11], [4, 11, 11, 11, 11], [11] * 5, [11] * 5]
    out = np.full((2, 6), -5, dtype=np.int32)                   # a staging view: every cell set
    empty = pad_decode_inputs([(1, 2, 3, ())], 2, 3, 6, 11, out=out)   # no blocks yet
    assert empty is out and out.tolist() == [[1, 2, 3, 11, 11, 11], [0, 0, 6, 11, 11, 11]]
    stale = np.full((4, 8), 99, dtype=np.int32)                 # last step's rows are overwritten
    assert pad_decode_inputs(seqs, 4, 5, 6, 11, out=stale).tolist() == rows.tolist()
    with pytest.raises(ValueError, match="do not fit a graph of batch 1"):
        pad_decode_inputs(seqs, 1, 5, 6, 11)
    with pytest.raises(ValueError, match="block table of 3 blocks, graphs hold 2"):
        pad_decode_inputs(seqs, 4, 2, 6, 11)


def test_pad_decode_inputs_row_loop_equals_vectorized():
    """Batches on both sides of graphs._ROW_LOOP (row by row / numpy) fill the same rows: checked
    cell by cell against a plain Python fill, into stale staging rows."""
    import numpy as np
    from backfit.runtime.graphs import decode as graphs
    for n in (graphs._ROW_LOOP, graphs._ROW_LOOP + 1, 3 * graphs._ROW_LOOP):
        seqs = [(i + 1, 10 * i, i, tuple(range(100 + i, 100 + i + i % 4))) for i in range(n)]
        B = n + 2
        want = [[0, 0, 6] + [11] * 5 for _ in range(B)]
        for i, (t, p, sl, tb) in enumerate(seqs):
            want[i][:3] = [t, p, sl]
            want[i][3:3 + len(tb)] = list(tb)
        stale = np.full((B, 8), 99, dtype=np.int32)
        assert pad_decode_inputs(seqs, B, 5, 6, 11, out=stale).tolist() == want, n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_replay_equals_eager(tiny_converted, tp1_process):
    """Twin runners (graphs / --enforce-eager) fed the same steps: exact sizes give bit-equal
    logits (the same kernels at the same shapes); a padded batch (3 in a graph of 4) may split
    attention differently, so it is held to FP32 summation noise and the same argmax."""
    from backfit.runtime import kernels as kpkg
    from backfit.runtime.runner import ModelRunner, RunnerConfig, StepInput, StepSeq
    if kpkg._backend not in (None, "triton"):
        pytest.skip("this process already runs the torch backend")
    conv = tiny_converted(1, "int8")
    rc = RunnerConfig(str(conv), device="cuda", kernels="triton", max_num_seqs=4,
                      max_model_len=128, block_size=16, num_blocks=40,
                      prefill_graph_tokens=0)    # the prefill steps eager in both (decode here)
    graphed = ModelRunner(rc)
    eager = ModelRunner(RunnerConfig(**{**rc.__dict__, "enforce_eager": True}))
    assert graphed.graphs is not None and graphed.graphs.sizes == [1, 2, 4]
    assert eager.graphs is None
    assert graphed.graphs.check() is None               # the start-up check passed, and again
    real = graphed.graphs.graphs[1]
    bad, out = torch.cuda.CUDAGraph(), torch.empty_like(real[1])
    with torch.cuda.graph(bad):                         # a graph that computes something else
        out.copy_(real[1] * 1.05)
    graphed.graphs.graphs[1] = (bad, out)
    assert "differ from the eager step's (relative error 0.05" in graphed.graphs.check()
    graphed.graphs.graphs[1] = real
    g = torch.Generator().manual_seed(0)
    for n in (1, 3, 4):
        tables = [tuple(range(8 * i, 8 * i + 8)) for i in range(n)]
        prompts = [torch.randint(3, 500, (9 + 5 * i,), generator=g).tolist() for i in range(n)]
        first = StepInput(tuple(StepSeq(i, i, tables[i], 0, tuple(p), True)
                                for i, p in enumerate(prompts)))
        assert torch.equal(graphed.forward(first).logits, eager.forward(first).logits)
        starts = [len(p) for p in prompts]
        for _ in range(12):                                         # crosses 4- and 8-blocks
            toks = torch.randint(3, 500, (n,), generator=g).tolist()
            step = StepInput(tuple(StepSeq(i, i, tables[i], starts[i], (toks[i],), True)
                                   for i in range(n)))
            before = graphed.graphs.replays
            got, want = graphed.forward(step).logits, eager.forward(step).logits
            assert graphed.graphs.replays == before + 1
            assert got.shape == want.shape == (n, graphed.cfg.vocab_size)
            if n in graphed.graphs.sizes:
                assert torch.equal(got, want), n
            else:
                torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
                assert torch.equal(got.argmax(-1), want.argmax(-1))
            starts = [s + 1 for s in starts]
