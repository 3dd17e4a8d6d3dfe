"""ModelRunner: one rank's model and cache pools; runs one engine step (docs/ENGINE.md §4).

A step is plain data (StepInput: picklable, broadcast to every TP rank): per sequence its slot,
block table, start and new token ids, plus the snapshot copies to make before and after the
forward. forward(step) runs every prefill chunk and decode token in ONE batch and returns FP32
logits [num_sampled, vocab] for the sequences that sample (their last token), plus every row of
the sequences that asked for prompt logprobs. Sampling is the engine's (rank 0 only).

Pool sizing (size_pools): on CUDA, free memory after loading and a profile forward of
max_num_batched_tokens tokens, times gpu_memory_utilization, goes to slots first (running
sequences + snapshots) and blocks after; on CPU, --cpu-kv-cache-gib bounds it the same way.
Byte counts come from the pools themselves (built on the meta device), so they cannot drift.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backfit.config import ModelConfig
from backfit.runtime.batch import ForwardBatch
from backfit.runtime.cache.paged import PagedCache, check_block_size

__all__ = ["RunnerConfig", "StepSeq", "StepInput", "ModelRunner", "default_block_size",
           "pool_bytes"]


@dataclass(frozen=True)
class RunnerConfig:
    model: str                               # converted directory
    dtype: str = "bfloat16"                  # activations: bfloat16 | float32
    device: str = "cpu"
    kv_cache_dtype: str = "auto"             # auto (= activations) | bf16 | int8
    block_size: int | None = None            # tokens per block; None: default_block_size
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    num_snapshot_slots: int | None = None    # prefix-cache snapshots; None: = max_num_seqs
    num_blocks: int | None = None            # None: from memory (size_pools)
    gpu_memory_utilization: float = 0.90
    cpu_kv_cache_gib: float = 4.0


@dataclass(frozen=True)
class StepSeq:
    seq_id: int
    slot: int
    block_table: tuple[int, ...]
    start: int                               # tokens already in the cache
    tokens: tuple[int, ...]                  # new tokens (a prefill chunk or one decode token)
    sample: bool                             # return the last row's logits
    all_logits: bool = False                 # return every row (prompt logprobs, echo)


@dataclass(frozen=True)
class StepInput:
    seqs: tuple[StepSeq, ...]
    restores: tuple[tuple[int, int], ...] = ()   # (snapshot slot, seq slot) before the forward
    saves: tuple[tuple[int, int], ...] = ()      # (seq slot, snapshot slot) after it


@dataclass
class StepOutput:
    logits: torch.Tensor | None              # [num sample seqs, V] FP32, in step order
    all_logits: dict[int, torch.Tensor] = field(default_factory=dict)   # seq_id -> [n, V]


def default_block_size(cfg: ModelConfig) -> int:
    """The smallest multiple of every compression ratio that is >= 64 tokens."""
    step = math.lcm(*[r for r in cfg.compress_ratios if r] or [1])
    return step * max(1, math.ceil(64 / step))


def pool_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv: str) -> tuple[int, int]:
    """(bytes per slot, bytes per block), measured on pools built on the meta device."""
    c = PagedCache(cfg, 1, 1, block_size, dtype, kv, device="meta").nbytes()
    return c["slots"], c["blocks"]


class ModelRunner:
    def __init__(self, rc: RunnerConfig):
        from backfit.runtime.loader import load_model
        from backfit.runtime.model.transformer import Transformer
        self.rc, self.timings = rc, {}
        self.cfg = ModelConfig.from_file(Path(rc.model) / "config.json")
        self.dtype = getattr(torch, rc.dtype)
        self.device = torch.device(rc.device)
        self.block_size = rc.block_size or default_block_size(self.cfg)
        check_block_size(self.cfg, self.block_size)
        self.kv = rc.kv_cache_dtype
        if self.kv == "bf16":                         # = the activations, which must be bf16
            if self.dtype != torch.bfloat16:
                raise ValueError("--kv-cache-dtype bf16 needs bfloat16 activations (or use auto)")
            self.kv = "auto"
        elif self.kv not in ("auto", "int8"):
            raise ValueError(f"--kv-cache-dtype {self.kv!r}: choose auto, bf16 or int8")
        t = time.perf_counter()
        self.model = Transformer(self.cfg, self.dtype, mtp=False)
        load_model(self.model, rc.model, self.device)
        self.timings["weights_s"] = time.perf_counter() - t
        t = time.perf_counter()
        self.num_slots, self.num_blocks = self.size_pools()
        self.cache = PagedCache(self.cfg, self.num_slots, self.num_blocks, self.block_size,
                                self.dtype, self.kv, self.device)
        self.timings["pools_s"] = time.perf_counter() - t

    @property
    def num_snapshot_slots(self) -> int:
        return self.num_slots - self.rc.max_num_seqs

    def size_pools(self) -> tuple[int, int]:
        """(slots, blocks) from the configured memory budget; raises with what to change."""
        rc = self.rc
        slots = rc.max_num_seqs + (rc.max_num_seqs if rc.num_snapshot_slots is None
                                   else rc.num_snapshot_slots)
        per_slot, per_block = pool_bytes(self.cfg, self.block_size, self.dtype, self.kv)
        need = math.ceil(rc.max_model_len / self.block_size)        # one full-length sequence
        if rc.num_blocks is not None:
            blocks = rc.num_blocks
        else:
            if self.device.type == "cuda":
                self._profile_forward()
                free, _ = torch.cuda.mem_get_info(self.device)
                total = torch.cuda.get_device_properties(self.device).total_memory
                budget = free - (1 - rc.gpu_memory_utilization) * total
            else:
                budget = rc.cpu_kv_cache_gib * 2**30
            blocks = int((budget - slots * per_slot) // per_block)
            blocks = min(blocks, need * rc.max_num_seqs) if self.device.type == "cpu" else blocks
        if blocks < need:
            raise ValueError(
                f"the KV cache holds {max(blocks, 0) * self.block_size} tokens, fewer than "
                f"--max-model-len {rc.max_model_len}: lower --max-model-len or --max-num-seqs, "
                f"use --kv-cache-dtype int8, or raise --gpu-memory-utilization / --cpu-kv-cache-gib "
                f"(a slot takes {per_slot / 2**20:.1f} MiB, a block of {self.block_size} "
                f"tokens {per_block / 2**20:.2f} MiB)")
        return slots, blocks

    @torch.no_grad()
    def _profile_forward(self) -> None:
        """One forward of max_num_batched_tokens tokens so the free-memory reading after it
        leaves room for the activations of the largest step (a scratch cache, then freed)."""
        n = min(self.rc.max_num_batched_tokens, self.rc.max_model_len)
        scratch = PagedCache(self.cfg, 1, math.ceil(n / self.block_size), self.block_size,
                             self.dtype, self.kv, self.device)
        b = ForwardBatch.build([(0, torch.zeros(n, dtype=torch.int64), 0)], self.device, [0],
                               [list(range(scratch.num_blocks))])
        self.model(b, scratch, last_only=True)
        del scratch
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    @torch.no_grad()
    def forward(self, step: StepInput) -> StepOutput:
        for src, dst in step.restores:
            self.cache.copy_slot(src, dst)
        seqs = step.seqs
        batch = ForwardBatch.build([(s.seq_id, list(s.tokens), s.start) for s in seqs],
                                   self.device, [s.slot for s in seqs],
                                   [s.block_table for s in seqs])
        X = self.model.hidden(batch, self.cache)                  # [T, hc, d]
        out = StepOutput(None)
        ends = batch.last_rows()
        rows = [int(ends[i]) for i, s in enumerate(seqs) if s.sample]
        if rows:
            out.logits = self.model.logits(X[torch.tensor(rows, device=X.device)])
        lo = 0
        for s in seqs:
            if s.all_logits:
                out.all_logits[s.seq_id] = self.model.logits(X[lo:lo + len(s.tokens)])
            lo += len(s.tokens)
        for src, dst in step.saves:
            self.cache.copy_slot(src, dst)
        return out
