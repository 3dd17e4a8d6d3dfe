"""Exact decoders and INT8 quantizers, checked code by code against independent oracles."""

import math

import pytest
import torch

from backfit import quant


def _e4m3_formula(code: int) -> float:
    s = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 7
    if e == 0xF and m == 7:
        return math.nan
    return s * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def test_e4m3_all_256_codes():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = quant.decode_e4m3(codes)
    oracle = codes.view(torch.float8_e4m3fn).to(torch.float32)   # torch's cast, test-only oracle
    nan = torch.isnan(oracle)
    assert nan.sum() == 2 and nan[0x7F] and nan[0xFF]
    assert torch.equal(torch.isnan(ours), nan)
    assert torch.equal(ours[~nan], oracle[~nan])
    assert all(ours[c].item() == _e4m3_formula(c) for c in range(256) if not nan[c])
    assert ours.nan_to_num().abs().max() == 448


def test_e8m0_all_256_codes():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = quant.decode_e8m0(codes)
    assert torch.isnan(ours[255]) and not torch.isnan(ours[:255]).any()
    assert all(ours[e].item() == 2.0 ** (e - 127) for e in range(255))   # 2^-127 incl. (subnormal)
    oracle = codes.view(torch.float8_e8m0fnu).to(torch.float32)
    assert torch.equal(ours[:255], oracle[:255])


def test_e2m1_all_16_codes():
    table = [0, .5, 1, 1.5, 2, 3, 4, 6]
    ours = quant.decode_e2m1(torch.arange(16))
    for c in range(16):
        mag = table[c & 7]
        assert ours[c].item() == (-mag if c & 8 else mag)
        assert math.copysign(1, ours[c].item()) == (-1 if c & 8 else 1)   # -0 stays -0


def test_unpack_low_nibble_first():
    packed = torch.tensor([[0x21, 0xF0]], dtype=torch.uint8).view(torch.int8)
    assert quant.unpack_e2m1(packed).tolist() == [[1, 2, 0, 15]]


def test_encode_e4m3_matches_torch_rne():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20000, generator=g) * 10.0 ** torch.randint(-4, 3, (20000,), generator=g),
                   quant.E4M3_LUT[:127], -quant.E4M3_LUT[1:127],
                   (quant.E4M3_LUT[1:126] + quant.E4M3_LUT[2:127]) / 2])   # exact ties
    x = x.clamp(-448, 448)
    ours = quant.decode_e4m3(quant.encode_e4m3(x))
    oracle = x.to(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(ours, oracle)


def test_encode_e2m1_round_half_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -2.5, 0.1, 100.0])
    got = quant.decode_e2m1(quant.encode_e2m1(x)).tolist()
    assert got == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -2.0, 0.0, 6.0]


def test_mxfp4_to_int8_bit_exact_all_codes_all_exponents():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8)     # every byte
    w = codes.repeat(255, 16)                                     # [255, 4096] packed -> K = 8192
    e = torch.arange(255, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 8192 // 32)
    q, e2 = quant.mxfp4_to_int8(w, e)
    assert q.dtype == torch.int8 and set(q.unique().tolist()) == {0, 1, 2, 3, 4, 6, 8, 12, -1, -2,
                                                                  -3, -4, -6, -8, -12}
    # oracle in float64: the float32 dequant overflows at 6 * 2^127 for e = 254
    exact = quant.decode_e2m1(quant.unpack_e2m1(w)).double() * torch.exp2(
        e.double() - 127).repeat_interleave(32, 1)
    ours = q.double() * torch.exp2(e2.double() - quant.MX_EXP_BIAS).repeat_interleave(32, 1)
    assert torch.equal(ours, exact)


def test_int8_group_quant_round_half_even():
    # amax 127 -> scale exactly 1.0, so w/scale hits the .5 ties directly
    w = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5] + [0.0] * 122])
    q, s = quant.quantize_int8_groups(w)
    assert s.tolist() == [[1.0]]
    assert q[0, :6].tolist() == [127, 0, 2, 2, 0, -2]


@pytest.mark.parametrize("shape", [(1, 128), (7, 256), (64, 1024)])
def test_int8_group_quant_error_bound(shape):
    g = torch.Generator().manual_seed(150)          # seed 150 puts an exact .5 tie at (0, 242)
    w = torch.randn(*shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 5
    w[0, :128] = 0.0                                              # an all-zero group
    q, s = quant.quantize_int8_groups(w)
    deq = quant.dequant_int8_groups(q, s)
    # half a step, plus the float32 rounding of w / scale and of q * scale (a few ulp of |w|):
    # at a tie the rounded quotient is exactly .5 while the true one may lie an ulp beyond it
    bound = s.repeat_interleave(128, 1) / 2 + w.abs() * 2.0 ** -21
    assert ((deq - w).abs() <= bound).all()
    assert (q.abs() <= 127).all() and (deq[0, :128] == 0).all()


def test_dequant_fp8_block_uses_tile_scale():
    w = torch.full((256, 256), 0x38, dtype=torch.uint8)          # e4m3 0x38 = 1.0
    s = torch.tensor([[127, 128], [126, 130]], dtype=torch.uint8)
    d = quant.dequant_fp8_block(w, s)
    assert d[0, 0] == 1 and d[0, 200] == 2 and d[200, 0] == 0.5 and d[255, 255] == 8


def test_rel_error():
    a = torch.ones(10, 10)
    assert quant.rel_error(a, a) == (0.0, 0.0)
    rel, mx = quant.rel_error(a * 1.01, a)
    assert abs(rel - 0.01) < 1e-6 and abs(mx - 0.01) < 1e-6


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_rel_error_propagates_non_finite(bad):
    exact = torch.ones(300, 7)
    approx = exact.clone()
    approx[250, 3] = bad                                      # in the second row chunk of 4096/7
    rel, mx = quant.rel_error(approx, exact, rows=128)
    assert math.isnan(rel) and math.isnan(mx)
    rel, mx = quant.rel_error(exact, approx, rows=128)       # in the reference side too
    assert math.isnan(rel) and math.isnan(mx)
    assert quant.rel_error(exact * 0, exact * 0) == (0.0, 0.0)


def test_first_nonfinite_row_major():
    t = torch.zeros(70, 5, dtype=torch.bfloat16)
    assert quant.first_nonfinite(t) is None
    t[66, 1] = math.inf
    t[66, 4] = math.nan
    t[69, 0] = math.nan
    assert quant.first_nonfinite(t, rows=16) == [66, 1]       # found in a later chunk
    assert quant.first_nonfinite(torch.tensor([0.0, 1.0, math.nan])) == [2]
    assert quant.first_nonfinite(torch.zeros(3, dtype=torch.int64)) is None
