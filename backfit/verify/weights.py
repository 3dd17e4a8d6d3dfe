"""Weight-level check: every converted tensor, dequantized, against the original dequantized.

Reads the converted directory through its manifest (gathering the tp shards), the original
through its index, one tensor at a time; reports relative / max-abs error per tensor and fails
on NaN or inf, on shapes that disagree with the manifest, and on source tensors left unused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from backfit.checkpoint import SafetensorsDir, read_header, read_tensor
from backfit.formats import load_manifest, rank_dir
from backfit.quant import (dequant_fp8_block, dequant_int8_groups, dequant_int8_mx, dequant_mx4,
                           dequant_mxfp4)
from backfit.verify.compare import tensor_metrics

__all__ = ["check_weights", "ConvertedDir"]


class ConvertedDir:
    """Global (unsharded) view of a converted directory's tensors."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.manifest = load_manifest(self.root)
        self.tp = self.manifest["tp"]
        self._headers: dict[tuple[int, str], dict] = {}

    def raw(self, name: str) -> torch.Tensor:
        t = self.manifest["tensors"][name]
        parts = []
        for r in range(self.tp):
            key = (r, t["file"])
            if key not in self._headers:
                self._headers[key] = read_header(rank_dir(self.root, r) / t["file"])
            parts.append(read_tensor(self._headers[key][name]))
        if t["shard_dim"] is None:
            return parts[0]
        return torch.cat(parts, dim=t["shard_dim"])

    def dequant(self, name: str) -> torch.Tensor:
        """A weight (or plain tensor) as float32, by its scheme."""
        t = self.manifest["tensors"][name]
        if t["scheme"] == "int8_g128":
            return dequant_int8_groups(self.raw(name), self.raw(name[:-7] + ".scale"))
        if t["scheme"] == "int8_mx32":
            return dequant_int8_mx(self.raw(name), self.raw(name[:-7] + ".scale"))
        if t["scheme"] == "mx4_e2m1":                   # packed [N, K/2] -> float32 [N, K]
            return dequant_mx4(self.raw(name), self.raw(name[:-7] + ".scale"))
        return self.raw(name).float() if self.raw(name).is_floating_point() else self.raw(name)


def _original(src: SafetensorsDir, sources: list[str]) -> torch.Tensor:
    w = src.read(sources[0])
    if len(sources) == 1:
        return w.float() if w.is_floating_point() else w
    s = src.read(sources[1])
    return dequant_mxfp4(w, s) if src.entries[sources[0]].dtype == "I8" else dequant_fp8_block(w, s)


def check_weights(original: str | Path, converted: str | Path) -> tuple[list[tuple[str, dict]], list[str]]:
    """Returns (per-tensor metrics, problems). Problems is empty when everything is consistent."""
    conv, src = ConvertedDir(converted), SafetensorsDir(original)
    rows, problems, used = [], [], set()
    for name, t in conv.manifest["tensors"].items():
        if t["role"] == "scale":
            continue
        used.update(t["source"])
        got, ref = conv.dequant(name), _original(src, t["source"])
        shape = list(t["shape"])
        if t["scheme"] == "mx4_e2m1":
            shape[-1] *= 2                              # the manifest gives the packed width
        if list(got.shape) != shape:
            problems.append(f"{name}: shape {list(got.shape)} != manifest {shape}")
            continue
        if got.is_floating_point() and not torch.isfinite(got).all():
            problems.append(f"{name}: NaN or inf after dequantization")
        m = tensor_metrics(got, ref) if got.is_floating_point() else \
            {"max_abs": float((got != ref).sum()), "rel": float(not torch.equal(got, ref)), "cos": 1.0}
        m["scheme"] = t["scheme"]
        recorded = t.get("rel_err")
        # written "not <=" so that a NaN on either side is a problem, never a silent pass
        if recorded is not None and not abs(recorded - m["rel"]) <= 1e-6 + 1e-3 * recorded:
            problems.append(f"{name}: manifest rel_err {recorded:.3e} but measured {m['rel']:.3e}")
        if t["scheme"] in ("int8_mx32", "mx4_e2m1", "bf16", "copy") and m["rel"] != 0.0:
            problems.append(f"{name}: scheme {t['scheme']} must be exact, rel error {m['rel']:.3e}")
        rows.append((name, m))
    unused = set(src.entries) - used
    if unused:
        problems.append(f"source tensors not in the manifest: {sorted(unused)[:3]} ({len(unused)})")
    return rows, problems


def summarize(rows: list[tuple[str, dict]]) -> str:
    by: dict[str, list[float]] = {}
    for _, m in rows:
        by.setdefault(m["scheme"], []).append(m["rel"])
    return json.dumps({k: {"tensors": len(v), "rel_mean": sum(v) / len(v), "rel_max": max(v)}
                       for k, v in sorted(by.items())}, indent=1)
