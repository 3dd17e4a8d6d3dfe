"""Converter throughput and peak memory on a multi-GB synthetic checkpoint (a benchmark, not a test).

    python scripts/bench_convert.py [--workdir DIR] [--dst-dir DIR] [--experts 256] [--hidden 1024]
                                    [--tp 4] [--scheme int8|mx4] [--repeat N] [--keep]

Writes a checkpoint in the original format (valid random bytes; dims chosen so it is a few GB),
then measures, with the page cache dropped for those files before each step (posix_fadvise):
  1. raw read speed of the same files (16 MiB reads, nothing else),
  2. raw durable write speed where DST goes (1 GiB in 16 MiB writes, then fsync),
  3. `backfit convert` in a subprocess: wall time, GB/s of source bytes, CPU seconds, peak RSS.
--repeat N does 1 and 3 N times (each with its own load average) and prints the best ratio
convert / raw read of one round. The converter writes ~2x the bytes it reads with --scheme int8
(MXFP4 -> INT8) and ~1x with mx4 (the bytes kept), so its ceiling is min(read, write/2);
--dst-dir /dev/shm takes the output disk out of the measurement. The load average is printed
because the machine may be shared. Peak RSS must not grow with checkpoint size: run with two
sizes (--experts 64 / 256) to see it. PYTHONPATH picks the converter measured (an older
commit's tree, for a before/after).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path


def drop_cache(root: Path) -> None:
    for f in root.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw_read(root: Path) -> tuple[int, float]:
    buf, total, t = bytearray(1 << 24), 0, time.perf_counter()
    for f in sorted(root.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return total, time.perf_counter() - t


def raw_write(root: Path, nbytes: int = 1 << 30) -> float:
    path, buf = root / "bench-write.tmp", os.urandom(1 << 24)
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as fh:
        for _ in range(nbytes // len(buf)):
            fh.write(buf)
        os.fsync(fh.fileno())
    secs = time.perf_counter() - t
    path.unlink()
    return nbytes / 1e9 / secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/backfit-bench")
    ap.add_argument("--dst-dir", default=None, help="where DST is written (default: --workdir)")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--scheme", choices=["int8", "mx4"], default="int8",
                    help="the converter's --experts scheme")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of raw read + convert")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint between runs")
    a = ap.parse_args()
    from backfit.synthetic import write_checkpoint

    work = Path(a.workdir)
    src = work / f"src-e{a.experts}-h{a.hidden}"
    dst = Path(a.dst_dir or work) / "backfit-bench-dst"
    if not src.exists():
        t = time.perf_counter()
        write_checkpoint(src, "flash", seed=0, small_vocab=True, realistic=False,
                         hidden_size=a.hidden, n_routed_experts=a.experts, moe_intermediate_size=1024,
                         o_lora_rank=256, q_lora_rank=512)
        print(f"generated {src} in {time.perf_counter() - t:.0f} s")
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    dst.parent.mkdir(parents=True, exist_ok=True)
    print(f"raw write: {raw_write(dst.parent):.2f} GB/s durable (fsync) in {dst.parent}")
    ratios = []
    for _ in range(a.repeat):
        drop_cache(src)
        nbytes, secs = raw_read(src)
        read = nbytes / 1e9 / secs
        print(f"raw read : {nbytes / 1e9:.2f} GB in {secs:.1f} s = {read:.2f} GB/s")
        shutil.rmtree(dst, ignore_errors=True)
        shutil.rmtree(dst.with_name(dst.name + ".partial"), ignore_errors=True)
        drop_cache(src)
        load = os.getloadavg()[0]
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "backfit.cli", "convert", str(src), str(dst),
                        "--tp", str(a.tp), "--experts", a.scheme, "--quiet"], check=True,
                       stdout=subprocess.DEVNULL)
        secs = time.perf_counter() - t
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime
        out = sum(f.stat().st_size for f in dst.rglob("*.safetensors"))
        ratios.append(size / 1e9 / secs / read)
        print(f"convert  : {size / 1e9:.2f} GB in {secs:.1f} s = {size / 1e9 / secs:.2f} GB/s source "
              f"= {ratios[-1]:.0%} of raw read ({out / 1e9:.2f} GB written), CPU {cpu:.1f} s, "
              f"peak RSS {ru.ru_maxrss / 1024:.0f} MiB, tp={a.tp}, experts={a.scheme}, "
              f"cores={os.cpu_count()}, load average {load:.1f} -> {os.getloadavg()[0]:.1f}")
        shutil.rmtree(dst)
    if a.repeat > 1:
        print(f"best of {a.repeat}: {max(ratios):.0%} of raw read (all: "
              + ", ".join(f"{r:.0%}" for r in ratios) + ")")
    if not a.keep:
        shutil.rmtree(src)


if __name__ == "__main__":
    main()
