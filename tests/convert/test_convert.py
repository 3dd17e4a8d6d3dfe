"""Conversion results: bit-exact experts, measured FP8 error, lossless bf16, tp sharding, manifest."""

import hashlib
import io
import json
import math

import pytest
import torch
from safetensors import safe_open

from backfit.checkpoint import SafetensorsDir
from backfit import quant
from backfit.convert.manifest import print_summary, summarize
from backfit.convert.run import convert
from backfit.formats import load_manifest, rank_dir
from backfit.quant import dequant_fp8_block, dequant_int8_groups, dequant_int8_mx, dequant_mxfp4


def _gather(dst, tp, name, shard_dim):
    """Reassemble a tensor from its rank shards, reading with the real safetensors library."""
    index = json.loads((rank_dir(dst, 0) / "model.safetensors.index.json").read_text())
    fname = index["weight_map"][name]
    parts = []
    for r in range(tp):
        with safe_open(rank_dir(dst, r) / fname, framework="pt") as f:
            parts.append(f.get_tensor(name))
    if shard_dim is None:
        assert all(torch.equal(p, parts[0]) for p in parts)
        return parts[0]
    return torch.cat(parts, dim=shard_dim)


@pytest.fixture(scope="module")
def tp4(tiny_converted):
    return tiny_converted(4)


def test_experts_bit_exact(tiny_flash, tp4):
    m, src = load_manifest(tp4), SafetensorsDir(tiny_flash)
    experts = [n for n, t in m["tensors"].items() if t["scheme"] == "int8_mx32" and t["role"] == "weight"]
    assert len(experts) == 7 * 16 * 3
    for name in experts:
        base = name[: -len(".weight")]
        q = _gather(tp4, 4, name, m["tensors"][name]["shard_dim"])
        e = _gather(tp4, 4, base + ".scale", m["tensors"][name]["shard_dim"])
        assert q.dtype == torch.int8 and e.dtype == torch.uint8
        orig = dequant_mxfp4(src.read(name), src.read(base + ".scale"))
        assert torch.equal(dequant_int8_mx(q, e), orig), name
        assert m["tensors"][name]["exact"] is True and m["tensors"][name]["rel_err"] == 0.0
    assert m["summary"]["experts_exact"] is True


