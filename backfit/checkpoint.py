"""Byte-level safetensors I/O with no model knowledge.

Reading: headers are parsed and validated by us (so a truncated file or a corrupt header gives a
message naming the file and tensor), tensors are read one at a time with `readinto`, and FP8
bytes come back as uint8 (no torch float8 dtype is ever created).
Writing: `ShardWriter` lays out the header from the full list of specs first, then accepts tensors
in any order (pwrite at known offsets), so a shard never has to be held in memory.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from backfit.inventory import DTYPE_BYTES

__all__ = ["CheckpointError", "TensorEntry", "read_header", "SafetensorsDir", "ShardWriter",
           "TORCH_DTYPE", "read_tensor"]

# safetensors dtype -> the torch dtype we hold its bytes in (FP8 kinds stay raw uint8)
TORCH_DTYPE = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
               "F8_E4M3": torch.uint8, "F8_E8M0": torch.uint8, "I8": torch.int8,
               "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64}
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A source file is missing, truncated or malformed. The message names file and tensor."""


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int          # absolute byte offset of the payload in `file`
    nbytes: int


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Parse and validate one safetensors header; returns name -> TensorEntry (file order)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated (no safetensors header)")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > _MAX_HEADER or 8 + hlen > size:
                raise CheckpointError(f"{path}: corrupt header (length {hlen} for a {size}-byte file)")
            raw = f.read(hlen)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt header ({e})") from None
    start, payload = 8 + hlen, size - 8 - hlen
    out: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: {name}: corrupt header entry {info!r}") from None
        if dtype not in DTYPE_BYTES:
            raise CheckpointError(f"{path}: {name}: unsupported dtype {dtype}")
        if e - b != math.prod(shape) * DTYPE_BYTES[dtype] or b < 0:
            raise CheckpointError(f"{path}: {name}: corrupt header (offsets {b}..{e} do not fit "
                                  f"{dtype}{list(shape)})")
        if e > payload:
            raise CheckpointError(f"{path}: {name}: file truncated (tensor ends at byte {start + e}, "
                                  f"file has {size})")
        out[name] = TensorEntry(path, name, dtype, shape, start + b, e - b)
    return out


def read_tensor(entry: TensorEntry, device: str | torch.device = "cpu") -> torch.Tensor:
    """Read one tensor's bytes into a fresh tensor of TORCH_DTYPE[entry.dtype] and its shape."""
    buf = torch.empty(entry.nbytes, dtype=torch.uint8)
    with open(entry.file, "rb") as f:
        f.seek(entry.offset)
        n = f.readinto(memoryview(buf.numpy()))
    if n != entry.nbytes:
        raise CheckpointError(f"{entry.file}: {entry.name}: file truncated while reading")
    t = buf.view(TORCH_DTYPE[entry.dtype]).reshape(entry.shape)
    return t.to(device) if str(device) != "cpu" else t


class SafetensorsDir:
    """A directory of safetensors shards with `model.safetensors.index.json` (or one file)."""

    INDEX = "model.safetensors.index.json"

    def __init__(self, root: str | Path):
        self.root = Path(root)
        index = self.root / self.INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: unreadable index ({e})") from None
        elif (self.root / "model.safetensors").exists():
            weight_map = {n: "model.safetensors" for n in read_header(self.root / "model.safetensors")}
        else:
            raise CheckpointError(f"{self.root}: no {self.INDEX} and no model.safetensors")
        self.files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            self.files.setdefault(fname, []).append(name)
        self.entries: dict[str, TensorEntry] = {}
        for fname, names in self.files.items():
            path = self.root / fname
            if not path.exists():
                raise CheckpointError(f"{path}: missing shard (index lists {names[0]} and "
                                      f"{len(names) - 1} more tensors in it)")
            header = read_header(path)
            for n in names:
                if n not in header:
                    raise CheckpointError(f"{path}: {n}: listed in {self.INDEX} but not in the file")
                self.entries[n] = header[n]
            for n in header:                   # a stray tensor is a sign of a mixed-up download
                if n not in weight_map:
                    raise CheckpointError(f"{path}: {n}: in the file but not in {index}")
                if weight_map[n] != fname:
                    raise CheckpointError(f"{path}: {n}: in the file, but {index} lists it in "
                                          f"{weight_map[n]}")

    def read(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        return read_tensor(self.entries[name], device)

    def file_size(self, fname: str) -> int:
        return (self.root / fname).stat().st_size


class ShardWriter:
    """Write one safetensors file whose header is fixed up front; tensors may come in any order."""

    def __init__(self, path: str | Path, specs: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        self.layout: dict[str, tuple[int, int, str, tuple[int, ...]]] = {}
        off = 0
        for name, dtype, shape in specs:
            n = math.prod(shape) * DTYPE_BYTES[dtype]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
            self.layout[name] = (off, n, dtype, tuple(shape))
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)                      # safetensors pads the header to 8 bytes
        self.data_start = 8 + len(raw)
        self.size = self.data_start + off
        self.pending = set(self.layout)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(self.fd, struct.pack("<Q", len(raw)) + raw, 0)
        except BaseException:
            os.close(self.fd)
            raise

    def write(self, name: str, t: torch.Tensor) -> None:
        off, n, dtype, shape = self.layout[name]
        if tuple(t.shape) != shape or t.element_size() != DTYPE_BYTES[dtype]:
            raise ValueError(f"{self.path}: {name}: got {t.dtype}{list(t.shape)}, expected {dtype}{list(shape)}")
        data = memoryview(t.detach().contiguous().cpu().view(torch.uint8).reshape(-1).numpy())
        done = 0
        while done < n:
            done += os.pwrite(self.fd, data[done:], self.data_start + off + done)
        self.pending.discard(name)

    def close(self) -> None:
        """fsync and close; raises if any declared tensor was never written."""
        try:
            if self.pending:
                raise ValueError(f"{self.path}: tensors never written: {sorted(self.pending)[:3]}")
            os.fsync(self.fd)
        finally:
            os.close(self.fd)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            os.close(self.fd)
