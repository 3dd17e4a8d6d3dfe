"""The runtime's drafters (runtime/model/draft: MTP chained, DSpark) against the independent
reference (verify/reference.py Reference.mtp_draft / dspark_draft) on the tiny Flash and 0731
checkpoints converted losslessly (bf16), FP32 activations, the paged pools.

Both sides are FP32 on the same weights through different code (a chunked paged forward vs one
reference pass), so draft logits agree to FP32 rounding: measured <= 5e-7 relative (seed 0);
TOL = 1e-4. The drafts are compared greedily (same argmax chain) and teacher-forced. Planted:
a DSpark ring one position short (rel 1.9e-2), the MTP chain fed X_p again instead of its own
output: both fail."""

from __future__ import annotations

import pytest
import torch
from support import one_thread

from backfit.config import ModelConfig
from backfit.runtime.batch import ForwardBatch
from backfit.runtime.cache.paged import PagedCache
from backfit.runtime.loader import load_model
from backfit.runtime.model.transformer import Transformer
from backfit.verify.reference import Reference

N, K, B = 40, 3, 16          # prefix tokens, drafts, block size
TOL = 1e-4


def rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(scope="module")
def conv_0731(tiny_converted):
    return tiny_converted(1, "bf16", "0731")


def _runtime(root):
    model = Transformer(ModelConfig.from_file(root / "config.json"), torch.float32)
    load_model(model, root)
    cache = PagedCache(model.cfg, 2, 8, B, torch.float32, mtp_layers=len(model.mtp))
    return model, cache


def _prefill(model, cache, tokens, chunks=(N,)):
    """The prompt tokens[:N] in chunks through the pools (slot 1, blocks 0..3), every chunk's
    drafter context written as the runner does -> the drafting."""
    from backfit.runtime.drafting import Drafting, RowPlan
    drafting, start = Drafting(model, cache, 2, K), 0
    for n in chunks:
        batch = ForwardBatch.build([(0, tokens[start:start + n].tolist(), start)], "cpu", [1],
                                   [(0, 1, 2, 3)])
        X = model.hidden(batch, cache.bind(batch))
        drafting.context(X, model.taps, batch.tokens, batch.positions, torch.ones(n).long(),
                         RowPlan([n], drafting.ring, "cpu"))
        start += n
    return drafting


def _draft(drafting, tokens, k):
    from backfit.runtime.runner import StepSeq
    drafting.k = k
    seq = StepSeq(0, 1, (0, 1, 2, 3), N, (int(tokens[N]),), True, draft=k)
    return drafting.draft([seq], 0)


@pytest.mark.parametrize("chunks", [(N,), (17, 23)])
def test_mtp_chain_equals_the_reference(tiny_flash, tiny_converted, tp1_process, chunks):
    tokens = torch.randint(0, 500, (N + 1,), generator=torch.Generator().manual_seed(3))
    with one_thread():
        model, cache = _runtime(tiny_converted(1, "bf16"))
        got = _draft(_prefill(model, cache, tokens, chunks), tokens, K)
        ref = Reference(tiny_flash)
        want = ref.mtp_draft(ref.prefix(tokens[:N]), int(tokens[N]), K)
        assert got.ids[0].tolist() == want.tokens.tolist()
        assert rel(got.logits[0], want.logits) < TOL, rel(got.logits[0], want.logits)
        forced = [7, 11]                               # teacher-forced: the runtime's drafts fed
        want = ref.mtp_draft(ref.prefix(tokens[:N]), int(tokens[N]), K, tokens=forced)
        model2, cache2 = _runtime(tiny_converted(1, "bf16"))
        d2 = _prefill(model2, cache2, tokens, chunks)
        import backfit.runtime.model.draft.mtp as mtp_mod
        seq = iter(forced)
        real = mtp_mod.pick
        mtp_mod.pick = lambda logits, rows, j: (torch.tensor([next(seq, None) or
                                                              int(logits.argmax())]), None)
        try:
            got = _draft(d2, tokens, K)
        finally:
            mtp_mod.pick = real
        assert rel(got.logits[0], want.logits) < TOL


def test_dspark_equals_the_reference(tiny_0731, conv_0731, tp1_process):
    tokens = torch.randint(0, 500, (N + 1,), generator=torch.Generator().manual_seed(4))
    with one_thread():
        model, cache = _runtime(conv_0731)
        got = _draft(_prefill(model, cache, tokens, (25, 15)), tokens, 5)
        ref = Reference(tiny_0731)
        want = ref.dspark_draft(ref.prefix(tokens[:N]), int(tokens[N]))
        assert got.ids[0].tolist() == want.tokens.tolist()
        assert rel(got.logits[0], want.logits) < TOL, rel(got.logits[0], want.logits)
        assert rel(got.confidence[0], want.confidence) < TOL
