"""Side CUDA streams: short chains of a step that nothing waits on right away run beside the main
stream, and CUDA graphs capture them as parallel branches (the decode step is latency-bound:
most of its kernels fill a few SMs for 2-10 µs, so two chains overlap almost for free).

Users (triton path on CUDA only; the torch path and CPU never fork):
  model.moe       the shared expert (3 launches) beside the router and the routed launches;
                  the combine joins it (kernels.moe.int8.fused_moe shared_ready); the router
                  is launched first (mark / after=: the side chain waits for its input only)
  model.attention the decode step's FP32 projections and compressor update ("comp", HCA /
                  CSA) and the CSA indexer chain ("index", after those projections: queries,
                  scores, top-k; its compressor update beside the queries on "icomp") beside
                  the query path (wq_a|wkv, q_norm, wq_b, RoPE; at batch 1 wq_a|wkv launched
                  before "comp", by mark / after=); decode attention joins both. Every layer:
                  the token's kv (kv_norm + RoPE + ring store, "kv") beside q_norm / wq_b /
                  the query RoPE (at batch 1 launched after q_norm)
  kernels.mhc.decode  the Sinkhorn of hc_pre (post, M: read only by the hc_post after the
                  sub-layer) beside the critical u + RMSNorm launch; hc_post queues it (after
                  the sub-layer's launches, waiting for PART alone) and joins it
Rules that keep the caching allocator safe without record_stream (which graph capture does not
track): fork with side.wait_stream(main) AFTER the side chain's inputs are queued; every tensor
the side chain reads or writes that main allocated stays referenced until main has waited on
the chain's event; what the side chain allocates is read by main only after that wait. A later
fork orders the side stream after everything main queued before it, so a block main frees and
reallocates can never be written by an earlier side launch.
"""

from __future__ import annotations

import torch

__all__ = ["beside", "fork", "mark", "side_stream", "stream_counters", "stream_key"]

_SIDE: dict[tuple[torch.device, str], torch.cuda.Stream] = {}


def side_stream(device: torch.device, name: str) -> torch.cuda.Stream:
    """The side stream `name` of `device` (one per name, created on first use)."""
    key = (torch.device(device), name)
    if key not in _SIDE:
        _SIDE[key] = torch.cuda.Stream(key[0])
    return _SIDE[key]


def stream_key(device: torch.device) -> int:
    """The current stream of `device` as a key (0 off CUDA): for the kernels' per-stream scratch
    (gemm's split-K workspace, cache_ops' block counters), which concurrent streams must not
    share."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


_COUNTERS: dict = {}     # (device, stream) -> [int32 zeros]: last-arriving-program counters


def stream_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 [>= n] counters of the current stream, for kernels whose last-arriving
    program finishes the work (cache_ops' fused compressor, kernels.router); every launch leaves
    them 0 again. One set per stream: the CSA layer's two compressor updates run on the side
    streams "comp" and "icomp" at once, and shared counters would mix their counts (a row
    finished before all its programs, or never). A larger n adds a larger buffer; the smaller
    ones stay alive, as CUDA graphs captured earlier hold their addresses."""
    bufs = _COUNTERS.setdefault((device, stream_key(device)), [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 256), dtype=torch.int32, device=device))
    return bufs[-1]


def mark(device: torch.device) -> torch.cuda.Event:
    """An event recorded on the current stream now: a side chain queued later with
    beside(..., after=mark) waits for what the current stream had queued here only, so the
    critical launch queued in between is launched first (in a replayed CUDA graph the nodes that
    become ready together start in the order they were captured, the step's trace shows, and
    the first takes the SMs)."""
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


def fork(device: torch.device, name: str, after: torch.cuda.Event | None = None
         ) -> torch.cuda.Stream:
    """side_stream(device, name), made to wait for everything queued on the current stream
    (after: for what it had queued when that mark() was taken. What it queued since must not
    read a block that this side stream allocated: freed, the block goes back to this stream,
    and this fork no longer orders its reuse after that read. The launches between mark and
    fork in the model read no block of the stream they fork)."""
    side = side_stream(device, name)
    if after is None:
        side.wait_stream(torch.cuda.current_stream(device))
    else:
        side.wait_event(after)
    return side


def beside(device: torch.device, name: str, fn, after: torch.cuda.Event | None = None):
    """fn() queued on the side stream `name` after everything the current stream has queued (or
    after the mark `after`) -> (its result, an event recorded after it). The caller waits for
    the event before it reads the result or anything fn wrote (the rules above)."""
    side = fork(device, name, after)
    with torch.cuda.stream(side):
        out = fn()
        done = torch.cuda.Event()
        done.record(side)
    return out, done
