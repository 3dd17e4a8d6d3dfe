"""L2 prefetch of weights: `l2_prefetch(tensors)` pulls up to six contiguous tensors into the
GPU's L2 with PTX `prefetch.global.L2` (sm_20 on, so SM80-safe), one instruction a SECTOR-byte
sector, and returns at once (no result, no host sync; grid from shapes only, CUDA-graph safe).

Why: at TP 4 a decode step's GEMVs read 2-16 MB each and pay ~2.5-4 µs of ramp and tail over
their bytes, while between them launches that read almost nothing (decode attention, the merge,
mHC's post_mix, the router: 8-13 µs of a layer on a few SMs) leave DRAM idle. Queued beside
those launches (model.prefetch), the next GEMVs' weights are read from L2 instead (50 MB on the
H100, 40 MB on the A100: one sub-layer's weights at TP 4 fit). A hint only: the data read later
is the same whatever happens to it, so there is nothing to check numerically.

Program p prefetches sectors p·LINES, (p + P)·LINES, ... of each range; lanes past a range's
end prefetch its last sector again (no address outside a tensor). `l2_prefetch_rows(stacks,
ids)`: the rows of [E, ...] stacks that device-side ids name (the routed experts' down
projections, beside their gate/up launch). The interpreter has no
inline PTX: off CUDA the call does nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["MAX_TENSORS", "PREFETCH_PROGRAMS", "SECTOR", "l2_prefetch", "l2_prefetch_rows"]

MAX_TENSORS = 6
# programs of a prefetch launch (4 warps each, LINES sectors a step): enough in-flight requests to
# draw near copy bandwidth from a fraction of the SMs, leaving the rest to the launches beside.
# Not yet timed on a GPU (model.prefetch.L2_PREFETCH is off as shipped).
PREFETCH_PROGRAMS = 64
SECTOR = 32             # bytes a prefetch instruction covers (an L2 sector; 128: a whole line)
_LINES = 512            # sectors a program prefetches per loop step (4 a thread on 4 warps)


@triton.jit
def _prefetch_range(A, n, SECTOR: tl.constexpr, LINES: tl.constexpr):
    """This program's sectors of the n bytes at A (A an 8-bit pointer)."""
    pid, P = tl.program_id(0), tl.num_programs(0)
    last = tl.cdiv(n, SECTOR) - 1
    for s0 in range(pid * LINES, last + 1, P * LINES):
        s = tl.minimum(s0 + tl.arange(0, LINES), last)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [A + s.to(tl.int64) * SECTOR], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _prefetch_rows(A, row_bytes, IDS, n_ids, E, SECTOR: tl.constexpr, LINES: tl.constexpr):
    """This program's sectors of rows IDS[0 .. n_ids) (clamped to [0, E)) of the [E, row_bytes]
    bytes at A; a row's last sector starts inside it (sectors = cdiv(row_bytes, SECTOR))."""
    pid, P = tl.program_id(0), tl.num_programs(0)
    per = tl.cdiv(row_bytes, SECTOR)
    last = n_ids * per - 1
    for s0 in range(pid * LINES, last + 1, P * LINES):
        s = tl.minimum(s0 + tl.arange(0, LINES), last)
        e = tl.minimum(tl.maximum(tl.load(IDS + s // per), 0), E - 1).to(tl.int64)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [A + e * row_bytes + (s % per).to(tl.int64) * SECTOR],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_rows_kernel(A0, r0, A1, r1, IDS, n_ids, E, R: tl.constexpr,
                             SECTOR: tl.constexpr, LINES: tl.constexpr):
    """Rows IDS of the stacks (A0, r0 bytes a row) and, R = 2, (A1, r1)."""
    _prefetch_rows(A0, r0, IDS, n_ids, E, SECTOR, LINES)
    if R > 1:
        _prefetch_rows(A1, r1, IDS, n_ids, E, SECTOR, LINES)


@triton.jit
def _l2_prefetch_kernel(A0, n0, A1, n1, A2, n2, A3, n3, A4, n4, A5, n5, R: tl.constexpr,
                        SECTOR: tl.constexpr, LINES: tl.constexpr):
    """Ranges (Ai, ni) for i < R, each split over all programs."""
    _prefetch_range(A0, n0, SECTOR, LINES)
    if R > 1:
        _prefetch_range(A1, n1, SECTOR, LINES)
    if R > 2:
        _prefetch_range(A2, n2, SECTOR, LINES)
    if R > 3:
        _prefetch_range(A3, n3, SECTOR, LINES)
    if R > 4:
        _prefetch_range(A4, n4, SECTOR, LINES)
    if R > 5:
        _prefetch_range(A5, n5, SECTOR, LINES)


def l2_prefetch(tensors: list[torch.Tensor], programs: int | None = None,
                sector: int | None = None) -> None:
    """Queue one launch on the current stream that prefetches every byte of `tensors` (up to
    MAX_TENSORS contiguous tensors on one CUDA device; empty ones skipped) into L2. programs:
    PREFETCH_PROGRAMS unless given; sector: SECTOR unless given (a power of two >= 32). Off
    CUDA: nothing."""
    ts = [t for t in tensors if t is not None and t.numel()]
    if len(ts) > MAX_TENSORS:
        raise ValueError(f"l2_prefetch: at most {MAX_TENSORS} tensors a launch, got {len(ts)}")
    for t in ts:
        if not t.is_contiguous() or t.device != ts[0].device:
            raise ValueError(f"l2_prefetch: contiguous tensors on one device, got "
                             f"{list(t.shape)} {t.device} (stride {t.stride()})")
    sector = SECTOR if sector is None else sector
    if sector < 32 or sector & (sector - 1):
        raise ValueError(f"l2_prefetch: sector must be a power of two >= 32, got {sector}")
    if not ts or ts[0].device.type != "cuda":
        return
    args = []
    for t in ts + ts[:1] * (MAX_TENSORS - len(ts)):          # unused slots: never read (R)
        args += [t.reshape(-1).view(torch.uint8), t.numel() * t.element_size()]
    _l2_prefetch_kernel[(programs or PREFETCH_PROGRAMS,)](*args, R=len(ts), SECTOR=sector,
                                                          LINES=_LINES, num_warps=4)


def l2_prefetch_rows(stacks: list[torch.Tensor], ids: torch.Tensor,
                     programs: int | None = None) -> None:
    """Queue one launch that prefetches rows ids (int64, any shape, values in [0, E); read on
    the device: the routed experts of a decode step) of one or two contiguous stacks [E, ...]
    (an expert's weight and its scales) into L2. Off CUDA: nothing."""
    if not 1 <= len(stacks) <= 2 or ids.dtype != torch.int64 or any(
            not t.is_contiguous() or t.dim() < 2 or t.shape[0] != stacks[0].shape[0]
            or t.device != ids.device for t in stacks):
        raise ValueError(f"l2_prefetch_rows: one or two contiguous [E, ...] stacks with the "
                         f"same E and int64 ids on their device, got "
                         f"{[(list(t.shape), t.device) for t in stacks]}, ids {ids.dtype}")
    if ids.device.type != "cuda" or not ids.numel():
        return
    args = []
    for t in stacks + stacks[:1] * (2 - len(stacks)):
        args += [t.view(-1).view(torch.uint8), t[0].numel() * t.element_size()]
    _l2_prefetch_rows_kernel[(programs or PREFETCH_PROGRAMS,)](
        *args, ids.reshape(-1), ids.numel(), stacks[0].shape[0], R=len(stacks), SECTOR=SECTOR,
        LINES=_LINES, num_warps=4)
