"""backfit.verify.reference against HF transformers 5.23 (an implementation nobody here wrote),
plus unit tests of the pieces (mHC Sinkhorn, YaRN, RoPE, routing, fake quant).

transformers needs `pip install "transformers==5.23.0" accelerate`; those tests skip without it.
"""

from __future__ import annotations

import gc
import json
import math
import weakref

import pytest
import torch

from backfit.checkpoint import SafetensorsDir, ShardWriter
from backfit.config import ModelConfig
from backfit.quant import decode_e4m3, encode_e4m3
from backfit.synthetic import write_checkpoint
from backfit.verify import qat, ref_attention, ref_blocks
from backfit.verify.ref_attention import apply_rope, hadamard, rope_cos_sin, rope_freqs, yarn_range
from backfit.verify.ref_blocks import MoEStats, Numerics, moe, sinkhorn
from backfit.verify.reference import LayerParams, Reference
from support import one_thread

S = 203             # > 160; crosses window 16 and ratio 4 / 8 boundaries, ends mid-block
PREFILL = 150       # cache test: prefill this many (ends mid-block), then decode one at a time
TOL = 1e-4          # max |ours - theirs| / max |theirs|


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 512, (S,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def flash(request, _one_thread):
    """The session's tiny Flash checkpoint (small vocab), built after _one_thread took effect."""
    return request.getfixturevalue("tiny_flash")


@pytest.fixture(scope="module")
def ours(flash, tokens) -> dict:
    return Reference(flash).forward(tokens, capture=True)


# ---- transformers cross-check ----------------------------------------------------------------
def _hf_config(raw: dict):
    from transformers import DeepseekV4Config
    raw = dict(raw)
    n = raw["num_hidden_layers"]
    ratios = raw.pop("compress_ratios")[:n]
    names = {0: "sliding_attention", 4: "compressed_sparse_attention"}
    raw["layer_types"] = [names.get(r, "heavily_compressed_attention") for r in ratios]
    hca = [r for r in ratios if r not in (0, 4)]
    # T2: its config maps ratios through a fixed {0, 4, 128} table; our HCA ratio is 8
    raw["compress_rates"] = {"compressed_sparse_attention": 4,
                             "heavily_compressed_attention": hca[0] if hca else 128}
    n_hash = raw.pop("num_hash_layers")
    raw["mlp_layer_types"] = ["hash_moe" if i < n_hash else "moe" for i in range(n)]
    return DeepseekV4Config(**raw)


def _hf_load(path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")                 # T3: its CPU FP8 loader needs accelerate
    from transformers import DeepseekV4ForCausalLM
    cfg = _hf_config(json.loads((path / "config.json").read_text()))
    # T1: FP8/FP4 are dequantized, BF16 tensors stay BF16 -> .float() (lossless)
    model = DeepseekV4ForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32)
    return model.float().eval()


@pytest.fixture(scope="module")
def hf(flash):
    return _hf_load(flash)


def test_hf_loads_the_same_weights(hf, flash):
    cfg = ModelConfig.from_file(flash / "config.json")
    P = LayerParams(SafetensorsDir(flash), "layers.3.", cfg, torch.device("cpu"))
    L = hf.model.layers[3]
    w1, w3, w2 = P.expert(5)
    pairs = [(L.self_attn.q_a_proj.weight, P["attn.wq_a.weight"]),                       # FP8
             (L.self_attn.o_a_proj.weight, P["attn.wo_a.weight"]),
             (L.mlp.experts.gate_up_proj[5], torch.cat([w1, w3])),                        # MXFP4
             (L.mlp.experts.down_proj[5], w2),
             (L.mlp.gate.e_score_correction_bias, P["ffn.gate.bias"]),
             (L.self_attn.compressor.position_bias, P["attn.compressor.ape"]),
             (L.attn_hc.fn, P["hc_attn_fn"])]
    for theirs, mine in pairs:
        assert torch.equal(theirs.float(), mine)
    t0 = LayerParams(P.ckpt, "layers.0.", P.cfg, P.device)["ffn.gate.tid2eid"]
    assert torch.equal(hf.model.layers[0].mlp.gate.tid2eid.long(), t0)


def test_logits_match_transformers(hf, ours, tokens):
    with torch.no_grad():
        o = hf(tokens[None], output_hidden_states=True)
    theirs = o.logits[0]
    assert rel(ours["logits"], theirs) <= TOL
    assert torch.equal(ours["logits"].argmax(-1), theirs.argmax(-1))
    # their hidden_states = inputs of every layer (layer i-1 output) + the final normed hidden
    for i, h in enumerate(o.hidden_states[1:-1]):
        assert rel(ours["hidden"][i], h[0]) <= TOL, f"layer {i}"
    assert rel(ours["final"], o.hidden_states[-1][0]) <= TOL


@pytest.mark.parametrize("n", [1, 7, 33])
def test_short_sequences_match_transformers(hf, flash, tokens, n):
    """Before the first compressed entry / indexer selection exists, and just after."""
    mine = Reference(flash).forward(tokens[:n])["logits"]
    with torch.no_grad():
        theirs = hf(tokens[None, :n]).logits[0]
    assert rel(mine, theirs) <= TOL and torch.equal(mine.argmax(-1), theirs.argmax(-1))


def test_transformers_cache_decode_matches_full_forward(hf, ours, tokens):
    with torch.no_grad():
        r = hf(tokens[None, :PREFILL], use_cache=True)
        pkv, rows = r.past_key_values, [r.logits[0]]
        for t in range(PREFILL, S):
            r = hf(tokens[None, t:t + 1], past_key_values=pkv, use_cache=True)
            pkv = r.past_key_values
            rows.append(r.logits[0])
    theirs = torch.cat(rows)
    assert rel(ours["logits"], theirs) <= TOL
    assert torch.equal(ours["logits"].argmax(-1), theirs.argmax(-1))


def _mtp_as_one_layer_model(src: SafetensorsDir, cfg_raw: dict, dst):
    """mtp.0 as a 1-layer main tower (its norm / hc_head as the model's), for transformers."""
    rename = {}
    for n in src.entries:
        if n.startswith("mtp.0."):
            rest = n[len("mtp.0."):]
            if rest.split(".")[0] in ("enorm", "hnorm", "e_proj", "h_proj"):
                continue
            top = rest == "norm.weight" or rest.startswith("hc_head_")
            rename[rest if top else "layers.0." + rest] = n
    rename["embed.weight"], rename["head.weight"] = "embed.weight", "head.weight"
    dst.mkdir()
    specs = [(n, src.entries[s].dtype, src.entries[s].shape) for n, s in rename.items()]
    with ShardWriter(dst / "model.safetensors", specs, {"format": "pt"}) as w:
        for n, s in rename.items():
            w.write(n, src.read(s))
    raw = dict(cfg_raw, num_hidden_layers=1, compress_ratios=[0, 0], num_hash_layers=0)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_mtp_matches_transformers_decoder_layer(flash, tokens, tmp_path, hf):
    """Our mtp.0 vs transformers' decoder layer + hc_head + norm + head run on the same input."""
    ref = Reference(flash)
    mine = ref.mtp_logits(tokens)                                          # [S-1, V]
    raw = json.loads((flash / "config.json").read_text())
    one = _hf_load(_mtp_as_one_layer_model(ref.ckpt, raw, tmp_path / "mtp_as_layer"))
    # main-tower streams before hc_head, from transformers (output of its last layer)
    seen = {}
    h = hf.model.layers[-1].register_forward_hook(lambda m, a, out: seen.setdefault("X", out))
    with torch.no_grad():
        hf(tokens[None])
    h.remove()
    X, nxt = seen["X"][0, :-1], tokens[1:]                        # row t: X_t and token t+1
    P, eps = ref.params("mtp.0."), ref.cfg.rms_norm_eps

    def norm(x, w):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w

    e = norm(hf.model.embed_tokens.weight[nxt], P["enorm.weight"])
    Y = (e @ P["e_proj.weight"].T)[:, None] + norm(X, P["hnorm.weight"]) @ P["h_proj.weight"].T
    hook = one.model.layers[0].register_forward_pre_hook(lambda m, a, kw: ((Y[None],) + a[1:], kw),
                                                         with_kwargs=True)
    with torch.no_grad():
        theirs = one(nxt[None]).logits[0]
    hook.remove()
    assert rel(mine, theirs) <= TOL
    assert torch.equal(mine.argmax(-1), theirs.argmax(-1))


# ---- our own behaviour ------------------------------------------------------------------------
def test_mtp_rows_and_next_token(flash, tokens):
    ref = Reference(flash)
    a = ref.mtp_logits(tokens[:40])
    b = ref.mtp_logits(tokens[:40], next_token=int(tokens[40]))
    assert a.shape == (39, 512) and b.shape == (40, 512)
    assert rel(b[:39], a) <= 1e-6                                          # causal: extra row only


def test_layers_are_built_one_at_a_time(flash, tokens, monkeypatch):
    alive: list[weakref.ref] = []
    orig = Reference.params

    def params(self, prefix):
        gc.collect()
        assert not any(r() is not None for r in alive), "previous layer's weights still held"
        p = orig(self, prefix)
        alive.append(weakref.ref(p))
        return p

    monkeypatch.setattr(Reference, "params", params)
    ref = Reference(flash)
    ref.forward(tokens[:24])
    assert len(alive) >= ref.cfg.num_hidden_layers            # the check above really ran


def test_query_chunking_is_invisible(flash, tokens, ours, monkeypatch):
    monkeypatch.setattr(ref_attention, "QUERY_CHUNK", 37)
    assert rel(Reference(flash).forward(tokens)["logits"], ours["logits"]) <= 1e-5


def test_bf16_mode_is_close(flash, tokens, ours):
    out = Reference(flash, dtype=torch.bfloat16).forward(tokens, capture=True)
    assert out["logits"].dtype == torch.float32 and out["final"].dtype == torch.bfloat16
    agree = (out["logits"].argmax(-1) == ours["logits"].argmax(-1)).float().mean()
    assert 0 < rel(out["logits"], ours["logits"]) < 0.2 and agree >= 0.85


def test_qat_points_are_the_only_difference(flash, tokens, monkeypatch):
    base = Reference(flash).forward(tokens[:120])["logits"]
    q = Reference(flash, qat=True).forward(tokens[:120])["logits"]
    assert rel(q, base) > 1e-3                                              # fake quant does act
    for mod, name in ((ref_blocks, "act_quant"), (ref_attention, "kv_fake_fp8"),
                      (ref_attention, "indexer_fake_fp4")):
        monkeypatch.setattr(mod, name, lambda x, *a, **k: x)
    assert torch.equal(Reference(flash, qat=True).forward(tokens[:120])["logits"], base)


def test_0731_main_tower_matches_transformers(tmp_path, tokens):
    """The 0731 variant's main tower (DSpark stages aside) against transformers, logits and every
    layer's streams; 120 tokens so its CSA indexer selects 16 of up to 30 entries."""
    d = write_checkpoint(tmp_path / "v0731", "0731", seed=0, small_vocab=True, tokenizer=False,
                         moe_intermediate_size=128, n_routed_experts=8)
    ref = Reference(d)
    assert ref.cfg.variant == "0731" and ref.cfg.num_mtp_stages == 3
    toks = tokens[:120]
    out = ref.forward(toks, capture=True)
    with torch.no_grad():
        o = _hf_load(d)(toks[None], output_hidden_states=True)
    assert rel(out["logits"], o.logits[0]) <= TOL                      # measured 1.8e-7
    assert torch.equal(out["logits"].argmax(-1), o.logits[0].argmax(-1))
    # their hidden_states: the input of every layer, then the final normed hidden
    assert len(out["hidden"]) == ref.cfg.num_hidden_layers == len(o.hidden_states) - 1
    for i, h in enumerate(o.hidden_states[1:-1]):
        assert rel(out["hidden"][i], h[0]) <= TOL, f"layer {i}"
    assert rel(out["final"], o.hidden_states[-1][0]) <= TOL
    with pytest.raises(ValueError):                                    # DSpark is not the Flash MTP
        ref.mtp_logits(torch.arange(10))


# ---- unit tests of the pieces -----------------------------------------------------------------
def test_sinkhorn_columns_sum_to_one():
    c = torch.randn(50, 4, 4, generator=torch.Generator().manual_seed(0))
    M = sinkhorn(c, 20, 1e-6)
    assert (M > 0).all()
    assert torch.allclose(M.sum(-2), torch.ones(50, 4), atol=1e-5)         # last pass: columns
    # rows only converge towards 1 (20 passes; slower for peaked logits, e.g. 3% at 3x scale)
    assert torch.allclose(M.sum(-1), torch.ones(50, 4), atol=1e-3)


def test_hc_post_orientation():
    # M_jk moves source stream j into destination k: X' = post * f + M^T X
    X = torch.arange(4.0)[None, :, None].expand(1, 4, 2)                   # stream j holds value j
    M = torch.zeros(1, 4, 4)
    M[0, 0, 3] = 1.0                                                       # source 0 -> dest 3
    out = ref_blocks.hc_post(torch.zeros(1, 2), X, torch.zeros(1, 4), M)
    assert out[0, 3].tolist() == [0.0, 0.0] and out[0, 0].tolist() == [0.0, 0.0]
    M[0, 2, 1] = 1.0
    out = ref_blocks.hc_post(torch.zeros(1, 2), X, torch.zeros(1, 4), M)
    assert out[0, 1].tolist() == [2.0, 2.0]


def test_yarn_table(flash):
    cfg = ModelConfig.from_file(flash / "config.json")                # rope 64, 160000, yarn x16
    assert yarn_range(64, 160000, 65536, 32, 1) == (15, 25)
    base = 1.0 / (160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    f = rope_freqs(cfg, 4)
    assert torch.equal(f[:16], base[:16]) and torch.allclose(f[25:], base[25:] / 16, rtol=1e-6)
    assert ((f[16:25] < base[16:25]) & (f[16:25] > base[16:25] / 16)).all()
    assert torch.equal(rope_freqs(cfg, 8), f)                               # same for HCA
    plain = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    assert torch.equal(rope_freqs(cfg, 0), plain)                           # ratio 0: no YaRN


def test_rope_inverse_and_relative(flash):
    cfg = ModelConfig.from_file(flash / "config.json")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 3, 256, generator=g)
    cos, sin = rope_cos_sin(rope_freqs(cfg, 4), torch.arange(30))
    y = apply_rope(x, cos[:, None], sin[:, None])
    assert torch.equal(y[..., :192], x[..., :192])                          # only the LAST 64 dims
    assert torch.allclose(apply_rope(y, cos[:, None], sin[:, None], inverse=True), x, atol=1e-5)
    # interleaved pairs: dims (192, 193) rotate by pos * f_0
    a, b = x[5, 0, 192], x[5, 0, 193]
    assert torch.allclose(y[5, 0, 192], a * math.cos(5) - b * math.sin(5), atol=1e-5)
    # q.k depends on the position difference only
    q, k = torch.randn(64, generator=g), torch.randn(64, generator=g)
    def dot(p1, p2):
        c, s = rope_cos_sin(rope_freqs(cfg, 0), torch.tensor([p1, p2]))
        return (apply_rope(q, c[0], s[0]) * apply_rope(k, c[1], s[1])).sum()
    assert torch.allclose(dot(7, 3), dot(104, 100), atol=1e-4)


def test_hadamard_is_orthonormal():
    H = hadamard(torch.eye(128))
    assert torch.allclose(H @ H.T, torch.eye(128), atol=1e-6) and H[0, 0] == 128 ** -0.5


class _StubParams(dict):
    """Router tensors + identity-like experts; records which experts were built."""

    def __init__(self, H, E, I, **tensors):
        super().__init__(tensors)
        g = torch.Generator().manual_seed(3)
        self.w = [(torch.randn(I, H, generator=g) / 4, torch.randn(I, H, generator=g) / 4,
                   torch.randn(H, I, generator=g) / 4) for _ in range(E)]
        for w, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):    # shared expert off
            self[f"ffn.shared_experts.{w}.weight"] = torch.zeros(shape)
        self.built: list[int] = []

    def expert(self, e):
        self.built.append(e)
        return self.w[e]


