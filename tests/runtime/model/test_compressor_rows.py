"""The fused projection's deferred compressor inputs (model.compressor.ProjectedRows, HeadWeights)
and how the decode step hands them on. Attention._project defers them on the paged decode step
only (prefill and mixed batches get z + ape and the rounded weights at once, the same bits);
Attention._kernels passes the raw rows (ape_added=False) and the indexer's head weights to
Compressor.decode_update, which passes HeadWeights.pending() to
kernels.cache.decode.compress_decode_fused and gives the kernel's weights back through formed().
Projections and the kernel are stubbed here (the kernel's values: tests/runtime/
test_decode_update.py, tests/runtime/kernels/test_cache_ops.py): what is passed, in plain torch.
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


def _csa_attention(monkeypatch):
    """A CSA (ratio 4) Attention of the tiny config on the triton path (CPU tensors admitted),
    its fused projections stubbed: fixed outputs, no kernel. -> (attn, fused FP32 outputs)."""
    monkeypatch.setattr(kpkg, "_backend", "triton")
    monkeypatch.setattr(kpkg, "_ANY_DEVICE", True)          # CPU tensors stand for CUDA ones
    attn = Attention(ModelConfig.from_dict(tiny_config_dict()), 4)
    g = torch.Generator().manual_seed(3)
    for comp in (attn.compressor, attn.indexer.compressor):
        comp.ape.normal_(generator=g)
    widths = [attn.compressor.wkv.out_features] * 2 + [attn.indexer.compressor.wkv.out_features] \
        * 2 + [attn.indexer.weights_proj.out_features]
    out = tuple(torch.randn(2, n, generator=g) for n in widths)
    qa = torch.randn(2, attn.wq_a.out_features, generator=g).bfloat16()
    kvx = torch.randn(2, attn.wkv.out_features, generator=g).bfloat16()
    iq = attn.indexer.wq_b                                    # Indexer.queries' projection
    iq.load("copy", torch.zeros(iq.out_features, iq.in_features))
    attn.fused_a = lambda x: (qa, kvx)
    attn.fused_f32 = lambda x, dtype: out
    return attn, out


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors through the interpreted kernels (Indexer.queries)")
def test_project_defers_ape_and_head_weights_to_the_decode_step_only(tp1_process, monkeypatch):
    """decode_step: the raw rows and weights (ProjectedRows, HeadWeights); else (prefill, mixed
    batches, FUSED_DECODE off) the ape row added and the weights rounded at once, the same bits
    as the deferred forms give when torch forms them."""
    attn, out = _csa_attention(monkeypatch)
    x, pos = torch.zeros(2, attn.cfg.hidden_size, dtype=torch.bfloat16), torch.tensor([6, 13])
    _, _, comp, icomp, w = attn._project(x, pos, decode_step=True)
    assert isinstance(comp, cm.ProjectedRows) and isinstance(icomp, cm.ProjectedRows)
    assert comp.c is out[0] and comp.z_raw is out[1] and icomp.c is out[2] and icomp.z_raw is out[3]
    assert isinstance(w, cm.HeadWeights) and w.raw is out[4] and w.dtype == torch.bfloat16
    assert w.scale == attn.indexer.weight_scale
    for step, fused_decode in ((False, True), (True, False)):
        monkeypatch.setattr(cm, "FUSED_DECODE", fused_decode)
        _, _, comp, icomp, wraw = attn._project(x, pos, decode_step=step)
        for rows, mod, c, z in ((comp, attn.compressor, out[0], out[1]),
                                (icomp, attn.indexer.compressor, out[2], out[3])):
            assert rows[0] is c and torch.equal(rows[1], mod.with_ape(c, z, pos)[1])
            assert not torch.equal(rows[1], z)                # the ape row was really added
        _, wI = attn.indexer.queries(torch.zeros(2, attn.cfg.q_lora_rank), wraw, pos)
        assert torch.equal(wI, cm.HeadWeights(out[4], torch.bfloat16, w.scale).tensor())


@pytest.mark.parametrize("lens,paged,want", [([1, 1], True, True), ([2], True, False),
                                             ([1, 1], False, False)])
def test_forward_asks_for_the_deferred_forms_on_the_paged_decode_step(
        tp1_process, monkeypatch, lens, paged, want):
    attn, _ = _csa_attention(monkeypatch)
    asked = []

    def project(x, pos, decode_step=False):
        asked.append(decode_step)
        raise _Stop
    monkeypatch.setattr(attn, "_project", project)
    batch = type("B", (), {"positions": torch.tensor([4, 9]), "seq_lens": lens})()
    cache = _RingCache() if not paged else type("P", (_RingCache,), {"block_table": None})()
    with pytest.raises(_Stop):
        attn.forward(torch.zeros(2, attn.cfg.hidden_size, dtype=torch.bfloat16), batch, cache)
    assert asked == [want]


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
    import backfit.runtime.kernels.cache as cache_ops           # the model's door to the room
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
        comp, icomp = cm.ProjectedRows(c, z), cm.ProjectedRows(ic, iz)
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


@pytest.mark.parametrize("ape_added", [False, True])
def test_multi_row_rows_store_kernel_equals_the_torch_stores(tp1_process, monkeypatch,
                                                             ape_added):
    """A verify batch (rows sharing a slot: PagedCache.bind_device(multi_row=True)) stores its
    compressor rows before pooling: Compressor._store_rows' one kernel (ROWS_KERNEL) leaves the
    rings bit for bit as PagedCache.write_rows_tokens' torch ops, ape added or not."""
    from support import kernel_module
    from backfit.runtime.cache.paged import PagedCache
    kernel_module("cache.prefill", "_rows_kernel", True)
    monkeypatch.setattr(kpkg, "_backend", "triton")
    monkeypatch.setattr(kpkg, "_ANY_DEVICE", True)
    cfg = ModelConfig.from_dict(tiny_config_dict())
    li = cfg.compress_ratios.index(4)                          # a CSA layer: both compressors
    attn = Attention(cfg, 4)
    slots = torch.tensor([2, 2, 2, 0], dtype=torch.int32)      # three rows of one sequence
    pos = torch.tensor([6, 7, 8, 3])
    tables = torch.zeros(4, 4, dtype=torch.int32)
    rings = {}
    for flag in (False, True):
        monkeypatch.setattr(cm, "ROWS_KERNEL", flag)
        pool = PagedCache(cfg, 3, 8, 16, torch.float32)
        layer = pool.bind_device(slots, tables, multi_row=True).layer(li)
        assert layer.multi_row
        for kind, comp in (("comp", attn.compressor), ("index", attn.indexer.compressor)):
            comp.ape.normal_(generator=torch.Generator().manual_seed(7))
            w = comp.wkv.out_features
            c, z = (torch.randn(4, w, generator=torch.Generator().manual_seed(w + i))
                    for i in range(2))
            comp._store_rows(layer, kind, pos, c, z, ape_added)
        rings[flag] = [t.clone() for kind in ("comp", "index") for t in layer.rows_pool(kind)]
    assert all(torch.equal(a, b) for a, b in zip(rings[False], rings[True]))
    assert all(t.abs().sum() > 0 for t in rings[True])         # rows were written
