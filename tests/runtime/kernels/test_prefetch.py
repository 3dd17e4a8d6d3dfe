"""kernels.prefetch: L2Plan's chunk table covers each tensor's bytes exactly once, in order (CPU);
on a GPU (marker gpu) a launch over real weights compiles, runs inside a CUDA graph and leaves
every byte as it was (the prefetch writes nothing)."""

import pytest
import torch

from backfit.runtime.kernels.prefetch import L2Plan


def test_plan_chunks_cover_each_span_in_order():
    a = torch.zeros(1000, dtype=torch.int8)
    b = torch.zeros(3, 100, dtype=torch.float32)
    c = torch.zeros(64, 64, dtype=torch.bfloat16).t()          # strided: the span of its storage
    p = L2Plan([a, None, b, c], ch=256)
    tab = p.tab.tolist()
    spans = [(a, 1000), (b, 1200), (c, 64 * 64 * 2)]
    want = []
    for t, nb in spans:
        want += [(t.data_ptr() - a.data_ptr() + s, min(256, nb - s), 0)
                 for s in range(0, nb, 256)]
    assert [tuple(r) for r in tab] == want
    assert p.bytes == 1000 + 1200 + 8192 and all(0 < n <= 256 for _, n, _ in tab)
    assert p.base is a


def test_expert_plan_chunks_one_expert_with_its_stride():
    w = torch.zeros(5, 16, 40, dtype=torch.uint8)            # [E, N, K/2] codes
    s = torch.zeros(5, 16, 3, dtype=torch.uint8)             # [E, N, K/32] exponents
    p = L2Plan([w, s], ch=256, experts=True)
    assert [tuple(r) for r in p.tab.tolist()] == [
        (0, 256, 640), (256, 256, 640), (512, 128, 640), (s.data_ptr() - w.data_ptr(), 48, 48)]
    assert p.bytes == 640 + 48


def test_plan_errors():
    with pytest.raises(ValueError, match="one device"):
        L2Plan([None, torch.zeros(0)])
    with pytest.raises(ValueError, match="expert ids"):
        L2Plan([torch.zeros(4)]).launch(torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="expert ids"):
        L2Plan([torch.zeros(2, 4)], experts=True).launch()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_launch_in_a_graph_writes_nothing():
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randint(-127, 128, (4096, 1000), dtype=torch.int8, device="cuda", generator=g)
    s = torch.rand(4096, device="cuda", generator=g)
    h = torch.randn(300, 77, device="cuda", generator=g).bfloat16()[:, 5:]   # strided
    e = torch.randint(0, 255, (8, 512, 2048), dtype=torch.uint8, device="cuda", generator=g)
    keep = [t.clone() for t in (w, s, h, e)]
    p, pe = L2Plan([w, s, h], ch=1 << 16), L2Plan([e], experts=True)
    ids = torch.tensor([[7, 0, 3]], device="cuda")
    p.launch()
    pe.launch(ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p.launch()
        pe.launch(ids)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip((w, s, h, e), keep))
