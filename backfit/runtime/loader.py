"""Converted directory (docs/FORMAT.md) -> this rank's tensors -> model; proves nothing was missed.

Dispatch is on each manifest entry's `scheme` and `role`, never on file names:
  role weight (int8_g128 | int8_mx32 | mx4_e2m1 | bf16) + its role-scale sibling -> Linear.load
  role tensor (copy) named X.weight of a Linear                     -> Linear.load("copy", ...)
  role tensor (copy) otherwise                                      -> copied into the buffer
Only files of rank{r}/ are opened. At the end every manifest tensor must have been consumed
(or lie under one of model.skipped_prefixes), and every Linear and every buffer of the model
must have been filled.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from backfit.checkpoint import read_header, read_tensor
from backfit.formats import FormatError, load_manifest, rank_dir
from backfit.runtime.distributed import get_tp_info
from backfit.runtime.layers import Linear

__all__ = ["LoadError", "load_model", "expected_names"]

_QUANT = ("int8_g128", "int8_mx32", "mx4_e2m1", "bf16")


class LoadError(FormatError):
    """The converted directory and the model disagree (missing, extra or mis-shaped tensors)."""


def expected_names(model: nn.Module) -> set[str]:
    """Every tensor name the model needs: X.weight per Linear, plus persistent plain buffers."""
    names: set[str] = set()
    for mname, mod in model.named_modules():
        pre = f"{mname}." if mname else ""
        linear = isinstance(mod, Linear)
        if linear:
            names.add(f"{pre}weight")                    # weight (+ scale) arrive together
        for bname, buf in mod.named_buffers(recurse=False):
            if linear and bname in ("weight", "scale"):
                continue
            if bname not in mod._non_persistent_buffers_set and buf is not None:
                names.add(pre + bname)                   # e.g. a router Linear's bias / tid2eid
    return names


def _local_shape(spec: dict, tp: int) -> tuple[int, ...]:
    shape = list(spec["shape"])
    if spec.get("shard_dim") is not None:
        shape[spec["shard_dim"]] //= tp
    return tuple(shape)


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    mname, _, leaf = name.rpartition(".")
    try:
        return (model.get_submodule(mname) if mname else model), leaf
    except AttributeError:
        raise LoadError(f"{name}: the manifest has it but the model has no module {mname!r}") from None


def load_model(model: nn.Module, root: str | Path, device: str | torch.device = "cpu") -> dict:
    """Fill `model` from this rank's files of converted dir `root`; returns a small report."""
    root, tp = Path(root), get_tp_info()
    manifest = load_manifest(root)
    if manifest["tp"] != tp.size:
        raise LoadError(f"{root}: converted for tp={manifest['tp']}, this process group has tp={tp.size}")
    rdir = rank_dir(root, tp.rank)
    index = json.loads((rdir / "model.safetensors.index.json").read_text())["weight_map"]
    specs: dict = manifest["tensors"]
    if set(index) != set(specs):
        extra, missing = sorted(set(index) - set(specs)), sorted(set(specs) - set(index))
        raise LoadError(f"{rdir}: index and manifest disagree: not in manifest {extra[:3]}, "
                        f"not in rank files {missing[:3]}")
    headers: dict[str, dict] = {}

    def read(name: str) -> torch.Tensor:
        fname = index[name]
        if fname not in headers:
            headers[fname] = read_header(rdir / fname)
        entry = headers[fname].get(name)
        if entry is None:
            raise LoadError(f"{rdir / fname}: {name} listed in the index but not in the file")
        want = _local_shape(specs[name], tp.size)
        if tuple(entry.shape) != want:
            raise LoadError(f"{name}: rank {tp.rank} holds {list(entry.shape)}, manifest says {list(want)}")
        return read_tensor(entry, device)

    skipped = tuple(getattr(model, "skipped_prefixes", ()))
    needed, consumed, filled, skipped_n = expected_names(model), set(), set(), 0
    for name, spec in specs.items():
        if name.startswith(skipped) if skipped else False:
            consumed.add(name)
            skipped_n += 1
            continue
        scheme, role = spec["scheme"], spec["role"]
        if role == "scale":
            continue                                        # taken together with its weight
        mod, leaf = _owner(model, name)
        if role == "weight" and scheme in _QUANT:
            if not isinstance(mod, Linear) or leaf != "weight":
                raise LoadError(f"{name}: scheme {scheme} but the model's target is not a Linear")
            sname = name[:-len("weight")] + "scale"
            scale = None
            if scheme != "bf16":
                if specs.get(sname, {}).get("role") != "scale":
                    raise LoadError(f"{name}: scheme {scheme} needs {sname}, missing from the manifest")
                scale = read(sname)
                consumed.add(sname)
            try:
                mod.load(scheme, read(name), scale, name)
            except ValueError as e:
                raise LoadError(str(e)) from None
        elif role == "tensor" and scheme == "copy":
            t = read(name)
            if isinstance(mod, Linear) and leaf == "weight":
                try:
                    mod.load("copy", t, None, name)
                except ValueError as e:
                    raise LoadError(str(e)) from None
            else:
                buf = mod._buffers.get(leaf) if leaf in mod._buffers else None
                if buf is None:
                    raise LoadError(f"{name}: the model has no buffer for it")
                if tuple(buf.shape) != tuple(t.shape):
                    raise LoadError(f"{name}: model buffer {list(buf.shape)}, file {list(t.shape)}")
                if buf.is_floating_point() != t.is_floating_point():
                    raise LoadError(f"{name}: dtype {t.dtype} cannot fill a {buf.dtype} buffer")
                mod._buffers[leaf] = t.to(device=device, dtype=buf.dtype)   # norms etc. upcast
        else:
            raise LoadError(f"{name}: unknown scheme/role {scheme}/{role}")
        consumed.add(name)
        filled.add(name)
    unconsumed = sorted(set(specs) - consumed)
    if unconsumed:
        raise LoadError(f"{len(unconsumed)} manifest tensors not consumed, e.g. {unconsumed[:3]}")
    unfilled = sorted(needed - filled)
    if unfilled:
        raise LoadError(f"{len(unfilled)} model tensors not in {root}, e.g. {unfilled[:5]}")
    model.to(device)
    return {"tensors": len(filled), "skipped": skipped_n, "files": len(headers), "rank": tp.rank}
