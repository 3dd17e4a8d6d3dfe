"""convert(src, dst): validate -> plan -> convert shards in parallel into DST.partial -> manifest
-> rename.

Shards are independent units (writer.py), so a pool of worker threads converts several at once:
the hot paths (reads, numpy gathers, torch ops, SHA-256, pwrite) all release the GIL. Each worker
holds one action at a time, so peak memory is about workers x the largest tensor, whatever the
checkpoint size, and the output of a shard does not depend on which worker made it or when.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import threading
from collections import defaultdict
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

from backfit.checkpoint import SafetensorsDir
from backfit.config import ModelConfig
from backfit.convert.manifest import finalize, print_summary
from backfit.convert.plan import Action, ConvertError, plan_conversion
from backfit.convert.writer import (JOURNAL, Cancelled, MemoryBudget, convert_shard, disk_error,
                                    load_journal, local_shape, working_set, write_json_atomic)
from backfit.formats import FORMAT_NAME, FORMAT_VERSION, rank_dir
from backfit.inventory import DTYPE_BYTES

__all__ = ["convert", "resolve_source"]

def resolve_source(src: str) -> Path:
    """A local directory, or a Hugging Face repo id already in the local cache (never downloads)."""
    p = Path(src).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise ConvertError(f"{src}: not a directory")
    if src.count("/") != 1 or src.startswith((".", "/", "~")):
        raise ConvertError(f"{src}: no such directory")
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(src, local_files_only=True))
    except Exception:
        raise ConvertError(f"{src}: not a directory and not in the local Hugging Face cache "
                           f"(fetch it first: hf download {src})") from None


def _options(cfg: ModelConfig, src: SafetensorsDir, tp: int, linears: str, experts: str) -> dict:
    from backfit import __version__
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "backfit": __version__,
            "tp": tp, "linears": linears,
            "experts": experts, "variant": cfg.variant,
            "source_sizes": {f: src.file_size(f) for f in sorted(src.files)}}


def _prepare_partial(partial: Path, options: dict, tp: int, out) -> None:
    """Resume only a DST.partial made with exactly these options; anything else starts over."""
    opt_file = partial / JOURNAL / "options.json"
    if partial.exists():
        try:
            old = json.loads(opt_file.read_text()) if opt_file.exists() else None
        except ValueError:
            old = None
        if old == options:
            return                                               # resume
        diff = [f"{k} {old.get(k)!r} -> {v!r}" for k, v in options.items()
                if old is not None and old.get(k) != v and k != "source_sizes"]
        what = ("no journal" if old is None else
                "other options: " + ", ".join(diff) if diff else "other source file sizes")
        print(f"{partial}: left by a run with {what}; starting over", file=out)
        shutil.rmtree(partial)
    for r in range(tp):
        rank_dir(partial, r).mkdir(parents=True, exist_ok=True)
    (partial / JOURNAL).mkdir(parents=True, exist_ok=True)
    write_json_atomic(opt_file, options)


def _pool_map(fn, items: list, workers: int, stop: threading.Event) -> list:
    """fn over items on `workers` threads, results in order; the first error stops the rest
    (they raise Cancelled between actions) and is raised once all have returned."""
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(workers, thread_name_prefix="convert") as pool:
        futs = [pool.submit(fn, x) for x in items]
        try:
            done, _ = wait(futs, return_when=FIRST_EXCEPTION)
        except BaseException:                                    # Ctrl-C in the main thread
            stop.set()
            for f in futs:
                f.cancel()
            raise
        if any(f.exception() for f in done):
            stop.set()
            for f in futs:
                f.cancel()                                       # not started: never starts
            wait(futs)
            futs = [f for f in futs if not f.cancelled()]
            errs = [f.exception() for f in futs if f.exception() is not None]
            raise next((e for e in errs if not isinstance(e, Cancelled)), errs[0])
        return [f.result() for f in futs]


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def torch_threads(n: int) -> int:
    """Set torch's intra-op threads, return the previous count."""
    import torch
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    return old


