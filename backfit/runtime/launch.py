"""Run one function on every tensor-parallel rank and hand back rank 0's result.

tp = 1 runs in this process. tp > 1 spawns one process per rank (gloo on CPU, NCCL on CUDA);
every rank runs the same function on its own shard, and rank 0's return value comes back
through a temporary file (torch.save), so it may hold tensors.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

import torch

from backfit.runtime.distributed import (destroy_distributed, free_port, get_tp_info,
                                         init_distributed, set_tp_info, tp_is_set)

__all__ = ["run_on_ranks"]


def _worker(rank: int, size: int, port: int, device: str, fn: Callable, args: tuple, out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    init_distributed(rank, size, port, device)
    try:
        result = fn(*args)
        if rank == 0:
            torch.save(result, out)
    finally:
        destroy_distributed()


def run_on_ranks(fn: Callable[..., Any], tp: int, args: tuple = (), device: str = "cpu") -> Any:
    """fn(*args) on tp ranks; returns rank 0's result. fn must be a module-level function."""
    if tp == 1:
        if not tp_is_set():
            set_tp_info(0, 1)
        elif get_tp_info().size != 1:
            raise RuntimeError(f"this process is rank {get_tp_info().rank} of {get_tp_info().size}")
        return fn(*args)
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="backfit-tp") as tmp:
        out = os.path.join(tmp, "rank0.pt")
        mp.spawn(_worker, args=(tp, free_port(), device, fn, args, out), nprocs=tp, join=True)
        return torch.load(out, weights_only=False)
