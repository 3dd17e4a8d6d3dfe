"""Shared fixtures: tiny checkpoints in the exact original format, built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

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
def tiny_converted(request, tmp_path_factory):
    """tiny_converted(tp, kind="int8" | "bf16" | "mx4", variant="flash" | "0731" | "vision") ->
    that tiny checkpoint converted with --linears/--experts kind (mx4: --linears int8
    --experts mx4),
    built once per (tp, kind, variant) and shared by every test: read-only (copy to corrupt)."""
    from backfit.convert.run import convert
    built: dict[tuple[int, str, str], Path] = {}

    def get(tp: int, kind: str = "int8", variant: str = "flash") -> Path:
        if (tp, kind, variant) not in built:
            src = request.getfixturevalue(f"tiny_{variant}")
            dst = tmp_path_factory.mktemp("conv") / f"{variant}_{kind}_tp{tp}"
            convert(src, dst, tp=tp, linears="int8" if kind == "mx4" else kind,
                    experts=kind, progress=False)
            built[tp, kind, variant] = dst
        return built[tp, kind, variant]
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
