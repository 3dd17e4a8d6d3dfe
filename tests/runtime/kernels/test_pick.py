"""kernels.pick: a drafter's pick over the vocabulary in three split launches (CPU: the Triton
interpreter; compiled for sm_80 in test_sm80_small_ops.py) against plain torch: greedy ids equal
torch.argmax's (ties: the first index, across chunks too), q within FP32 rounding of
torch.softmax(l / T) and summing to 1, and the sampled id exactly the exponential race over the
returned q (the acceptance rule needs the draw to come from that q, bit for bit)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"

from support import kernel_module  # noqa: E402


def _pk(monkeypatch, ch: int):
    pk = kernel_module("pick", "_pick_stats_kernel", INTERPRET)
    monkeypatch.setattr(pk, "PICK_CH", ch)
    return pk


@pytest.mark.parametrize("S, V, ch", [(3, 9000, 2048), (1, 4096, 1024), (5, 1500, 4096)])
def test_pick_equals_torch(monkeypatch, S, V, ch):
    pk = _pk(monkeypatch, ch)
    g = torch.Generator().manual_seed(S * V)
    logits = torch.randn(S, V, generator=g) * 3
    temp = torch.tensor([0.0, 0.7, 1.3, 1e-7, 2.0][:S])
    both = torch.empty(S, 2, V).exponential_(generator=g)
    noise = both[:, 1]                                          # strided rows
    ids, q = pk.pick_tokens(*(t.to(DEV) for t in (logits, temp, noise)))
    ids, q = ids.cpu(), q.cpu()
    want_q = torch.softmax(logits / temp[:, None].clamp(min=1e-5), -1)
    assert torch.allclose(q, want_q, rtol=1e-5, atol=1e-7)
    assert torch.allclose(q.sum(-1), torch.ones(S), atol=1e-5)
    race = (q / noise).argmax(-1)                              # the draw from the returned q
    want = torch.where(temp > 0, race, logits.argmax(-1))
    assert torch.equal(ids, want) and ids.dtype == torch.int64


def test_pick_greedy_ties_take_the_first_index_across_chunks(monkeypatch):
    pk = _pk(monkeypatch, 2048)                                # two loop steps a chunk
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(1))
    top = logits.max() + 1
    logits[0, [3000, 700, 4999]] = top                         # three chunks hold the maximum
    logits[1, [1500, 100]] = top                               # one chunk, two loop steps
    logits[2, [1030, 1025]] = top                              # one loop step
    ids, _ = pk.pick_tokens(logits.to(DEV), torch.zeros(3, device=DEV),
                            torch.ones(3, 5000, device=DEV))
    assert ids.tolist() == [700, 100, 1025]
    with pytest.raises(ValueError, match="pick_tokens"):
        pk.pick_tokens(logits.to(DEV).double(), torch.zeros(3, device=DEV),
                       torch.ones(3, 5000, device=DEV))


def test_draft_pick_takes_the_kernel_on_the_kernel_path(monkeypatch):
    """model.draft.common.pick with temperatures: kernels.pick where the kernel path is on
    (PICK_KERNEL), the torch form otherwise; greedy rows agree, and a sampled row's id is the race
    over the returned q; PICK_KERNEL = False gives the torch form back."""
    import backfit.runtime.kernels as kpkg
    from backfit.runtime.model.draft import common
    _pk(monkeypatch, 1024)
    g = torch.Generator().manual_seed(4)
    S, V, k = 3, 3000, 2
    logits = (torch.randn(S, V, generator=g) * 2).to(DEV)
    z = torch.zeros(S, dtype=torch.long, device=DEV)
    rows = common.DraftRows(z, z, z.int(), z.int()[:, None], k,
                            torch.tensor([0.0, 0.9, 0.0], device=DEV),
                            torch.empty(k, S, V).exponential_(generator=g).to(DEV))
    monkeypatch.setattr(kpkg, "_backend", "torch")
    want_ids, want_q = common.pick(logits, rows, 1)               # torch backend: torch form
    monkeypatch.setattr(kpkg, "_backend", "triton")
    monkeypatch.setattr(kpkg, "_ANY_DEVICE", True)
    calls = []
    from backfit.runtime.kernels import pick as pk
    real = pk.pick_tokens
    monkeypatch.setattr(pk, "pick_tokens", lambda *a: calls.append(1) or real(*a))
    ids, q = common.pick(logits, rows, 1)
    assert calls and torch.allclose(q, want_q, rtol=1e-5, atol=1e-7)
    assert ids[0] == want_ids[0] and ids[2] == want_ids[2]
    assert ids[1] == (q[1] / rows.noise[1, 1]).argmax()
    monkeypatch.setattr(common, "PICK_KERNEL", False)
    ids2, q2 = common.pick(logits, rows, 1)
    assert len(calls) == 1 and torch.equal(ids2, want_ids) and torch.equal(q2, want_q)
