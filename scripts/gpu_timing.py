"""Timing helpers shared by the GPU benchmark scripts (bench_mhc, bench_attention,
bench_attention_prefill): medians of CUDA-event timings, eager or as CUDA-graph replays."""

from __future__ import annotations

import statistics

import torch

__all__ = ["cuda_time", "graph_time", "copy_bandwidth"]


def _median_s(run, reps: int) -> float:
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def cuda_time(fn, reps: int = 10) -> float:
    """Median seconds of one eager fn() call (after one warm-up call)."""
    fn()
    torch.cuda.synchronize()
    return _median_s(fn, reps)


def graph_time(fn, reps: int = 10) -> float:
    """Median seconds of one replay of a CUDA graph that runs fn() once (launch gaps excluded)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return _median_s(g.replay, reps)


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s, read + written, of a 2 GiB copy."""
    x = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / graph_time(lambda: y.copy_(x))
