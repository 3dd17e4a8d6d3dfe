"""The query-blocked prefill attention kernel (kernels.attention.prefill, or its column-chunked
form kernels.attention.prefill_cd where the table says CD) compiles on this CPU
machine at real dims (64 heads, D 512, window 128; CSA ratio 4 in 32-entry blocks, HCA ratio
128), bf16 and int8 pools, every mode, and (bf16) with Vision-Exp image spans:
  SM80_CONFIGS (SM80_INT8_CONFIGS with int8 pools) for sm_80 within 99 KB of shared memory (two blocks an A100 SM), BF16 mma.sync
  only (q·k and p·V on tensor cores), no FP8/FP4 (test_sm80.py's _compile);
  PREFILL_CONFIGS for sm_90 within the H200's 227 KB (a config past it fails at launch there).
Compiled in a subprocess without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_sm80 import SHARED_LIMIT, _compile, compile_in_subprocess  # noqa: E402

BF16_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
SM90_SHARED = 227 * 1024
TYPES = dict(Q="*bf16", KV="*bf16", RING="*bf16", RSC="*fp32", SLOTS="*i32", POS="*i32",
             ENT="*bf16", ESC="*fp32", TABLES="*i32", SEL="*i32", SINK="*fp32", SEQ="*i32",
             START="*i32", BLOCKS="*i32", O="*fp32", SPAN_LO="*i32", SPAN_HI="*i32", T="i32",
             H="i32", R="i32", stride_tb="i32", n_sel="i32", scale="fp32")


def _sm90(fn, types, constexprs, opts) -> dict:
    """triton.compile for GPUTarget("cuda", 90, 32) -> shared bytes (no cubin checks)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {a: types.get(a, "constexpr") for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if sig[a].startswith("*") or a == "H"}
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    return dict(kernel=fn.__name__, config=constexprs, opts=opts, shared=c.metadata.shared,
                target=90)


def compile_all() -> list[dict]:
    import triton.language as tl

    from backfit.runtime.kernels.attention import prefill as ap
    from backfit.runtime.kernels.attention import prefill_cd as apc

    out = []
    for target in (80, 90):
        for mode, m in ap.MODES.items():
            for int8, span in ((False, False), (True, False), (False, True)):   # span: images
                cfg = ap.prefill_config(mode, 64, sm90=target == 90, int8=int8)
                opts = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
                cd = cfg.pop("CD", 0)
                fn = apc._prefill_cd_kernel if cd else ap._prefill_kernel
                const = dict(cfg, W=128, RATIO=128 if m == 1 else 4, PB=1 if m == 1 else 32,
                             MODE=m, INT8=int8, D=512, DP=512, F32=False, EXACT=False,
                             DT=tl.bfloat16, SPAN=span)
                types = dict(TYPES, RING="*i8", ENT="*i8") if int8 else TYPES
                if target == 80:
                    out.append(dict(_compile(fn, types, const, opts, ("H",)), target=80))
                else:
                    out.append(_sm90(fn, types, const, opts))
    return out


def test_prefill_attention_compiles_for_sm80_and_sm90_within_shared_memory():
    results = compile_in_subprocess(__file__)
    assert len(results) == 18
    for r in results:
        name = f"sm_{r['target']} {r['config']} {r['opts']}"
        if r["target"] == 80:
            assert r["cubin"] > 0, name
            assert r["shared"] <= SHARED_LIMIT, f"{name}: {r['shared']} B shared"
            assert not r["fp8"], f"{name}: FP8/FP4 in the PTX"
            assert r["mma"] == [BF16_MMA], name
        else:
            assert 0 < r["shared"] <= SM90_SHARED, f"{name}: {r['shared']} B shared"


if __name__ == "__main__":
    print(json.dumps(compile_all(), default=str))
