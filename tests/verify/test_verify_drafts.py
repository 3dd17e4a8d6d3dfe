"""The reference drafters (Reference.mtp_draft / dspark_draft, dsv4-model.md 5.8-5.9): each
property from the spec checked against a construction that does not share the drafter's code
path -- the causal prefill (cross-checked against transformers in test_reference.py) or the
checkpoint's tensors used by hand.

Tolerances: both sides are FP32 on the same weights but through different shapes (one row vs a
prefill, context attention vs the chunked window attention), so they agree to float rounding:
measured at most 1.1e-6 relative (tiny checkpoints, seed 0). TOL = 1e-5; the planted faults
(a shifted position, a window one row off, a ring lagging by one, ...) moved the checked rows
by 4.6e-2 or more.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support import one_thread

from backfit.verify import ref_drafters
from backfit.verify.ref_attention import attention
from backfit.verify.ref_blocks import rms_norm
from backfit.verify.ref_drafters import block_attention, mtp_input
from backfit.verify.reference import Reference, decoder_layer

S, N = 48, 40        # prefix tokens of the shared tower pass; drafts after N of them (p = 39)
TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 500, (S,), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def flash(request, _one_thread):
    ref = Reference(request.getfixturevalue("tiny_flash"))
    assert N - 1 > ref.cfg.sliding_window          # the window really drops old positions
    return ref


@pytest.fixture(scope="module")
def v0731(request, _one_thread):
    ref = Reference(request.getfixturevalue("tiny_0731"))
    assert N - 1 > ref.cfg.sliding_window
    return ref


@pytest.fixture(scope="module")
def flash_pre(flash, tokens):
    return flash.prefix(tokens)


@pytest.fixture(scope="module")
def pre0731(v0731, tokens):
    return v0731.prefix(tokens)


# ---- Flash MTP chained --------------------------------------------------------------------------
def test_mtp_step_one_is_the_mtp_logits_row(flash, flash_pre, tokens):
    """Step 1 = mtp_logits' row p for the same prefix and next token (a full prefill of mtp.0,
    cross-checked against transformers), also for a next token that is not tokens[N]."""
    for nxt in (int(tokens[N]), 3):
        d = flash.mtp_draft(flash_pre, nxt, 1, length=N)
        want = flash.mtp_logits(tokens[:N], next_token=nxt)[N - 1]
        assert d.positions.tolist() == [N - 1]
        assert rel(d.logits[0], want) <= TOL


def test_mtp_chain_equals_the_prefill_of_its_own_inputs(flash, flash_pre, tokens):
    """Step j's row = the last row of a causal mtp.0 prefill over positions 0..p+j whose inputs
    are (X_t, x_{t+1}) for t < p, (X_p, x_{p+1}) at p, and (Y_{i-1}, d_i) at p + i, with Y the
    block's own pre-hc_head output: the chained positions, the window over the prefix rows and
    the earlier steps' KV, and the fed-back streams all at once."""
    ref, k, p = flash, 4, N - 1
    d = ref.mtp_draft(flash_pre, int(tokens[N]), k, length=N)
    P = ref.params("mtp.0.")
    seq = mtp_input(flash_pre.X[:p], ref._embed(tokens[1:N]), P, ref.cfg, ref.nx)   # rows < p
    X, tok = flash_pre.X[p:p + 1], int(tokens[N])
    for j in range(k):
        t = torch.tensor([tok])
        seq = torch.cat([seq, mtp_input(X, ref._embed(t), P, ref.cfg, ref.nx)])     # row p + j
        out = decoder_layer(seq, torch.zeros(p + j + 1, dtype=torch.long), P, ref.cfg, 0, False,
                            ref.nx)
        X = out[-1:]
        _, want = ref._head(X, P, P["norm.weight"])
        assert rel(d.logits[j], want[0]) <= TOL, f"step {j + 1}"
        assert int(d.tokens[j]) == int(d.logits[j].argmax())          # greedy chain
        tok = int(d.tokens[j])
    assert d.positions.tolist() == list(range(p, p + k))


def test_mtp_teacher_forcing(flash, flash_pre, tokens):
    nxt = int(tokens[N])
    greedy = flash.mtp_draft(flash_pre, nxt, 3, length=N)
    other = (int(greedy.tokens[0]) + 1) % 500
    forced = flash.mtp_draft(flash_pre, nxt, 3, tokens=[other], length=N)
    assert rel(forced.logits[0], greedy.logits[0]) <= TOL              # before the given token
    assert rel(forced.logits[1], greedy.logits[1]) > 1e-2              # fed the given token
    assert forced.tokens[0] == other
    assert forced.tokens[1:].tolist() == forced.logits[1:].argmax(-1).tolist()   # then greedy


