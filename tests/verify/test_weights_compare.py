"""Weight-level check of a converted directory and the comparison metrics."""

import json
import math
import struct

import pytest
import torch

from backfit.formats import rank_dir
from backfit.verify.compare import format_table, logit_metrics, tensor_metrics
from backfit.verify.run import _judge, _judge_hidden, hidden_limits
from backfit.verify.weights import check_weights


@pytest.fixture(scope="module")
def converted(tiny_converted):
    return tiny_converted(2)


def test_weights_consistent(tiny_flash, converted):
    rows, problems = check_weights(tiny_flash, converted)
    assert problems == []
    by = {}
    for _, m in rows:
        by.setdefault(m["scheme"], []).append(m["rel"])
    assert max(by["int8_g128"]) <= 0.015 and min(by["int8_g128"]) > 0
    assert set(by["int8_mx32"]) == {0.0} and set(by["copy"]) == {0.0} and set(by["bf16"]) == {0.0}


def test_weights_detects_a_corrupted_expert(tiny_flash, converted, tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(converted, bad)
    f = rank_dir(bad, 1) / "model-00005-of-00009.safetensors"
    raw = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    off = json.loads(raw[8:8 + n])["layers.3.ffn.experts.2.w1.weight"]["data_offsets"][0]
    raw[8 + n + off] = (raw[8 + n + off] + 1) % 256
    f.write_bytes(bytes(raw))
    _, problems = check_weights(tiny_flash, bad)
    assert problems and all("layers.3.ffn.experts.2.w1.weight" in p for p in problems)


def test_metrics():
    a = torch.randn(10, 50, generator=torch.Generator().manual_seed(0))
    m = logit_metrics(a, a)
    assert m["kl_mean"] == 0 and m["top1"] == 1 and m["top5"] == 1 and m["max_dlogit"] == 0
    b = a.clone()
    b[0, a[0].argmax()] -= 100                                  # flips position 0's top-1
    m = logit_metrics(b, a)
    assert m["top1"] == 0.9 and m["kl_max"] > 1 and m["max_dlogit"] == 100
    t = tensor_metrics(a * 1.01, a)
    assert abs(t["rel"] - 0.01) < 1e-6 and abs(t["cos"] - 1) < 1e-12
    assert "top1" in format_table([("logits", m)], ["top1", "kl_mean"])


def test_nan_is_never_an_error_of_zero():
    a = torch.randn(10, 50, generator=torch.Generator().manual_seed(1))
    b = a.clone()
    b[3, 7] = float("nan")
    t = tensor_metrics(b, a)
    assert math.isnan(t["rel"]) and math.isnan(t["max_abs"])
    assert tensor_metrics(a, torch.zeros_like(a))["rel"] == math.inf       # zero reference
    assert tensor_metrics(torch.zeros(3), torch.zeros(3))["rel"] == 0.0
    m = logit_metrics(b, a)
    assert math.isnan(m["kl_mean"]) and math.isnan(m["rel"])


@pytest.mark.parametrize("kind", ["semantics", "conversion", "precision"])
def test_gates_fail_on_nan_metrics(kind):
    """NaN > limit is False: every gate must still count a NaN as a breach."""
    clean = {"rel": 0.0, "top1": 1.0, "kl_mean": 0.0}
    floor = {"top1": 1.0, "kl_mean": 1e-5}
    assert _judge(kind, clean, floor) == []
    for key in ("kl_mean",) + (("rel",) if kind == "semantics" else ()):
        assert _judge(kind, dict(clean, **{key: math.nan}), floor), key
    assert _judge(kind, dict(clean, top1=math.nan), floor)
    limits = hidden_limits(kind, [1e-3, 2e-3], 2)
    assert len(limits) == 2 and all(lim > 0 for lim in limits)
    rows = [("layer 0", {"rel": 0.0}), ("layer 1", {"rel": math.nan})]
    assert _judge_hidden(rows, limits) == [f"layer 1 hidden relative error nan > {limits[1]:.1e}"]
    assert _judge_hidden([("layer 0", {"rel": limits[0] * 1.01})], limits)      # just over


def test_hidden_limits_are_the_documented_ones():
    assert hidden_limits("semantics", None, 3) == [1e-5] * 3
    assert hidden_limits("conversion", None, 2) == [1e-2] * 2
    assert hidden_limits("precision", [1e-3, 8e-3], 2) == [1e-2, 1.6e-2]      # max(2 x floor, 1 %)
