"""Compressor.decode_update (batched, branchless: the CUDA-graph decode step) writes exactly what
the per-sequence Compressor.update writes, token by token.

Four sequences at different positions (one starts at 0, so the CSA's virtual block -1 and the
first completions are crossed) decode 40 tokens of random compressor rows through both paths on
twin pools; after every step the rows and every allocated entry block must be identical, and the
scratch block is the only other block decode_update may touch. Blocks are shuffled, bf16 and
int8 storage, the CSA (ratio 4, overlapping, + its indexer compressor) and the HCA (ratio 8).
"""

import random

import pytest
import torch

from backfit.runtime.batch import ForwardBatch
from backfit.runtime.cache.paged import PagedCache

BLOCK = 16
STEPS = 40


def _tables(n_seqs, need, n_blocks, seed):
    free = list(range(n_blocks))
    random.Random(seed).shuffle(free)
    return [[free.pop() for _ in range(need)] for _ in range(n_seqs)]


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_decode_update_equals_update(model_f32, kv_dtype):
    cfg = model_f32.cfg
    layers = {r: i for i, r in reversed(list(enumerate(cfg.compress_ratios[:cfg.num_hidden_layers])))}
    assert 4 in layers and any(r >= 8 for r in layers), "tiny model needs a CSA and an HCA layer"
    g = torch.Generator().manual_seed(3)
    starts = [0, 3, 17, 30]
    need = -(-(max(starts) + STEPS) // BLOCK)
    tables = _tables(len(starts), need, 40, seed=1)
    slots = [5, 0, 2, 7]
    ref, new = (PagedCache(cfg, 8, 40, BLOCK, torch.bfloat16, kv_dtype) for _ in range(2))
    mods = []
    for r, li in layers.items():
        if r == 0:
            continue
        attn = model_f32.layers[li].attn
        mods.append((li, "comp", attn.compressor))
        if attn.indexer is not None:
            mods.append((li, "index", attn.indexer.compressor))
    for step in range(STEPS):
        pos = [s + step for s in starts]
        batch = ForwardBatch.build([(i, [1], p) for i, p in enumerate(pos)], slots=slots,
                                   block_tables=tables)
        bref, bnew = ref.bind(batch), new.bind(batch)
        pos_t = torch.tensor(pos)
        for li, kind, comp in mods:
            width = comp.wkv.out_features
            c = torch.randn(len(pos), width, generator=g)
            z = torch.randn(len(pos), width, generator=g)
            lref, lnew = bref.layer(li), bnew.layer(li)
            for i, p in enumerate(pos):
                comp.update(lref, i, kind, c[i:i + 1], z[i:i + 1], p, torch.bfloat16, read=False)
            comp.decode_update(lnew, kind, c, z, pos_t, torch.bfloat16)
            pr, pn = lref._part(kind), lnew._part(kind)
            assert torch.equal(pr.c[:8], pn.c[:8]) and torch.equal(pr.z[:8], pn.z[:8])
            used = sorted(b for t in tables for b in t)
            assert torch.equal(pr.entries.data[used], pn.entries.data[used]), (step, li, kind)
            if kv_dtype == "int8" and kind == "comp":
                assert torch.equal(pr.entries.scale[used], pn.entries.scale[used])
            others = [b for b in range(40) if b not in used]
            assert not pn.entries.data[others].any(), "decode_update wrote a block it does not own"
    # the completions really happened: the sequence from 0 has its first entries
    assert ref.layers[mods[0][0]].comp.entries.data[tables[0][0]].any()
