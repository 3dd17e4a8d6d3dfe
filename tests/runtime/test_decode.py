"""Decoding state: prefill + token-by-token decode, uneven chunks and mixed batches give the
same logits as one full-sequence forward (float32 activations, lossless bf16 conversion).

The tiny model has window 16, CSA ratio 4 (layers 2, 4), HCA ratio 8 (layers 3, 5): the
lengths below (1 ... 300) cross the window and every compression boundary many times,
and the full forward at 300 runs attention in two query blocks of 256 and 44.
"""

import pytest
import torch

from backfit.runtime.batch import ForwardBatch
from backfit.runtime.model.draft.mtp import mtp_logits

S = 300
TOL = 1e-4


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 512, (S,), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def full(model_f32, tokens) -> torch.Tensor:
    return model_f32(ForwardBatch.single(tokens))                  # [S, vocab]


def _check(got, want, rel_err, what):
    err = rel_err(got, want)
    bad = (err > TOL).nonzero().flatten().tolist()
    assert not bad, f"{what}: positions {bad[:10]} differ (max rel err {err.max():.2e})"
    assert torch.equal(got.argmax(-1), want.argmax(-1)), what


@pytest.mark.parametrize("prefill,total", [(1, 1), (1, 17), (5, 33), (16, 70), (33, 150), (140, S)])
def test_prefill_then_decode(model_f32, tokens, full, rel_err, prefill, total):
    st = model_f32.new_state()
    outs = [model_f32(ForwardBatch.single(tokens[:prefill]), st)]
    for p in range(prefill, total):
        outs.append(model_f32(ForwardBatch.single(tokens[p:p + 1], start=p), st))
    _check(torch.cat(outs), full[:total], rel_err, f"prefill {prefill} + decode to {total}")
    assert st.seqs[0].length == total


def test_uneven_chunks(model_f32, tokens, full, rel_err):
    st, start, outs = model_f32.new_state(), 0, []
    for n in (3, 5, 1, 9, 13, 2, 7, 40, 1, 69, 150):               # sums to 300
        outs.append(model_f32(ForwardBatch.single(tokens[start:start + n], start=start), st))
        start += n
    assert start == S
    _check(torch.cat(outs), full, rel_err, "uneven chunks")


def test_mixed_batch_and_last_only(model_f32, tokens, full, rel_err):
    """Two sequences in one batch: one prefilling, one decoding; then both decode together."""
    other = torch.randint(0, 512, (50,), generator=torch.Generator().manual_seed(3))
    want_other = model_f32(ForwardBatch.single(other))
    st = model_f32.new_state()
    model_f32(ForwardBatch.single(other[:30], seq_id=1), st)
    got = model_f32(ForwardBatch.build([(0, tokens[:25], 0), (1, other[30:31], 30)]), st)
    _check(got[:25], full[:25], rel_err, "batched prefill")
    _check(got[25:], want_other[30:31], rel_err, "batched decode")
    for p in range(25, 35):
        b = ForwardBatch.build([(1, other[p + 6:p + 7], p + 6), (0, tokens[p:p + 1], p)])
        got = model_f32(b, st, last_only=True)                     # [2, vocab]
        _check(got[1:], full[p:p + 1], rel_err, f"batched decode seq 0 at {p}")
        _check(got[:1], want_other[p + 6:p + 7], rel_err, f"batched decode seq 1 at {p + 6}")
    st.free(1)
    with pytest.raises(ValueError):                                 # must continue exactly
        model_f32(ForwardBatch.single(tokens[40:41], start=40), st)


def test_mtp_draft_streams(model_f32, tokens, rel_err):
    """MTP block: prefill + decode gives the same draft logits as one pass."""
    nxt = torch.roll(tokens, -1)
    _, want = mtp_logits(model_f32, ForwardBatch.single(tokens[:40]), nxt[:40])
    st = model_f32.new_state()
    outs = [mtp_logits(model_f32, ForwardBatch.single(tokens[:21]), nxt[:21], st)[1]]
    for p in range(21, 40):
        outs.append(mtp_logits(model_f32, ForwardBatch.single(tokens[p:p + 1], start=p),
                               nxt[p:p + 1], st)[1])
    _check(torch.cat(outs), want, rel_err, "mtp draft")


def test_query_blocks(model_f32, tokens, full, rel_err):
    """Attention in blocks of 7 queries (not aligned to window or ratios) = one block."""
    attns = [layer.attn for layer in model_f32.layers]
    try:
        for a in attns:
            a.q_chunk = 7
        got = model_f32(ForwardBatch.single(tokens))
    finally:
        for a in attns:
            a.q_chunk = 256
    _check(got, full, rel_err, "query blocks of 7")


def test_logits_of_rows_and_last_only(model_f32, tokens):
    """logits(X, rows) = logits(X)[rows] and forward(last_only) = the sequences' last rows: the
    runner's sampled rows (the kernel path also gathers hc_head's partials with them, GPU test
    tests/runtime/test_graphs.py). To FP32 rounding: the CPU head's matmul blocks by M."""
    batch = ForwardBatch.build([(0, tokens[:9].tolist(), 0), (1, tokens[20:24].tolist(), 0)])
    X = model_f32.hidden(batch)
    every = model_f32.logits(X)
    rows = torch.tensor([8, 12, 3])
    torch.testing.assert_close(model_f32.logits(X, rows), every[rows], rtol=1e-5, atol=1e-5)
    last = model_f32(ForwardBatch.build([(0, tokens[:9].tolist(), 0),
                                         (1, tokens[20:24].tolist(), 0)]), last_only=True)
    torch.testing.assert_close(last, every[[8, 12]], rtol=1e-5, atol=1e-5)
