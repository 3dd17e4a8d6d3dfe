"""The small-M GEMV kernels (kernels.linear.gemv) compile for sm_80 on this CPU machine
(test_sm80.py's
helper) for every config of GEMV_CANDIDATES, GEMV_TABLE and the default, int8_g128 (BF16 out) and
BF16 weights (FP32 out; the grouped rows "bf16g": BF16 out, 1024-row groups), cuda and fma at M
padded to 1 and 8 rows, and the cuda rows of K 1024 with the RMSNorm in the launch (norm=, at
their M): shared memory within 99 KB,
no FP8/FP4. cuda, fma: no MMA (CUDA-core FMAs), and MAGIC really converts without an int ->
float cvt (I2F) in the PTX; fma and cuda V8 (int8) need no shared memory beyond the final
reductions' 1 KB (more would mean a layout change inside the K loop). Compiled in a subprocess
without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_sm80 import SHARED_LIMIT, _compile, compile_in_subprocess  # noqa: E402

MPS = (1, 8)


def _configs() -> list[tuple[str, dict, int]]:
    """(kind, config, MP): every candidate and the default; the cuda variant at MP 1 and 8."""
    from backfit.runtime.kernels.linear import gemv

    out, seen = [], set()
    kinds = {**gemv.GEMV_CANDIDATES, "bf16g": []}                  # bf16g: gemv_grouped's rows
    table = {k: [e[4] for e in gemv.GEMV_TABLE if e[0] == k] for k in kinds}
    for kind, cands in kinds.items():
        default = [gemv.gemv_config(1, 1, 128, kind == "int8")] if kind != "bf16g" else []
        for c in cands + table[kind] + default:                        # default: no table entry
            key = (kind, tuple(sorted(c.items())))
            if key not in seen:
                seen.add(key)
                out += [(kind, c, mp) for mp in MPS]
    # launch(norm=) (q_norm in wq_b's GEMV): the table's cuda rows of wq_b's K (1024)
    for e in gemv.GEMV_TABLE:
        if e[0] == "int8" and e[2] == (1024, 1024) and e[4]["variant"] == "cuda":
            out.append(("int8", dict(e[4], NORM=True), e[3][1]))
    return out


def compile_all() -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from backfit.runtime.kernels.linear import gemv

    out = []
    for kind, cfg, mp in _configs():
        quant = kind == "int8"
        types = dict(X="*bf16", W="*i8" if quant else "*bf16", S="*fp32" if quant else "*bf16",
                     Y="*bf16" if quant or kind == "bf16g" else "*fp32", M="i32", N="i32",
                     K="i32", stride_xm="i32")
        opts = dict(num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1))
        fn = gemv._gemv_kernel if cfg["variant"] == "cuda" else gemv._gemv_fma_kernel
        const = dict(QUANT=quant, MAGIC=bool(cfg.get("MAGIC")), EVEN_K=True, MP=mp,
                     BN=cfg["BN"], BK=cfg["BK"], STAGES=cfg.get("STAGES", 1),
                     GROUP_N=1024 if kind == "bf16g" else 0)           # wo_a's o_lora rows
        if cfg["variant"] == "cuda":
            const.update(V8=bool(cfg.get("V8")), PREFETCH=bool(cfg.get("PREFETCH")))
        if cfg.get("NORM"):
            types.update(NW="*fp32", eps="fp32")
            const.update(NORM=True)
        r = _compile(fn, types, const, opts, ("N", "K", "stride_xm"))
        # the same source again (a cache hit) for the PTX: int -> float conversions
        sig = {a: types.get(a, "constexpr") for a in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                 if sig[a].startswith("*") or a in ("N", "K", "stride_xm")}
        c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                           target=GPUTarget("cuda", 80, 32), options=opts)
        r["i2f"] = len(re.findall(r"cvt\.rn\.f32\.s(?:8|16|32)", c.asm["ptx"]))
        r["kind"] = kind
        out.append(r)
    return out


def test_gemv_compiles_for_sm80():
    results = compile_in_subprocess(__file__)
    assert len(results) == len(_configs())
    for r in results:
        name = f"{r['kernel']} {r['config']} {r['opts']}"
        assert r["cubin"] > 0, name
        assert r["shared"] <= SHARED_LIMIT, f"{name}: {r['shared']} B shared"
        assert not r["fp8"], name
        assert r["mma"] == [], name
        if (r["kernel"] == "_gemv_fma_kernel" or r["config"].get("V8") and r["config"]["QUANT"]) \
                and r["config"]["STAGES"] == 1:
            # only the cross-warp reduction scratch: 1 KB under Triton 3.9 (CI), 2 KB under the
            # device's 3.6 (H200 run, 2026-12-01); more would mean the weight tile went to smem
            # (STAGES > 1 puts it there on purpose: cp.async buffers, bounded above)
            assert r["shared"] <= 2048, f"{name}: {r['shared']} B shared (a layout change?)"
        if r["config"]["QUANT"] and r["config"]["MAGIC"]:   # (norm: mean(x²) = Σ / float(K))
            assert r["i2f"] == int(r["config"].get("NORM", 0)), f"{name}: MAGIC still converts"
        elif r["config"]["QUANT"]:
            assert r["i2f"] > 0, f"{name}: no int8 -> fp32 cvt found (the check is blind)"

if __name__ == "__main__":
    print(json.dumps(compile_all()))
