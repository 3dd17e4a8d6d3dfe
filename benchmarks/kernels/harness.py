"""The shared harness of the kernel benchmarks in this folder (run on a lent GPU, never in CI):
the device's two ceilings measured in the same run (copy bandwidth, BF16 and INT8 matrix rates),
medians of CUDA-event timings (eager, or as CUDA-graph replays that hide the launch gaps), and
JSON out. Import it as `from harness import ...` (each script's folder is on sys.path)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

__all__ = ["ceilings", "copy_bandwidth", "cuda_time", "events_ms", "graph_time", "graph_us",
           "write_json"]

DEV = "cuda"


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


def events_ms(fn, reps: int = 10) -> float:
    """Median ms of fn() timed with CUDA events (eager; for code that syncs, like the torch MoE)."""
    return cuda_time(fn, reps) * 1e3


def graph_us(calls: list, reps: int = 20) -> float:
    """Median µs per call: all `calls` captured in one CUDA graph, replayed `reps` times."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    del g
    return statistics.median(ts) * 1e3 / len(calls)


def ceilings() -> dict:
    n = 1 << 31                                                     # 2 Gi bf16 = 4 GiB
    src = torch.empty(n, dtype=torch.bfloat16, device=DEV).normal_()
    dst = torch.empty_like(src)
    ms = events_ms(lambda: dst.copy_(src))
    bw = 2 * src.numel() * 2 / ms / 1e9                             # TB/s (bytes read + written)
    del src, dst
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    bf16 = 2 * 8192 ** 3 / events_ms(lambda: a @ b) / 1e9           # TFLOP/s
    ai = torch.randint(-127, 128, (8192, 8192), device=DEV, dtype=torch.int8)
    bi = torch.randint(-127, 128, (8192, 8192), device=DEV, dtype=torch.int8).t()
    int8 = 2 * 8192 ** 3 / events_ms(lambda: torch._int_mm(ai, bi)) / 1e9
    return dict(copy_TBps=bw, bf16_TFLOPs=bf16, int8_TOPs=int8)


def write_json(path: str | None, rows) -> None:
    """rows (plus the device's name) as JSON at path (nothing when path is None)."""
    if path:
        out = {"device": torch.cuda.get_device_name(), "rows": rows}
        Path(path).write_text(json.dumps(out, indent=1))
