"""The summed down launch of the fused MoE (a scheme's DOWN_SUM: common.launch_down_sum): the down
projection and the combine in one launch equal, bit for bit, the same variant's down launch
followed by pointwise.moe_combine, with and without the shared expert, in FP32 and BF16, for
both expert schemes; and it is taken only where down_sum_config says. CPU: Triton interpreter."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"

import moe_support  # noqa: E402
from moe_support import LIMIT, moe_kernels, stacks  # noqa: E402
from support import one_thread  # noqa: E402
from test_moe import mx_weight  # noqa: E402
from test_moe_mx4 import mx4_weight  # noqa: E402

from backfit.runtime.kernels import pointwise  # noqa: E402

E, D, I, K_TOP = 8, 256, 128, 6
# per scheme: (weights, the variant with a summed down, a gate/up tile of few interpreter
# programs)
SCHEMES = dict(mx4=(mx4_weight, "word4d", dict(variant="word4d", BN=64, BK=256, num_warps=1)),
               int8=(mx_weight, "base", dict(variant="base", BN=64, BK=256, num_warps=1)))


@pytest.fixture(scope="module")
def kmods():
    """scheme -> its module (fused_moe_<scheme>, DOWN_SUM), imported for this mode."""
    mx4 = moe_kernels(INTERPRET)[1]
    return dict(mx4=(mx4, mx4.fused_moe_mx4),
                int8=(importlib.import_module("backfit.runtime.kernels.moe.int8"),) * 2)


def _run(kmods, scheme):
    mod, run = kmods[scheme]
    return mod, (run if scheme == "mx4" else mod.fused_moe_int8)


def _no_combine(*a, **k):
    raise AssertionError("moe_combine launched: the down did not sum the pairs")


@pytest.mark.parametrize("scheme,tile", [("mx4", dict(BN=32, BK=128, num_warps=1)),
                                         ("mx4", dict(BN=64, BK=64, num_warps=1, num_stages=2)),
                                         ("int8", dict(BN=32, BK=128, num_warps=1)),
                                         ("int8", dict(BN=64, BK=64, num_warps=1))])
def test_summed_down_equals_down_then_combine(kmods, scheme, tile, monkeypatch):
    """The down launch + moe_combine against the summed launch of the same variant and tile, T
    = 1 and 3, shared or not, FP32 (tp > 1: the all-reduce's input) and BF16 sums; BK 64 < I:
    two K tiles a pair."""
    mod, run = _run(kmods, scheme)
    weight, variant, up = SCHEMES[scheme]
    st, gen = stacks(weight, E, D, I, 61, (122, 130))
    down = dict(variant=variant, **tile)
    with one_thread():
        for T in (1, 3):
            x = (torch.randn(T, D, generator=gen) * 2).bfloat16().to(DEV)
            idx, w = moe_support.routing(T, K_TOP, E, gen, DEV)
            shared = (torch.randn(T, D, generator=gen) * 0.5).bfloat16().to(DEV)
            for sh in (None, shared):
                for dtype in (torch.float32, torch.bfloat16):
                    monkeypatch.setattr(mod, "DOWN_SUM", None)
                    want = run(x, idx, w, *st, LIMIT, path="decode", config=dict(up, down=down),
                               shared=sh, dtype=dtype)
                    monkeypatch.setattr(mod, "DOWN_SUM", dict(down, max_pairs=18))
                    with monkeypatch.context() as m:
                        m.setattr(pointwise, "moe_combine", _no_combine)
                        got = run(x, idx, w, *st, LIMIT, path="decode", config=up, shared=sh,
                                  dtype=dtype)
                    assert got.dtype == dtype and got.shape == (T, D)
                    assert torch.equal(got, want), (tile, T, sh is None, dtype)


def test_summed_down_only_where_it_applies(kmods, monkeypatch):
    """Past max_pairs, and with the sum left to the caller (pairs=True), the down stays
    per pair; a variant without a summed down is a one-line error."""
    mod, run = _run(kmods, "mx4")
    _, variant, up = SCHEMES["mx4"]
    st, gen = stacks(mx4_weight, E, D, I, 62, (122, 130))
    x = (torch.randn(2, D, generator=gen) * 2).bfloat16().to(DEV)
    idx, w = moe_support.routing(2, K_TOP, E, gen, DEV)
    monkeypatch.setattr(mod, "DOWN_SUM", dict(variant=variant, BN=64, BK=128, num_warps=1,
                                               max_pairs=6))
    calls = []
    real = pointwise.moe_combine
    monkeypatch.setattr(pointwise, "moe_combine", lambda *a, **k: calls.append(1) or real(*a, **k))
    with one_thread():
        run(x, idx, w, *st, LIMIT, path="decode", config=up)                  # 12 pairs > 6
        assert calls == [1]
        s = run(x[:1], idx[:1], w[:1], *st, LIMIT, path="decode", config=up, pairs=True)
        assert isinstance(s, pointwise.PairSum)
        monkeypatch.setattr(mod, "DOWN_SUM", dict(variant="mma", BN=16, BK=128, num_warps=1))
        with pytest.raises(ValueError, match="no summed down for variant 'mma'"):
            run(x[:1], idx[:1], w[:1], *st, LIMIT, path="decode", config=up)