# ---- 0731 DSpark --------------------------------------------------------------------------------
def test_dspark_taps_are_taken_after_the_layers(v0731, pre0731, tokens):
    out = v0731.forward(tokens, capture=True)
    want = torch.cat([out["hidden"][i].mean(dim=1) for i in v0731.cfg.dspark_target_layer_ids], -1)
    assert pre0731.taps.shape == (S, 3 * v0731.cfg.hidden_size)
    assert rel(pre0731.taps, want) <= 1e-6


class _Recorder:
    """Wraps ref_drafters.context_attention: keeps each call's inputs and output."""

    def __init__(self, monkeypatch):
        self.calls, self.inner = [], ref_drafters.context_attention
        monkeypatch.setattr(ref_drafters, "context_attention", self)

    def __call__(self, x, pos, ctx, ok, P, cfg, nx, fake_quant):
        out = self.inner(x, pos, ctx, ok, P, cfg, nx, fake_quant)
        self.calls.append({"x": x, "ctx": ctx, "P": P, "fake_quant": fake_quant, "out": out[0]})
        return out


def test_dspark_last_block_row_is_a_causal_row_after_the_ring(v0731, pre0731, tokens, monkeypatch):
    """Every stage: its ring = main_kv of main_x = main_norm(main_proj(taps)) at target positions
    p-W+1..p, the block at p+1..p+B right after it. So the LAST block row sees exactly what the
    last row of a causal prefill over [main_x ring rows, block rows] sees (RoPE is relative): the
    main attention path must reproduce it. Earlier rows see later block rows: they must not."""
    ref, cfg = v0731, v0731.cfg
    W, B, p = cfg.sliding_window, cfg.dspark_block_size, N - 1
    rec = _Recorder(monkeypatch)
    ref.dspark_draft(pre0731, int(tokens[N]), length=N)
    assert len(rec.calls) == cfg.num_mtp_stages
    P0 = ref.params("mtp.0.")
    main_x = rms_norm(pre0731.taps[p - W + 1:p + 1] @ P0["main_proj.weight"].T,
                      P0["main_norm.weight"], cfg.rms_norm_eps)                       # [W, H]
    wide = dataclasses.replace(cfg, sliding_window=W + B)
    for s, call in enumerate(rec.calls):
        assert call["P"].prefix == f"mtp.{s}."
        causal = attention(torch.cat([main_x, call["x"]]), ref.params(f"mtp.{s}."), wide, 0, ref.nx)
        assert rel(call["out"][-1], causal[-1]) <= TOL, f"stage {s}"
        assert rel(call["out"][0], causal[W]) > 1e-2, f"stage {s}: row 0 looks causal"


def test_dspark_block_attention_is_non_causal(v0731):
    """Changing the LAST block row's input changes the FIRST row's output."""
    ref, cfg = v0731, v0731.cfg
    P = ref.params("mtp.1.")
    g = torch.Generator().manual_seed(0)
    ring = torch.randn(10, cfg.head_dim, generator=g)          # any [L, D] context KV
    pos = torch.arange(20, 25)
    x = torch.randn(5, cfg.hidden_size, generator=g)
    attn = block_attention(P, cfg, ref.nx, pos, ring, False)
    a = attn(x)
    x2 = x.clone()
    x2[4] *= -1
    assert rel(attn(x2)[0], a[0]) > 1e-2


def _perturbed(pre, rows):
    taps = pre.taps.clone()
    taps[rows] = taps[rows].flip(0) * -1.0 if len(rows) > 1 else -taps[rows]
    return dataclasses.replace(pre, taps=taps, cache={})


def test_dspark_ring_holds_the_last_window_of_target_rows(v0731, pre0731, tokens):
    """The ring = main_kv of target positions p-W+1 .. p (the last accepted row p included):
    changing the tap at p-W or at p+1 (a later row of the shared tower pass) changes nothing,
    changing it at p-W+1 or at p changes every drafted row."""
    ref, W, p = v0731, v0731.cfg.sliding_window, N - 1
    base = ref.dspark_draft(pre0731, int(tokens[N]), length=N)
    for row, seen in ((p - W, False), (p + 1, False), (p - W + 1, True), (p, True)):
        d = ref.dspark_draft(_perturbed(pre0731, [row]), int(tokens[N]), length=N)
        change = rel(d.base, base.base)
        assert (change > 1e-3) if seen else (change <= 1e-6), (row, change)


