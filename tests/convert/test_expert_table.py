"""The INT8 expert fast path: the 16-bit gather table, rank-major pieces, and the checks behind
`exact` (the table against the reference decoder, codes on sampled rows)."""

import numpy as np
import pytest
import torch

from backfit.convert import transforms
from backfit.convert.transforms import ExpertTable, _sampled_exact
from backfit.convert.writer import _split
from backfit.quant import mxfp4_to_int8


def _packed(n, half, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, half), generator=g, dtype=torch.int32).to(torch.uint8) \
        .view(torch.int8)


def test_table_is_ok_and_equals_the_byte_gather():
    t = ExpertTable()
    assert t.ok and t.table.shape == (65536,) and t.table.dtype == np.uint32
    w = _packed(96, 64)
    want, _ = mxfp4_to_int8(w, torch.zeros(96, 4, dtype=torch.uint8))
    got = t.convert(w)
    assert got.dtype == torch.int8 and torch.equal(got, want) and _sampled_exact(w, got)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_rank_major_pieces_equal_the_split_of_the_full_tensor(tp):
    t, w = ExpertTable(), _packed(130, 128, seed=tp)              # 130 rows: last row sampled
    pieces = t.convert(w, tp, dim=1)                              # [tp, N, K/tp]
    full = t.convert(w)                                           # [N, K]
    assert pieces.shape == (tp, 130, 256 // tp)
    assert all(torch.equal(a, b) for a, b in zip(pieces, _split(full, 1, tp)))
    assert _sampled_exact(w, pieces)


def test_a_wrong_table_is_not_ok(monkeypatch):
    """One wrong entry (a byte whose codes are swapped) makes the table fail its own check."""
    bad = transforms._CHECK_PAIRS.copy()
    bad[0x21] = bad[0x12]                                         # would decode 0x21 as 0x12
    monkeypatch.setattr(transforms, "_CHECK_PAIRS", bad)
    assert not ExpertTable().ok


def test_sampled_check_catches_a_layout_bug():
    """Rank pieces in the wrong order (every row wrong) and one sampled row off are both caught;
    the check compares against the reference decoder, not against the table."""
    t, w = ExpertTable(), _packed(128, 64)
    pieces = t.convert(w, 4, dim=1)
    assert not _sampled_exact(w, pieces.flip(0).contiguous())
    full = t.convert(w).clone()
    full[64, 0] ^= 1                                              # row 64 is sampled
    assert not _sampled_exact(w, full)


def test_convert_measures_a_layout_bug_as_not_exact(tiny_flash, tmp_path, monkeypatch):
    """A converter that writes w2's rank pieces in the wrong order must report exact: false and
    a measured error, like a wrong table does (test_convert.test_exact_flag_is_measured)."""
    from backfit.convert.run import convert

    real = ExpertTable.convert
    monkeypatch.setattr(ExpertTable, "convert",
                        lambda self, w, tp=1, dim=None: real(self, w, tp, dim).flip(0)
                        if dim == 1 else real(self, w, tp, dim))
    m = convert(tiny_flash, tmp_path / "bad", tp=2, progress=False, out=open("/dev/null", "w"))
    t = m["tensors"]["layers.3.ffn.experts.5.w2.weight"]
    assert t["exact"] is False and 0 < t["rel_err"]
    assert m["tensors"]["layers.3.ffn.experts.5.w1.weight"]["exact"] is True
    assert m["summary"]["experts_exact"] is False
