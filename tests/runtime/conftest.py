"""Runtime fixtures: one thread, TP info (0, 1) for this process, converted dirs built once.

Conversions come from the session-wide `tiny_converted` (tests/conftest.py): bf16 tp1
(lossless: decode and reference parity), int8 tp1/2/4 (the deployment format: TP equivalence
with sharded scales).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import one_thread

from backfit.config import ModelConfig
from backfit.runtime.distributed import get_tp_info, set_tp_info, tp_is_set
from backfit.runtime.loader import load_model
from backfit.runtime.model.transformer import Transformer


@pytest.fixture(scope="session", autouse=True)
def _rt_one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="session")
def tp1_process():
    """This pytest process is rank 0 of 1 (TP info is set once per process)."""
    if not tp_is_set():
        set_tp_info(0, 1)
    assert get_tp_info().size == 1
    return get_tp_info()


@pytest.fixture(scope="session")
def flash_ckpt(request, _rt_one_thread) -> Path:
    return request.getfixturevalue("tiny_flash")


@pytest.fixture(scope="session")
def bf16_tp1(flash_ckpt, tiny_converted) -> Path:
    return tiny_converted(1, "bf16")


@pytest.fixture(scope="session")
def int8_dirs(flash_ckpt, tiny_converted) -> dict[int, Path]:
    return {tp: tiny_converted(tp) for tp in (1, 2, 4)}


def _build_model(root: Path, dtype=torch.float32) -> Transformer:
    m = Transformer(ModelConfig.from_file(root / "config.json"), dtype)
    load_model(m, root)
    return m


@pytest.fixture(scope="session")
def build_model(tp1_process):
    """build_model(converted_dir, dtype) -> loaded Transformer (this process: tp=1)."""
    return _build_model


@pytest.fixture(scope="session")
def model_f32(bf16_tp1, build_model) -> Transformer:
    return build_model(bf16_tp1)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row max |a-b| / max |b| (b is the trusted side), float64."""
    a, b = a.double(), b.double()
    return (a - b).abs().amax(-1) / b.abs().amax(-1)


@pytest.fixture(scope="session")
def rel_err():
    return _rel_err
