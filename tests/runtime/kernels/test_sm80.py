"""Every shipped kernel config compiles for sm_80 on this CPU machine (triton.compile to a
GPUTarget("cuda", 80, 32), through PTX and cubin), fits 99 KB of shared memory (two blocks per
A100 SM; 163 KB is the hard limit) and uses only BF16/INT8 mma.sync, no FP8.

Compiled in a subprocess without TRITON_INTERPRET (the interpreter tests set it in-process).
Pointer and 16-multiple int arguments get tt.divisibility 16, as the JIT specializes them at
real shapes; without it Triton cannot vectorize or pipeline the loads, and shared use reads low.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

SHARED_LIMIT = 99 * 1024
A100_SMS = 108


def _compile(fn, types: dict, constexprs: dict, opts: dict, div16: tuple = ()) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {a: types.get(a, "constexpr") for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if sig[a].startswith("*") or a in div16}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 80, 32), options=opts)
    ptx = c.asm["ptx"]
    return dict(kernel=fn.__name__, config={k: v for k, v in constexprs.items()}, opts=opts,
                shared=c.metadata.shared, cubin=len(c.asm["cubin"]),
                mma=sorted(set(re.findall(r"mma\.sync\.aligned\.[\w.]+", ptx))),
                fp8=bool(re.search(r"e4m3|e5m2|e2m1", ptx)),
                fma_f32=bool(re.search(r"fma\.rn\.f32", ptx)),
                fma_bf16x2=bool(re.search(r"fma\.rn\.bf16x2", ptx)),
                mul_rn_f32=len(re.findall(r"mul\.rn(?:\.ftz)?\.f32", ptx)),
                i2f=bool(re.search(r"cvt\.rn\.f32\.s(8|16|32)", ptx)))


def compile_in_subprocess(script: str) -> list[dict]:
    """Run `script` (it prints compile_all()'s JSON) without TRITON_INTERPRET -> the results."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _split(cfg: dict) -> tuple[dict, dict]:
    cfg = dict(cfg)
    opts = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
    cfg.pop("K_SPLIT", None)
    cfg.pop("variant", None)
    return cfg, opts


def compile_all() -> list[dict]:
    from backfit.runtime.kernels.linear import gemm
    from backfit.runtime.kernels.moe import common, int8 as moe

    out = []
    a16 = dict(X="*bf16", W="*i8", S="*fp32", Y="*bf16", WS="*fp32", LOCK="*i32", M="i32",
               N="i32", K="i32", stride_xm="i32", K_SPLIT="i32")
    for m, quant in ((1, True), (16, True), (32, True), (127, True), (1, False), (1024, False)):
        cfg, opts = _split(gemm.a16_config(m, 4096, 4096, quant, A100_SMS))
        types = a16 if quant else dict(a16, W="*bf16", S="*bf16")
        out.append(_compile(gemm._a16_kernel, types, dict(cfg, QUANT=quant, F32=False), opts,
                            ("N", "K", "stride_xm", "K_SPLIT")))
    for m in (64, 1024):
        cfg, opts = _split(gemm.w8a8_config(m, 4096))
        out.append(_compile(gemm._w8a8_kernel, dict(A="*i8", AS="*fp32", W="*i8", WS="*fp32",
                            Y="*bf16", M="i32", N="i32", K="i32"), cfg, opts, ("N", "K")))
    for g in (8, 64):
        out.append(_compile(gemm._act_quant_kernel, dict(X="*bf16", Q="*i8", S="*fp32", K="i32",
                            stride_xm="i32"), dict(G=g, GP=g), dict(num_warps=4),
                            ("K", "stride_xm")))
    mtypes = dict(A="*bf16", IDX="*i32", RW="*fp32", W1="*i8", S1="*u8", W3="*i8", S3="*u8",
                  OUT="*bf16", N="i32", K="i32", TOPK="i32", SORTED="*i32", BLOCK_E="*i32",
                  P="i32", E="i32")
    # decode GEMV: the shipped configs (tp 1 and the I <= 512 rows), and each variant at the default tile and at the sweep
    # grid's most weights per thread (benchmarks/kernels/bench_kernels.py --moe-decode-sweep), and a
    # K loop pipelined 3 deep (STAGES, its cp.async buffers within the shared-memory bound)
    decode = [moe.decode_config(4096, p, I=i) for p, i in ((6, 512), (64, 512), (6, None))] + [
        dict(variant=v, BN=bn, BK=bk, num_warps=wp, num_stages=ns, STAGES=st)
        for v in moe.DECODE_VARIANTS
        for bn, bk, wp, ns, st in ((16, 512, 4, 2, 1), (32, 512, 4, 2, 1), (16, 256, 4, 3, 3))]
    for gated in (True, False):
        for dc in decode:
            kern, extra = moe._GEMV[dc["variant"]]
            cfg, opts = _split(dc)
            out.append(_compile(kern, mtypes, dict(cfg, **extra, GATED=gated, LIMIT=10.0), opts,
                                ("N", "K")))
        for p in (384, 6144, 12288, 8192 * 6):
            cfg, opts = _split(common.sorted_pair(p, None)[0 if gated else 1])
            out.append(_compile(moe._moe_sorted_kernel, mtypes,
                                dict(cfg, GATED=gated, LIMIT=10.0, F32=False), opts, ("N", "K")))
    # the summed down (DOWN_SUM) at a TP-4 rank's I = 512, top-6, shared added, FP32 out
    stypes = dict(H="*bf16", IDX="*i64", W2="*i8", S2="*u8", SH="*bf16", Y="*fp32", N="i32",
                  K="i32")
    for bn, bk, nw in ((4, 512, 1), (16, 512, 4)):
        out.append(_compile(common._down_sum_kernel, stypes,
                            dict(ROWS=moe.SUM_ROWS["base"], TOPK=6, SHARED=True, BN=bn, BK=bk,
                                 STAGES=1),
                            dict(num_warps=nw, num_stages=2), ("N", "K")))
    return out


def test_every_kernel_config_compiles_for_sm80_within_shared_memory():
    results = compile_in_subprocess(__file__)
    assert len(results) == 18 + 2 * (3 + 3 * 5) + 2        # 3 rows, 5 variants x 3, summed
    for r in results:
        name = f"{r['kernel']} {r['config']}"
        assert r["cubin"] > 0, name
        # (a one-warp program needs no shared memory: 0 B)
        assert 0 <= r["shared"] <= SHARED_LIMIT, f"{name}: {r['shared']} B shared on sm_80"
        assert not r["fp8"], f"{name}: FP8/FP4 in the PTX"
        if r["kernel"] in ("_a16_kernel", "_moe_sorted_kernel"):
            assert r["mma"] == ["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"], name
        elif r["kernel"] == "_w8a8_kernel":
            assert r["mma"] == ["mma.sync.aligned.m16n8k32.row.col.satfinite.s32.s8.s8.s32"], name
        else:
            assert r["mma"] == [], name                              # GEMV / quantizer: CUDA cores
        if r["kernel"] == "_moe_sorted_kernel":       # DEQ 2: BF16 bit trick, no int -> float
            assert r["config"]["DEQ"] == 2 and r["fma_bf16x2"] and not r["i2f"], name
    # A [BM, 128] and W [BN, 128] INT8 tiles per stage; >= 2 buffers means cp.async pipelining
    for r in (r for r in results if r["kernel"] == "_w8a8_kernel"):
        tile = (r["config"]["BM"] + r["config"]["BN"]) * 128
        assert r["shared"] >= 2 * tile, f"W8A8 {r['config']}: not multi-stage pipelined"


if __name__ == "__main__":
    print(json.dumps(compile_all(), default=str))
