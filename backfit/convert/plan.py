"""What to do with each source tensor: a pure function of (inventory, source headers, options).

Validation happens here, before anything is written: every source tensor must be in the
inventory that config.json implies, with its dtype and shape; every expected tensor must exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from backfit.checkpoint import TensorEntry
from backfit.config import ModelConfig
from backfit.formats import INT8_GROUP, MX_GROUP, shard_dim_for
from backfit.inventory import expected_tensors, is_vision_tensor

__all__ = ["Output", "Action", "plan_conversion", "ConvertError", "EXPERT_KINDS"]

EXPERT_KINDS = ("int8", "bf16", "mx4")     # --experts: int8_mx32 | bf16 | mx4_e2m1 (FORMAT.md)


class ConvertError(RuntimeError):
    """Conversion cannot proceed; the message is one line naming the file and tensor."""


@dataclass(frozen=True)
class Output:
    name: str
    dtype: str
    shape: tuple[int, ...]       # global (unsharded) shape
    shard_dim: int | None
    scheme: str
    role: str                    # "weight" | "scale" | "tensor"


@dataclass(frozen=True)
class Action:
    kind: str                    # fp8_int8 | fp8_bf16 | fp4_int8 | fp4_bf16 | fp4_mx4 | copy
    sources: tuple[TensorEntry, ...]   # (weight,) or (weight, scale)
    outputs: tuple[Output, ...]

    @property
    def file(self) -> Path:
        return self.sources[0].file

    @property
    def nbytes_in(self) -> int:
        return sum(s.nbytes for s in self.sources)


def _outputs(kind: str, name: str, entry: TensorEntry) -> tuple[Output, ...]:
    base = name[: -len(".weight")]
    dim = shard_dim_for(name)
    if kind == "copy":
        return (Output(name, entry.dtype, entry.shape, dim, "copy", "tensor"),)
    n, k = entry.shape
    if kind == "fp4_mx4":                                 # the packed bytes [N, K/2] as they are
        return (Output(name, "U8", (n, k), dim, "mx4_e2m1", "weight"),
                Output(base + ".scale", "U8", (n, 2 * k // MX_GROUP), dim, "mx4_e2m1", "scale"))
    if kind.startswith("fp4"):
        k *= 2                                            # two e2m1 codes per byte
    if kind.endswith("bf16"):
        return (Output(name, "BF16", (n, k), dim, "bf16", "weight"),)
    scheme, group, sdt = (("int8_g128", INT8_GROUP, "F32") if kind == "fp8_int8"
                          else ("int8_mx32", MX_GROUP, "U8"))
    return (Output(name, "I8", (n, k), dim, scheme, "weight"),
            Output(base + ".scale", sdt, (n, k // group), dim, scheme, "scale"))


def _check_tp(out: Output, tp: int) -> None:
    if out.shard_dim is None or tp == 1:
        return
    size = out.shape[out.shard_dim]
    if size % tp:
        raise ConvertError(f"--tp {tp}: {out.name}: dim {out.shard_dim} of size {size} "
                           f"is not divisible by {tp}")


def plan_conversion(entries: dict[str, TensorEntry], cfg: ModelConfig, tp: int,
                    linears: str = "int8", experts: str = "int8") -> list[Action]:
    """Validate the source against config.json and return one Action per weight/tensor."""
    if experts not in EXPERT_KINDS:
        raise ConvertError(f"--experts {experts!r}: choose one of {', '.join(EXPERT_KINDS)}")
    expected = expected_tensors(cfg)
    stray = None if cfg.vision else next((n for n in entries if is_vision_tensor(n)), None)
    if stray:                                # before the hash layers' bias says "unknown tensor"
        raise ConvertError(f"{entries[stray].file}: {stray}: a Vision-Exp tensor, but "
                           f"config.json has no vision_n_layers > 0 (a text-only config for a "
                           f"vision checkpoint?)")
    for name, e in entries.items():
        exp = expected.get(name)
        if exp is None:
            raise ConvertError(f"{e.file}: {name}: unknown tensor (not in the DeepSeek-V4 inventory "
                               f"implied by config.json)")
        if e.dtype != exp.dtype:
            raise ConvertError(f"{e.file}: {name}: dtype {e.dtype}, expected {exp.dtype}")
        if e.shape != exp.shape:
            raise ConvertError(f"{e.file}: {name}: shape {list(e.shape)} does not match "
                               f"{list(exp.shape)} implied by config.json")
    for name in expected:
        if name not in entries:
            sib = entries.get(name[: -len(".scale")] + ".weight") if name.endswith(".scale") else None
            where = sib.file if sib else "checkpoint"
            what = "missing scale tensor" if sib else "missing tensor (config.json implies it)"
            raise ConvertError(f"{where}: {name}: {what}")

    actions = []
    for name, e in entries.items():
        if name.endswith(".scale"):
            continue                                     # handled with its weight
        if e.dtype == "F8_E4M3":
            kind = "fp8_bf16" if linears == "bf16" or name.endswith(".attn.wo_a.weight") else "fp8_int8"
        elif e.dtype == "I8":                             # packed MXFP4 routed expert
            kind = {"bf16": "fp4_bf16", "mx4": "fp4_mx4"}.get(experts, "fp4_int8")
        else:
            kind = "copy"
        srcs = (e,) if kind == "copy" else (e, entries[name[: -len(".weight")] + ".scale"])
        outs = _outputs(kind, name, e)
        for o in outs:
            _check_tp(o, tp)
            # groups must not straddle ranks (mx4: K/(2tp) packed bytes per rank are then K/tp
            # inputs, a whole number of 32-input groups)
            if o.role == "scale" and o.shard_dim == 1:
                k_local = o.shape[1] * (INT8_GROUP if o.scheme == "int8_g128" else MX_GROUP) // tp
                if o.shape[1] % tp:
                    raise ConvertError(f"--tp {tp}: {name}: {k_local} inputs per rank is not a "
                                       f"multiple of the scale group")
        actions.append(Action(kind, srcs, outs))
    return actions
