"""Weight-level check of a converted directory and the comparison metrics."""

import json
import struct

import pytest
import torch

from backfit.formats import rank_dir
from backfit.verify.compare import format_table, logit_metrics, tensor_metrics
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
