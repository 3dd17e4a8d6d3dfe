"""The fused projection's deferred compressor inputs (model.compressor.ProjectedRows, HeadWeights)
and how the decode step hands them on: Compressor.decode_update passes HeadWeights.pending() to
kernels.cache_ops.compress_decode_fused and gives the kernel's weights back through formed();
Attention._kernels passes the raw rows (ape_added=False) and the indexer's head weights to it.
The kernel itself is stubbed here (its values: tests/runtime/test_decode_update.py,
tests/runtime/kernels/test_cache_ops.py); these tests check what is passed, in plain torch.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():       # kernel modules imported here (cache_ops, attention)
    os.environ.setdefault("TRITON_INTERPRET", "1")     # decorated as the other CPU tests want

import backfit.runtime.kernels as kpkg
from backfit.config import ModelConfig
from backfit.runtime.layers import Rotary
from backfit.runtime.model import compressor as cm
from backfit.runtime.model.attention import Attention
from backfit.synthetic import tiny_config_dict

SCALE = 0.01


def test_head_weights_pending_formed_and_torch_forming():
    raw = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    hw = cm.HeadWeights(raw, torch.bfloat16, SCALE)
    got = hw.pending(torch.bfloat16)
    assert got[0] is raw and got[1] == SCALE
    assert hw.pending(torch.float32) is None                  # a kernel rounding to another dtype
    w = torch.randn(3, 8)
    hw.formed(w)
    assert hw.pending(torch.bfloat16) is None                 # formed once, never again
    assert hw.tensor() is w and torch.equal(hw[1:], w[1:])
    lazy = cm.HeadWeights(raw, torch.bfloat16, SCALE)        # no kernel: torch forms them on use
    assert torch.equal(lazy[0], raw.to(torch.bfloat16).float()[0] * SCALE)
    assert lazy.pending(torch.bfloat16) is None and lazy.tensor() is lazy.tensor()


def test_projected_rows_add_ape_once_on_use():
    comp = cm.Compressor(16, 8, 4, True, 1e-6, Rotary(4, 10000.0, None))
    comp.ape.normal_(generator=torch.Generator().manual_seed(2))
    c, z, pos = torch.randn(5, 16), torch.randn(5, 16), torch.tensor([0, 3, 4, 9, 30])
    rows = cm.ProjectedRows(comp, c, z, pos)
    assert rows[0] is c
    assert torch.equal(rows[1], comp.with_ape(c, z, pos)[1]) and rows[1] is rows[1]
    assert not torch.equal(rows[1], z)                        # the ape row was really added
    with pytest.raises(IndexError, match="0 = c, 1 = z"):
        rows[2]


class _Cache:
    """What the fused branch of Compressor.decode_update reads of the layer cache."""
    scratch_block = 7

    def entry_pool(self, kind):
        return "data", "scale"

    def slot_ids(self):
        return "slots"

    def rows_pool(self, kind):
        return "ring_c", "ring_z"

    def block_table(self):
        return "tables"


def test_decode_update_hands_head_weights_to_the_fused_kernel(monkeypatch):
    from backfit.runtime.kernels import cache_ops
    calls = []

    def fused(c, z, ape, *args):
        calls.append((ape, args[-1]))                         # ape row, head_w
        return None if args[-1] is None else torch.full(args[-1][0].shape, 5.0)
    monkeypatch.setattr(cache_ops, "compress_decode_fused", fused)
    monkeypatch.setattr(kpkg, "_backend", "triton")
    monkeypatch.setattr(kpkg, "_ANY_DEVICE", True)           # CPU tensors stand for CUDA ones
    monkeypatch.setattr(cm, "FUSED_DECODE", True)
    comp = cm.Compressor(16, 8, 4, True, 1e-6, Rotary(4, 10000.0, None))
    c = z = torch.zeros(2, 16)
    pos = torch.tensor([3, 8])
    hw = cm.HeadWeights(torch.randn(2, 4), torch.bfloat16, SCALE)
    comp.decode_update(_Cache(), "index", c, z, pos, torch.bfloat16, ape_added=False, head_w=hw)
    ape, head_w = calls[-1]
    assert ape is comp.ape and head_w[0] is hw.raw and head_w[1] == SCALE
    assert torch.equal(hw.tensor(), torch.full((2, 4), 5.0))   # the kernel's, not torch's
    comp.decode_update(_Cache(), "index", c, z, pos, torch.bfloat16, head_w=hw)
    assert calls[-1] == (None, None)                          # formed already; ape in z
    other = cm.HeadWeights(torch.randn(2, 4), torch.bfloat16, SCALE)
    comp.decode_update(_Cache(), "index", c, z, pos, torch.float32, head_w=other)
    assert calls[-1][1] is None and other.pending(torch.bfloat16) is not None


class _Stop(Exception):
    pass


class _Batch:
    seq_lens = [1, 1]


class _RingCache:
    def ring_pool(self):
        return None, None


@pytest.mark.parametrize("fused", [True, False])
def test_attention_decode_step_hands_on_raw_rows_and_head_weights(tp1_process, monkeypatch,
                                                                  fused):
    """_kernels' decode branch: ProjectedRows -> (c, raw z, ape_added=False), the indexer's
    compressor also the HeadWeights; plain (c, z) tuples -> ape_added left True, no head_w."""
    attn = Attention(ModelConfig.from_dict(tiny_config_dict()), 4)
    seen = []

    def record(self, cache, kind, c, z, pos, dtype, ape_added=True, head_w=None):
        seen.append((self, kind, c, z, ape_added, head_w))
        if len(seen) == 2:
            raise _Stop                                       # the rest of _kernels: not here
    monkeypatch.setattr(cm.Compressor, "decode_update", record)
    pos = torch.tensor([5, 9])
    c, z, ic, iz, w = (torch.randn(2, 4) for _ in range(5))
    if fused:
        comp = cm.ProjectedRows(attn.compressor, c, z, pos)
        icomp = cm.ProjectedRows(attn.indexer.compressor, ic, iz, pos)
        wI = cm.HeadWeights(w, torch.bfloat16, SCALE)
    else:
        comp, icomp, wI = (c, z), (ic, iz), w
    q = torch.zeros(2, attn.local_heads, 8, dtype=torch.bfloat16)
    with pytest.raises(_Stop):
        attn._kernels(q, None, pos, _Batch(), _RingCache(), comp, (None, wI, icomp))
    want = ((attn.compressor, "comp", c, z), (attn.indexer.compressor, "index", ic, iz))
    for got, w4 in zip(seen, want):
        assert got[0] is w4[0] and got[1] == w4[1] and got[2] is w4[2] and got[3] is w4[3]
    assert [s[4] for s in seen] == [not fused] * 2
    assert seen[0][5] is None and seen[1][5] is (wI if fused else None)
