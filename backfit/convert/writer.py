"""Write one source shard's conversion for every rank, atomically, and journal it for resume.

Unit of work = one source shard file (run.py converts several at once, one per worker thread).
Its tp output files are written as `*.tmp` (header laid out first, tensors pwritten as they are
produced, one action in memory at a time), fsynced, renamed, and only then is the shard's
journal entry written. A killed run leaves at most `.tmp` files, which the next run overwrites.
The source is read once, in file order, and hashed (SHA-256) as it is read.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import threading
from pathlib import Path

import numpy as np
import torch

from backfit.checkpoint import TORCH_DTYPE, CheckpointError, ShardWriter, TensorEntry
from backfit.convert.plan import Action, ConvertError, Output
from backfit.convert.transforms import ExpertTable, apply
from backfit.formats import rank_dir
from backfit.inventory import DTYPE_BYTES

__all__ = ["local_shape", "convert_shard", "JOURNAL", "load_journal", "write_json_atomic",
           "disk_error", "Cancelled", "source_sha256", "MemoryBudget", "working_set"]

JOURNAL = ".journal"
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class Cancelled(Exception):
    """Another shard failed; this one stopped between two actions (its .tmp files stay)."""


# Peak bytes one worker holds per source byte of an action (from the transforms' temporaries):
# FP8 dequant keeps an int64 index, float32 values, scales and the INT8 re-quantization alive
# (~32 B per e4m3 byte); MXFP4 -> INT8 the packed bytes, two int8 outputs and the check (~6 B);
# MXFP4 -> BF16 ~24 B per packed byte; MXFP4 -> mx4 the packed bytes and a dim-1 split copy
# (~2 B); a copy the tensor and its chunked finiteness mask (~2 B).
_WORKING_SET = {"fp8_int8": 32, "fp8_bf16": 32, "fp4_int8": 6, "fp4_bf16": 24, "fp4_mx4": 2,
                "copy": 2}


def working_set(a: Action) -> int:
    """Estimated peak bytes held while `a` is converted."""
    return _WORKING_SET[a.kind] * a.sources[0].nbytes + sum(e.nbytes for e in a.sources[1:])


class MemoryBudget:
    """Bytes the workers may hold at once: an action waits until its working set fits (or until
    it is alone, so one action larger than the budget still runs). Peak memory of the pool is
    then about the budget, whatever the number of workers or the size of the checkpoint."""

    def __init__(self, nbytes: int):
        self.total, self.used, self.cond = nbytes, 0, threading.Condition()

    def acquire(self, n: int, stop: threading.Event | None = None) -> None:
        with self.cond:
            while self.used and self.used + n > self.total:
                if stop is not None and stop.is_set():
                    raise Cancelled("memory budget")
                self.cond.wait(0.1)
            self.used += n

    def release(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()


def local_shape(o: Output, tp: int) -> tuple[int, ...]:
    if o.shard_dim is None:
        return o.shape
    s = list(o.shape)
    s[o.shard_dim] //= tp
    return tuple(s)


def write_json_atomic(path: Path, obj) -> None:
    """Compact, sorted keys, fsynced, renamed into place. json.dumps without indent runs the C
    encoder (json.dump and any indent run the pure-Python one: 10x slower on a manifest)."""
    tmp = path.with_name(path.name + ".tmp")
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    with open(tmp, "w") as f:
        f.write(text)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def disk_error(e: OSError, path: Path) -> ConvertError | None:
    if e.errno in _DISK_ERRNOS:
        return ConvertError(f"{path}: out of disk space ({os.strerror(e.errno)}); free space "
                            f"and re-run the same command to resume")
    return None


def source_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)                              # hashlib drops the GIL on big buffers
    return h.hexdigest()


def load_journal(partial: Path, fname: str, tp: int, src_file: Path | None = None) -> dict | None:
    """The journal entry of a finished shard, or None if the shard must be (re)done.

    The entry stands only if every rank file has the size it recorded and, when `src_file` is
    given, the source still has the SHA-256 it recorded (rehashed: resume reads done shards once).
    """
    path = partial / JOURNAL / f"{fname}.json"
    if not path.exists():
        return None
    try:
        entry = json.loads(path.read_text())
        sizes = entry["outputs"]
    except (ValueError, KeyError, TypeError):
        return None                                      # torn or from an older converter
    for r in range(tp):
        f = rank_dir(partial, r) / fname
        if not f.exists() or f.stat().st_size != sizes[r]:
            return None
    if src_file is not None and source_sha256(src_file) != entry["source"]["sha256"]:
        return None
    return entry


def _split(t: torch.Tensor, dim: int | None, tp: int) -> list[torch.Tensor]:
    """tp contiguous pieces. A dim-1 split of [N, K] is one [tp, N, K/tp] transposing copy, done
    by numpy (40x faster than torch's strided int8 copy on CPU); bf16 travels as int16 bits."""
    if dim is None or tp == 1:
        return [t] * tp
    if dim == 0:
        return list(t.chunk(tp, dim=0))
    n, k = t.shape
    bits = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    out = torch.from_numpy(np.ascontiguousarray(bits.numpy().reshape(n, tp, k // tp).transpose(1, 0, 2)))
    return list(out.view(t.dtype))


# Source readahead: the kernel is asked (POSIX_FADV_WILLNEED) for the next READAHEAD bytes of a
# shard while the worker converts what it has, so the disk streams during compute instead of
# each read waiting for it; bytes already converted are dropped from the page cache
# (POSIX_FADV_DONTNEED): the source is read once, and its pages are reused for the output.
READAHEAD = 64 << 20


class _SourceReader:
    """One source file, read tensor by tensor through one descriptor, hashed on the way.

    Reads in file order extend the SHA-256 for free; any other order (a file whose scales sit
    far from their weights) falls back to one extra sequential pass at the end.
    """

    def __init__(self, path: Path):
        self.path, self.fd = path, os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        (hlen,) = np.frombuffer(os.pread(self.fd, 8, 0), "<u8")
        self.sha, self.pos = hashlib.sha256(os.pread(self.fd, 8 + int(hlen), 0)), 8 + int(hlen)
        self.advised = 0                                 # WILLNEED given up to here

    def _advise(self, e: TensorEntry) -> None:
        end = min(self.size, e.offset + e.nbytes + READAHEAD)
        if end - self.advised > READAHEAD // 2 or e.offset + e.nbytes > self.advised:
            start = max(self.advised, e.offset)
            os.posix_fadvise(self.fd, start, end - start, os.POSIX_FADV_WILLNEED)
            self.advised = end

    def read(self, e: TensorEntry) -> torch.Tensor:
        self._advise(e)
        buf = torch.empty(e.nbytes, dtype=torch.uint8)
        view, done = memoryview(buf.numpy()), 0
        while done < e.nbytes:
            n = os.preadv(self.fd, [view[done:]], e.offset + done)
            if n == 0:
                raise CheckpointError(f"{e.file}: {e.name}: file truncated while reading")
            done += n
        if self.sha is not None and e.offset == self.pos:
            self.sha.update(view)
            self.pos += e.nbytes
        else:
            self.sha = None
        os.posix_fadvise(self.fd, e.offset, e.nbytes, os.POSIX_FADV_DONTNEED)
        return buf.view(TORCH_DTYPE[e.dtype]).reshape(e.shape)

    def sha256(self) -> str:
        if self.sha is not None and self.pos == self.size:
            return self.sha.hexdigest()
        return source_sha256(self.path)

    def close(self) -> None:
        os.close(self.fd)


def convert_shard(src_file: Path, actions: list[Action], tp: int, partial: Path,
                  on_progress=lambda nbytes: None, stop: threading.Event | None = None,
                  budget: MemoryBudget | None = None) -> dict:
    """Convert one source shard into tp rank files; returns its journal entry.

    Thread-safe for distinct shards. `stop` set by another thread -> Cancelled between actions;
    `budget` (shared by the workers) bounds the bytes held at once.
    """
    fname = src_file.name
    specs: list[list] = [[] for _ in range(tp)]
    for a in actions:
        for o in a.outputs:
            for r in range(tp):
                specs[r].append((o.name, o.dtype, local_shape(o, tp)))
    tmp = [rank_dir(partial, r) / (fname + ".tmp") for r in range(tp)]
    writers: list[ShardWriter] = []
    stats: dict[str, dict] = {}
    reader = _SourceReader(src_file)
    table = ExpertTable() if any(a.kind == "fp4_int8" for a in actions) else None
    try:
        for r in range(tp):
            writers.append(ShardWriter(tmp[r], specs[r], {"format": "pt"}))
        order = sorted(actions, key=lambda a: min(e.offset for e in a.sources))   # file order
        for a in order:
            if stop is not None and stop.is_set():
                raise Cancelled(fname)
            need = working_set(a)
            if budget is not None:
                budget.acquire(need, stop)
            try:
                srcs = sorted(a.sources, key=lambda e: e.offset)
                got = {e.name: reader.read(e) for e in srcs}
                outs, st = apply(a, [got[e.name] for e in a.sources], tp, table)
                for o in a.outputs:                        # a list: already the rank pieces
                    v = outs[o.name]
                    pieces = v if isinstance(v, list) else _split(v, o.shard_dim, tp)
                    for w, piece in zip(writers, pieces):
                        w.write(o.name, piece)
                del got, outs, pieces
            finally:
                if budget is not None:
                    budget.release(need)
            if st:
                stats[a.sources[0].name] = st
            on_progress(a.nbytes_in)
        for w in writers:
            w.close()
        writers = []
        sha = reader.sha256()
    except OSError as e:
        err = disk_error(e, tmp[0].parent)
        if err:
            raise err from None
        raise
    finally:
        reader.close()
        for w in writers:                                  # error path: release descriptors
            try:
                os.close(w.fd)
            except OSError:
                pass
    for r in range(tp):
        os.replace(tmp[r], rank_dir(partial, r) / fname)
    entry = {
        "source": {"size": src_file.stat().st_size, "sha256": sha},
        "tensors": stats,
        "bytes_out": [sum(math.prod(shape) * DTYPE_BYTES[dt] for _, dt, shape in specs[r])
                      for r in range(tp)],
        "outputs": [(rank_dir(partial, r) / fname).stat().st_size for r in range(tp)],
    }
    write_json_atomic(partial / JOURNAL / f"{fname}.json", entry)
    return entry