def _routed_manual(x, idx, wts, P, limit):
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(idx[t].tolist(), wts[t]):
            w1, w3, w2 = P.w[e]
            g, u = (w1 @ x[t]).clamp(max=limit), (w3 @ x[t]).clamp(-limit, limit)
            h = torch.nn.functional.silu(g) * u
            y[t] += w2 @ (w * h)
    return y


def _assert_routed(y, x, idx, wts, P, cfg):
    """y = the routed experts summed by hand. Both are FP32 in two summation orders over terms
    up to |40| (the hash-routing case: 1.1e-5 / 1.8e-5 apart at most on an AMX Xeon with its
    default GEMMs / with oneDNN and MKL pinned below AMX), so the bound scales with the output;
    a wrong expert or weight is off by O(1) (a 1 % error in one routing weight fails it)."""
    want = _routed_manual(x, idx, wts, P, cfg.swiglu_limit)
    assert torch.allclose(y, want, rtol=0, atol=2e-6 * want.abs().max().item())


def test_hash_routing_uses_tid2eid(flash):
    cfg = ModelConfig.from_file(flash / "config.json")
    H, E, I, k = cfg.hidden_size, cfg.n_routed_experts, 32, cfg.num_experts_per_tok
    g = torch.Generator().manual_seed(0)
    tid2eid = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(cfg.vocab_size)])
    gate = torch.randn(E, H, generator=g) / 8
    P = _StubParams(H, E, I, **{"ffn.gate.weight": gate, "ffn.gate.tid2eid": tid2eid})
    x, tok = torch.randn(5, H, generator=g), torch.tensor([3, 3, 17, 400, 9])
    y = moe(x, tok, P, cfg, True, Numerics())
    idx = tid2eid[tok]
    assert sorted(P.built) == sorted(set(idx.flatten().tolist()))
    s = torch.sqrt(torch.nn.functional.softplus(x @ gate.T)).gather(1, idx)
    wts = s / s.sum(-1, keepdim=True) * cfg.routed_scaling_factor
    _assert_routed(y, x, idx, wts, P, cfg)


