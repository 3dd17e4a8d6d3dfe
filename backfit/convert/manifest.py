"""The last step of a conversion: rank indexes, copied side files, manifest.json, the summary.

A non-finite error statistic is the worst possible value here (it sorts above every finite one,
makes the mean NaN and is counted), so no summary can look healthy while one tensor is broken.
With the converter's checks (transforms.py) it cannot occur in a completed conversion.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import sys
from collections import defaultdict
from pathlib import Path

from backfit.config import ModelConfig
from backfit.convert.plan import Action
from backfit.convert.writer import JOURNAL, write_json_atomic
from backfit.formats import FORMAT_NAME, FORMAT_VERSION, MANIFEST, SCHEMES, rank_dir

__all__ = ["finalize", "summarize", "print_summary", "COPY_FILES"]

COPY_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def finalize(partial: Path, src: Path, cfg: ModelConfig, actions: list[Action],
             journals: dict[str, dict], options: dict, tp: int) -> dict:
    """Write the rank indexes, the side files and manifest.json into DST.partial; returns it."""
    tensors = {}
    for a in actions:
        st = journals[a.file.name]["tensors"].get(a.sources[0].name, {})
        for o in a.outputs:
            tensors[o.name] = {"scheme": o.scheme, "role": o.role, "dtype": o.dtype,
                               "shape": list(o.shape), "shard_dim": o.shard_dim,
                               "source": [e.name for e in a.sources], "file": a.file.name,
                               **(st if o.role != "scale" else {})}
    wmap = {o.name: a.file.name for a in actions for o in a.outputs}
    for r in range(tp):
        total = sum(j["bytes_out"][r] for j in journals.values())
        write_json_atomic(rank_dir(partial, r) / "model.safetensors.index.json",
                          {"metadata": {"total_size": total, "rank": r, "tp": tp},
                           "weight_map": dict(sorted(wmap.items()))})
    for f in COPY_FILES:
        if (src / f).exists():
            shutil.copyfile(src / f, partial / f)
    manifest = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "tp": tp,
        "schemes": {"linears": options["linears"], "experts": options["experts"],
                    "meaning": SCHEMES},
        "model": {"variant": cfg.variant, "num_hidden_layers": cfg.num_hidden_layers,
                  "num_mtp_stages": cfg.num_mtp_stages,
                  "vision": dataclasses.asdict(cfg.vision) if cfg.vision else None},
        "source": {"files": {f: j["source"] for f, j in sorted(journals.items())}},
        "ranks": [{"dir": rank_dir(".", r).name,
                   "bytes": sum(j["bytes_out"][r] for j in journals.values())} for r in range(tp)],
        "tensors": tensors,
        "summary": summarize(tensors, journals, tp),
    }
    write_json_atomic(partial / MANIFEST, manifest)
    shutil.rmtree(partial / JOURNAL)
    return manifest


def _badness(err: float) -> tuple[bool, float]:
    """Sort key: any non-finite error ranks above every finite one."""
    return (not math.isfinite(err), err if math.isfinite(err) else 0.0)


def summarize(tensors: dict, journals: dict, tp: int) -> dict:
    """Counts per scheme, bytes, FP8->INT8 error statistics and the experts' exact flag."""
    per_scheme: dict[str, int] = defaultdict(int)
    errs = []
    for name, t in tensors.items():
        if t["role"] != "scale":
            per_scheme[t["scheme"]] += 1
        if t["scheme"] == "int8_g128" and t["role"] == "weight":
            errs.append((t["rel_err"], name))
    bytes_in = sum(j["source"]["size"] for j in journals.values())
    worst = max(errs, key=lambda x: _badness(x[0])) if errs else (0.0, None)
    nonfinite = sum(not math.isfinite(e) for e, _ in errs)
    mean = (math.nan if nonfinite else sum(e for e, _ in errs) / len(errs)) if errs else 0.0
    experts = [t for t in tensors.values()
               if t["scheme"] in ("int8_mx32", "mx4_e2m1") and t["role"] == "weight"]
    return {"tensors_per_scheme": dict(sorted(per_scheme.items())), "bytes_in": bytes_in,
            "bytes_out_per_rank": [sum(j["bytes_out"][r] for j in journals.values()) for r in range(tp)],
            "int8_g128_rel_err": {"worst": worst[0], "worst_tensor": worst[1], "mean": mean,
                                  "count": len(errs), "nonfinite": nonfinite},
            # a flag the transform did not write counts as not exact
            "experts_exact": all(t.get("exact") is True for t in experts)}


def print_summary(m: dict, out=sys.stdout) -> None:
    s = m["summary"]
    print(f"\nconverted to {FORMAT_NAME} v{FORMAT_VERSION}, tp={m['tp']}, linears={m['schemes']['linears']}, "
          f"experts={m['schemes']['experts']}", file=out)
    print(f"  {'scheme':<10} {'tensors':>8}", file=out)
    for k, v in s["tensors_per_scheme"].items():
        print(f"  {k:<10} {v:>8}", file=out)
    print(f"  bytes in {s['bytes_in'] / 1e6:,.1f} MB; out per rank: "
          + ", ".join(f"{b / 1e6:,.1f} MB" for b in s["bytes_out_per_rank"]), file=out)
    e = s["int8_g128_rel_err"]
    if e["count"]:
        bad = e.get("nonfinite", 0) or not math.isfinite(e["worst"])
        worst = f"NON-FINITE ({e['worst']})" if bad else f"{e['worst']:.3%}"
        mean = "NaN" if not math.isfinite(e["mean"]) else f"{e['mean']:.3%}"
        print(f"  FP8->INT8 relative error over {e['count']} tensors: mean {mean}, "
              f"worst {worst} ({e['worst_tensor']})", file=out)
    print(f"  MXFP4 experts bit-exact: {'yes' if s['experts_exact'] else 'NO'}", file=out)
