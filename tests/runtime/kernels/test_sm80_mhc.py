"""The mHC kernels (mhc, mhc_decode) and the FP32-output a16 linear compile for sm_80 on this CPU machine within
99 KB of shared memory, with no FP8/FP4 (as test_sm80.py does for the other kernels, whose
_compile helper this reuses). mHC is FP32 math on CUDA cores: no mma, except the tiled prefill
partials with MMA3 (fn as three exact bf16 pieces through the BF16 mma.sync, FP32 accumulate).
The FP32-output linear keeps the BF16 mma.sync (exact products, FP32 accumulate) and stores
FP32. Real dims: S 4, d 4096 (K = 16384), n_out 24 (hc_pre) and 4 (hc_head). Compiled in a
subprocess without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_sm80 import A100_SMS, SHARED_LIMIT, _compile, _split, compile_in_subprocess  # noqa: E402

BF16_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


def compile_all() -> list[dict]:
    from backfit.runtime.kernels.linear import gemm
    from backfit.runtime.kernels.mhc import core as mhc, decode as mhc_decode, tile as mhc_tile

    out = []
    warps = dict(num_warps=4, num_stages=1)
    for n_out in (24, 4):
        out.append(_compile(mhc._mix_partial_kernel, dict(X="*bf16", FN="*fp32", PART="*fp32",
                            K="i32", K_SPLIT="i32", SPLIT="i32"),
                            dict(NOUT=n_out, NP=32 if n_out == 24 else 8, BK=mhc._BK), warps,
                            ("K", "K_SPLIT")))
    ctypes = dict(PART="*fp32", X="*bf16", SCALE="*fp32", BASE="*fp32", U="*bf16", POST="*fp32",
                  MOUT="*fp32", SPLIT="i32", D="i32", K="i32", iters="i32", hc_eps="fp32",
                  norm_eps="fp32")
    # SP: decode at T = 1 (the K splits of mix_split), prefill (one torch-matmul split)
    for sinkhorn, n_out, sp in ((True, 24, mhc.mix_split(1, 16384, A100_SMS)), (True, 24, 1),
                                (False, 4, mhc.mix_split(1, 16384, A100_SMS))):
        out.append(_compile(mhc._collapse_kernel, ctypes,
                            dict(S=4, NOUT=n_out, NP=32 if sinkhorn else 8, SP=sp, BD=mhc._BD,
                                 SINKHORN=sinkhorn), warps, ("D", "K")))
    # tiled prefill path at tile_config's choice (T 8192), mma x 3 and FP32 FMA dots, both n_out
    cfg = mhc_tile.tile_config(8192, 16384, A100_SMS)
    tile_opts = dict(num_warps=cfg["warps"], num_stages=3)             # the launcher's default
    for n_out, mma3 in ((24, True), (4, True), (24, False)):
        out.append(_compile(mhc_tile._mix_tile_kernel, dict(X="*bf16", FN="*fp32", PART="*fp32",
                            T="i32", K="i32", K_SPLIT="i32", SPLIT="i32"),
                            dict(NOUT=n_out, NP=32 if n_out == 24 else 16, BT=cfg["BT"],
                                 BK=cfg["BK"], MMA3=mma3, F32=False), tile_opts, ("K", "K_SPLIT")))
    for sinkhorn in (True, False):
        out.append(_compile(mhc_tile._collapse_tile_kernel, dict(ctypes, T="i32"),
                            dict(S=4, NOUT=24 if sinkhorn else 4, NP=32 if sinkhorn else 16,
                                 BT=cfg["BTU"], BD=cfg["BD"], SINKHORN=sinkhorn),
                            dict(num_warps=cfg["warps_u"], num_stages=3), ("D", "K")))
    out.append(_compile(mhc._post_kernel, dict(F="*bf16", X="*bf16", POST="*fp32", MIX="*fp32",
                        OUT="*bf16", D="i32"), dict(S=4, BD=mhc._BD), warps, ("D",)))
    # mhc_decode (decode, d 4096): hc_post + the next hc_pre's / hc_head's partials at post_bd's
    # T = 1 block and the largest, plain hc_post; collapse + RMSNorm at 1 / 4 / 8 warps (scalar
    # and [S, S] tensor Sinkhorn), SP = the
    # post kernel's d blocks (128 at BD 32) or mix_split's, hc_head (no Sinkhorn)
    # (KC 6: the decode Block's MoE pairs summed in, with and without the shared expert's)
    import triton.language as tl
    post_types = dict(F="*bf16", X="*bf16", POST="*fp32", MIX="*fp32", OUT="*bf16", FN="*fp32",
                      PART="*fp32", D="i32", K="i32", SH="*bf16")
    bd1 = mhc_decode.post_bd(1, 4096)
    for n_out, bd, has_fn, kc, sh in ((24, bd1, True, 0, False), (24, 256, True, 0, False),
                                      (4, 64, True, 0, False), (1, bd1, False, 0, False),
                                      (24, bd1, True, 6, True), (4, bd1, True, 6, False)):
        out.append(_compile(mhc_decode._post_mix_kernel, post_types,
                            dict(S=4, NOUT=n_out, NP=max(2, 1 << n_out.bit_length()), BD=bd,
                                 HAS_FN=has_fn, KC=kc, HAS_SH=sh, FT=tl.bfloat16), warps,
                            ("D", "K")))
    # hc_post(pre=): the next hc_pre's critical launch in the last programs (the 2026-12-02 fold),
    # at FOLD's tile (the one-pass u, bd_u 4096) for the attention's and the MoE's hc_post (its
    # loads early, as at T = 1, and after the gates), and the two-pass u at bd_u 1024
    fold_types = dict(post_types, CNT="*i32", SCALE="*fp32", BASE="*fp32", NW="*fp32", U="*bf16",
                      hc_eps="fp32", norm_eps="fp32", rms_eps="fp32")
    for bd_u, kc, early in ((mhc_decode.FOLD["bd_u"], 0, True), (mhc_decode.FOLD["bd_u"], 6, True),
                            (mhc_decode.FOLD["bd_u"], 6, False), (1024, 0, False)):
        out.append(_compile(mhc_decode._post_mix_kernel, fold_types,
                            dict(S=4, NOUT=24, NP=32, BD=bd1, HAS_FN=True, KC=kc, HAS_SH=kc > 0,
                                 FT=tl.bfloat16, SP=4096 // bd1, BDU=bd_u, PRE=True,
                                 ONE_PASS=bd_u >= 4096, EARLY=early),
                            dict(num_warps=mhc_decode.FOLD["warps"], num_stages=1), ("D", "K")))
    norm_types = dict(ctypes, W="*fp32", rms_eps="fp32")
    bd8 = mhc_decode.post_bd(8, 4096)
    # the two COLLAPSE defaults (T <= 4: 4 warps / 1024; else 8 / 4096, tensor Sinkhorn) first
    for sinkhorn, norm, sp, w, bd, scalar in ((True, True, 4096 // bd1, 4, 1024, False),
                                              (True, True, 4096 // bd8, 8, 4096, False),
                                              (True, True, 4096 // bd1, 1, 1024, True),
                                              (True, True, 4096 // bd1, 4, 1024, True),
                                              (True, True, 4096 // bd1, 8, 4096, True),
                                              (True, False, mhc.mix_split(1, 16384, A100_SMS),
                                               2, 512, False),
                                              (False, True, 4096 // bd1, 4, 1024, False)):
        out.append(_compile(mhc_decode._collapse_norm_kernel, norm_types,
                            dict(S=4, NOUT=24 if sinkhorn else 4, NP=32 if sinkhorn else 8, SP=sp,
                                 BD=bd, SINKHORN=sinkhorn, NORM=norm, SCALAR=scalar,
                                 ONE_PASS=bd >= 4096),
                            dict(num_warps=w, num_stages=1), ("D", "K")))
    # hc_pre_async's two launches at T = 1: gates + u + norm (no Sinkhorn) at COLLAPSE_U's tile,
    # post + M (no u) at COLLAPSE's
    cu, cp = mhc_decode.collapse_config(1, mhc_decode.COLLAPSE_U), mhc_decode.collapse_config(1)
    for sinkhorn, norm, uout, c in ((False, True, True, cu), (True, False, False, cp)):
        out.append(_compile(mhc_decode._collapse_norm_kernel, norm_types,
                            dict(S=4, NOUT=24, NP=32, SP=4096 // bd1, BD=c["bd"],
                                 SINKHORN=sinkhorn, NORM=norm, SCALAR=False, UOUT=uout,
                                 ONE_PASS=uout and c["bd"] >= 4096),
                            dict(num_warps=c["warps"], num_stages=1), ("D", "K")))
    a16 = dict(X="*bf16", W="*i8", S="*fp32", Y="*fp32", WS="*fp32", LOCK="*i32", M="i32",
               N="i32", K="i32", stride_xm="i32", K_SPLIT="i32")
    # head (bf16 weight, vocab shard x 4096) at decode; router / compressor sizes, int8 at prefill
    for m, n, quant in ((1, 16160, False), (8, 256, False), (1, 1024, True), (1024, 1024, True)):
        cfg, opts = _split(gemm.a16_config(m, n, 4096, quant, A100_SMS))
        types = a16 if quant else dict(a16, W="*bf16", S="*bf16")
        out.append(_compile(gemm._a16_kernel, types, dict(cfg, QUANT=quant, F32=False), opts,
                            ("N", "K", "stride_xm", "K_SPLIT")))
    return out


def test_mhc_and_fp32_output_linear_compile_for_sm80_within_shared_memory():
    results = compile_in_subprocess(__file__)
    assert len(results) == 34
    for r in results:
        name = f"{r['kernel']} {r['config']}"
        assert r["cubin"] > 0, name
        assert r["shared"] <= SHARED_LIMIT, f"{name}: {r['shared']} B shared on sm_80"
        assert not r["fp8"], f"{name}: FP8/FP4 in the PTX"
        if r["kernel"] == "_a16_kernel" or r["config"].get("MMA3"):
            assert r["mma"] == [BF16_MMA], name                    # BF16 MMA, FP32 accumulate
        elif r["kernel"] == "_mix_tile_kernel":                    # FP32 "ieee" dots: FMA only
            assert r["mma"] == [] and r["fma_f32"], name
        else:
            assert r["mma"] == [], name                            # mHC: FP32 on CUDA cores


if __name__ == "__main__":
    print(json.dumps(compile_all(), default=str))