def test_bias_selects_but_does_not_weight(flash):
    cfg = ModelConfig.from_file(flash / "config.json")
    H, E, I, k = cfg.hidden_size, cfg.n_routed_experts, 32, cfg.num_experts_per_tok
    g = torch.Generator().manual_seed(1)
    gate, x = torch.randn(E, H, generator=g) / 8, torch.randn(6, H, generator=g)
    bias = torch.zeros(E)
    bias[[0, 1]] = 50.0                                                    # forces experts 0, 1 in
    P = _StubParams(H, E, I, **{"ffn.gate.weight": gate, "ffn.gate.bias": bias})
    stats = MoEStats()
    y = moe(x, torch.zeros(6, dtype=torch.long), P, cfg, False, Numerics(), stats)
    s = torch.sqrt(torch.nn.functional.softplus(x @ gate.T))
    idx = (s + bias).topk(k).indices
    assert (idx[:, :2].sort(-1).values == torch.tensor([0, 1])).all()
    wts = s.gather(1, idx)
    wts = wts / wts.sum(-1, keepdim=True) * cfg.routed_scaling_factor     # unbiased scores
    _assert_routed(y, x, idx, wts, P, cfg)
    assert stats.frac("bias_changed_selection") > 0


def test_fake_fp8_grid_and_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=g) * torch.logspace(-3, 2, 256)
    y = qat.act_quant(x)
    assert torch.equal(qat.act_quant(y), y)                                # idempotent
    for blk in range(2):
        xs, ys = x[:, blk * 128:(blk + 1) * 128], y[:, blk * 128:(blk + 1) * 128]
        s = 2.0 ** torch.ceil(torch.log2(xs.abs().amax(-1, keepdim=True) / 448))
        q = ys / s
        assert q.abs().max() <= 448
        assert torch.equal(q, decode_e4m3(encode_e4m3(q)))          # on the e4m3 grid
        assert ((ys - xs).abs() <= xs.abs() / 16 + s * 2.0 ** -9).all()     # 3 mantissa bits
    kv = torch.randn(4, 256, generator=g)
    out = qat.kv_fake_fp8(kv, 64)
    assert torch.equal(out[:, 192:], kv[:, 192:]) and not torch.equal(out[:, :192], kv[:, :192])


def test_fake_fp4_grid():
    x = torch.tensor([[6.0, 3.1, -2.4, 0.2] + [0.0] * 28])
    y = qat.fake_fp4(x, 32)                                                # amax 6 -> scale 1
    assert y[0, :4].tolist() == [6.0, 3.0, -2.0, 0.0]
    z = qat.fake_fp4(x * 2.0 ** -20, 32)
    assert torch.equal(z, y * 2.0 ** -20)                                  # power-of-two scale
