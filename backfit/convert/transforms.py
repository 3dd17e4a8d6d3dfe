"""One function per Action kind: source bytes in, full (unsharded) output tensors and error stats
out.

Every check is made in the pass that already reads the data, and any failure is one ConvertError
line naming the file, the tensor and the first offending index:
  - copied floats (BF16/F32): NaN or Inf (a row-chunked isfinite pass);
  - e4m3 bytes: the NaN codes 0x7F/0xFF;
  - FP8 x scale and MXFP4 x scale: a non-finite product is detected through the error pass
    (rel_error propagates NaN/Inf), so valid tensors pay nothing extra;
  - UE8M0 scale bytes: 255 (NaN) and bytes outside E8M0_ACCEPTED (below).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from backfit.convert.plan import Action, ConvertError
from backfit.quant import (E4M3_LUT, E8M0_NAN, FP8_BLOCK, MX_GROUP, decode_e2m1, decode_e8m0,
                           dequant_fp8_block, dequant_int8_groups, dequant_int8_mx, dequant_mx4,
                           dequant_mxfp4, first_nonfinite, mxfp4_to_int8,
                           quantize_int8_groups, rel_error, unpack_e2m1)

__all__ = ["apply", "E8M0_ACCEPTED", "experts_exact", "mx4_exact", "mx4_decoder_exact",
           "ExpertTable"]

_E4M3_NAN = (0x7F, 0xFF)

# Accepted UE8M0 scale bytes e (value 2^(e-127), dsv4-model.md 4.2): 0..159. DeepSeek's scales
# are 2^ceil(log2(amax/448)) per FP8 tile and 2^ceil(log2(amax/6)) per MXFP4 group (4.1, 4.3),
# and trained weights are O(1), so real bytes sit a few steps below 127 (section 8 of that file
# gives 115-130 as the plausible range). The overflow edges are far above: 448 * 2^(e-127) is
# Inf in float32/bf16 from e = 247, 6 * 2^(e-127) from e = 253. e <= 159 (scale <= 2^32, weights
# up to 448 * 2^32) leaves 32 octaves of room over any trained weight and still far from the
# edge; anything above is a damaged byte (bit 7 set on a real scale gives 243..255). No lower
# bound: a small scale only makes values tiny, never non-finite, and an all-zero group may
# legitimately get any small byte (0 included) from a quantizer, so refusing one would refuse a
# valid checkpoint. 255 is NaN and refused on its own.
E8M0_ACCEPTED = (0, 127 + 32)


def _where(action: Action, i: int = 0) -> str:
    e = action.sources[i]
    return f"{e.file}: {e.name}"


def _check_scale(action: Action, s: torch.Tensor) -> None:
    """UE8M0 bytes [*, *]: no 255 (NaN), every byte inside E8M0_ACCEPTED."""
    a = s.numpy()
    lo, hi = int(a.min()), int(a.max())                  # two cheap passes over a small tensor
    if lo >= E8M0_ACCEPTED[0] and hi <= E8M0_ACCEPTED[1]:
        return
    if hi == E8M0_NAN:
        bad = (s == E8M0_NAN).nonzero()[0].tolist()
        raise ConvertError(f"{_where(action, 1)}: UE8M0 scale byte 255 (NaN) at {bad}")
    bad = ((s < E8M0_ACCEPTED[0]) | (s > E8M0_ACCEPTED[1])).nonzero()[0].tolist()
    b = int(s[tuple(bad)])
    lo, hi = E8M0_ACCEPTED
    raise ConvertError(f"{_where(action, 1)}: UE8M0 scale byte {b} (2^{b - 127}) at {bad} is "
                       f"outside the accepted {lo}..{hi} (2^{lo - 127}..2^{hi - 127}): damaged "
                       f"checkpoint")


def _check_e4m3(action: Action, w: torch.Tensor) -> None:
    bad = ((w == _E4M3_NAN[0]) | (w == _E4M3_NAN[1])).nonzero()
    if len(bad):
        raise ConvertError(f"{_where(action)}: e4m3 NaN code at {bad[0].tolist()}")


def _check_finite_source(action: Action, t: torch.Tensor) -> None:
    bad = first_nonfinite(t)
    if bad is not None:
        v = t[tuple(bad)].item()
        raise ConvertError(f"{_where(action)}: non-finite value {v} at {bad} in the source")


def _check_product(action: Action, ref: torch.Tensor, s: torch.Tensor, rel: float, what: str,
                   group: tuple[int, int]) -> None:
    """rel is NaN iff ref (the dequantized source) holds a NaN/Inf: only then is ref scanned.
    group: elements per scale byte (rows, cols), to name the byte behind the first bad value."""
    if math.isfinite(rel):
        return
    bad = first_nonfinite(ref)
    if bad is None:                                        # finite, but its squares overflowed
        raise ConvertError(f"{_where(action)}: {what} is too large to measure (error pass "
                           f"overflowed): the scale bytes are damaged")
    v = ref[tuple(bad)].item()
    tile = [bad[0] // group[0], bad[1] // group[1]]
    raise ConvertError(f"{_where(action)}: {what} gives {v} at {bad} (scale byte "
                       f"{int(s[tuple(tile)])} at {tile} of {action.sources[1].name})")


def _dequant_fp8(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """quant.dequant_fp8_block, same float32 values, ~3x less work: one uint8-indexed numpy gather
    (no int64 index copy) and the tile scale broadcast in place (no two expanded copies)."""
    n, k = w.shape
    b = FP8_BLOCK
    if n % b or k % b:                                     # never in Flash/0731 (dsv4-model.md 4.1)
        return dequant_fp8_block(w, s)
    vals = torch.from_numpy(E4M3_LUT.numpy().take(w.numpy()))                 # [N, K] float32
    vals.view(n // b, b, k // b, b).mul_(decode_e8m0(s)[:, None, :, None])   # x 2^(e-127) per tile
    return vals


# Independent check table for the bit-exact expert path: packed byte -> its two values 2*e2m1, made
# through the reference decoder (unpack_e2m1 + decode_e2m1, the dequant_mxfp4 path), not through
# quant's gather table; viewed as one int16 per byte like the INT8 pairs it is compared with.
_CHECK_PAIRS = (decode_e2m1(unpack_e2m1(torch.arange(256, dtype=torch.int32).to(torch.uint8)
                                        .view(torch.int8)[:, None])) * 2).to(torch.int8)
_CHECK_PAIRS = _CHECK_PAIRS.contiguous().view(torch.int16).reshape(256).numpy()


def experts_exact(w: torch.Tensor, s: torch.Tensor, q: torch.Tensor, e: torch.Tensor) -> bool:
    """True iff INT8 q [N, K] / exponents e [N, K/32] equal packed MXFP4 w [N, K/2] / s in value.

    value = q * 2^(e-128) = e2m1 * 2^(s-127) for all elements iff q == 2*e2m1 and e == s, so this
    compares bytes: one table gather over w and one compare over q (no float math).
    """
    if q.shape != (w.shape[0], 2 * w.shape[1]) or not torch.equal(e.view(torch.uint8), s):
        return False
    want = _CHECK_PAIRS.take(w.contiguous().view(torch.uint8).numpy())       # [N, K/2] int16
    return bool(np.array_equal(q.contiguous().view(torch.int16).numpy(), want))


class ExpertTable:
    """MXFP4 -> INT8 for whole tensors in one 16-bit gather: a packed byte pair (4 codes) -> four
    int8 values 2*e2m1 as one uint32, so each gather step converts 4 codes (1.5x faster than the
    byte -> int16 gather of quant.mxfp4_to_int8; the table is 256 KiB and stays in L2).

    The table is made by quant.mxfp4_to_int8 (the scheme's definition) over all 65,536 byte
    pairs, and `ok` says whether every entry equals the independent reference decoder
    (_CHECK_PAIRS): a wrong table is caught whatever bytes a tensor happens to hold.
    """

    def __init__(self):
        pairs = np.arange(65536, dtype="<u2").view(np.uint8).reshape(65536, 2)    # lo, hi byte
        q, _ = mxfp4_to_int8(torch.from_numpy(pairs).view(torch.int8),
                             torch.zeros(65536, 1, dtype=torch.uint8))             # [65536, 4]
        self.table = q.contiguous().numpy().view(np.uint32).reshape(65536)
        self.ok = bool(np.array_equal(q.numpy().view(np.int16), _CHECK_PAIRS.take(pairs)))

    def convert(self, w: torch.Tensor, tp: int = 1, dim: int | None = None) -> torch.Tensor:
        """Packed w [N, K/2] -> int8 [N, K], or [tp, N, K/tp] rank-major when dim == 1 (the
        rank pieces of a dim-1 split straight from the gather: no transposing copy after it)."""
        n, half = w.shape
        b = w.contiguous().view(torch.uint8).numpy().view("<u2")                 # [N, K/4]
        if dim == 1 and tp > 1:
            b = b.reshape(n, tp, half // (2 * tp)).transpose(1, 0, 2)            # [tp, N, K/4tp]
        out = np.empty(b.shape, np.uint32)
        np.take(self.table, b, out=out)
        return torch.from_numpy(out.view(np.int8))


def _sampled_exact(w: torch.Tensor, q: torch.Tensor) -> bool:
    """q (ExpertTable.convert of w) equals the reference decoding of w on every 64th row plus the
    last one: checks that the verified table was applied to this tensor in the right layout
    (nibble order, rank pieces) for 1/64 of the cost of a full second pass."""
    n = w.shape[0]
    rows = np.unique(np.r_[np.arange(0, n, 64), n - 1])
    want = _CHECK_PAIRS.take(w.contiguous().view(torch.uint8).numpy()[rows])   # [R, K/2] int16
    got = q.numpy().view(np.int16)                          # [N, K/2] or [tp, N, K/2tp]
    got = got[rows] if got.ndim == 2 else got[:, rows].transpose(1, 0, 2).reshape(len(rows), -1)
    return bool(np.array_equal(got, want))


_MX4_DECODER_EXACT: bool | None = None


def mx4_decoder_exact() -> bool:
    """True iff the runtime's decoder (quant.dequant_mx4) gives, bit for bit, the reference
    dequant_mxfp4 value for every packed byte (all 16 x 16 code pairs) under every exponent byte
    0..254: a [255, 256]-byte grid, one exponent per row. Measured once per process."""
    global _MX4_DECODER_EXACT
    if _MX4_DECODER_EXACT is None:
        w = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(255, 1)   # [255, 256]
        s = torch.arange(255, dtype=torch.int32).to(torch.uint8)[:, None]
        s = s.repeat(1, 256 * 2 // MX_GROUP)                                      # [255, 16]
        got, ref = dequant_mx4(w, s), dequant_mxfp4(w, s)                         # [255, 512]
        _MX4_DECODER_EXACT = torch.equal(got.view(torch.int32), ref.view(torch.int32))
    return _MX4_DECODER_EXACT


def mx4_exact(w: torch.Tensor, s: torch.Tensor, q: torch.Tensor, e: torch.Tensor) -> bool:
    """True iff mx4 codes q [N, K/2] / exponents e [N, K/32] equal MXFP4 w / s in value.

    A value is a function of (packed byte, exponent byte) only, so: the bytes handed to the
    writer equal the source bytes, and the runtime decoder is exact on every such pair.
    """
    return (q.dtype == e.dtype == torch.uint8 and q.shape == w.shape and e.shape == s.shape
            and torch.equal(q, w.view(torch.uint8)) and torch.equal(e, s.view(torch.uint8))
            and mx4_decoder_exact())


def apply(action: Action, tensors: list[torch.Tensor], tp: int = 1,
          table: ExpertTable | None = None) -> tuple[dict, dict]:
    """Run `action` on its source tensors (as read by checkpoint.read_tensor).

    Returns ({output name: full tensor, or the list of its tp rank pieces}, stats); stats has
    rel_err / max_abs_err for lossy or dequantizing schemes (measured against the exact
    dequantized source) and `exact`. table: the INT8 expert table (made here if not given).
    """
    kind, outs = action.kind, action.outputs
    if kind == "copy":
        _check_finite_source(action, tensors[0])
        return {outs[0].name: tensors[0]}, {}
    w, s = tensors
    if kind.startswith("fp8"):
        _check_e4m3(action, w)
        if (s == E8M0_NAN).any():                               # before the product: clearer
            _check_scale(action, s)
        ref = _dequant_fp8(w, s)                                # float32 [N, K]
        if kind == "fp8_int8":
            q, scale = quantize_int8_groups(ref)
            rel, mx = rel_error(dequant_int8_groups(q, scale), ref)
            _check_product(action, ref, s, rel, "FP8 x scale", (128, 128))
            _check_scale(action, s)
            return {outs[0].name: q, outs[1].name: scale}, {"rel_err": rel, "max_abs_err": mx,
                                                             "exact": rel == 0.0}
        out = ref.to(torch.bfloat16)
        rel, mx = rel_error(out, ref)
        _check_product(action, ref, s, rel, "FP8 x scale", (128, 128))
        _check_scale(action, s)
        return {outs[0].name: out}, {"rel_err": rel, "max_abs_err": mx, "exact": rel == 0.0}
    _check_scale(action, s)                                     # MXFP4: the bytes are the scale
    if kind in ("fp4_int8", "fp4_mx4"):
        # Exact by construction, and `exact` still measured by an independent decoder. int8:
        # 2*e2m1 is an integer, the exponent byte unchanged; the table is checked against the
        # reference on all 65,536 entries, the exponent bytes in full, the codes handed to the
        # writer on sampled rows (_sampled_exact). mx4: the source bytes as they are (two e2m1
        # codes per byte, low nibble first; the UE8M0 byte, bias 127), compared in full.
        e = s.view(torch.uint8)
        if kind == "fp4_int8" and w.shape[1] % 2:           # odd packed rows: byte gather
            q = qout = mxfp4_to_int8(w, s)[0]
            ok, full, dequant = experts_exact(w, s, q, e), (lambda: q), dequant_int8_mx
        elif kind == "fp4_int8":
            table = table or ExpertTable()
            dim = outs[0].shard_dim
            split = dim == 1 and tp > 1 and w.shape[1] % (2 * tp) == 0
            q = table.convert(w, tp, dim if split else None)     # [N, K] or [tp, N, K/tp]
            ok = table.ok and q.shape[-1] * (tp if split else 1) == 2 * w.shape[1] \
                and _sampled_exact(w, q)
            full = (lambda: torch.cat(list(q), 1)) if split else (lambda: q)
            dequant = dequant_int8_mx
            qout = list(q) if split else q
        else:
            q = qout = w.view(torch.uint8)
            ok, full, dequant = mx4_exact(w, s, q, e), (lambda: q), dequant_mx4
        stats = {"rel_err": 0.0, "max_abs_err": 0.0, "exact": True}
        if not ok:
            rel, mx = rel_error(dequant(full(), e), dequant_mxfp4(w, s))    # failure path only
            stats = {"rel_err": rel, "max_abs_err": mx, "exact": False}
        return {outs[0].name: qout, outs[1].name: e}, stats
    if kind == "fp4_bf16":
        ref = dequant_mxfp4(w, s)
        out = ref.to(torch.bfloat16)
        rel, mx = rel_error(out, ref)
        _check_product(action, ref, s, rel, "MXFP4 x scale", (1, 32))
        return {outs[0].name: out}, {"rel_err": rel, "max_abs_err": mx, "exact": rel == 0.0}
    raise AssertionError(kind)