def test_fp8_error_recorded_and_bounded(tiny_flash, tp4):
    m, src = load_manifest(tp4), SafetensorsDir(tiny_flash)
    lossy = {n: t for n, t in m["tensors"].items() if t["scheme"] == "int8_g128" and t["role"] == "weight"}
    fp8 = [n for n, e in src.entries.items() if e.dtype == "F8_E4M3"]
    assert set(lossy) | {n for n in fp8 if n.endswith("wo_a.weight")} == set(fp8)
    for name, t in lossy.items():
        base = name[: -len(".weight")]
        q = _gather(tp4, 4, name, t["shard_dim"])
        s = _gather(tp4, 4, base + ".scale", t["shard_dim"])
        assert s.dtype == torch.float32 and s.shape == (q.shape[0], q.shape[1] // 128)
        ref = dequant_fp8_block(src.read(name), src.read(base + ".scale")).double()
        rel = ((dequant_int8_groups(q, s).double() - ref).norm() / ref.norm()).item()
        assert abs(rel - t["rel_err"]) < 1e-9, name                   # recorded = recomputed
        assert 0.001 < t["rel_err"] <= 0.015, (name, t["rel_err"])      # lossy, but within budget
    summ = m["summary"]["int8_g128_rel_err"]
    assert summ["count"] == len(lossy) and summ["worst"] <= 0.015


def test_wo_a_is_exact_bf16(tiny_flash, tp4):
    m, src = load_manifest(tp4), SafetensorsDir(tiny_flash)
    name = "layers.2.attn.wo_a.weight"
    t = m["tensors"][name]
    assert t["scheme"] == "bf16" and t["shard_dim"] == 0 and t["rel_err"] == 0.0
    w = _gather(tp4, 4, name, 0)
    ref = dequant_fp8_block(src.read(name), src.read(name[:-7] + ".scale"))
    assert torch.equal(w.float(), ref)


def test_passthrough_unchanged(tiny_flash, tp4):
    m, src = load_manifest(tp4), SafetensorsDir(tiny_flash)
    for name in ("embed.weight", "layers.0.ffn.gate.tid2eid", "layers.3.ffn.gate.bias",
                 "layers.2.attn.attn_sink", "hc_head_fn", "mtp.0.enorm.weight"):
        t = m["tensors"][name]
        assert t["scheme"] == "copy"
        assert torch.equal(_gather(tp4, 4, name, t["shard_dim"]), src.read(name)), name


def test_manifest_complete(tiny_flash, tp4):
    m, src = load_manifest(tp4), SafetensorsDir(tiny_flash)
    assert m["tp"] == 4 and m["schemes"]["linears"] == "int8" and m["schemes"]["experts"] == "int8"
    consumed = {s for t in m["tensors"].values() for s in t["source"]}
    assert consumed == set(src.entries)                                # every source tensor used
    for fname, info in m["source"]["files"].items():
        data = (tiny_flash / fname).read_bytes()
        assert info == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    for t in m["tensors"].values():
        assert {"scheme", "role", "dtype", "shape", "shard_dim", "source", "file"} <= set(t)
    for r in range(4):
        idx = json.loads((rank_dir(tp4, r) / "model.safetensors.index.json").read_text())
        assert set(idx["weight_map"]) == set(m["tensors"])
        files = sorted(p.name for p in rank_dir(tp4, r).glob("*.safetensors"))
        assert files == sorted(set(idx["weight_map"].values()))
        total = 0
        for f in files:
            with safe_open(rank_dir(tp4, r) / f, framework="pt") as h:
                total += sum(h.get_tensor(k).nbytes for k in h.keys())
        assert total == idx["metadata"]["total_size"] == m["ranks"][r]["bytes"]
    assert (tp4 / "config.json").read_bytes() == (tiny_flash / "config.json").read_bytes()
    assert (tp4 / "tokenizer.json").exists() and not (tp4.parent / "tp4.partial").exists()


def test_shard_dims_follow_the_plan(tp4):
    m = load_manifest(tp4)["tensors"]
    expect = {"embed.weight": 0, "head.weight": 0, "layers.3.attn.wq_b.weight": 0,
              "layers.3.attn.attn_sink": 0, "layers.2.attn.indexer.wq_b.weight": 0,
              "layers.2.attn.indexer.weights_proj.weight": 0, "layers.3.attn.wo_a.weight": 0,
              "layers.3.attn.wo_b.weight": 1, "layers.3.attn.wo_b.scale": 1,
              "layers.3.ffn.shared_experts.w1.weight": 0, "layers.3.ffn.shared_experts.w2.weight": 1,
              "layers.3.ffn.experts.5.w3.weight": 0, "layers.3.ffn.experts.5.w2.scale": 1,
              "layers.3.attn.wq_a.weight": None, "layers.3.attn.wkv.weight": None,
              "layers.3.attn.compressor.wkv.weight": None, "layers.3.ffn.gate.weight": None,
              "hc_head_fn": None, "mtp.0.e_proj.weight": None}
    assert {n: m[n]["shard_dim"] for n in expect} == expect


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_every_tp_reassembles_to_tp1(tiny_converted, tp4, tp):
    dst = tiny_converted(tp)
    m = load_manifest(dst)
    for name in ("layers.3.attn.wo_b.weight", "layers.3.attn.wo_b.scale", "head.weight",
                 "layers.4.ffn.experts.3.w2.weight", "layers.4.ffn.experts.3.w2.scale",
                 "layers.2.attn.wq_b.scale"):
        d = m["tensors"][name]["shard_dim"]
        assert torch.equal(_gather(dst, tp, name, d), _gather(tp4, 4, name, d)), name


def test_lossless_bf16_schemes(tiny_flash, tmp_path):
    dst = tmp_path / "bf16"
    m = convert(tiny_flash, dst, tp=2, linears="bf16", experts="bf16", progress=False)
    src = SafetensorsDir(tiny_flash)
    assert set(m["summary"]["tensors_per_scheme"]) == {"bf16", "copy"}
    for name in ("layers.3.attn.wq_b.weight", "layers.3.ffn.experts.7.w1.weight"):
        t = m["tensors"][name]
        w = _gather(dst, 2, name, t["shard_dim"])
        base = name[:-7]
        deq = dequant_mxfp4 if ".experts." in name else dequant_fp8_block
        assert w.dtype == torch.bfloat16 and t["rel_err"] == 0.0
        assert torch.equal(w.float(), deq(src.read(name), src.read(base + ".scale")))


def test_0731_variant_converts(tiny_0731, tmp_path):
    m = convert(tiny_0731, tmp_path / "c", tp=4, progress=False)
    assert m["model"]["variant"] == "0731" and m["model"]["num_mtp_stages"] == 3
    assert m["tensors"]["mtp.0.main_proj.weight"]["scheme"] == "int8_g128"
    assert m["tensors"]["mtp.2.markov_head.markov_w1.weight"]["shard_dim"] is None


def test_exact_flag_is_measured(tiny_flash, tmp_path, monkeypatch):
    """A planted bug in the expert gather table (nibbles swapped) must show up as exact: false."""
    pairs = quant._BYTE_TO_PAIR.view(torch.int8).reshape(256, 2)
    monkeypatch.setattr(quant, "_BYTE_TO_PAIR", pairs.flip(1).contiguous().view(torch.int16))
    out = io.StringIO()
    m = convert(tiny_flash, tmp_path / "bad", tp=1, progress=False, out=out)
    t = m["tensors"]["layers.3.ffn.experts.5.w2.weight"]
    assert t["exact"] is False and 0 < t["rel_err"] < math.inf
    assert m["summary"]["experts_exact"] is False and "bit-exact: NO" in out.getvalue()


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("first", [True, False])
def test_summary_never_hides_a_non_finite_error(bad, first):
    errs = [("a.weight", 0.012), ("b.weight", bad), ("c.weight", 0.009)]
    tensors = {n: {"scheme": "int8_g128", "role": "weight", "rel_err": e}
               for n, e in (errs if first else errs[::-1])}
    journals = {"f": {"source": {"size": 1}, "bytes_out": [1]}}
    s = summarize(tensors, journals, 1)["int8_g128_rel_err"]
    assert s["worst_tensor"] == "b.weight" and not math.isfinite(s["worst"])
    assert math.isnan(s["mean"]) and s["nonfinite"] == 1 and s["count"] == 3
    out = io.StringIO()
    print_summary({"tp": 1, "schemes": {"linears": "int8", "experts": "int8"},
                   "summary": {"tensors_per_scheme": {"int8_g128": 3}, "bytes_in": 1,
                               "bytes_out_per_rank": [1], "int8_g128_rel_err": s,
                               "experts_exact": True}}, out)
    assert "worst NON-FINITE" in out.getvalue() and "mean NaN" in out.getvalue()
