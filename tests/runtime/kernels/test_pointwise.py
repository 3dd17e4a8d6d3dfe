"""swiglu, route and moe_combine (runtime.kernels.pointwise) against the torch math of runtime/model/moe.py.

CPU: the Triton interpreter. swiglu: within one BF16 ulp of the torch expression (FP32 math,
Triton's sigmoid), FP32 to 1e-6. route: the same experts in the same order (scores drawn so that
no two of a token's top-k are within FP32 noise), weights to 1e-6; hash layers read tid2eid;
the shapes of Flash (256 experts, top 6) and a small ragged one.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"

from support import kernel_module  # noqa: E402


def kmod():
    return kernel_module("pointwise", "_route_kernel", INTERPRET)


def _swiglu_ref(gu, limit):
    I = gu.shape[1] // 2
    g, u = gu[:, :I].float().clamp(max=limit), gu[:, I:].float().clamp(-limit, limit)
    return (F.silu(g) * u).to(gu.dtype)


@pytest.mark.parametrize("T, I", [(1, 2048), (5, 100), (3, 512)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu(T, I, dtype):
    k = kmod()
    g = torch.Generator().manual_seed(T * I)
    gu = (torch.randn(T, 2 * I, generator=g) * 6).to(dtype).to(DEV)     # clamps at 10 are hit
    got, want = k.swiglu(gu, 10.0), _swiglu_ref(gu, 10.0)
    assert got.dtype == dtype and got.shape == (T, I)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        diff = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs().max()
        assert int(diff) <= 1
    with pytest.raises(ValueError, match="swiglu"):
        k.swiglu(gu[:, :3], 10.0)


def _route_ref(logits, k, scale, bias=None, tid2eid=None, tokens=None):
    s = torch.sqrt(F.softplus(logits))
    idx = tid2eid[tokens].long() if tid2eid is not None else (s + bias).topk(k, dim=-1).indices
    w = s.gather(1, idx)
    return idx, w / w.sum(-1, keepdim=True) * scale


@pytest.mark.parametrize("T, E, k", [(1, 256, 6), (7, 256, 6), (4, 20, 3)])
def test_route_scored_and_hashed(T, E, k):
    m = kmod()
    g = torch.Generator().manual_seed(T * E)
    # distinct scores: a random permutation spread over [-25, 25] (softplus's both branches)
    logits = torch.stack([torch.randperm(E, generator=g).float() for _ in range(T)])
    logits = (logits / E * 50 - 25 + torch.rand(T, E, generator=g) * 1e-3).to(DEV)
    bias = (torch.randn(E, generator=g) * 0.01).to(DEV)
    ids, w = m.route(logits, k, 2.5, bias=bias)
    rid, rw = _route_ref(logits, k, 2.5, bias=bias)
    assert ids.dtype == torch.int64 and torch.equal(ids, rid)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-6)
    tid2eid = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(50)]).to(DEV)
    tokens = torch.randint(0, 50, (T,), generator=g).to(DEV)
    ids, w = m.route(logits, k, 1.5, tid2eid=tid2eid, tokens=tokens)
    rid, rw = _route_ref(logits, k, 1.5, tid2eid=tid2eid, tokens=tokens)
    assert torch.equal(ids, rid)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="route"):
        m.route(logits, k, 1.0)


@pytest.mark.parametrize("T, k, D", [(1, 6, 4096), (3, 6, 100), (2, 1, 64)])
def test_moe_combine(T, k, D):
    """Σ_j out[t·k+j] in FP32 in order j = 0..k-1, + the shared output: equal to the same sum
    done by torch in that order (bit for bit), stored as bf16 or FP32."""
    m = kmod()
    g = torch.Generator().manual_seed(T * k + D)
    out = (torch.randn(T * k, D, generator=g) * 3).bfloat16().to(DEV)
    shared = torch.randn(T, D, generator=g).bfloat16().to(DEV)
    want = out.view(T, k, D)[:, 0].float()
    for j in range(1, k):
        want = want + out.view(T, k, D)[:, j].float()
    assert torch.equal(m.moe_combine(out, k), want)
    y = m.moe_combine(out, k, shared, torch.bfloat16)
    ref = (shared.float() + want).bfloat16()
    assert y.dtype == torch.bfloat16
    if INTERPRET:          # the interpreter's FP32 -> BF16 cast is not round-to-nearest: 1 ulp
        assert int((y.view(torch.int16).int() - ref.view(torch.int16).int()).abs().max()) <= 1
    else:
        assert torch.equal(y, ref)
    assert torch.equal(m.moe_combine(out, k, shared), shared.float() + want)
    with pytest.raises(ValueError, match="moe_combine"):
        m.moe_combine(out[:, :-1].t(), k)
    with pytest.raises(ValueError, match="shared must be"):
        m.moe_combine(out, k, shared[:, 1:])


@pytest.mark.parametrize("T, V, D, S", [(1, 50, 4096, 4), (5, 7, 100, 4), (3, 9, 64, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_embed_streams(T, V, D, S, dtype):
    """S copies of the clamped rows (ids below 0 and past V-1 included), bit for bit against
    VocabParallelEmbedding's tp-1 torch expression and Transformer.hidden's repeat."""
    m = kmod()
    g = torch.Generator().manual_seed(T + V + D)
    weight = torch.randn(V, D, generator=g).bfloat16().to(DEV)
    ids = torch.randint(-3, V + 3, (T,), generator=g).to(DEV)
    ids[0] = V + 5                                               # always one out of range
    want = weight[ids.clamp(0, V - 1)].to(dtype)[:, None, :].repeat(1, S, 1)
    got = m.embed_streams(weight, ids, S, dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(m.embed_streams(weight, ids.int(), S, dtype), want)   # int32 ids
    with pytest.raises(ValueError, match="embed_streams"):
        m.embed_streams(weight, ids.float(), S, dtype)


@pytest.mark.parametrize("start", [0, 40, 95])
def test_embed_streams_vocab_shard(start):
    """One rank's shard (rows start..start+V-1): VocabParallelEmbedding's tp > 1 torch expression
    (local ids, rows outside the shard zero) bit for bit, so the ranks' all-reduce is exact."""
    m = kmod()
    g = torch.Generator().manual_seed(start)
    V, D = 40, 100
    weight = torch.randn(V, D, generator=g).bfloat16().to(DEV)
    ids = torch.randint(0, 140, (9,), generator=g).to(DEV)
    ids[0], ids[1] = start, start + V - 1                        # both ends of the shard inside
    local = ids - start
    outside = (local < 0) | (local >= V)
    want = weight[local.clamp(0, V - 1)].masked_fill(outside[:, None], 0)[:, None, :]
    got = m.embed_streams(weight, ids, 1, torch.bfloat16, start=start)
    assert torch.equal(got, want) and not got[0].eq(0).all()


