"""The small decode kernels (kernels.rope_norm: RMSNorm, RoPE; kernels.cache.decode: compressor
pooling, cache stores, the fused compressor decode update; kernels.cache.prefill: its prefill
form and the ring-rows store; kernels.pointwise: SwiGLU, router top-k,
MoE combine, embedding, the placeholder fill; kernels.router: the router GEMV + top-k in one launch;
kernels.pick: the drafters' pick over the vocabulary)
compile for sm_80 on this CPU machine (test_sm80.py's helper): shared memory within 99 KB, no MMA
(CUDA-core math), no FP8/FP4, and FMA contraction really off in RoPE (no fma.rn.f32 in its PTX: the
torch path rounds every product; the fused update's RoPE uses the 4 explicit mul.rn).
Real widths."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_sm80 import SHARED_LIMIT, _compile, compile_in_subprocess  # noqa: E402


_FUSED_TYPES = dict(
    C="*fp32", Z="*fp32", sc_b="i32", sz_b="i32", APE="*fp32", POS="*i64", SLOTS="*i32",
    RC="*fp32", RZ="*fp32", EBUF="*fp32", CNT="*i32", NW="*fp32", eps="fp32", F="*fp64",
    TABLES="*i32", stride_tb="i32", DATA="*bf16", SCALE="*fp32", scratch="i32", R="i32", D="i32",
    WIDTH="i32", WRAW="*fp32", sw_b="i32", WI="*fp32", H="i32", w_scale="fp32")
_PREFILL_TYPES = dict(
    C="*fp32", Z="*fp32", sc_b="i32", sz_b="i32", ROWS="*i32", POS="*i64", SEQ="*i32",
    START="*i32", SLOTS="*i32", RC="*fp32", RZ="*fp32", EBUF="*fp32", CNT="*i32", NW="*fp32",
    eps="fp32", F="*fp64", TABLES="*i32", stride_tb="i32", DATA="*bf16", SCALE="*fp32",
    scratch="i32", R="i32", D="i32", WIDTH="i32")


def compile_all() -> list[dict]:
    import triton

    from backfit.runtime.kernels import pick, pointwise, rope_norm, router
    from backfit.runtime.kernels.cache import decode as cache_ops, prefill as cache_prefill

    out = []
    for n, w in ((4096, True), (1024, True), (512, False)):
        out.append(_compile(rope_norm._rms_kernel, dict(X="*bf16", W="*fp32", Y="*bf16", N="i32",
                            stride_x="i32", eps="fp32"), dict(HAS_W=w, BLOCK=n),
                            dict(num_warps=8 if n >= 2048 else 4, num_stages=1), ("N", "stride_x")))
    for d, v, norm, x_t, head in ((512, 16, False, "*bf16", True), (512, 1, False, "*fp32", True),
                                  (128, 16, False, "*bf16", True), (512, 4, True, "*bf16", True),
                                  (512, 16, False, "*bf16", False)):      # in place (HEAD off)
        r = _compile(rope_norm._rope_kernel, dict(X=x_t, Y="*bf16", POS="*i64", F="*fp64",
                     W="*fp32", V="i32", D="i32", stride_xn="i32", eps="fp32"),
                     dict(SIGN=1.0, R=64, BV=v, BD=triton.next_power_of_2(d - 64), NORM=norm,
                          HAS_W=norm, DP=d, HEAD=head),
                     dict(num_warps=4, num_stages=1, enable_fp_fusion=False), ("D",))
        out.append(r)
    for m, overlap, d, bd in ((4, True, 512, 128), (128, False, 512, 32), (4, True, 128, 128)):
        n = 2 * m if overlap else m
        out.append(_compile(cache_ops._compress_kernel, dict(
            C="*fp32", Z="*fp32", sc_b="i32", sz_b="i32", POS="*i64", SLOTS="*i32", RC="*fp32", RZ="*fp32",
            E="*fp32", R="i32", D="i32", WIDTH="i32"), dict(M=m, OVERLAP=overlap, N=n,
            NP=triton.next_power_of_2(n), BD=bd), dict(num_warps=4, num_stages=1), ("D",)))
    for m, overlap, d, bd, int8 in ((4, True, 512, 128, False), (4, True, 512, 128, True),
                                    (128, False, 512, 32, True), (4, True, 128, 128, False)):
        n = 2 * m if overlap else m                  # compress_decode_fused: CSA, HCA, indexer
        out.append(_compile(cache_ops._fused_kernel, dict(
            _FUSED_TYPES, DATA="*i8" if int8 else "*bf16"), dict(
            M=m, OVERLAP=overlap, N=n, NP=triton.next_power_of_2(n), BD=bd, NBLK=d // bd,
            HAS_APE=True, DP=d, RR=64, BH=triton.next_power_of_2(d - 64), PB=32, INT8=int8,
            BF16=True, RN=True, HAS_W=d == 128, BHW=64), dict(num_warps=4, num_stages=1),
            ("D",)))
    for m, overlap, d, bd, int8 in ((4, True, 512, 128, False), (128, False, 512, 32, True),
                                    (4, True, 128, 128, False)):
        n = 2 * m if overlap else m                  # compress_prefill: CSA, HCA, indexer
        out.append(_compile(cache_prefill._compress_prefill_kernel, dict(
            _PREFILL_TYPES, DATA="*i8" if int8 else "*bf16"), dict(
            M=m, OVERLAP=overlap, N=n, NP=triton.next_power_of_2(n), BD=bd, NBLK=d // bd, DP=d,
            RR=64, BH=triton.next_power_of_2(d - 64), PB=32, INT8=int8, BF16=True, RN=True),
            dict(num_warps=4, num_stages=1), ("D",)))
    for width, ident in ((1024, False), (512, False), (1024, True), (512, True)):
        out.append(_compile(cache_prefill._rows_kernel, dict(     # store_rows: CSA, HCA rows;
            C="*fp32", Z="*fp32", sc_b="i32", sz_b="i32",          # ident: a verify's rows
            ROWS="*i64" if ident else "*i32", RPOS="*i64" if ident else "*i32", RSLOT="*i32",
            RC="*fp32", RZ="*fp32", R="i32", WIDTH="i32", APE="*fp32", M="i32"),
            dict(BW=width, IDENT=ident, HAS_APE=ident), dict(num_warps=4, num_stages=1),
            ("WIDTH",)))
    for mode, int8 in ((0, False), (0, True), (1, True), (1, False)):
        out.append(_compile(cache_ops._store_kernel, dict(
            X="*bf16", sx_b="i32", POS="*i64", SLOTS="*i32", TABLES="*i32", stride_tb="i32",
            DATA="*i8" if int8 else "*bf16", SCALE="*fp32", R="i32", scratch="i32", D="i32"),
            dict(MODE=mode, M=4, PB=32, INT8=int8, BD=512), dict(num_warps=4, num_stages=1)))
    out.append(_compile(pick._pick_stats_kernel, dict(          # the drafters' pick
        L="*fp32", T="*fp32", STATS="*fp32", IDX="*i32", V="i32", NB="i32", CH="i32"),
        dict(BV=1024), dict(num_warps=4, num_stages=1), ("V",)))
    out.append(_compile(pick._pick_probs_kernel, dict(
        L="*fp32", T="*fp32", E="*fp32", sE="i32", STATS="*fp32", Q="*fp32", RACE="*fp32",
        RIDX="*i32", V="i32", NB="i32", CH="i32"), dict(NBP=32, BV=1024),
        dict(num_warps=4, num_stages=1), ("V",)))
    out.append(_compile(pick._pick_ids_kernel, dict(
        T="*fp32", STATS="*fp32", IDX="*i32", RACE="*fp32", RIDX="*i32", OUT="*i64", NB="i32"),
        dict(NBP=32), dict(num_warps=1, num_stages=1)))
    out.append(_compile(pointwise._swiglu_kernel, dict(GU="*bf16", H="*bf16", I="i32",
                        stride_gu="i32"), dict(LIMIT=10.0, BI=1024), dict(num_warps=4, num_stages=1),
                        ("I", "stride_gu")))
    for hashed, vl in itertools.product((False, True), (False, True)):   # vl: Vision-Exp
        out.append(_compile(pointwise._route_kernel, dict(
            LOGITS="*fp32", BIAS="*fp32", TID2EID="*i64", TOKENS="*i64", IDX="*i64", W="*fp32",
            E="i32", scale="fp32", BIAS_VL="*fp32", V="i32"),
            dict(K=6, HASH=hashed, BE=256, KP=8, VL=vl), dict(num_warps=4, num_stages=1)))
    for hashed, vl in itertools.product((False, True), (False, True)):   # router_config's tile
        out.append(_compile(router._router_kernel, dict(
            X="*bf16", G="*bf16", LOGITS="*fp32", CNT="*i32", BIAS="*fp32", TID2EID="*i64",
            TOKENS="*i64", IDX="*i64", WOUT="*fp32", E="i32", D="i32", stride_xm="i32",
            scale="fp32", BIAS_VL="*fp32", V="i32"),
            dict(K=6, HASH=hashed, BE=256, KP=8, BN=1, BK=4096, VL=vl),
            dict(num_warps=8, num_stages=1), ("D", "stride_xm")))
    for shard in (False, True):                          # embed_streams: tp 1, a vocab shard
        out.append(_compile(pointwise._embed_kernel, dict(
            W="*bf16", IDS="*i64", X="*bf16", V="i32", D="i32", start="i32"),
            dict(S=4 if not shard else 1, BD=1024, SHARD=shard), dict(num_warps=4, num_stages=1),
            ("D",)))
    for out_t in ("*bf16", "*fp32"):
        out.append(_compile(pointwise._combine_kernel, dict(OUT="*bf16", SH="*bf16", Y=out_t,
                            D="i32"), dict(K=6, SHARED=True, BD=1024),
                            dict(num_warps=4, num_stages=1), ("D",)))
    for tok in ("*i32", "*i64"):
        out.append(_compile(pointwise._placeholder_kernel, dict(T=tok, stride="i32",
                            PREV="*i64", n="i32"), dict(BLOCK=256),
                            dict(num_warps=2, num_stages=1), ()))
    return out


def test_small_kernels_compile_for_sm80():
    results = compile_in_subprocess(__file__)
    assert len(results) == 44
    for r in results:
        name = f"{r['kernel']} {r['config']}"
        assert r["cubin"] > 0, name
        assert r["shared"] <= SHARED_LIMIT, f"{name}: {r['shared']} B shared"
        assert not r["fp8"] and r["mma"] == [], name
        if r["kernel"] == "_rope_kernel":
            assert not r["fma_f32"], f"{name}: FP32 FMA contraction in RoPE"
        if r["kernel"] in ("_fused_kernel", "_compress_prefill_kernel"):   # explicit mul.rn RoPE
            assert r["mul_rn_f32"] == 4, f"{name}: {r['mul_rn_f32']} mul.rn.f32 (FMA-free RoPE)"


if __name__ == "__main__":
    print(json.dumps(compile_all()))
