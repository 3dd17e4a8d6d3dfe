"""Helpers shared by test modules (importable as `support`: pyproject sets pythonpath = tests)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
# the tiny_vision checkpoint's experts are cut down (8 x 256 instead of 16 x 1024): four times
# faster to write and to run through the reference, and still convertible at tp 1 and 2
VISION_DIMS = dict(n_routed_experts=8, moe_intermediate_size=256)


def clone_checkpoint(src: Path, dst: Path) -> Path:
    """A cheap copy: every file a symlink; tests replace the files they corrupt (never in place)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        os.symlink(f, dst / f.name)
    return dst


def materialize(path: Path) -> Path:
    """Turn a symlink made by clone_checkpoint into a private copy that may be edited."""
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data)
    return path


@contextlib.contextmanager
def one_thread():
    """Torch on one thread. Tiny matrices run as fast, and on a shared 2-core box OpenMP with two
    threads stalls 10-40x whenever another process holds a core."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def kernel_module(name: str, probe: str, interpret: bool):
    """backfit.runtime.kernels.<name>, imported (or re-imported) so that its Triton kernels run
    interpreted iff `interpret`: TRITON_INTERPRET is read when a module's kernels are decorated.
    probe: one @triton.jit function of the module, to see how it was decorated."""
    import importlib

    import triton
    common = importlib.import_module("backfit.runtime.kernels.common")   # dot_bf16, shared
    if common.interpreted() != interpret:
        importlib.reload(common)
    m = importlib.import_module(f"backfit.runtime.kernels.{name}")
    if isinstance(getattr(m, probe), triton.runtime.jit.JITFunction) == interpret:
        m = importlib.reload(m)
    return m


def truncating_pool_get(monkeypatch):
    """Patch kernels.ref.pool_get_ref so its int8 dequantization casts to BF16 by truncation, as
    the Triton interpreter's casts do (the attention kernel tests, interpreted)."""
    from backfit.runtime.kernels import ref
    real = ref.pool_get_ref

    def get(data, scale, idx, dtype):
        if scale is None or dtype != torch.bfloat16:
            return real(data, scale, idx, dtype)
        x = data[idx].float() * scale[idx][..., None]
        return (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
    monkeypatch.setattr(ref, "pool_get_ref", get)


def prefill_then_decode(n: int, gen: torch.Generator, steps: int = 16):
    """Runner steps for n sequences on disjoint 16-block tables: one prefill of 118 + 7i random
    tokens each, then `steps` one-token decode steps (on the tiny model they cross CSA (4) and
    HCA (8) entry ends) -> yields (is_prefill, StepInput)."""
    from backfit.runtime.runner import StepInput, StepSeq
    tables = [tuple(range(16 * i, 16 * i + 16)) for i in range(n)]
    prompts = [torch.randint(3, 500, (118 + 7 * i,), generator=gen).tolist() for i in range(n)]
    yield True, StepInput(tuple(StepSeq(i, i, tables[i], 0, tuple(p), True)
                                for i, p in enumerate(prompts)))
    starts = [len(p) for p in prompts]
    for _ in range(steps):
        toks = torch.randint(3, 500, (n,), generator=gen).tolist()
        yield False, StepInput(tuple(StepSeq(i, i, tables[i], starts[i], (toks[i],), True)
                                     for i in range(n)))
        starts = [s + 1 for s in starts]