def test_route_ties_go_to_the_lower_id_and_negative_scores_order():
    """The top-k's integer keys: equal scores pick the lower expert id first; scores s + bias
    below zero (a large negative bias) keep float order, and -0.0 ties with +0.0."""
    m = kmod()
    E, k = 16, 10                                                # into the negative scores
    logits = torch.zeros(2, E)
    logits[0, [3, 9, 12]] = 5.0                                  # three equal best, then ties
    bias = torch.zeros(E)
    bias[:8] = -torch.arange(8).float() - 10.0                   # s + bias < 0 on ids 0..7
    s0 = torch.sqrt(F.softplus(torch.zeros(())))
    bias[14], bias[15] = -s0, -s0                                # s + bias = 0 exactly on 14, 15
    logits[1] = -100.0                                           # s ~ 0: the scores are the bias
    ids, _ = m.route(logits.to(DEV), k, 1.0, bias=bias.to(DEV))
    for t in range(2):
        sb = (torch.sqrt(F.softplus(logits[t])) + bias).tolist()
        want = sorted(range(E), key=lambda e: (-sb[e], e))[:k]
        assert len({sb[e] for e in want}) < k                   # ties inside the top-k
        assert ids[t].tolist() == want, t


@pytest.mark.parametrize("T, R, dtype, stride", [(1, 1, torch.int64, 1), (600, 40, torch.int32, 3),
                                                 (9, 9, torch.int64, 1)])
