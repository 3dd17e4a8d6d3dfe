"""Shared fixtures: tiny checkpoints in the exact original format, built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Before torch is imported: pin the CPU GEMM libraries to row-independent kernels. On newer Xeons
# a GEMM row's result depends on how many rows ride with it: oneDNN's AMX BF16 kernels (F.linear,
# K = 1024: rows padded to 64 or 128 differ from the same rows alone in the last bit) and MKL's
# FP32 small-M path (mHC's [T, 1024] x [1024, 24]: T = 11 vs 64). The CPU tests that hold padded
# shapes bit-equal to unpadded ones (the prefill pieces, tests/runtime/test_prefill_graphs.py,
# which checks this premise first) need rows that do not. Both settings are caps that change
# nothing on older CPUs (the CI boxes before 2026-12-05 passed without them); a value set by the
# caller is kept.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")   # oneDNN: the ISA below AMX
os.environ.setdefault("MKL_CBWR", "AVX2,STRICT")                   # MKL: AVX2 code, strict CNR

import torch  # noqa: E402

from backfit.synthetic import write_checkpoint
from support import VISION_DIMS

# `make test` runs two pytest-xdist workers on the 2-core CI box: one torch thread each (OpenMP
# with two threads stalls 10-40x whenever another process holds a core, tests/support.py)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_flash(tmp_path_factory) -> Path:
    """Flash variant, small vocabulary (fast)."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "flash", "flash", seed=0, small_vocab=True)


@pytest.fixture(scope="session")
def tiny_0731(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "0731", "0731", seed=0, small_vocab=True)


@pytest.fixture(scope="session")
def tiny_converted(tiny_flash, tmp_path_factory):
    """tiny_converted(tp, kind="int8" | "bf16" | "mx4") -> tiny_flash converted with
    --linears/--experts kind (mx4: --linears int8 --experts mx4), built once per (tp, kind) and
    shared by every test: read-only (copy to corrupt)."""
    from backfit.convert.run import convert
    built: dict[tuple[int, str], Path] = {}

    def get(tp: int, kind: str = "int8") -> Path:
        if (tp, kind) not in built:
            dst = tmp_path_factory.mktemp("conv") / f"{kind}_tp{tp}"
            convert(tiny_flash, dst, tp=tp, linears="int8" if kind == "mx4" else kind,
                    experts=kind, progress=False)
            built[tp, kind] = dst
        return built[tp, kind]
    return get


@pytest.fixture(scope="session")
def tiny_flash_real_vocab(tmp_path_factory) -> Path:
    """Flash variant with the real 129,280-id vocabulary and the real tokenizer."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "flash_v", "flash", seed=0)



@pytest.fixture(scope="session")
def tiny_vision(tmp_path_factory) -> Path:
    """Vision-Exp variant (0731 text + ViT, aligner, sentinels, bias_vl), small vocab."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "vision", "vision", seed=0,
                            small_vocab=True, **VISION_DIMS)
