"""The 4-bit MoE kernels (runtime.kernels.moe.mx4) compile for sm_80 on this CPU machine within
99 KB of shared memory (test_sm80.py's _compile): the sorted kernel's dots are BF16 mma.sync
only, the decode GEMVs use no mma (the "mma" variant: BF16 mma.sync only), the sorted kernel decodes
to BF16 pairs with fma.rn.bf16x2 (DEQ 2), and the PTX has no
FP8/FP4 type (the e2m1 codes are decoded with integer ops) and no flush-to-zero FP32 multiply
(the e = 0, 1 weights are subnormal).
Shipped configs at V4-Flash TP4 shapes (K 4096, I 512). Compiled in a subprocess without
TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_sm80 import SHARED_LIMIT, _compile, _split, compile_in_subprocess  # noqa: E402

BF16_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


def compile_all() -> list[dict]:
    import triton

    from backfit.runtime.kernels.moe import common as moe
    from backfit.runtime.kernels.moe import mx4 as moe_mx4

    types = dict(A="*bf16", IDX="*i32", RW="*fp32", W1="*u8", S1="*u8", W3="*u8", S3="*u8",
                 OUT="*bf16", N="i32", K="i32", TOPK="i32", SORTED="*i32", BLOCK_E="*i32",
                 P="i32", E="i32")
    out = []

    def compile_one(*a):
        ptx = []
        real = triton.compile
        triton.compile = lambda *b, **kw: ptx.append(real(*b, **kw)) or ptx[-1]
        try:
            r = _compile(*a)
        finally:
            triton.compile = real
        return dict(r, ftz_mul=bool(re.search(r"(mul|fma|cvt)[\w.]*\.ftz", ptx[0].asm["ptx"])))
    for gated, k in ((True, 4096), (False, 512)):
        for i in (None, 512):                     # the shipped tiles: tp 1, a TP-4 rank's I
            cfg = dict(moe_mx4.decode_config(k, 6, down=not gated, I=i))
            kern, extra = moe_mx4._GEMV4[cfg.pop("variant", "base")]
            extra = {**extra, **({"F32": False} if "F32" in extra else {})}   # compiled: BF16 MMA
            cfg, opts = _split(cfg)
            out.append(compile_one(kern, types, dict(cfg, **extra, GATED=gated, LIMIT=10.0),
                                   opts, ("N", "K")))
        for p in (384, 6144, 12288, 8192 * 6):
            cfg, opts = _split(moe.sorted_pair(p, None, False)[0 if gated else 1])
            out.append(compile_one(moe_mx4._mx4_sorted_kernel, types,
                                dict(cfg, GATED=gated, BY_SLOT=not gated, LIMIT=10.0, F32=False),
                                opts, ("N", "K")))
    # decode variants (config "variant"): prefetch at the shipped tile, both variants at the
    # --moe-decode-sweep grid's most inputs per thread (BN 32 x BK 1024, 4 warps)
    # packed-word variants: word at the grid's most weights per thread, mma at the
    # H200's best tile, at 32 rows x 2 x 2 warps (the grid's largest shared, 98 KB), and down
    for gated, k, var, tile in ((True, 4096, "prefetch", None), (False, 512, "prefetch", None),
                                (True, 4096, "base", (32, 1024, 4, 2)),
                                (True, 4096, "prefetch", (32, 1024, 4, 2)),
                                (True, 4096, "word", (16, 2048, 8, 2)),
                                (False, 512, "word", (16, 1024, 4, 2)),
                                (True, 4096, "word4d", (4, 4096, 4, 2)),
                                (False, 512, "word4d", (16, 512, 4, 2)),
                                (True, 4096, "mma", (32, 512, 2, 2)),
                                (True, 4096, "mma", (32, 1024, 4, 2)),
                                (False, 512, "mma", (64, 256, 4, 3))):
        dc = dict(moe_mx4.decode_config(k), variant=var)
        if tile:
            dc.update(BN=tile[0], BK=tile[1], num_warps=tile[2], num_stages=tile[3],
                      STAGES=1)                 # the sweep grid's tiles: plain K loops
        kern, extra = moe_mx4._GEMV4[var]
        extra = {**extra, **({"F32": False} if "F32" in extra else {})}   # compiled: BF16 MMA
        cfg, opts = _split(dc)
        out.append(compile_one(kern, types, dict(cfg, **extra, GATED=gated, LIMIT=10.0), opts,
                               ("N", "K")))
    # the summed down (DOWN_SUM) at a TP-4 rank's I = 512, top-6, shared added, FP32 out
    sum_types = dict(H="*bf16", IDX="*i64", W2="*u8", S2="*u8", SH="*bf16", Y="*fp32", N="i32",
                     K="i32")
    for bn, bk, nw in ((2, 512, 1), (8, 256, 2)):
        out.append(compile_one(moe._down_sum_kernel, sum_types,
                               dict(ROWS=moe_mx4.SUM_ROWS["word4d"], TOPK=6, SHARED=True, BN=bn,
                                    BK=bk, STAGES=1),
                               dict(num_warps=nw, num_stages=2), ("N", "K")))
    return out


def test_mx4_moe_kernels_compile_for_sm80_within_shared_memory():
    results = compile_in_subprocess(__file__)
    assert len(results) == 12 + 4 + 7 + 2              # + decode variants, summed down
    for r in results:
        name = f"{r['kernel']} {r['config']}"
        assert r["cubin"] > 0, name
        assert r["shared"] <= SHARED_LIMIT, f"{name}: {r['shared']} B shared on sm_80"
        assert not r["fp8"], f"{name}: FP8/FP4 in the PTX"
        assert not r["ftz_mul"], f"{name}: flush-to-zero FP32 multiply in the PTX"
        if r["kernel"] in ("_mx4_sorted_kernel", "_mx4_gemv_mma_kernel"):
            assert r["mma"] == [BF16_MMA], name
        else:
            assert r["mma"] == [], name                              # GEMV: CUDA cores
        if r["kernel"] == "_mx4_sorted_kernel":             # DEQ 2: BF16 pairs from PTX
            assert r["config"]["DEQ"] == 2 and r["fma_bf16x2"], name


if __name__ == "__main__":
    print(json.dumps(compile_all(), default=str))
