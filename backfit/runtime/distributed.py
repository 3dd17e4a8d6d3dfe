"""Tensor-parallel process state (set once per process) and collective wrappers.

TPInfo is process-wide and frozen: `set_tp_info` raises if called twice, `get_tp_info` raises if
nothing was set. Collectives are no-ops at size 1, so single-process code never touches
torch.distributed. Backend: gloo on CPU, nccl on GPU.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["TPInfo", "set_tp_info", "get_tp_info", "tp_is_set", "init_distributed",
           "destroy_distributed", "all_reduce", "all_gather", "free_port", "min_over_ranks",
           "broadcast_from_rank0", "all_gather_rows"]


@dataclass(frozen=True)
class TPInfo:
    rank: int
    size: int

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad TPInfo rank={self.rank} size={self.size}")

    def shard(self, n: int, what: str = "dimension") -> int:
        """Local share of a global size n; raises if n does not divide evenly."""
        if n % self.size:
            raise ValueError(f"{what} {n} is not divisible by tp={self.size}")
        return n // self.size


_TP: TPInfo | None = None


def set_tp_info(rank: int, size: int) -> TPInfo:
    global _TP
    if _TP is not None:
        raise RuntimeError(f"TP info already set to {_TP}; it is set once per process")
    _TP = TPInfo(rank, size)
    return _TP


def get_tp_info() -> TPInfo:
    if _TP is None:
        raise RuntimeError("TP info not set: call set_tp_info(rank, size) or init_distributed first")
    return _TP


def tp_is_set() -> bool:
    return _TP is not None


def free_port() -> int:
    """A TCP port that was free a moment ago (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(rank: int, size: int, port: int | None = None, device: str = "cpu",
                     host: str = "127.0.0.1") -> TPInfo:
    """Set TPInfo and, for size > 1, join a process group (gloo on CPU, nccl on CUDA)."""
    info = set_tp_info(rank, size)
    if size > 1:
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        port = port if port is not None else int(os.environ.get("MASTER_PORT", "29500"))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank,
                                world_size=size)
    return info


def destroy_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _gloo(x: torch.Tensor) -> bool:
    return x.device.type == "cpu"


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group (in place when possible); identity at size 1.

    On CPU (gloo) a bfloat16 tensor is reduced in float32: gloo's bf16 support varies by build,
    and the sum of tp partials is more accurate in fp32 anyway.
    """
    if get_tp_info().size == 1:
        return x
    if _gloo(x) and x.dtype == torch.bfloat16:
        y = x.float()
        dist.all_reduce(y)
        return y.to(x.dtype)
    dist.all_reduce(x)
    return x


def min_over_ranks(values: list[int], device: torch.device) -> list[int]:
    """The element-wise minimum of every rank's `values` (ints), on every rank; the values
    themselves at size 1. The pools' sizes: each rank plans from its own free memory."""
    if get_tp_info().size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64,
                     device=device if torch.device(device).type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [int(v) for v in t.tolist()]


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """x of rank 0 into every rank's x (same shape and dtype everywhere), in place; identity at
    size 1. The overlapped step's sampled ids: only rank 0 samples."""
    if get_tp_info().size > 1:
        dist.broadcast(x, src=0)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's x along `dim` (rank order); identity at size 1."""
    tp = get_tp_info()
    if tp.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)


def all_gather_rows(x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Every rank's rows, in rank order: x [sizes[rank], ...] on each rank (the same trailing
    shape, dtype and device everywhere) -> [x_0 [sizes[0], ...], x_1, ...]; [x] at size 1.
    sizes: every rank's row count, known on every rank (zeros allowed).

    One all_gather of [max(sizes), ...] buffers (x zero-padded), none when every size is 0. The
    rows travel as raw bytes (uint8): bit-exact for any dtype, whatever gloo's bf16 support."""
    tp = get_tp_info()
    if len(sizes) != tp.size or x.shape[0] != sizes[tp.rank]:
        raise ValueError(f"rank {tp.rank}: {x.shape[0]} rows, sizes {sizes} (tp={tp.size})")
    if tp.size == 1:
        return [x]
    tail, m = x.shape[1:], max(sizes)
    width = math.prod(tail) * x.element_size()               # bytes per row
    buf = torch.zeros(m, width, dtype=torch.uint8, device=x.device)           # [m, width]
    if sizes[tp.rank]:
        buf[:sizes[tp.rank]] = x.contiguous().view(x.shape[0], -1).view(torch.uint8)
    parts = [torch.empty_like(buf) for _ in range(tp.size)]
    if m:
        dist.all_gather(parts, buf)
    return [p[:n].view(x.dtype).view(n, *tail) for p, n in zip(parts, sizes)]
