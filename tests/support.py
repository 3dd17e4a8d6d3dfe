"""Helpers shared by test modules (importable as `support`: pyproject sets pythonpath = tests)."""

from __future__ import annotations

import os
from pathlib import Path

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


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