def test_dspark_drafts_reuse_one_tower(v0731, pre0731, tokens):
    """Drafting after N tokens of a longer pass = drafting from a pass over those N tokens."""
    nxt = int(tokens[N])
    long = v0731.dspark_draft(pre0731, nxt, length=N)
    short = v0731.dspark_draft(tokens[:N], nxt)
    for a, b in zip(long[:3], short[:3]):
        assert rel(a, b) <= TOL
    assert torch.equal(long.tokens, short.tokens) and torch.equal(long.positions, short.positions)
    assert long.positions.tolist() == list(range(N, N + 5))


def test_dspark_markov_loop_and_confidence(v0731, pre0731, tokens):
    """By hand from the checkpoint's tensors: base = head(norm(hd)); logits_i - base_i =
    markov_w2 @ markov_w1[out_i] with out_0 = x_{p+1}; out_{i+1} = argmax(logits_i) (or the given
    token); confidence_i = proj . concat(hd_i, markov_w1[out_i]), a raw logit."""
    ref, cfg = v0731, v0731.cfg
    P = ref.params("mtp.2.")
    w1, w2 = P["markov_head.markov_w1.weight"], P["markov_head.markov_w2.weight"]
    proj = P["confidence_head.proj.weight"][0]
    head = ref.ckpt.read("head.weight").float()
    markov_moved_argmax = False
    for length, nxt, given in ((N, int(tokens[N]), None), (N - 7, 5, None), (N, 9, [17, 300])):
        d = ref.dspark_draft(pre0731, nxt, tokens=given, length=length)
        want_base = rms_norm(d.hidden, P["norm.weight"], cfg.rms_norm_eps).float() @ head.T
        assert rel(d.base, want_base) <= TOL
        out = [nxt] + d.tokens.tolist()
        for i in range(cfg.dspark_block_size):
            assert rel(d.logits[i] - d.base[i], w2 @ w1[out[i]]) <= TOL, i
            if given and i < len(given):
                assert out[i + 1] == given[i]
            else:
                assert out[i + 1] == int(d.logits[i].argmax())
                markov_moved_argmax |= out[i + 1] != int(d.base[i].argmax())
            want = proj @ torch.cat([d.hidden[i].float(), w1[out[i]]])
            assert abs(float(d.confidence[i]) - float(want)) <= TOL * abs(float(want)) + 1e-6
        assert not ((d.confidence > 0) & (d.confidence < 1)).all()        # raw logits
    assert markov_moved_argmax, "no case where the Markov term changed the argmax: weak test"


def test_dspark_kv_fake_quant_is_one_switch(v0731, pre0731, tokens, monkeypatch):
    """dspark_kv_qat (default: qat) fake-quantizes the ring and the block KV, both."""
    assert Reference(v0731.dir, qat=True).dspark_kv_qat is True
    assert Reference(v0731.dir, qat=True, dspark_kv_qat=False).dspark_kv_qat is False
    ref = Reference(v0731.dir, dspark_kv_qat=True)
    plain = v0731.dspark_draft(pre0731, int(tokens[N]), length=N)
    rec = _Recorder(monkeypatch)
    fq = ref.dspark_draft(dataclasses.replace(pre0731, cache={}), int(tokens[N]), length=N)
    assert rel(fq.base, plain.base) > 1e-4
    assert all(c["fake_quant"] for c in rec.calls)                      # the block's own KV
    from backfit.verify.qat import kv_fake_fp8
    for c in rec.calls:                                                 # the ring: on the grid
        assert torch.equal(kv_fake_fp8(c["ctx"], ref.cfg.qk_rope_head_dim), c["ctx"])


def test_drafter_errors(flash, v0731, flash_pre, pre0731):
    with pytest.raises(ValueError, match="Flash checkpoint"):
        v0731.mtp_draft(pre0731, 3, 2)
    with pytest.raises(ValueError, match="0731 checkpoint"):
        flash.dspark_draft(flash_pre, 3)
    with pytest.raises(ValueError, match="length"):
        flash.mtp_draft(flash_pre, 3, 2, length=S + 1)
    with pytest.raises(ValueError, match="at most 2"):
        flash.mtp_draft(flash_pre, 3, 2, tokens=[1, 2, 3])
    with pytest.raises(ValueError, match="out of range"):
        v0731.dspark_draft(pre0731, 10**6)
    with pytest.raises(ValueError, match="k must be"):
        flash.mtp_draft(flash_pre, 3, 0)
    with pytest.raises(ValueError, match="numerics"):
        Reference(flash.dir, dtype=torch.bfloat16).mtp_draft(flash_pre, 3, 1)
