"""Reference numerics in plain torch (CPU or GPU), never using hardware FP8/FP4 or torch float8 math.

Source formats arrive as raw bytes (uint8 / int8 tensors); every decoder is a 256- or 16-entry
float32 lookup table built from the bit layout, so it is exact by construction:
  e4m3fn  sign | 4-bit exponent (bias 7) | 3-bit mantissa; 0x7F/0xFF NaN; max 448; no inf
  UE8M0   unsigned byte e -> 2^(e-127); 255 is NaN; no zero
  e2m1    sign | 2-bit exponent | 1-bit mantissa -> 0, .5, 1, 1.5, 2, 3, 4, 6 (and negatives)
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "E4M3_LUT", "E2M1_LUT", "E8M0_NAN",
    "decode_e4m3", "decode_e8m0", "decode_e2m1", "unpack_e2m1",
    "encode_e4m3", "encode_e2m1", "e8m0_pow2_scale",
    "dequant_fp8_block", "dequant_mxfp4", "mxfp4_to_int8", "dequant_int8_mx", "MX_EXP_BIAS",
    "quantize_int8_groups", "dequant_int8_groups", "rel_error", "first_nonfinite",
    "MX4_EXP_BIAS", "dequant_mx4",
]

FP8_BLOCK = 128     # DeepSeek's 128x128 weight tiles
MX_GROUP = 32       # MXFP4: one scale per row per 32 inputs
E8M0_NAN = 255
# INT8 experts store q = 2*e2m1 (integers) and keep the source exponent byte e; the value is
# q * 2^(e - MX_EXP_BIAS). Bias 128 (not 127) absorbs the factor 2, so no byte ever changes.
MX_EXP_BIAS = 128


def _e4m3_table() -> torch.Tensor:
    vals = []
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp, man = (code >> 3) & 0xF, code & 0x7
        if exp == 0xF and man == 0x7:
            vals.append(float("nan"))
        elif exp == 0:
            vals.append(sign * man / 8.0 * 2.0 ** -6)           # subnormal
        else:
            vals.append(sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7))
    return torch.tensor(vals, dtype=torch.float32)


def _e8m0_table() -> torch.Tensor:
    # 2^(e-127) for e = 0..254 (2^-127 is a float32 subnormal, still exact), NaN for 255
    t = torch.tensor([2.0 ** (e - 127) for e in range(255)] + [float("nan")], dtype=torch.float64)
    return t.to(torch.float32)


E4M3_LUT = _e4m3_table()
E8M0_LUT = _e8m0_table()
E2M1_LUT = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6],
                        dtype=torch.float32)


def _lut(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    return table.to(codes.device)[codes.to(torch.int64)]


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3fn bytes (any shape) -> float32, exact."""
    return _lut(E4M3_LUT, codes.view(torch.uint8) if codes.dtype == torch.int8 else codes)


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """uint8 UE8M0 bytes -> float32 2^(e-127); 255 -> NaN."""
    return _lut(E8M0_LUT, codes)


def decode_e2m1(nibbles: torch.Tensor) -> torch.Tensor:
    """codes 0..15 (any int dtype) -> float32."""
    return _lut(E2M1_LUT, nibbles)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 [N, K/2] packed FP4 -> uint8 codes [N, K]; low nibble is element 2j, high 2j+1."""
    b = packed.view(torch.uint8)
    return torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)


def _encode_float(x: torch.Tensor, man_bits: int, bias: int, max_val: float, sign_bit: int) -> torch.Tensor:
    """Round to a small float format (round-to-nearest-even, saturating) and return its codes.

    All steps are exact float32 operations: the quantum of |x| is 2^(floor(log2|x|) - man_bits)
    (2^(1-bias-man_bits) for subnormals), and torch.round rounds half to even.
    """
    a = x.abs().to(torch.float32).clamp(max=max_val)
    emin = 1 - bias
    e = (torch.frexp(a).exponent - 1).clamp(min=emin)
    v = torch.round(torch.ldexp(a, man_bits - e))                  # integer multiples of the quantum
    v = torch.ldexp(v, e - man_bits).clamp(max=max_val)
    ev = (torch.frexp(v).exponent - 1).clamp(min=emin)
    normal = v >= 2.0 ** emin
    mant = torch.where(normal, torch.ldexp(v, man_bits - ev) - 2 ** man_bits,
                       v * 2.0 ** (man_bits - emin)).to(torch.int32)
    field = torch.where(normal, ev + bias, torch.zeros_like(ev)).to(torch.int32)
    code = (field << man_bits) | mant
    code = torch.where(torch.signbit(x) & (code != 0), code | sign_bit, code)
    return code.to(torch.uint8)


def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float -> e4m3fn bytes, round-to-nearest-even, saturating at +-448 (no NaN produced)."""
    return _encode_float(x, 3, 7, 448.0, 0x80)


