"""kernels.prefetch.l2_prefetch / l2_prefetch_rows: the launches' argument checks and their
no-op off CUDA (CPU); on sm_80 the kernels compile to prefetch.global.L2 and no store (a hint
that changes no data; the rows kernel loads only its ids); on a GPU (marker gpu) prefetches of
every tensor size around their loop steps, and of stacked rows, leave every byte as it was and
the stream usable after them."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_sm80 import _compile, compile_in_subprocess  # noqa: E402


def test_checks_and_cpu_noop():
    from backfit.runtime.kernels.prefetch import MAX_TENSORS, l2_prefetch, l2_prefetch_rows
    t = torch.zeros(4, 8)
    ids = torch.tensor([[3, 0]])
    l2_prefetch_rows([t, t.to(torch.uint8)], ids)                  # CPU: nothing, no error
    for stacks, i in (([t, torch.zeros(5, 8)], ids), ([t.t()], ids), ([t], ids.int()),
                      ([t] * 3, ids), ([t[0]], ids)):
        with pytest.raises(ValueError, match="l2_prefetch_rows"):
            l2_prefetch_rows(stacks, i)
    l2_prefetch([t, None, torch.empty(0)])                       # CPU: nothing, no error
    l2_prefetch([])
    with pytest.raises(ValueError, match="at most"):
        l2_prefetch([t] * (MAX_TENSORS + 1))
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch([t.t()])
    with pytest.raises(ValueError, match="sector"):
        l2_prefetch([t], sector=48)


def compile_all() -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from backfit.runtime.kernels import prefetch as pf
    fn = pf._l2_prefetch_kernel
    types = {f"{a}{i}": t for i in range(pf.MAX_TENSORS) for a, t in (("A", "*u8"), ("n", "i64"))}
    out = []
    for r in (1, 3, pf.MAX_TENSORS):
        const = dict(R=r, SECTOR=pf.SECTOR, LINES=pf._LINES)
        res = _compile(fn, types, const, dict(num_warps=4, num_stages=1))
        sig = {a: types.get(a, "constexpr") for a in fn.arg_names}
        ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                             target=GPUTarget("cuda", 80, 32), options=dict(num_warps=4)).asm["ptx"]
        res.update(prefetch=len(re.findall(r"prefetch\.global\.L2", ptx)),
                   loads=len(re.findall(r"\bld\.global", ptx)),
                   stores=len(re.findall(r"\bst\.global", ptx)))
        out.append(res)
    fn = pf._l2_prefetch_rows_kernel
    types = dict(A0="*u8", r0="i64", A1="*u8", r1="i64", IDS="*i64", n_ids="i32", E="i32")
    for r in (1, 2):
        const = dict(R=r, SECTOR=pf.SECTOR, LINES=pf._LINES)
        res = _compile(fn, types, const, dict(num_warps=4, num_stages=1))
        sig = {a: types.get(a, "constexpr") for a in fn.arg_names}
        ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                             target=GPUTarget("cuda", 80, 32), options=dict(num_warps=4)).asm["ptx"]
        res.update(prefetch=len(re.findall(r"prefetch\.global\.L2", ptx)),
                   loads=len(re.findall(r"\bld\.global", ptx)),
                   stores=len(re.findall(r"\bst\.global", ptx)))
        out.append(res)
    return out


def test_prefetch_compiles_for_sm80():
    results = compile_in_subprocess(__file__)
    per_thread = 512 // 128                     # _LINES sectors a step over 4 warps
    assert [r["kernel"] for r in results] == ["_l2_prefetch_kernel"] * 3 \
        + ["_l2_prefetch_rows_kernel"] * 2
    for r in results:
        assert r["cubin"] > 0 and r["shared"] == 0, r
        assert r["prefetch"] == per_thread * r["config"]["R"], r
        assert r["stores"] == 0, r
        # the rows kernel reads its ids (one gather a sector), the other kernel nothing
        assert r["loads"] == (0 if r["kernel"] == "_l2_prefetch_kernel" else r["prefetch"]), r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefetch_changes_nothing_on_a_gpu():
    from backfit.runtime.kernels.prefetch import l2_prefetch, l2_prefetch_rows
    g = torch.Generator(device="cuda").manual_seed(3)
    ts = [torch.randint(-128, 127, (n,), dtype=torch.int8, device="cuda", generator=g)
          for n in (1, 31, 32, 33, 512 * 32 - 1, 512 * 32 * 64 + 7, 3 << 20)]
    ts.append(torch.randn(1000, 257, device="cuda", generator=g).bfloat16())
    stacks = [torch.randint(0, 255, (9, 40, 33), dtype=torch.uint8, device="cuda",
                            generator=g), torch.randn(9, 40, 3, device="cuda", generator=g)]
    ts += stacks
    before = [t.clone() for t in ts]
    for i in range(0, len(ts), 4):
        for p in (1, 64, 300):
            for sector in (32, 128):
                l2_prefetch(ts[i:i + 4], programs=p, sector=sector)
    ids = torch.tensor([[8, 0, 3], [3, 3, 8]], device="cuda")
    for p in (1, 64, 300):
        l2_prefetch_rows(stacks, ids, programs=p)
        l2_prefetch_rows(stacks[:1], ids[:1, :1], programs=p)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(ts, before))


if __name__ == "__main__":
    print(json.dumps(compile_all()))