def _resume(partial: Path, source: SafetensorsDir, files: list[str], tp: int, workers: int,
            stop: threading.Event, out) -> dict[str, dict | None]:
    """Journal entry per shard, None for those to (re)do; done shards are re-checked (sizes and
    the source SHA-256 the journal recorded), in parallel."""
    journaled = [f for f in files if (partial / JOURNAL / f"{f}.json").exists()]
    checked = _pool_map(lambda f: load_journal(partial, f, tp, source.root / f), journaled,
                        workers, stop)
    journals: dict[str, dict | None] = dict.fromkeys(files)
    for f, j in zip(journaled, checked):
        if j is None:
            print(f"redoing {f}: its journal entry no longer matches the files (checksum or size)",
                  file=out)
        journals[f] = j
    n = sum(j is not None for j in journals.values())
    if n:
        print(f"resuming: {n} of {len(files)} shards already converted", file=out)
    return journals


def _check_disk(partial: Path, todo: dict[str, list[Action]], tp: int) -> None:
    need = sum(math.prod(local_shape(o, tp)) * DTYPE_BYTES[o.dtype] * tp
               for acts in todo.values() for a in acts for o in a.outputs)
    free = shutil.disk_usage(partial).free
    if need > free:
        raise ConvertError(f"{partial}: out of disk space: the conversion needs {need / 1e9:.2f} GB "
                           f"more, {free / 1e9:.2f} GB free")


def convert(src: str | Path, dst: str | Path, tp: int = 4, linears: str = "int8",
            experts: str = "int8", force: bool = False, progress: bool = True,
            out=sys.stdout, workers: int | None = None) -> dict:
    """Convert an original DeepSeek-V4 checkpoint into a backfit directory. Returns the manifest.

    workers: shards converted at once (default: every core, at most the number of shards).
    """
    if tp not in (1, 2, 4, 8):
        raise ConvertError(f"--tp {tp}: must be 1, 2, 4 or 8")
    src_path, dst = resolve_source(str(src)), Path(dst)
    if dst.exists() and not force:
        raise ConvertError(f"{dst}: already exists (pass --force to replace it)")
    cfg = ModelConfig.from_file(src_path / "config.json")
    source = SafetensorsDir(src_path)
    actions = plan_conversion(source.entries, cfg, tp, linears, experts)
    by_file: dict[str, list[Action]] = defaultdict(list)
    for a in actions:
        by_file[a.file.name].append(a)
    partial = dst.with_name(dst.name + ".partial")
    options = _options(cfg, source, tp, linears, experts)
    _prepare_partial(partial, options, tp, out)
    n_workers = max(1, min(workers or os.cpu_count() or 1, len(by_file)))
    # half the available memory, but at least the largest action: peak RSS is bounded by this
    # (plus the interpreter), not by the checkpoint size or the worker count
    budget = MemoryBudget(max(_available_memory() // 2, max(working_set(a) for a in actions)))
    stop = threading.Event()
    threads = torch_threads(1)                         # parallel over shards, not inside ops
    try:
        journals = _resume(partial, source, sorted(by_file), tp, n_workers, stop, out)
        todo = {f: by_file[f] for f, j in journals.items() if j is None}
        _check_disk(partial, todo, tp)
        total = sum(a.nbytes_in for a in actions)
        done = total - sum(a.nbytes_in for acts in todo.values() for a in acts)
        from tqdm import tqdm
        with tqdm(total=total, initial=done, unit="B", unit_scale=True, desc="convert",
                  disable=not progress, file=sys.stderr) as bar:
            lock = threading.Lock()

            def tick(nbytes: int) -> None:
                with lock:
                    bar.update(nbytes)

            # largest shards first: the pool then ends with small ones and stays busy
            order = sorted(todo, key=lambda f: -source.file_size(f))
            results = _pool_map(lambda f: convert_shard(source.root / f, todo[f], tp, partial,
                                                        on_progress=tick, stop=stop,
                                                        budget=budget),
                                order, n_workers, stop)
        journals.update(zip(order, results))
    finally:
        torch_threads(threads)
    try:
        manifest = finalize(partial, src_path, cfg, actions, journals, options, tp)
    except OSError as e:
        raise (disk_error(e, partial) or e) from None
    if dst.exists():                                           # --force: replace only now
        old = dst.with_name(dst.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(partial, dst)
        shutil.rmtree(old)
    else:
        os.replace(partial, dst)
    print_summary(manifest, out)
    return manifest
