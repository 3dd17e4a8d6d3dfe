"""Tensor-parallel ranks for the engine: this process is rank 0, ranks 1..tp-1 are children.

Rank 0 (the engine's process) schedules; for every step it broadcasts the StepInput over a gloo
control group (plain pickled data, also under NCCL), then runs its own forward; every rank runs
the same forward on its shard and meets the others in the model's all-reduces (and, for an
overlapped step's placeholder tokens, in a broadcast of rank 0's sampled ids). Only rank 0's
logits are used (ParallelHead all-gathers, so every rank has them).

A rank that dies must not leave the engine hanging in a collective: a watchdog thread polls the
children and, if one exits, reports it and ends this process with exit code 70 (gloo usually
raises first, on the closed socket; NCCL would wait forever).
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from backfit.runtime.distributed import (destroy_distributed, free_port, init_distributed,
                                         tp_is_set)
from backfit.runtime.runner import ModelRunner, RunnerConfig, StepInput, StepOutput

__all__ = ["RankGroup"]

_TIMEOUT = datetime.timedelta(minutes=10)


def _rank_main(rank: int, size: int, port: int, rc: RunnerConfig) -> None:
    import torch
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    init_distributed(rank, size, port, rc.device)
    ctrl = dist.new_group(backend="gloo", timeout=_TIMEOUT)
    try:
        runner = ModelRunner(rc)
        dist.barrier(group=ctrl)
        while True:
            msg = [None]
            dist.broadcast_object_list(msg, src=0, group=ctrl)
            if msg[0] is None:
                break
            runner.forward(msg[0])
    finally:
        destroy_distributed()


class RankGroup:
    """The runner of rank 0 plus tp-1 child ranks; forward(step) runs the step on all of them."""

    def __init__(self, rc: RunnerConfig, tp: int):
        self.tp, self.procs, self._closed = tp, [], False
        if tp == 1:
            if not tp_is_set():
                init_distributed(0, 1)
            self.runner = ModelRunner(rc)
            return
        if tp_is_set():
            raise RuntimeError("this process already has TP info; a tp > 1 engine must own it")
        port = free_port()
        ctx = mp.get_context("spawn")
        for r in range(1, tp):
            p = ctx.Process(target=_rank_main, args=(r, tp, port, rc), daemon=True)
            p.start()
            self.procs.append(p)
        threading.Thread(target=self._watch, daemon=True).start()
        init_distributed(0, tp, port, rc.device)
        self.ctrl = dist.new_group(backend="gloo", timeout=_TIMEOUT)
        self.runner = ModelRunner(rc)
        dist.barrier(group=self.ctrl)                     # every rank loaded

    def _watch(self) -> None:
        while not self._closed:
            for r, p in enumerate(self.procs, 1):
                if p.exitcode is not None and not self._closed:
                    print(f"backfit: tensor-parallel rank {r} died (exit code {p.exitcode}); "
                          "stopping the engine", file=sys.stderr, flush=True)
                    time.sleep(5)                         # let a raising collective report first
                    os._exit(70)
            time.sleep(0.5)

    def forward(self, step: StepInput, prev=None) -> StepOutput:
        """prev: the overlapped step's device ids (runner.forward: the other ranks take them
        from rank 0 inside the step)."""
        if self.tp > 1:
            dist.broadcast_object_list([step], src=0, group=self.ctrl)
        return self.runner.forward(step, prev)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.tp > 1:
            try:
                dist.broadcast_object_list([None], src=0, group=self.ctrl)
            finally:
                for p in self.procs:
                    p.join(timeout=30)
                    if p.is_alive():
                        p.kill()
                destroy_distributed()
