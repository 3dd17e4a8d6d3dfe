"""Shared fixtures: tiny checkpoints in the exact original format, built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from backfit.synthetic import write_checkpoint

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(scope="session")
def tiny_flash(tmp_path_factory) -> Path:
    """Flash variant, small vocabulary (fast)."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "flash", "flash", seed=0, small_vocab=True)


@pytest.fixture(scope="session")
def tiny_0731(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "0731", "0731", seed=0, small_vocab=True)


@pytest.fixture(scope="session")
def tiny_flash_real_vocab(tmp_path_factory) -> Path:
    """Flash variant with the real 129,280-id vocabulary and the real tokenizer."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "flash_v", "flash", seed=0)


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
