"""Can one persistent launch run a chain of dependent decode GEMVs faster than a launch each?
(on the lent GPU; docs/PERFORMANCE.md "The TP-4 slice", the structural lever):

    python benchmarks/kernels/bench_persistent.py [--out persistent.json]

The chain: six dependent int8 GEMVs at a TP-4 rank's batch-1 shapes (wq_a|wkv 4096 -> 1536,
wq_b 1024 -> 8192, wo_a 8192 -> 2048, wo_b 2048 -> 4096, the shared expert's w1|w3 4096 -> 1024
and w2 512 -> 4096; each phase reads the first K outputs of the one before), y = (q·x)·s with a
per-row FP32 scale. Three ways, CUDA-graph timed, µs per chain:
  launched    one launch a phase (what the runtime does today)
  persistent  one launch of `grid` programs (at most the SMs, so all are resident); a grid-wide
              barrier between phases: bar.sync, one thread's release atomic on a counter, a spin
              on acquire reads until every program arrived (SM80 atomics only; no cooperative
              launch); the last program out resets the counters for the next replay
  +L2         persistent, and before each barrier every program asks for its next phase's weight
              rows with `prefetch.global.L2` (PTX ISA 2.0, SM80-safe), so the weights stream
              from DRAM while the slowest program finishes and the barrier resolves
Also the barrier alone: µs a phase of a persistent launch whose phases load 16 bytes and meet.
The kernel's math has a torch reference (tests/test_scripts.py runs it in the interpreter with
one program, where the barrier passes at once). Figures: docs/PERFORMANCE.md "The TP-4 slice"
("The persistent lever, measured"): a barrier costs about a launch; the persistent chain loses.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import copy_bandwidth, graph_us  # noqa: E402

# (N, K) of each phase: a TP-4 rank's batch-1 linears in the order a layer runs them
CHAIN = ((1536, 4096), (8192, 1024), (2048, 8192), (4096, 2048), (1024, 4096), (4096, 512))


@triton.jit
def _l2_prefetch(ptrs):
    """prefetch.global.L2 of each address (no result; kept by is_pure=False)."""
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                     dtype=tl.int32, is_pure=False, pack=1)


SPIN_MAX = tl.constexpr(1 << 20)     # a barrier gives up after this many polls (wrong output,
                                     # not a hung GPU, if the grid were ever not resident)


@triton.jit
def _grid_barrier(CNT, target):
    """Every program of the grid past this point once the counter reaches `target` (programs
    are all resident: the grid is at most what the SMs hold at once)."""
    tl.debug_barrier()                                      # this program's stores are done
    tl.atomic_add(CNT, 1, sem="release", scope="gpu")
    polls = 0
    while (tl.atomic_add(CNT, 0, sem="acquire", scope="gpu") < target) & (polls < SPIN_MAX):
        polls += 1
    tl.debug_barrier()


@triton.jit
def _grid_done(CNT):
    """CNT[1] counts the programs that finished; the last resets both counters for the next
    launch (every program is then past every barrier)."""
    if tl.atomic_add(CNT + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.atomic_xchg(CNT, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(CNT + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _chain_kernel(W, S, ACT, TAB, CNT, p_lo, p_hi, BN: tl.constexpr, BK: tl.constexpr,
                  PERSIST: tl.constexpr, L2: tl.constexpr):
    """Phases [p_lo, p_hi): TAB int64 [P, 6] = (weight offset, N, K, x offset, y offset, scale
    offset); y[n] = s[n]·Σ_k q[n, k]·x[k] (FP32, bf16 out) over row blocks pid, pid + grid, ...
    PERSIST: a grid barrier between phases (CNT[0]; CNT[1] counts the programs that finished,
    the last resets both)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    for p in range(p_lo, p_hi):
        w_off = tl.load(TAB + p * 6)
        N = tl.load(TAB + p * 6 + 1)
        K = tl.load(TAB + p * 6 + 2)
        x_off = tl.load(TAB + p * 6 + 3)
        y_off = tl.load(TAB + p * 6 + 4)
        s_off = tl.load(TAB + p * 6 + 5)
        for blk in range(pid, tl.cdiv(N, BN), nprog):
            rows = blk * BN + rn
            ok = rows < N
            acc = tl.zeros((BN, BK), dtype=tl.float32)
            for k0 in range(0, K, BK):
                q = tl.load(W + w_off + rows[:, None] * K + k0 + rk[None, :], mask=ok[:, None],
                            other=0)
                x = tl.load(ACT + x_off + k0 + rk, cache_modifier=".cg").to(tl.float32)
                acc += q.to(tl.float32) * x[None, :]
            s = tl.load(S + s_off + rows, mask=ok, other=0.0)
            tl.store(ACT + y_off + rows, (tl.sum(acc, axis=1) * s).to(tl.bfloat16), mask=ok)
        if PERSIST:
            if p + 1 < p_hi:
                if L2:                                  # this program's rows of the next phase
                    w2 = tl.load(TAB + p * 6 + 6)
                    n2 = tl.load(TAB + p * 6 + 7)
                    k2 = tl.load(TAB + p * 6 + 8)
                    for blk in range(pid, tl.cdiv(n2, BN), nprog):
                        rows = blk * BN + rn
                        for k0 in range(0, k2, BK):     # one address per 128-byte line
                            rl = tl.arange(0, BK // 128) * 128
                            _l2_prefetch(W + w2 + rows[:, None] * k2 + k0 + rl[None, :])
                _grid_barrier(CNT, (p + 1 - p_lo) * nprog)
    if PERSIST:
        _grid_done(CNT)


@triton.jit
def _meet_kernel(Y, CNT, n_phase):
    """n_phase grid barriers, a 16-byte store before each (the barrier alone)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    r = tl.arange(0, 4)
    for ph in range(n_phase):
        tl.store(Y + pid * 4 + r, r + ph)
        _grid_barrier(CNT, (ph + 1) * nprog)
    _grid_done(CNT)


class Chain:
    """The chain's weights, scales and activations on `device`, and its three ways of running."""

    def __init__(self, chain=CHAIN, device="cuda", seed=0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.chain = chain
        self.w = [torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8) for n, k in chain]
        self.s = [torch.rand(n, generator=g) / (8 * k ** 0.5) for n, k in chain]
        rows, w_off, s_off, x_off, y_off = [], 0, 0, 0, chain[0][1]
        for n, k in chain:                  # phase i reads the first K of phase i-1's output
            rows.append((w_off, n, k, x_off, y_off, s_off))
            w_off, s_off, x_off, y_off = w_off + n * k, s_off + n, y_off, y_off + n
        a_off = y_off
        self.tab = torch.tensor(rows + [(0,) * 6], dtype=torch.int64, device=device)
        self.W = torch.cat([w.flatten() for w in self.w]).to(device)
        self.S = torch.cat(self.s).to(device)
        self.act = torch.zeros(a_off, dtype=torch.bfloat16, device=device)
        self.act[:chain[0][1]] = torch.randn(chain[0][1], generator=g).bfloat16().to(device)
        self.cnt = torch.zeros(2, dtype=torch.int32, device=device)
        self.rows = rows

    def out(self, i: int) -> torch.Tensor:
        return self.act[self.rows[i][4]:self.rows[i][4] + self.chain[i][0]]

    def reference(self, outs: list) -> list:
        """Each phase by torch (FP32 math, bf16 out) from the input the kernel gave it (phase
        0's input, then `outs[i - 1]`): a one-ulp difference would otherwise grow down the
        chain."""
        xs = [self.act[:self.chain[0][1]].cpu()] + list(outs[:-1])
        return [((w.float() * x.float()[:k]).sum(1) * s).bfloat16()
                for (n, k), w, s, x in zip(self.chain, self.w, self.s, xs)]

    def launched(self, bn=8, bk=512, warps=4):
        for p, (n, _) in enumerate(self.chain):
            _chain_kernel[(triton.cdiv(n, bn),)](
                self.W, self.S, self.act, self.tab, self.cnt, p, p + 1, BN=bn, BK=bk,
                PERSIST=False, L2=False, num_warps=warps)

    def persistent(self, grid, bn=8, bk=512, warps=4, l2=False):
        return _chain_kernel[(grid,)](self.W, self.S, self.act, self.tab, self.cnt, 0,
                                      len(self.chain), BN=bn, BK=bk, PERSIST=True, L2=l2,
                                      num_warps=warps)

    def outputs(self, fn) -> list:
        """Each phase's output after fn() ran the chain from cleared outputs."""
        self.act[self.chain[0][1]:] = 0
        fn()
        return [self.out(i).cpu() for i in range(len(self.chain))]


def resident(kernel, warps: int) -> int:
    """Programs of a compiled kernel one SM holds at once (registers, warps, shared memory)."""
    pr = torch.cuda.get_device_properties(0)
    regs = getattr(pr, "regs_per_multiprocessor", 65536)
    by_regs = regs // max(1, kernel.n_regs * 32 * warps)
    by_warps = pr.max_threads_per_multi_processor // (32 * warps)
    smem = kernel.metadata.shared
    by_smem = getattr(pr, "shared_memory_per_multiprocessor", 167936) // smem if smem else 64
    return min(by_regs, by_warps, by_smem)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_persistent.json")
    a = ap.parse_args()
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    c = Chain()
    byts = sum(n * k + 4 * n for n, k in CHAIN)
    res = dict(device=torch.cuda.get_device_name(), copy_TBps=bw / 1e12, sms=sms,
               chain_bytes=byts, bytes_us=byts / bw * 1e6, rows={})
    print(f"device {res['device']}  {sms} SMs  copy {bw / 1e12:.2f} TB/s  chain of {len(CHAIN)}:"
          f" {byts / 1e6:.1f} MB = {byts / bw * 1e6:.2f} us at copy bandwidth", flush=True)
    y = torch.zeros(sms * 4, dtype=torch.int32, device="cuda")
    for n_phase in (1, 6, 24):
        us = graph_us([lambda: _meet_kernel[(sms,)](y, c.cnt, n_phase, num_warps=4)])
        res["rows"][f"meet, {n_phase} phases"] = us
        print(f"meet   {n_phase:3d} grid barriers: {us:7.2f} us ({us / n_phase:.2f} a barrier)",
              flush=True)
    for bn, bk, warps in ((8, 512, 4), (4, 1024, 4), (8, 1024, 8), (16, 512, 8)):
        tag = f"BN {bn:2d} BK {bk:4d} w{warps}"
        base = c.outputs(lambda: c.launched(bn, bk, warps))
        ref = c.reference(base)
        err = max(((o.float() - r.float()).abs().max() / r.float().abs().max()).item()
                  for o, r in zip(base, ref))
        rows = {"launched": lambda: c.launched(bn, bk, warps)}
        fits = resident(c.persistent(1, bn, bk, warps), warps)   # one program: no wait
        for mult in (1, 2):
            if mult > fits:
                print(f"chain  {tag} persistent {mult}/SM: {fits} a SM resident, skipped")
                continue
            for l2 in (False, True):
                rows[f"persistent {mult}/SM" + (" +L2" if l2 else "")] = \
                    lambda m=mult, l2=l2: c.persistent(m * sms, bn, bk, warps, l2)
        for name, fn in rows.items():
            try:
                same = all(torch.equal(o, b) for o, b in zip(c.outputs(fn), base))
                us = graph_us([fn])
            except Exception as e:                          # e.g. the L2 prefetch's asm
                print(f"chain  {tag} {name:22s} failed: {type(e).__name__}: {e}", flush=True)
                continue
            res["rows"][f"{tag} {name}"] = dict(us=us, same_as_launched=same, rel_err=err)
            print(f"chain  {tag} {name:22s} {us:7.2f} us  {byts / bw * 1e6 / us:6.1%} of copy "
                  f"bandwidth  bits = launched: {same}  (launched vs torch {err:.1e})",
                  flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
