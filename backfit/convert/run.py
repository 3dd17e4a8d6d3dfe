"""convert(src, dst): validate -> plan -> convert shard by shard into DST.partial -> manifest -> rename."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from collections import defaultdict
from pathlib import Path

from backfit.checkpoint import SafetensorsDir
from backfit.config import ModelConfig
from backfit.convert.plan import Action, ConvertError, plan_conversion
from backfit.convert.writer import (JOURNAL, convert_shard, disk_error, load_journal, local_shape,
                                    write_json_atomic)
from backfit.formats import FORMAT_NAME, FORMAT_VERSION, MANIFEST, SCHEMES, rank_dir
from backfit.inventory import DTYPE_BYTES

__all__ = ["convert", "resolve_source"]

_COPY_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


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
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "tp": tp, "linears": linears,
            "experts": experts, "variant": cfg.variant,
            "source_sizes": {f: src.file_size(f) for f in sorted(src.files)}}


def _prepare_partial(partial: Path, options: dict, tp: int) -> None:
    opt_file = partial / JOURNAL / "options.json"
    if partial.exists():
        if opt_file.exists() and json.loads(opt_file.read_text()) == options:
            return                                               # resume
        shutil.rmtree(partial)                                   # other options or no journal
    for r in range(tp):
        rank_dir(partial, r).mkdir(parents=True, exist_ok=True)
    (partial / JOURNAL).mkdir(parents=True, exist_ok=True)
    write_json_atomic(opt_file, options)


def _check_disk(partial: Path, todo: dict[str, list[Action]], tp: int) -> None:
    need = sum(math.prod(local_shape(o, tp)) * DTYPE_BYTES[o.dtype] * tp
               for acts in todo.values() for a in acts for o in a.outputs)
    free = shutil.disk_usage(partial).free
    if need > free:
        raise ConvertError(f"{partial}: out of disk space: the conversion needs {need / 1e9:.2f} GB "
                           f"more, {free / 1e9:.2f} GB free")


def convert(src: str | Path, dst: str | Path, tp: int = 4, linears: str = "int8",
            experts: str = "int8", force: bool = False, progress: bool = True,
            out=sys.stdout) -> dict:
    """Convert an original DeepSeek-V4 checkpoint into a backfit directory. Returns the manifest."""
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
    _prepare_partial(partial, options, tp)

    journals = {f: load_journal(partial, f, tp) for f in sorted(by_file)}
    todo = {f: by_file[f] for f, j in journals.items() if j is None}
    _check_disk(partial, todo, tp)
    total = sum(a.nbytes_in for a in actions)
    done = total - sum(a.nbytes_in for acts in todo.values() for a in acts)
    if done:
        print(f"resuming: {len(journals) - len(todo)} of {len(journals)} shards already converted",
              file=out)
    from tqdm import tqdm
    with tqdm(total=total, initial=done, unit="B", unit_scale=True, desc="convert",
              disable=not progress, file=sys.stderr) as bar:
        for fname, acts in todo.items():
            bar.set_postfix_str(fname, refresh=False)
            journals[fname] = convert_shard(source.root / fname, acts, tp, partial, bar.update)
    try:
        manifest = _finalize(partial, src_path, cfg, actions, journals, options, tp)
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


def _finalize(partial: Path, src: Path, cfg: ModelConfig, actions: list[Action],
              journals: dict[str, dict], options: dict, tp: int) -> dict:
    tensors = {}
    for a in actions:
        st = journals[a.file.name]["tensors"].get(a.sources[0].name, {})
        for o in a.outputs:
            tensors[o.name] = {"scheme": o.scheme, "role": o.role, "dtype": o.dtype,
                               "shape": list(o.shape), "shard_dim": o.shard_dim,
                               "source": [e.name for e in a.sources], "file": a.file.name,
                               **(st if o.role != "scale" else {})}
    for r in range(tp):
        wmap = {o.name: a.file.name for a in actions for o in a.outputs}
        total = sum(j["bytes_out"][r] for j in journals.values())
        write_json_atomic(rank_dir(partial, r) / "model.safetensors.index.json",
                          {"metadata": {"total_size": total, "rank": r, "tp": tp},
                           "weight_map": dict(sorted(wmap.items()))})
    for f in _COPY_FILES:
        if (src / f).exists():
            shutil.copyfile(src / f, partial / f)
    manifest = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "tp": tp,
        "schemes": {"linears": options["linears"], "experts": options["experts"],
                    "meaning": SCHEMES},
        "model": {"variant": cfg.variant, "num_hidden_layers": cfg.num_hidden_layers,
                  "num_mtp_stages": cfg.num_mtp_stages},
        "source": {"files": {f: j["source"] for f, j in sorted(journals.items())}},
        "ranks": [{"dir": rank_dir(".", r).name,
                   "bytes": sum(j["bytes_out"][r] for j in journals.values())} for r in range(tp)],
        "tensors": tensors,
        "summary": _summary(tensors, journals, tp),
    }
    write_json_atomic(partial / MANIFEST, manifest)
    shutil.rmtree(partial / JOURNAL)
    return manifest


def _summary(tensors: dict, journals: dict, tp: int) -> dict:
    per_scheme: dict[str, int] = defaultdict(int)
    errs = []
    for name, t in tensors.items():
        if t["role"] != "scale":
            per_scheme[t["scheme"]] += 1
        if t["scheme"] == "int8_g128" and t["role"] == "weight":
            errs.append((t["rel_err"], name))
    bytes_in = sum(j["source"]["size"] for j in journals.values())
    worst = max(errs) if errs else (0.0, None)
    return {"tensors_per_scheme": dict(sorted(per_scheme.items())), "bytes_in": bytes_in,
            "bytes_out_per_rank": [sum(j["bytes_out"][r] for j in journals.values()) for r in range(tp)],
            "int8_g128_rel_err": {"worst": worst[0], "worst_tensor": worst[1],
                                  "mean": sum(e for e, _ in errs) / len(errs) if errs else 0.0,
                                  "count": len(errs)},
            "experts_exact": all(t.get("exact", True) for t in tensors.values()
                                 if t["scheme"] == "int8_mx32" and t["role"] == "weight")}


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
        print(f"  FP8->INT8 relative error over {e['count']} tensors: mean {e['mean']:.3%}, "
              f"worst {e['worst']:.3%} ({e['worst_tensor']})", file=out)
    print(f"  MXFP4 experts bit-exact: {'yes' if s['experts_exact'] else 'NO'}", file=out)