_E2M1_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])   # between codes i and i+1
_E2M1_ODD_MIDS = _E2M1_MIDS[1::2]                                     # ties that round up (to even)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float -> e2m1 codes 0..15, round-to-nearest-even, saturating at +-6.

    code = number of midpoints below |x|, plus one on a tie whose upper neighbour is even.
    """
    a = x.abs().to(torch.float32)
    code = torch.bucketize(a, _E2M1_MIDS.to(a.device)).to(torch.uint8)
    code += torch.isin(a, _E2M1_ODD_MIDS.to(a.device)).to(torch.uint8)
    return torch.where(torch.signbit(x) & (code != 0), code | 0x8, code)


def e8m0_pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """DeepSeek's power-of-two scale: byte e with 2^(e-127) = 2^ceil(log2(amax/qmax))."""
    exp = torch.ceil(torch.log2(amax.clamp(min=1e-30).double() / qmax))
    return (exp + 127).clamp(0, 254).to(torch.uint8)


def _expand_block(scale: torch.Tensor, shape: tuple[int, int], bn: int, bk: int) -> torch.Tensor:
    n, k = shape
    return scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def dequant_fp8_block(w: torch.Tensor, s: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """e4m3 bytes [N, K] with UE8M0 tile scales [ceil(N/b), ceil(K/b)] -> float32 [N, K]."""
    return decode_e4m3(w) * _expand_block(decode_e8m0(s), tuple(w.shape), block, block)


def dequant_mxfp4(w: torch.Tensor, s: torch.Tensor, group: int = MX_GROUP) -> torch.Tensor:
    """packed FP4 int8 [N, K/2] with UE8M0 scales [N, K/32] -> float32 [N, K]."""
    vals = decode_e2m1(unpack_e2m1(w))
    return vals * decode_e8m0(s).repeat_interleave(group, 1)


# 2*e2m1 as int8 (0, 1, 2, 3, 4, 6, 8, 12 and negatives; exact). _BYTE_TO_PAIR maps a packed byte
# to its two int8 values (low nibble first) stored as one int16, so a single gather with the raw
# byte as index unpacks and converts (numpy indexes with uint8 directly: no int64 index copy).
_E2M1_X2_INT8 = (E2M1_LUT * 2).to(torch.int8)
_BYTE_TO_PAIR = torch.stack((_E2M1_X2_INT8[torch.arange(256) & 15],
                             _E2M1_X2_INT8[torch.arange(256) >> 4]), 1).contiguous().view(torch.int16)


def mxfp4_to_int8(w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bit-exact MXFP4 -> INT8: q [N, K] int8 = 2*e2m1, exponent bytes [N, K/32] unchanged.

    value = q * 2^(e - MX_EXP_BIAS) equals the MXFP4 value for every element and every e < 255.
    """
    n, half = w.shape
    b = w.contiguous().view(torch.uint8)
    if b.device.type == "cpu":
        pairs = torch.from_numpy(_BYTE_TO_PAIR.numpy()[:, 0].take(b.numpy()))   # ndarray.take: fastest gather
    else:
        pairs = _BYTE_TO_PAIR.to(b.device)[:, 0][b.long()]
    return pairs.view(torch.int8).reshape(n, 2 * half), s.view(torch.uint8).clone()


def dequant_int8_mx(q: torch.Tensor, e: torch.Tensor, group: int = MX_GROUP) -> torch.Tensor:
    """INT8 [N, K] with exponent bytes [N, K/group] (bias 128) -> float32."""
    scale = torch.exp2(e.to(torch.float32) - MX_EXP_BIAS)
    return q.to(torch.float32) * scale.repeat_interleave(group, 1)


# mx4_e2m1 keeps the MXFP4 bytes: packed codes (low nibble = element 2j) and the UE8M0 byte, bias
# 127 as in the source. dequant_mx4 is the runtime's decoder, written apart from dequant_mxfp4 (a
# byte -> value-pair table and ldexp instead of unpack + two lookups) so each checks the other.
MX4_EXP_BIAS = 127
_BYTE_TO_E2M1_PAIR = torch.stack((E2M1_LUT[torch.arange(256) & 15],
                                  E2M1_LUT[torch.arange(256) >> 4]), 1)       # [256, 2] float32


def dequant_mx4(w: torch.Tensor, s: torch.Tensor, group: int = MX_GROUP) -> torch.Tensor:
    """mx4_e2m1: uint8 packed codes [N, K/2] with exponent bytes [N, K/group] -> float32 [N, K].

    value = e2m1 * 2^(e - 127): exact in float32 (and bf16) for every code and every e up to
    252 (e2m1 has one mantissa bit: the smallest product 0.5 * 2^-127 is a representable
    subnormal); from e = 253 the large codes overflow to +-inf, as in dequant_mxfp4. The
    converter accepts e <= 159 only (convert.transforms.E8M0_ACCEPTED).
    """
    n, half = w.shape
    pairs = _BYTE_TO_E2M1_PAIR.to(w.device)[w.view(torch.uint8).long()]     # [N, K/2, 2]
    vals = pairs.reshape(n, 2 * half)
    exps = s.view(torch.uint8).to(torch.int32) - MX4_EXP_BIAS                 # [N, K/group]
    return torch.ldexp(vals.view(n, -1, group), exps[..., None].float()).reshape(n, 2 * half)


def quantize_int8_groups(w: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax INT8 per (row, `group` inputs): w [N, K] -> q int8 [N, K], scale fp32 [N, K/group].

    scale = amax/127; q = round_half_to_even(w/scale) in [-127, 127]; an all-zero group gets scale 0.
    """
    n, k = w.shape
    if k % group:
        raise ValueError(f"input dim {k} is not a multiple of the INT8 group {group}")
    g = w.to(torch.float32).reshape(n, k // group, group)
    scale = g.abs().amax(dim=-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(g / safe[..., None]).clamp(-127, 127).to(torch.int8)   # torch.round: half-to-even
    return q.reshape(n, k), scale


def dequant_int8_groups(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """INT8 [N, K] and fp32 scale [N, K/g] -> float32 [N, K]."""
    n, k = q.shape
    g = k // scale.shape[1]
    return (q.to(torch.float32).reshape(n, -1, g) * scale.to(torch.float32)[..., None]).reshape(n, k)


def rel_error(approx: torch.Tensor, exact: torch.Tensor,
              rows: int | None = None) -> tuple[float, float]:
    """(relative Frobenius error, max abs error) of approx against exact, float64, by row chunks.

    A NaN or Inf in either input makes both results NaN: a broken tensor must never look exact.
    Default chunks hold ~64K elements, so the float64 temporaries stay in cache (9x faster than
    4096-row chunks on a 4096 x 4096 tensor).
    """
    if exact.dim() == 0:
        approx, exact = approx.reshape(1), exact.reshape(1)
    if rows is None:
        rows = max(1, (1 << 16) // max(1, exact[0].numel()))
    num = den = mx = 0.0
    for a, e in zip(approx.split(rows), exact.split(rows)):
        e64 = e.double()
        d = a.double() - e64                                        # inf - inf -> nan, on purpose
        num += d.square().sum().item()
        den += e64.square().sum().item()
        if d.numel():
            m = d.abs().max().item()                                # torch max propagates nan
            mx = m if math.isnan(m) or m > mx else mx               # Python's max() would drop it
    if not (math.isfinite(num) and math.isfinite(den) and math.isfinite(mx)):
        return math.nan, math.nan
    rel = (num / den) ** 0.5 if den > 0 else float(num > 0)
    return rel, mx


def first_nonfinite(t: torch.Tensor, rows: int | None = None) -> list[int] | None:
    """Index (a list, row-major first) of the first NaN/Inf in floating tensor `t`, or None.

    Works in row chunks (~256K elements by default), so the bool mask stays in cache and small
    even for a 1 GB embedding.
    """
    if not t.is_floating_point():
        return None
    flat = t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(-1, 1)
    rows = rows or max(1, (1 << 18) // max(1, flat.shape[1]))
    for start in range(0, flat.shape[0], rows):
        bad = ~torch.isfinite(flat[start:start + rows])
        if bad.any():
            i = int(bad.reshape(-1).nonzero()[0])
            flat_idx = start * flat.shape[1] + i
            return [int(x) for x in torch.unravel_index(torch.tensor(flat_idx), t.shape)] \
                if t.dim() else []
    return None
