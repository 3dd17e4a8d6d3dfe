"""One function per Action kind: source bytes in, full (unsharded) output tensors and error stats out."""

from __future__ import annotations

import torch

from backfit.convert.plan import Action, ConvertError
from backfit.quant import (E8M0_NAN, dequant_fp8_block, dequant_int8_groups, dequant_mxfp4,
                           mxfp4_to_int8, quantize_int8_groups, rel_error)

__all__ = ["apply"]

_E4M3_NAN = (0x7F, 0xFF)


def _check_scale(action: Action, s: torch.Tensor) -> None:
    bad = (s == E8M0_NAN).nonzero()
    if len(bad):
        e = action.sources[1]
        raise ConvertError(f"{e.file}: {e.name}: UE8M0 scale byte 255 (NaN) at {bad[0].tolist()}")


def _check_e4m3(action: Action, w: torch.Tensor) -> None:
    bad = ((w == _E4M3_NAN[0]) | (w == _E4M3_NAN[1])).nonzero()
    if len(bad):
        e = action.sources[0]
        raise ConvertError(f"{e.file}: {e.name}: e4m3 NaN code at {bad[0].tolist()}")


def apply(action: Action, tensors: list[torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """Run `action` on its source tensors (as read by checkpoint.read_tensor).

    Returns ({output name: full tensor}, stats); stats has rel_err / max_abs_err for lossy or
    dequantizing schemes (measured against the exact dequantized source) and `exact`.
    """
    kind, outs = action.kind, action.outputs
    if kind == "copy":
        return {outs[0].name: tensors[0]}, {}
    w, s = tensors
    _check_scale(action, s)
    if kind.startswith("fp8"):
        _check_e4m3(action, w)
        ref = dequant_fp8_block(w, s)
        if kind == "fp8_int8":
            q, scale = quantize_int8_groups(ref)
            rel, mx = rel_error(dequant_int8_groups(q, scale), ref)
            return {outs[0].name: q, outs[1].name: scale}, {"rel_err": rel, "max_abs_err": mx,
                                                             "exact": rel == 0.0}
        out = ref.to(torch.bfloat16)
        rel, mx = rel_error(out, ref)
        return {outs[0].name: out}, {"rel_err": rel, "max_abs_err": mx, "exact": rel == 0.0}
    if kind == "fp4_int8":
        # Exact by construction (2*e2m1 is an integer, the exponent byte is unchanged); the
        # test suite proves it over all 16 codes and all 255 finite exponents.
        q, e = mxfp4_to_int8(w, s)
        return {outs[0].name: q, outs[1].name: e}, {"rel_err": 0.0, "max_abs_err": 0.0, "exact": True}
    if kind == "fp4_bf16":
        ref = dequant_mxfp4(w, s)
        out = ref.to(torch.bfloat16)
        rel, mx = rel_error(out, ref)
        return {outs[0].name: out}, {"rel_err": rel, "max_abs_err": mx, "exact": rel == 0.0}
    raise AssertionError(kind)
