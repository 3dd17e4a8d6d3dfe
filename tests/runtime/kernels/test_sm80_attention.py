"""The attention and indexer kernels compile for sm_80 on this CPU machine within 99 KB of shared
memory, with BF16 mma.sync only where a dot is meant and no FP8/FP4 (as test_sm80.py does for
the linear and MoE kernels, whose _compile helper this reuses), decode and chunked-prefill
(PREFILL) variants, and the indexer's scores with its query's RoPE inside (QR).
Real dims: D 512, 16-head blocks, indexer 64 heads x 128, top-512 in 2048-wide chunks. Compiled
in a subprocess without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_sm80 import SHARED_LIMIT, _compile, compile_in_subprocess  # noqa: E402

BF16_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


def compile_all() -> list[dict]:
    import triton.language as tl

    from backfit.runtime.kernels.attention import decode as attention, indexer, merge

    out = []
    types = dict(Q="*bf16", KV="*bf16", RING="*bf16", RSC="*fp32", SLOTS="*i32", POS="*i32",
                 ENT="*bf16", ESC="*fp32", TABLES="*i32", SEL="*i32", SINK="*fp32",
                 SEQ="*i32", START="*i32", O="*fp32",
                 PO="*fp32", PM="*fp32", PL="*fp32", H="i32", R="i32", stride_tb="i32",
                 n_sel="i32", CHUNK="i32", scale="fp32")
    for mode, split, int8, prefill in ((0, 1, False, False), (1, 1, True, False),
                                       (2, 1, False, False), (1, 8, False, False),
                                       (2, 20, True, False), (2, 1, True, True),
                                       (1, 1, False, True)):
        cfg = attention.decode_config(1 if split > 1 else 64, 64, 640, 108, split, prefill)
        opts = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
        cfg.pop("CHUNK")
        t = dict(types, RING="*i8", ENT="*i8") if int8 else types
        out.append(_compile(attention._decode_kernel, t, dict(
            cfg, W=128, RATIO=128 if mode == 1 else 4, PB=1 if mode == 1 else 32, MODE=mode,
            INT8=int8, D=512, DP=512, F32=False, EXACT=False, DT=tl.bfloat16, PREFILL=prefill,
            LIVE=attention.LIVE_SPLIT),
            opts, ("H", "CHUNK")))
    out.append(_compile(merge._merge_kernel, dict(PO="*fp32", PM="*fp32", PL="*fp32",
                        SINK="*fp32", O="*fp32", H="i32"), dict(D=512, SPLIT=16, DP=256),
                        dict(num_warps=4, num_stages=1), ("H",)))
    out.append(_compile(merge._merge_rope_kernel, dict(PO="*fp32", PM="*fp32", PL="*fp32",
                        SINK="*fp32", POS="*i64", F="*fp64", O="*bf16", H="i32"),
                        dict(D=512, R=64, SPLIT=16, BH=16, MP=attention.MERGE_PAIRS),
                        dict(num_warps=4, num_stages=1, enable_fp_fusion=False), ("H",)))
    for prefill, qr in ((True, 0), (False, 64)):
        out.append(_compile(indexer._score_kernel, dict(QI="*bf16", WI="*fp32", KEYS="*bf16",
                            TABLES="*i32", POS="*i32", OUT="*fp32", SEQ="*i32", H="i32",
                            NC="i32", stride_tb="i32", QF="*fp64"),
                            dict(PB=32, DI=128, BH=64, BN=32, F32=False, EXACT=False,
                                 PREFILL=prefill, QR=qr), dict(num_warps=4, num_stages=1)))
    for fn, first in ((indexer._topk_scores_kernel, "*fp32"), (indexer._topk_keys_kernel, "*i64")):
        key = "SCORES" if first == "*fp32" else "IN"
        out.append(_compile(fn, {key: first, "OUT": "*i64", "N": "i32", "n_out": "i32"},
                            dict(K=512, C=indexer.TOPK_CHUNK), dict(num_warps=4, num_stages=1)))
    out.append(_compile(indexer._unpack_kernel, dict(IN="*i64", SEL="*i32", N="i32", k="i32",
                        NEG_INF_KEY="i32"), dict(KP=512), dict(num_warps=4, num_stages=1)))
    return out


def test_attention_and_indexer_kernels_compile_for_sm80_within_shared_memory():
    results = compile_in_subprocess(__file__)
    assert len(results) == 14
    for r in results:
        name = f"{r['kernel']} {r['config']}"
        assert r["cubin"] > 0, name
        assert r["shared"] <= SHARED_LIMIT, f"{name}: {r['shared']} B shared on sm_80"
        assert not r["fp8"], f"{name}: FP8/FP4 in the PTX"
        if r["kernel"] in ("_decode_kernel", "_score_kernel"):
            assert r["mma"] == [BF16_MMA], name                      # q·k, p·v on tensor cores
        else:
            assert r["mma"] == [], name
        if r["kernel"] == "_merge_rope_kernel":                      # the rope's torch rounding
            assert not r["fma_f32"], f"{name}: FP32 FMA contraction in the de-rotation"
        if r["kernel"] == "_score_kernel":           # q_rope: its products rounded alone (mul.rn)
            assert (r["mul_rn_f32"] > 0) == (r["config"]["QR"] > 0), name


if __name__ == "__main__":
    print(json.dumps(compile_all(), default=str))
