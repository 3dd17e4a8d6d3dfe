"""Where a step's time goes, on the lent GPU (4 real DeepSeek-V4-Flash layers, triton kernels):

    python3 scripts/profile_step.py [--trace] [--host] [--prefill N[,N..] [--syncs]
                                    [--prefill-graphs]
                                    [--launches K,..]]
                                    [--python DIR] [--experts int8|mx4|both] [--layers 4]
                                    [--tp-shard 1] [--spec dspark:5] [--out file.txt]

  --trace    the ordered kernel list of one batch-1 CUDA-graph replay: start, gap to the previous
             kernel and duration in µs (torch.profiler), with the kernel count and GPU busy time
  --host     the host part of a batch-1 and a batch-8 graph step, piece by piece (padding into
             the pinned staging rows, the one input copy, replay(), the logits clone), each with
             its sync, against the replay's GPU time (CUDA events)
  --prefill  the top kernels of one N-token prefill (eager; with --prefill-graphs eager, then
             through the piecewise prefill graphs), its wall time against the GPU's
             busy time, and (--syncs) every host sync it makes (torch.cuda sync debug mode),
             counted by the backfit source line that made it; --launches rope,prefill: each
             launch of the kernels so named, in order, with its duration
  --python   the host's Python in eager forwards (decode batch 1 and 8, a 128-token prefill
             chunk): the unprofiled wall time, Python calls a forward, the top functions by own
             and by cumulative time (cProfile), and DIR/<case>.prof (pstats) to read elsewhere
  --experts  the routed-expert scheme(s) traced (mx4: built as mx4_e2m1, the INT8 slice fills an
             80 GB card; both: the int8 run, then bench_model.to_mx4's re-layout of the same
             values in the same process); default int8
  --spec     METHOD:K (mtp or dspark): instead of the above, the batch-1 speculative step
             (runtime/graphs/spec.py: draft + verify of 1 + K rows, one replay) against the plain
             decode graph of the same model, each traced as --trace does, then both side by side
             by kernel and by room of backfit.runtime.kernels (cuBLAS, copies, elementwise:
             torch): launches and µs
  --layers / --tp-shard  layers 0..N-1 of the real schedule as TP rank 0 of K, collectives
             counted no-ops (bench_decode.py's; e.g. --tp-shard 4: the shapes one TP4 rank runs)
Built like scripts/bench_decode.py (random converted weights, random paged pools).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model as bd  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from backfit.runtime.graphs.decode import pad_decode_inputs  # noqa: E402


def cuda_events(fn, n: int):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return sorted((e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)


def listed(ev, log) -> dict[str, list]:
    """Log each kernel of ev in order (start, gap to the previous one's end, duration, µs) ->
    {name (60 chars): [launches, µs of GPU time]}."""
    t0 = prev = ev[0].time_range.start
    tot: dict[str, list] = {}
    for e in ev:
        s = e.time_range.start
        log(f"{s - t0:9.1f} gap {s - prev:6.1f} dur {e.time_range.end - s:7.1f}  {e.name[:100]}")
        prev = e.time_range.end
        t = tot.setdefault(e.name[:60], [0, 0.0])
        t[0], t[1] = t[0] + 1, t[1] + e.device_time
    return tot


def trace(r, log, ctx: int = 512) -> None:
    st = bd.step_input(r, 1, ctx)
    ev = cuda_events(lambda: r.forward(st), 1)
    t0 = ev[0].time_range.start
    # the span from the first kernel after the input copy: the copy is followed by a host gap
    # (0.6 ms in 2026-12-02) before replay() is reached, which is not the graph's time
    k1 = next((e.time_range.start for e in ev[1:] if "Memcpy" not in e.name), t0)
    log(f"batch-1 graph step at context {ctx}: {len(ev)} kernels, "
        f"busy {sum(e.device_time for e in ev) / 1e3:.3f} ms, "
        f"span {(ev[-1].time_range.end - t0) / 1e3:.3f} ms "
        f"({(ev[-1].time_range.end - k1) / 1e3:.3f} ms from the first kernel)")
    tot = listed(ev, log)
    log("by kernel (launches, us):")
    for k, (n, us) in sorted(tot.items(), key=lambda kv: -kv[1][1]):
        log(f"  {us:8.1f} {n:4d}x  {k}")


def kernel_rooms() -> dict[str, str]:
    """Triton kernel name -> its room of backfit.runtime.kernels (moe, attention, linear, mhc,
    cache, router, pointwise, rope_norm), from the modules' JIT functions; a name two rooms
    share maps to both ("a|b")."""
    import importlib
    import pkgutil

    import triton
    import backfit.runtime.kernels as kp
    rooms: dict[str, str] = {}
    for m in pkgutil.walk_packages(kp.__path__, kp.__name__ + "."):
        mod = importlib.import_module(m.name)
        room = m.name.split(".")[3]
        for k, v in vars(mod).items():
            if isinstance(v, triton.runtime.jit.KernelInterface) \
                    and getattr(v, "fn", v).__module__ == mod.__name__:   # JIT or interpreted
                old = rooms.get(k)
                rooms[k] = room if old in (None, room) else f"{old}|{room}"
    return rooms


def part_of(name: str, rooms: dict[str, str]) -> str:
    """A kernel's part of the step: its room, else "torch" (cuBLAS, copies, elementwise)."""
    return rooms.get(name.split("(")[0].strip(), "torch")


def spec_trace(a, log) -> None:
    """--spec: the batch-1 speculative step's kernels against the plain step's (module doc)."""
    from bench_spec import captured

    from backfit.runtime.drafting import Drafting
    method, k = a.spec.split(":")
    k = int(k)
    raw = bd.raw_config(a.layers, False, "flash" if method == "mtp" else "0731")
    r = bd.rank_runner(raw, "cuda", 1, a.ctx + 16, tp_shard=a.tp_shard, mtp=True,
                       experts="mx4" if a.experts == "mx4" else "int8")
    bd.use_backend(r, "triton")
    nblk = -(-r.rc.max_model_len // r.block_size)
    st = bd.step_input(r, 1, a.ctx)
    seqs = [(s.tokens[0], s.start, s.slot, s.block_table) for s in st.seqs]
    r.drafting = Drafting(r.model, r.cache, r.num_slots, k)
    g, sg = captured(r, [1], nblk)
    g.run(seqs)
    sg.run(seqs, [0.0], 0)
    tables = {}
    for name, fn in (("plain", g.graphs[1][0].replay), (f"{method} k {k}", sg.graphs[1][0].replay)):
        ev = cuda_events(fn, 1)
        span = (ev[-1].time_range.end - ev[0].time_range.start) / 1e3
        log(f"== {name}: {len(ev)} kernels, busy {sum(e.device_time for e in ev) / 1e3:.3f} ms, "
            f"span {span:.3f} ms, median replay {bd.median_ms(fn, 50, True):.3f} ms")
        tables[name] = listed(ev, log)
    (pn, pt), (sn, stot) = tables.items()
    log(f"by kernel: launches and µs, {pn} | {sn} (sorted by the difference)")
    keys = sorted(set(pt) | set(stot), key=lambda n: -(stot.get(n, [0, 0])[1] - pt.get(n, [0, 0])[1]))
    for n in keys:
        (c0, u0), (c1, u1) = pt.get(n, [0, 0.0]), stot.get(n, [0, 0.0])
        log(f"  {c0:5d} {u0:9.1f} | {c1:5d} {u1:9.1f}  {u1 - u0:+9.1f}  {n}")
    rooms = kernel_rooms()

    def by_room(tot: dict) -> dict[str, list]:          # {room: [launches, µs]}
        out: dict[str, list] = {}
        for n, (c, u) in tot.items():
            acc = out.setdefault(part_of(n, rooms), [0, 0.0])
            acc[0], acc[1] = acc[0] + c, acc[1] + u
        return out
    p_room, s_room = by_room(pt), by_room(stot)
    log(f"by room of backfit.runtime.kernels: launches and µs, {pn} | {sn}")
    for part in sorted(set(p_room) | set(s_room)):
        (c0, u0), (c1, u1) = p_room.get(part, [0, 0.0]), s_room.get(part, [0, 0.0])
        log(f"  {part:10s} {c0:5d} {u0:9.1f} | {c1:5d} {u1:9.1f}  x{u1 / max(u0, 1e-9):5.2f}")


def host(r, log) -> None:
    G = r.graphs

    def med(f, n=200):
        ts = []
        for _ in range(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            f()
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t) * 1e6)
        return statistics.median(ts)
    for B in (1, 8):
        st = bd.step_input(r, B, 512)
        seqs = [(s.tokens[0], s.start, s.slot, s.block_table) for s in st.seqs]
        Bg = G.size_for(B)
        g, out = G.graphs[Bg]
        pad = (G.nblk, r.cache.scratch_slot, r.cache.scratch_block, G.rows[:Bg])
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        gpu = []
        for _ in range(50):
            e0.record()
            g.replay()
            e1.record()
            torch.cuda.synchronize()
            gpu.append(e0.elapsed_time(e1) * 1e3)
        def cpu_only(f, n=200):                  # the call's own host time, GPU idle first
            ts = []
            for _ in range(n):
                torch.cuda.synchronize()
                t = time.perf_counter()
                f()
                ts.append((time.perf_counter() - t) * 1e6)
            torch.cuda.synchronize()
            return statistics.median(ts)

        def per_call(f, k=16):                   # k calls queued back to back, one sync
            return med(lambda: [f() for _ in range(k)], 25) / k
        res = {"forward + sync": med(lambda: r.forward(st)),
               "forward, host part only": cpu_only(lambda: r.forward(st)),
               "forward x16 queued, per step": per_call(lambda: r.forward(st)),
               "replay + sync": med(g.replay),
               "replay call only (host)": cpu_only(g.replay),
               "replay x16 queued, per replay": per_call(g.replay),
               "replay GPU time (events)": statistics.median(gpu),
               "pad into the pinned rows": med(lambda: pad_decode_inputs(seqs, Bg, *pad)),
               "the one input copy + sync": med(
                   lambda: G.stage[:Bg].copy_(G.host[:Bg], non_blocking=True)),
               "logits clone + sync": med(lambda: out[:B].clone())}
        log(f"batch {B} (graph {Bg}):")
        for k, v in res.items():
            log(f"  {k:28s} {v:9.1f} us")


def sync_sites(fn) -> list[tuple[str, int]]:
    """fn() under torch.cuda's sync debug mode: each synchronizing call's innermost backfit
    frames (file:line function) -> [(site, count)], most frequent first."""
    import traceback
    import warnings
    sites: dict[str, int] = {}

    def show(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing" not in str(message):   # e.g. the mode's prototype notice
            return
        fr = [f for f in traceback.extract_stack()[:-1] if "/backfit/" in f.filename]
        key = " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in fr[::-1][:3])
        key = key or f"{filename}:{lineno}"
        sites[key] = sites.get(key, 0) + 1
    torch.cuda.synchronize()
    with warnings.catch_warnings():             # restores showwarning and the filters
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sorted(sites.items(), key=lambda kv: -kv[1])


def prefill(r, n: int, log, syncs: bool = False, launches: str = "") -> None:
    st = bd.step_input(r, 1, 0, n=n)
    ev = cuda_events(lambda: r.forward(st), 2)
    tot, cnt = {}, {}
    for e in ev:
        tot[e.name] = tot.get(e.name, 0) + e.device_time / 2 / 1e3
        cnt[e.name] = cnt.get(e.name, 0) + 0.5
    walls = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        r.forward(st)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t) * 1e3)
    log(f"prefill {n}: {len(ev) / 2:.0f} kernels, GPU busy {sum(tot.values()):.2f} ms, "
        f"wall {statistics.median(walls):.2f} ms (median of 3)")
    first = ev[:len(ev) // 2]                         # the first of the two profiled runs
    gaps, end = [], first[0].time_range.end if first else 0
    for prev, e in zip(first, first[1:]):
        end = max(end, prev.time_range.end)
        gaps.append((e.time_range.start - end, prev.name[:50], e.name[:50]))
    log(f"  GPU idle between kernels {sum(g for g, *_ in gaps if g > 0) / 1e3:.2f} ms; largest:")
    for g, a, b in sorted(gaps, reverse=True)[:12]:
        log(f"  idle {g:8.1f} us  after {a}  before {b}")
    if syncs:
        for site, k in sync_sites(lambda: r.forward(st)):
            log(f"  sync {k:4d}x  {site}")
    for k, v in sorted(tot.items(), key=lambda kv: -kv[1])[:25]:
        log(f"  {v:8.3f} ms {cnt[k]:6.0f}x  {k[:100]}")
    if launches:                                      # each launch of the named kernels, in order
        log(f"  launches of kernels matching {launches!r} (first run, in order):")
        for e in first:
            if any(x in e.name for x in launches.split(",")):
                log(f"  {e.time_range.start - first[0].time_range.start:10.1f} us  dur "
                    f"{e.time_range.end - e.time_range.start:8.1f}  {e.name[:80]}")


def python_host(r, out_dir: str, log) -> None:
    import cProfile
    import io
    import pstats
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    graphs, r.graphs = r.graphs, None                  # every case eager
    for name, st in (("decode1", bd.step_input(r, 1, 256)), ("decode8", bd.step_input(r, 8, 256)),
                     ("prefill128", bd.step_input(r, 1, 0, n=128))):
        for _ in range(3):                             # warm-up: compiles
            r.forward(st)
        torch.cuda.synchronize()
        walls = []
        for _ in range(10):
            t = time.perf_counter()
            r.forward(st)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t) * 1e3)
        k = 5
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(k):
            r.forward(st)
        torch.cuda.synchronize()
        prof.disable()
        prof.dump_stats(str(Path(out_dir) / f"{name}.prof"))
        ps = pstats.Stats(prof)
        log(f"== {name}: eager forward {statistics.median(walls):.2f} ms (median of 10, "
            f"unprofiled); {ps.total_calls / k:.0f} Python calls a forward, "
            f"{ps.total_tt / k * 1e3:.2f} ms a forward under the profiler")
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(30)
            log(f"-- by {key}\n" + buf.getvalue().split("\n", 6)[-1])
    r.graphs = graphs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--host", action="store_true")
    ap.add_argument("--prefill", default="", metavar="N[,N..]",
                    help="prefill chunk(s) of N tokens, each profiled")
    ap.add_argument("--syncs", action="store_true", help="--prefill: list its host syncs")
    ap.add_argument("--prefill-graphs", action="store_true",
                    help="--prefill: each chunk eager, then through the piecewise prefill graphs")
    ap.add_argument("--launches", default="", metavar="NAMES",
                    help="--prefill: every launch of kernels whose name holds one of these "
                         "(comma-separated), in order, with its duration")
    ap.add_argument("--python", default=None, metavar="DIR",
                    help="cProfile of eager forwards; pstats files into DIR")
    ap.add_argument("--experts", choices=("int8", "mx4", "both"), default="int8")
    ap.add_argument("--ctx", type=int, default=512, help="--trace: the step's context length")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tp-shard", type=int, default=1)
    ap.add_argument("--spec", default="", metavar="METHOD:K",
                    help="the batch-1 speculative step (mtp or dspark, K drafts) against plain")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lines = []

    def log(m):
        print(m, flush=True)
        lines.append(m)
    if a.spec:
        spec_trace(a, log)
        if a.out:
            Path(a.out).write_text("\n".join(lines) + "\n")
        return
    raw = bd.raw_config(a.layers, False)
    chunks = [int(n) for n in a.prefill.split(",") if n]
    r = bd.rank_runner(raw, "cuda", 8, max(8184, a.ctx), max(chunks, default=0), a.tp_shard,
                       experts="mx4" if a.experts == "mx4" else "int8")   # mx4 built as such
    bd.use_backend(r, "triton")
    pieces = None
    if a.prefill_graphs and chunks:
        from backfit.runtime.graphs import PrefillGraphs
        pieces = PrefillGraphs(r.model, max(chunks), r.device)
        pieces.capture(log)
        log(f"prefill graphs check: {pieces.check() or 'passed'}")
    for n in chunks:
        for pg in (None, pieces) if pieces is not None else (None,):
            r.prefill_graphs = pg
            if pieces is not None:
                log(f"-- {'prefill graphs' if pg else 'eager'}")
            prefill(r, n, log, a.syncs, a.launches)
    r.prefill_graphs = None
    if a.python:
        python_host(r, a.python, log)
    for scheme in ("int8", "mx4") if a.experts == "both" else (a.experts,):
        if scheme == "mx4" and a.experts == "both":
            r.graphs = None
            log(f"experts -> mx4_e2m1: {bd.to_mx4(r)}")
        if a.trace or a.host:
            log(f"== experts {scheme}")
            r.graphs = bd.capture_graphs(r)
            if a.trace:
                trace(r, log, a.ctx)
            if a.host:
                host(r, log)
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