def test_fill_placeholders(T, R, dtype, stride):
    """Placeholders -1 - r become prev[r]; every other token, and the strided view's other
    columns, stay as they were; the torch fallback (runtime.batch) gives the same."""
    from backfit.runtime.batch import fill_placeholders_
    k = kmod()
    g = torch.Generator().manual_seed(T)
    prev = torch.randint(0, 129280, (R,), generator=g)
    real = torch.randint(0, 129280, (T,), generator=g)
    rows = torch.randint(0, R, (T,), generator=g)
    hole = torch.rand(T, generator=g) < 0.5
    toks = torch.where(hole, -1 - rows, real)
    want = torch.where(hole, prev[rows], real).to(dtype)
    buf = torch.full((T, stride), 7, dtype=dtype)
    buf[:, 0] = toks.to(dtype)
    got = buf.to(DEV)
    k.fill_placeholders_(got[:, 0], prev.to(DEV))
    assert torch.equal(got[:, 0].cpu(), want) and bool((got[:, 1:] == 7).all())
    ref = toks.to(dtype).clone()
    assert torch.equal(fill_placeholders_(ref, prev), want)           # kernel_path off: torch
    with pytest.raises(ValueError, match="fill_placeholders_"):
        k.fill_placeholders_(got[:, 0].float(), prev.to(DEV))


def _route_vl_ref(logits, k, scale, tokens, V, bias=None, tid2eid=None, bias_vl=None):
    """Vision-Exp (dsv4-vision.md 11.1), row by row: a token >= V selects the top-k of
    s + bias_vl, others as without images (tid2eid or the top-k of s + bias)."""
    s = torch.sqrt(F.softplus(logits.cpu()))
    idx = []
    for t, tok in enumerate(tokens.tolist()):
        if tok >= V:
            idx.append((s[t] + bias_vl.cpu()).topk(k).indices)
        elif tid2eid is not None:
            idx.append(tid2eid[tok].cpu().long())
        else:
            idx.append((s[t] + bias.cpu()).topk(k).indices)
    idx = torch.stack(idx)
    w = s.gather(1, idx)
    return idx.to(DEV), (w / w.sum(-1, keepdim=True) * scale).to(DEV)


def vl_case(T, E, k, V, seed):
    """Distinct scores; bias forces experts 0..k-1, bias_vl E-k..E-1 into a selection (so a row
    routed by the wrong bias picks a wrong set); tokens mix text ids and all five block ids."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.stack([torch.randperm(E, generator=g).float() for _ in range(T)])
    logits = (logits / E * 50 - 25).to(DEV)
    bias, bias_vl = torch.zeros(E), torch.zeros(E)
    bias[:k], bias_vl[E - k:] = 100.0, 100.0
    tokens = torch.randint(0, V, (T,), generator=g)
    tokens[1::2] = V + torch.arange(T)[1::2] % 5              # IMAGE_START .. IMAGE_END ids
    tid2eid = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(V)])
    return logits, bias.to(DEV), bias_vl.to(DEV), tokens.to(DEV), tid2eid.to(DEV)


@pytest.mark.parametrize("hashed", [False, True], ids=["scored", "hash"])
def test_route_bias_vl(hashed):
    """bias_vl: image-block rows (token >= vocab, every type) select with bias_vl, hash layers
    included (their tid2eid never read at an out-of-vocabulary id); text rows unchanged."""
    m = kmod()
    T, E, k, V = 10, 20, 3, 50
    logits, bias, bias_vl, tokens, tid2eid = vl_case(T, E, k, V, 5)
    kw = dict(tid2eid=tid2eid) if hashed else dict(bias=bias)
    ids, w = m.route(logits, k, 1.5, tokens=tokens, bias_vl=bias_vl, vocab=V, **kw)
    rid, rw = _route_vl_ref(logits, k, 1.5, tokens, V, bias_vl=bias_vl, **kw)
    assert torch.equal(ids, rid)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-6)
    assert set(ids[1].tolist()) == set(range(E - k, E))       # an image row: bias_vl's set
    with pytest.raises(ValueError, match="route"):
        m.route(logits, k, 1.0, bias=bias, bias_vl=bias_vl, vocab=V)        # no tokens
