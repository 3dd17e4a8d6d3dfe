"""indexer._topk_pass_kernel (topk_select's TOPK_FAST path) compiles for sm_80 on this CPU
machine (test_sm80.py's helper) in its variants (scores / keys pass, FINAL or not, keys passes
merged or bitonic) at the real top-512 in 2048-wide chunks (and the sweep's other candidates:
8 warps, 1024-wide scores chunks): shared memory
within 99 KB, no MMA (integer compares and a bitonic top-k), no FP8/FP4. The old path's kernels
are compiled in test_sm80_attention.py. Compiled in a subprocess without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_sm80 import SHARED_LIMIT, _compile, compile_in_subprocess  # noqa: E402

C = 2048                                        # indexer.TOPK_CHUNK
VARIANTS = [(True, False, False, 4, C), (False, True, True, 4, C), (True, True, False, 4, C),
            (False, False, True, 4, C), (False, False, False, 4, C), (True, False, False, 8, C),
            (False, False, True, 8, C), (True, False, False, 8, 1024),
            (True, False, False, 16, 1024), (False, False, True, 16, C),
            (False, True, True, 16, C), (True, True, False, 16, 1024)]
# (SCORES, FINAL, MERGE, num_warps, C); C 1024: TOPK_SCORES_CHUNK; 16 warps: TOPK_WARPS. Scores
# passes at 16 warps twice: as shipped (RB = TOPK_RB, BJ = TOPK_RB_BJ) and with RB 0 (BJ TOPK_BJ)


def compile_all() -> list[dict]:
    from backfit.runtime.kernels.attention import indexer

    assert indexer.TOPK_CHUNK == C
    out = []
    for scores, final, merge, warps, c in VARIANTS:
        types = dict(IN="*fp32" if scores else "*i64", OUT="*i32" if final else "*i64",
                     SEL="*i32", N="i32", n_out="i32", k="i32", NEG_INF_KEY="i32")
        for rb in {0, indexer.TOPK_RB if scores and warps == 16 else 0}:
            bj = indexer.TOPK_RB_BJ if rb else indexer.TOPK_BJ
            out.append(_compile(indexer._topk_pass_kernel, types,
                                dict(K=512, C=c, BJ=bj, SCORES=scores, FINAL=final,
                                     MERGE=merge, LK=9, RB=rb),
                                dict(num_warps=warps, num_stages=1)))
    return out


def test_topk_pass_kernel_compiles_for_sm80_within_shared_memory():
    results = compile_in_subprocess(__file__)
    assert len(results) == len(VARIANTS) + 2                    # + the 2 RB scores passes
    for r in results:
        name = f"{r['kernel']} {r['config']} {r['opts']}"
        assert r["cubin"] > 0, name
        assert r["shared"] <= SHARED_LIMIT, f"{name}: {r['shared']} B shared on sm_80"
        assert not r["fp8"], f"{name}: FP8/FP4 in the PTX"
        assert r["mma"] == [], name


if __name__ == "__main__":
    print(json.dumps(compile_all(), default=str))
