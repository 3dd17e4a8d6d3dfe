"""L2 prefetch of weights a decode step will read soon, on a side stream (SM80-safe).

A TP-4 rank's batch-1 decode step is latency-bound: each GEMV waits a DRAM round trip before its
first FMA, and most of the step the DRAM sits idle. One launch on the "prefetch" side stream
(runtime.streams) asks for the weights of a GEMV or two ahead with `prefetch.global.L2` (PTX ISA
2.0; no result, no register held), so they stream in beside the launches before them and those
GEMVs read them from L2. Nothing is computed and nothing is written: the outputs are the same
bits with or without it.

  L2Plan(tensors)   the byte spans of `tensors` in CH-byte chunks, as an int64 [n, 3] table
                    of (offset from the first tensor's address, bytes, bytes an expert), built
                    once; experts=True: stacks [E, ...], a launch asks for chosen experts' slices
  plan.launch(idx)  one launch, a program a chunk (and expert id), one prefetch a 128-byte line
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["CH", "L2Plan"]

CH = 1 << 18            # bytes a program asks for (256 KiB: 2,048 lines)
_BLOCK = 512            # lines a step of a program (4 warps: 4 a thread)
_LINE = 128


@triton.jit
def _l2_prefetch(ptrs):
    """prefetch.global.L2 of each address (no result; kept by is_pure=False)."""
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(BASE, TAB, IDX, E, CHB: tl.constexpr, BLOCK: tl.constexpr,
                     INDEXED: tl.constexpr):
    """Program (p, j): the lines of bytes [BASE + TAB[p, 0], + TAB[p, 1]) (TAB[p, 1] <= CHB);
    INDEXED: of expert IDX[j]'s slice (clamped to [0, E): a hint never leaves the stack),
    TAB[p, 2] bytes further per expert."""
    p = tl.program_id(0)
    base = BASE.to(tl.pointer_type(tl.uint8))          # byte addresses, whatever BASE's dtype
    off = tl.load(TAB + 3 * p)
    n = tl.load(TAB + 3 * p + 1)
    if INDEXED:
        e = tl.minimum(tl.maximum(tl.load(IDX + tl.program_id(1)).to(tl.int64), 0), E - 1)
        off += e * tl.load(TAB + 3 * p + 2)
    r = tl.arange(0, BLOCK).to(tl.int64) * 128
    for i in range(0, CHB, BLOCK * 128):
        o = tl.minimum(i + r, n - 1)                    # lines past the chunk: its last byte
        _l2_prefetch(base + off + o)


def _span(t: torch.Tensor) -> int:
    """Bytes from t's first element to its last (any strides)."""
    return (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()


class L2Plan:
    """The chunks of `tensors` (any dtype and strides; None skipped), in the order given (the
    order the step reads them: programs start in order, so the first weights arrive first).
    experts=True: each tensor is an expert stack [E, ...] and a launch asks for the slices of
    the experts it is given (launch(idx))."""

    def __init__(self, tensors: list, ch: int = CH, experts: bool = False):
        ts = [t for t in tensors if t is not None and t.numel()]
        if not ts or len({t.device for t in ts}) != 1:
            raise ValueError("L2Plan: tensors on one device expected")
        self.base, self.experts = ts[0], experts
        self.n_experts = ts[0].shape[0] if experts else 1
        self.ids = None                     # the last launch's ids, kept alive (streams' rules)
        b0, rows = ts[0].data_ptr(), []
        for t in ts:
            nb, step = (_span(t[0]), t.stride(0) * t.element_size()) if experts else (_span(t), 0)
            rows += [(t.data_ptr() - b0 + s, min(ch, nb - s), step) for s in range(0, nb, ch)]
        self.tab = torch.tensor(rows, dtype=torch.int64, device=ts[0].device)   # [n, 3]
        self.bytes = sum(n for _, n, _ in rows)         # (an expert's, with experts)
        self.ch = ch
        self.refs = ts                                  # their addresses stay valid

    def launch(self, idx: torch.Tensor | None = None) -> None:
        """One launch on the current stream (CUDA): every chunk's lines asked into L2 (of each
        expert in idx, any shape of int ids, with experts=True)."""
        if self.experts != (idx is not None):
            raise ValueError("L2Plan.launch: expert ids go with (and only with) experts=True")
        n_idx = idx.numel() if idx is not None else 1
        self.ids = idx              # read on the side stream: alive until the next launch
        _prefetch_kernel[(self.tab.shape[0], n_idx)](
            self.base, self.tab, idx if idx is not None else self.tab, self.n_experts, CHB=self.ch,
            BLOCK=min(_BLOCK, triton.cdiv(self.ch, _LINE)), INDEXED=idx is not None,
            num_warps=4)
