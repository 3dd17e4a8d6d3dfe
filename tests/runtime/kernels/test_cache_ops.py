"""Decode cache kernels (runtime.kernels.cache.decode) against the torch path of PagedCache and
Compressor.decode_update, on twin pools (CPU: the Triton interpreter).

compress_decode: the ring rows it writes are exact, the pooled entries agree with the torch
pooling to FP32 rounding (Triton's exp), for CSA (ratio 4, 2D-wide rows, virtual block -1) and
HCA (ratio 8 and the real 128), positions before, at and after block ends, strided row inputs.
store_decode: bit-exact against _Store.put for the ring and the entry stores, BF16 and INT8
(the same absmax/127 and round-half-even arithmetic), scratch-block redirection included.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"

from support import kernel_module  # noqa: E402

from backfit.runtime.batch import ForwardBatch  # noqa: E402
from backfit.runtime.cache.paged import PagedCache  # noqa: E402
from backfit.runtime.streams import stream_counters  # noqa: E402


def kmod():
    return kernel_module("cache.decode", "_store_kernel", INTERPRET)


def _torch_pool(rc, rz, slots, pos, m, overlap, D):
    """The torch decode_update pooling over ring rows (after this token's rows are written)."""
    n = 2 * m if overlap else m
    R = rc.shape[1]
    r = (pos[:, None] - torch.arange(n - 1, -1, -1, device=pos.device)) % R
    sc, sz = rc[slots.long()[:, None], r], rz[slots.long()[:, None], r]
    if overlap:
        sc = torch.cat((sc[:, :m, :D], sc[:, m:, D:]), 1)
        sz = torch.cat((sz[:, :m, :D], sz[:, m:, D:]), 1)
        virt = (pos < m)[:, None] & (torch.arange(2 * m, device=pos.device) < m)[None]
        sc, sz = sc.masked_fill(virt[..., None], 0.0), sz.masked_fill(virt[..., None], float("-inf"))
    return (torch.softmax(sz, 1) * sc).sum(1)


@pytest.mark.parametrize("m, overlap, D", [(4, True, 64), (4, True, 512), (8, False, 64),
                                           (128, False, 512)])
def test_compress_decode(m, overlap, D):
    k = kmod()
    g = torch.Generator().manual_seed(m + D)
    width = (2 if overlap else 1) * D
    S, R = 5, (2 * m if overlap else m) + 8
    rc = torch.randn(S, R, width, generator=g).to(DEV)
    rz = torch.randn(S, R, width, generator=g).to(DEV)
    pos = torch.tensor([0, m - 1, m, 2 * m - 1, 3 * m + 1, 40 * m + m - 1], device=DEV)
    slots = torch.tensor([4, 0, 2, 1, 3, 0][:len(pos)], dtype=torch.int32, device=DEV)
    pos, slots = pos[:4], slots[:4]                         # distinct slots (one writer each)
    both = torch.randn(len(pos), 3, width, generator=g).to(DEV)
    c, z = both[:, 0], both[:, 1, :].contiguous()           # strided c rows, contiguous z
    want_c, want_z = rc.clone(), rz.clone()
    want_c[slots.long(), pos % R], want_z[slots.long(), pos % R] = c, z
    want = _torch_pool(want_c, want_z, slots, pos, m, overlap, D)
    E = k.compress_decode(c, z, pos, slots, rc, rz, m, overlap, D)
    assert torch.equal(rc, want_c) and torch.equal(rz, want_z)
    torch.testing.assert_close(E, want, rtol=2e-6, atol=2e-6)
    with pytest.raises(ValueError, match="compress_decode"):
        k.compress_decode(c[:, :D], z[:, :D], pos, slots, rc, rz, m, overlap, D) if overlap \
            else k.compress_decode(c.double(), z.double(), pos, slots, rc, rz, m, overlap, D)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_store_decode_equals_store_put(model_f32, kv_dtype):
    k = kmod()
    cfg = model_f32.cfg
    li = next(i for i in range(cfg.num_hidden_layers) if cfg.ratio(i) == 4)
    B, blocks = 16, 30
    free = list(range(blocks))
    random.Random(2).shuffle(free)
    tables = [[free.pop() for _ in range(4)] for _ in range(3)]
    pos = [3, 7, 40]                              # entry 0 done, entry 1 done, 40: not (scratch)
    batch = ForwardBatch.build([(i, [1], p) for i, p in enumerate(pos)], slots=[2, 0, 1],
                               block_tables=tables)
    ref, new = (PagedCache(cfg, 4, blocks, B, torch.bfloat16, kv_dtype, device=DEV)
                for _ in range(2))
    lr, ln = ref.bind(batch).layer(li), new.bind(batch).layer(li)
    g = torch.Generator().manual_seed(5)
    pos_t = torch.tensor(pos, device=DEV)
    kv = (torch.randn(3, cfg.head_dim, generator=g) * 3).to(torch.bfloat16).to(DEV)
    lr.write_window_tokens(pos_t, kv)                       # torch path (CPU tensors)
    ring = new.layers[li].ring
    k.store_decode(kv, pos_t, ring.data, ring.scale, slots=ln.slot_ids())
    assert torch.equal(ring.data, ref.layers[li].ring.data)
    if kv_dtype == "int8":
        assert torch.equal(ring.scale, ref.layers[li].ring.scale)
    E = (torch.randn(3, cfg.head_dim, generator=g)).to(torch.bfloat16).to(DEV)
    lr.write_entries_tokens("comp", pos_t, E)
    ent = new.layers[li].comp.entries
    k.store_decode(E, pos_t, ent.data, ent.scale, tables=ln.block_table(), ratio=4,
                   scratch=new.scratch_block)
    assert torch.equal(ent.data, ref.layers[li].comp.entries.data)
    assert ent.data[tables[1][0]].any() and ent.data[new.scratch_block].any()   # done / scratch
    if kv_dtype == "int8":
        assert torch.equal(ent.scale, ref.layers[li].comp.entries.scale)


def _old_chain(k, rn, c, z, ape, pos, slots, rc, rz, m, overlap, D, w, eps, inv_freq, r,
               data, scale, tables, scratch, dtype):
    """Today's kernel path of Compressor.decode_update: with_ape (torch), compress_decode,
    E.to(dtype), rms_norm, rope at (pos // m)·m, store_decode."""
    z = z + ape[pos % m]
    E = k.compress_decode(c, z, pos, slots, rc, rz, m, overlap, D)
    E = rn.rope(rn.rms_norm(E.to(dtype), w, eps), (pos // m) * m, inv_freq, r)
    k.store_decode(E, pos, data, scale, tables=tables, ratio=m, scratch=scratch)


def _fused_case(m, overlap, D, int8, dtype, B=4):
    """Inputs of one fused update: (args before the pools, twin pools, tables, NB, hw). B = 4:
    positions 1, m-1, 3m-1 (block 2 done), 9m+2; larger B: random positions, half at ends."""
    from backfit.runtime.layers import yarn_inv_freq
    g = torch.Generator().manual_seed(7 * m + D + B)
    width = (2 if overlap else 1) * D
    S, R, PB, NB, r = B + 1, (2 * m if overlap else m) + 8, 4, 3 * B, 64
    if B == 4:
        pos = torch.tensor([1, m - 1, 3 * m - 1, 9 * m + 2])
    else:
        pos = torch.randint(0, 12 * m - 1, (B,), generator=g)
        pos[::2] = (pos[::2] // m + 1) * m - 1
    slots = torch.randperm(S, generator=g)[:B].int().to(DEV)
    tables = torch.randperm(NB, generator=g).int().view(B, 3).to(DEV)
    rc = torch.randn(S, R, width, generator=g).to(DEV)
    rz = torch.randn(S, R, width, generator=g).to(DEV)
    ape = torch.randn(m, width, generator=g).to(DEV)
    both = torch.randn(B, 2, width, generator=g).to(DEV)
    c, z = both[:, 0], both[:, 1]                                     # strided rows
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(DEV)
    inv_freq = yarn_inv_freq(r, 160000.0, None).to(DEV)
    pools = []
    for _ in range(2):
        data = torch.zeros(NB + 1, PB, D, dtype=torch.int8 if int8 else dtype, device=DEV)
        pools.append((rc.clone(), rz.clone(), data,
                      torch.ones(NB + 1, PB, device=DEV) if int8 else None))
    hw = torch.randn(B, 70, generator=g).to(DEV)[:, 3:67]            # [B, 64] strided rows
    return (c, z, ape, pos.to(DEV), slots), (w, 1e-6, inv_freq, r), pools, tables, NB, hw


W_SCALE = 128 ** -0.5 * 64 ** -0.5


@pytest.mark.parametrize("m, overlap, D, int8, dtype", [
    (4, True, 512, False, torch.bfloat16), (4, True, 512, True, torch.bfloat16),
    (4, True, 128, False, torch.bfloat16), (128, False, 512, True, torch.bfloat16),
    (8, False, 64, False, torch.float32)])
def test_compress_decode_fused_equals_chain(m, overlap, D, int8, dtype):
    """Rows, entry pool (and scales) bit-equal to the old chain on twin pools; positions before
    and at block ends, pos < m (CSA's virtual block), B = 4 different positions; the indexer
    head weights formed in the same launch equal torch's round, upcast, scale."""
    k, rn = kmod(), kernel_module("rope_norm", "_rms_kernel", INTERPRET)
    (c, z, ape, pos, slots), norm, pools, tables, NB, hw = _fused_case(m, overlap, D, int8, dtype)
    (rc0, rz0, d0, s0), (rc1, rz1, d1, s1) = pools
    _old_chain(k, rn, c, z, ape, pos, slots, rc0, rz0, m, overlap, D, *norm, d0, s0, tables, NB,
               dtype)
    wI = k.compress_decode_fused(c, z, ape, pos, slots, rc1, rz1, *norm, d1, s1, tables, NB, m,
                                 overlap, D, dtype, head_w=(hw, W_SCALE))
    assert torch.equal(wI, hw.to(dtype).float() * W_SCALE)            # Indexer.queries' w
    if D // min(128, max(16, 4096 // (2 * m if overlap else m))) > 1:  # several blocks per row
        assert not stream_counters(c.device, 4).any(), "block counters not reset for the next call"
    assert torch.equal(rc0, rc1) and torch.equal(rz0, rz1)
    assert torch.equal(d0, d1)
    if int8:
        assert torch.equal(s0, s1)
    assert d1[tables[1, 0]].any() and d1[NB].any()                   # a done entry, the scratch
    if m <= 8:                                                        # rows 1 and 2 complete too
        assert d1[tables[2, (3 * m - 1) // m // 4]].any()
    with pytest.raises(ValueError, match="compress_decode_fused"):
        k.compress_decode_fused(c, z, ape, pos, slots, rc1, rz1, *norm, d1, s1, tables.long(),
                                NB, m, overlap, D, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("m, overlap, int8", [(4, True, False), (128, False, True)])
def test_compress_decode_fused_cuda_graph(m, overlap, int8):
    """GPU: no host sync; captured in a CUDA graph and replayed 3 times (the block counters
    must be 0 again each time) from the same state, it writes what the old chain writes;
    B = 64 at random positions, half of them completing an entry."""
    from moe_support import without_host_sync
    k, rn = kmod(), kernel_module("rope_norm", "_rms_kernel", False)
    D, dt = 512, torch.bfloat16
    (c, z, ape, pos, slots), norm, pools, tables, NB, hw = _fused_case(m, overlap, D, int8, dt,
                                                                       B=64)
    (rc0, rz0, d0, s0), (rc1, rz1, d1, s1) = pools
    _old_chain(k, rn, c, z, ape, pos, slots, rc0, rz0, m, overlap, D, *norm, d0, s0, tables, NB,
               dt)
    state = [t.clone() for t in (rc1, rz1, d1) + ((s1,) if int8 else ())]

    def fn():
        k.compress_decode_fused(c, z, ape, pos, slots, rc1, rz1, *norm, d1, s1, tables, NB, m,
                                overlap, D, dt)
    without_host_sync(fn)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        for t, t0 in zip((rc1, rz1, d1) + ((s1,) if int8 else ()), state):
            t.copy_(t0)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(rc0, rc1) and torch.equal(rz0, rz1)
        assert torch.equal(d0[:NB], d1[:NB])           # (rows racing for the scratch: either)
        if int8:
            assert torch.equal(s0[:NB], s1[:NB])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_block_counters_are_per_stream():
    """The CSA layer's two compressor updates run on two side streams at once: each stream has
    its own block counters (shared ones would mix the two launches' counts)."""
    dev = torch.device("cuda")
    main = stream_counters(dev, 4)
    with torch.cuda.stream(torch.cuda.Stream(dev)):
        side = stream_counters(dev, 4)
    assert main.data_ptr() != side.data_ptr()
    assert stream_counters(dev, 4).data_ptr() == main.data_ptr()
