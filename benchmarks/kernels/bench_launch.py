"""What a launch costs inside a CUDA graph, and how much of a TP-4 rank's largest decode kernels is
their bytes (on the lent GPU; docs/PERFORMANCE.md "The TP-4 slice"):

    python benchmarks/kernels/bench_launch.py [--out launch.json]

  chains   100 launches in one graph, one stream, µs a launch: an empty kernel (1 program; 528
           programs of 4 warps) and a kernel whose programs each load 16 bytes from DRAM and
           store them (one dependent round trip a launch, the floor of any kernel that reads
           what the launch before it wrote)
  cold/hot a TP-4 rank's batch-1 kernels graph-timed over 16 calls: cold = other weights each
           call (16 copies or 16 routings: the weights stream from HBM), hot = the same weights
           each call (they stay in L2): the mx4 and int8 routed gate/up (6 experts x 2 x 512 x
           4096), the int8 `wq_b` GEMV (8192 x 1024). Hot close to cold: the kernel is bound
           by its instructions or latency, not by its bytes.
Figures: docs/PERFORMANCE.md "The TP-4 slice" ("The persistent lever, measured").
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
from bench_gemv import make_weights  # noqa: E402  (random int8_g128 weights)
from bench_kernels import mx4_stack, mx_stack  # noqa: E402  (random expert stacks)
from harness import copy_bandwidth, graph_us  # noqa: E402

from backfit.runtime.kernels.linear import gemv  # noqa: E402
from backfit.runtime.kernels.moe import common, int8 as moe_int8, mx4 as moe_mx4  # noqa: E402

DEV = "cuda"
N_CHAIN = 100


@triton.jit
def _empty_kernel(X, flag):
    if flag != 0:                                   # never taken: the launch alone
        tl.store(X + tl.program_id(0), 0)


@triton.jit
def _touch_kernel(X, Y, off, stride):
    """Program p: 16 bytes from X[off + p·stride] (DRAM: a new region each launch) to Y[p]."""
    p = tl.program_id(0)
    r = tl.arange(0, 4)
    v = tl.load(X + off + p.to(tl.int64) * stride + r)
    tl.store(Y + p * 4 + r, v)


def chains() -> dict:
    """µs a launch of 100-launch chains in one graph."""
    out = {}
    y = torch.zeros(528 * 4, dtype=torch.int32, device=DEV)
    big = torch.zeros(1 << 29, dtype=torch.int32, device=DEV)       # 2 GiB: no L2 reuse
    stride = 1024                                                   # 4 KB between programs
    span = 528 * stride
    for name, fn in (
            ("empty, 1 program of 1 warp", lambda i: _empty_kernel[(1,)](y, 0, num_warps=1)),
            ("empty, 528 programs of 4 warps",
             lambda i: _empty_kernel[(528,)](y, 0, num_warps=4)),
            ("one DRAM round trip, 528 programs of 4 warps",
             lambda i: _touch_kernel[(528,)](big, y, (i * span) % (big.numel() - span), stride,
                                             num_warps=4))):
        us = graph_us([lambda i=i, fn=fn: fn(i) for i in range(N_CHAIN)])
        out[name] = us
        print(f"chain  {name:48s} {us:6.2f} us a launch", flush=True)
    return out


def gate_up(scheme: str, cold: bool, E: int = 256, D: int = 4096, I: int = 512,
            k: int = 6) -> tuple[float, float]:
    """(µs a call, weight bytes a call) of the routed gate/up launch at batch 1."""
    mod = moe_mx4 if scheme == "mx4" else moe_int8
    kern = moe_mx4._GEMV4 if scheme == "mx4" else moe_int8._GEMV
    w1, s1 = (mx4_stack if scheme == "mx4" else mx_stack)(E, I, D)
    w3, s3 = (mx4_stack if scheme == "mx4" else mx_stack)(E, I, D)
    cfg = mod.decode_config(D, k, I=I)
    calls = []
    for r in range(16):
        g = torch.Generator(device="cpu").manual_seed(r if cold else 0)
        ids = torch.randperm(E, generator=g)[:k].to(DEV, torch.int32)
        x = torch.randn(1, D, device=DEV).bfloat16()
        rw = torch.rand(k, device=DEV)
        h = torch.empty(k, I, device=DEV, dtype=torch.bfloat16)
        calls.append(lambda x=x, ids=ids, rw=rw, h=h: common.launch_decode(
            kern, k, I, D, cfg, (x, ids, rw, w1, s1, w3, s3, h, I, D, k), GATED=True,
            LIMIT=10.0))
    per_expert = 2 * I * D * ((0.5 if scheme == "mx4" else 1) + 1 / 32)
    return graph_us(calls), k * per_expert


def wq_b(cold: bool, N: int = 8192, K: int = 1024) -> tuple[float, float]:
    """(µs a call, weight bytes) of a TP-4 rank's int8 wq_b GEMV at M = 1."""
    ws = make_weights(N, K, "int8", 16 if cold else 1)
    x = torch.randn(1, K, device=DEV).bfloat16()
    calls = [lambda w=w, s=s: gemv.gemv(x, w, s, "int8_g128", out_dtype=torch.bfloat16)
             for w, s in (ws * 16)[:16]]
    return graph_us(calls), N * K * (1 + 4 / 128)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_launch.json")
    a = ap.parse_args()
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy {bw / 1e12:.2f} TB/s", flush=True)
    res = dict(device=torch.cuda.get_device_name(), copy_TBps=bw / 1e12, chains=chains(),
               kernels={})
    for name, fn in (("mx4 gate/up", lambda c: gate_up("mx4", c)),
                     ("int8 gate/up", lambda c: gate_up("int8", c)),
                     ("int8 wq_b GEMV", wq_b)):
        (cold, byts), (hot, _) = fn(True), fn(False)
        res["kernels"][name] = dict(cold_us=cold, hot_us=hot, bytes=byts,
                                    bytes_us=byts / bw * 1e6)
        print(f"kernel {name:16s} cold {cold:6.2f} us  hot (L2) {hot:6.2f} us  its bytes at "
              f"copy bandwidth {byts / bw * 1e6:5.2f} us", flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
