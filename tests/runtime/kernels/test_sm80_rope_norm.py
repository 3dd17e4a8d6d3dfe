"""The RMSNorm and RoPE kernels compile for sm_80 on this CPU machine (test_sm80.py's helper):
no shared-memory blow-up, no MMA (CUDA-core math), no FP8/FP4, and FMA contraction really off
in RoPE (no fma.rn.f32 in its PTX: the torch path rounds every product). Real widths."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_sm80 import SHARED_LIMIT, _compile, compile_in_subprocess  # noqa: E402


def compile_all() -> list[dict]:
    import triton

    from backfit.runtime.kernels import rope_norm

    out = []
    for n, w in ((4096, True), (1024, True), (512, False)):
        out.append(_compile(rope_norm._rms_kernel, dict(X="*bf16", W="*fp32", Y="*bf16", N="i32",
                            stride_x="i32", eps="fp32"), dict(HAS_W=w, BLOCK=n),
                            dict(num_warps=8 if n >= 2048 else 4, num_stages=1), ("N", "stride_x")))
    for d, v in ((512, 16), (512, 1), (128, 16)):
        r = _compile(rope_norm._rope_kernel, dict(X="*bf16", Y="*bf16", POS="*i64", F="*fp64",
                     V="i32", D="i32"), dict(SIGN=1.0, R=64, BV=v, BD=triton.next_power_of_2(d - 64)),
                     dict(num_warps=4, num_stages=1, enable_fp_fusion=False), ("D",))
        out.append(r)
    return out


def test_rope_norm_kernels_compile_for_sm80():
    results = compile_in_subprocess(__file__)
    assert len(results) == 6
    for r in results:
        name = f"{r['kernel']} {r['config']}"
        assert r["cubin"] > 0, name
        assert r["shared"] <= SHARED_LIMIT, f"{name}: {r['shared']} B shared"
        assert not r["fp8"] and r["mma"] == [], name
        if r["kernel"] == "_rope_kernel":
            assert not r["fma_f32"], f"{name}: FP32 FMA contraction in RoPE"


if __name__ == "__main__":
    print(json.dumps(compile_all()))
