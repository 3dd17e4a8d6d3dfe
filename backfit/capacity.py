"""The memory planner: weights, reserves and KV-cache capacity per rank (`backfit plan`).

Every rank holds its weight shard plus the whole KV cache (the single latent head is not split
by TP), so one rank's budget decides everything:

  pool = floor(gpu_mem · utilization) − used − workspace − graph_reserve
  used = weights + runtime reserve (computed), or total − free after loading (measured, `fit`)
  pool = num_slots · slot_bytes + num_snapshot_slots · snapshot_bytes + num_blocks · block_bytes
         (runtime/cache/layout.py; num_slots = max_num_seqs, snapshots: docs/ENGINE.md §3)

Weights come from the inventory and the conversion plan (the same `plan_conversion` that
`backfit convert` runs), or from manifest.json for a converted directory. The reserves, per rank,
for a forward of T = max_num_batched_tokens tokens (A = 2 bytes, bf16 activations):

  streams    3·T·hc·H·A + T·H·4          layer input, sub-block output, mHC-mixed copy; FP32
             collapsed input
  attention  T · (q_lora + 2·NH/tp·D + D + o_groups/tp·o_lora + IH/tp·IHD)·A
             + T · 2·(2D + 2·IHD)·4      q, o, kv, wo_a out, indexer q; compressor c, z (FP32)
  moe        T·(E·4 + k·(2H·A + 2·I/tp·4 + I/tp·A) + 2·I/tp·4)   router logits, gathered x,
             gate/up (FP32), h, expert outputs (bf16), shared expert gate/up; attention and MoE
             run one after the other, so the larger of the two counts
  scores     C = min(T, SCORE_CHUNK) query rows at a time: indexer C·(L/4)·4 (heads summed on
             each rank, as DeepSeek's fp8_index kernel does) + top-k ids C·topk·4, attention
             2·C·NH/tp·(W + max(topk, L/m))·4 (logits and probabilities; HCA attends all L/m)
  logits     S·(V/tp·4 + V·16): local FP32 logits, gathered FP32 row, sampler probs + int64
             sort ids (S = max_num_seqs rows are sampled per step)
  graphs     the same workspace at T = S = max_num_seqs (decode graphs share one private pool,
             captured largest first) + GRAPH_BYTES per captured batch size; with prefill graphs
             (P = prefill_graph_tokens, default min(T, 2048) where they cost at most 10 % of the
             KV capacity) + 2·streams + max(attention, moe) + attention at T = P (their pool,
             each size's last streams, the static buffers the pieces share with the eager
             attention cores) + PIECE_BYTES per piece (L + 1 a size)
  runtime    CUDA context + cuBLAS: 685 MiB measured on an H200 (torch 2.11, CUDA 13), rounded
             up to 0.75 GiB; NCCL buffers at tp > 1: 0.5 GiB, an estimate (not measured here)

Engine start-up (runtime/runner.py ModelRunner.size_pools; the same `fit` as `backfit plan`):
free memory is read with torch.cuda.mem_get_info() after loading, the workspace term above is
subtracted as computed, and so is the graph reserve (decode, and prefill where on), before
the graphs are captured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from backfit.config import ModelConfig
from backfit.formats import MANIFEST, load_manifest
from backfit.inventory import DTYPE_BYTES, expected_tensors
from backfit.runtime.cache.budget import (CONTEXT_BYTES, GRAPH_BYTES, NCCL_BYTES, SCORE_CHUNK,  # noqa: F401
                                          BATCHED_TOKENS, GiB, MiB, Plan, Workspace, _gib, fit,
                                          graph_reserve, longest_fit, max_positions,
                                          model_limit, pick_batched_tokens,
                                          pick_prefill_graphs, prefill_graph_count,
                                          prefill_graph_reserve, runtime_reserve, workspace)
from backfit.runtime.cache.layout import cache_layout

__all__ = ["GiB", "EXPERT_SCHEMES", "MAX_NUM_SEQS", "SCORE_CHUNK",
           "WeightBytes", "Workspace", "Plan", "parse_bytes", "read_model", "max_positions",
           "weight_bytes", "manifest_weight_bytes", "workspace", "graph_reserve", "runtime_reserve",
           "fit", "plan", "format_plan"]

MAX_NUM_SEQS = 64
# --experts -> bytes of one routed-expert weight, for the record; the bytes themselves come from
# the plan's outputs. mx4 (mx4_e2m1, MXFP4 kept packed): 0.5 B + 1 B per 32.
EXPERT_SCHEMES = {"int8": 1 + 1 / 32, "bf16": 2.0, "mx4": 0.5 + 1 / 32}
PLANNED: frozenset[str] = frozenset()     # schemes no converter writes yet (none now)


def parse_bytes(text: str) -> int:
    """'80GiB', '80 GB', '81920MiB', '1e9' -> bytes."""
    units = {"kib": 2 ** 10, "mib": MiB, "gib": GiB, "tib": 2 ** 40, "kb": 10 ** 3, "mb": 10 ** 6,
             "gb": 10 ** 9, "tb": 10 ** 12, "b": 1, "": 1}
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("kmgtib")
    try:
        value, unit = float(num), units[s[len(num):]]
    except (ValueError, KeyError):
        raise ValueError(f"cannot read {text!r} as a size (e.g. 80GiB, 80GB, 81920MiB)") from None
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return int(value * unit)


@dataclass(frozen=True)
class WeightBytes:
    per_rank: int                # the largest rank's payload (ranks are equal: torch.chunk)
    experts: int                 # routed experts (main tower + drafts) on that rank
    mtp: int                     # draft stages (mtp.*) on that rank, included in per_rank
    source: str                  # "manifest" | "inventory"
    planned: bool = False        # a scheme that no converter writes yet (none now)


def _per_rank(shape, dtype: str, shard_dim, tp: int) -> int:
    n = math.prod(shape) * DTYPE_BYTES[dtype]
    return n if shard_dim is None else n // tp


@lru_cache(maxsize=64)                    # planning 69k Flash tensors takes ~2 s on a slow core
def weight_bytes(cfg: ModelConfig, tp: int, experts: str = "int8", linears: str = "int8",
                 mtp: bool = False) -> WeightBytes:
    """Per-rank bytes of the directory `backfit convert --tp tp` would write, from the inventory."""
    from backfit.checkpoint import TensorEntry             # imports torch: only when needed
    from backfit.convert.plan import plan_conversion
    if experts not in EXPERT_SCHEMES:
        raise ValueError(f"--experts {experts!r}: choose one of {', '.join(EXPERT_SCHEMES)}")
    entries = {n: TensorEntry(Path(n), n, t.dtype, t.shape, 0, t.nbytes)
               for n, t in expected_tensors(cfg).items()}
    actions = plan_conversion(entries, cfg, tp, linears=linears, experts=experts)
    total = ex = draft = 0
    for a in actions:
        for o in a.outputs:
            if o.name.startswith("mtp.") and not mtp:
                continue
            n = _per_rank(o.shape, o.dtype, o.shard_dim, tp)
            total += n
            ex += n if ".experts." in o.name else 0
            draft += n if o.name.startswith("mtp.") else 0
    return WeightBytes(total, ex, draft, "inventory", experts in PLANNED)


def manifest_weight_bytes(manifest: dict, mtp: bool = False) -> WeightBytes:
    """Per-rank bytes of a converted directory, from its tensors; checked against ranks[].bytes."""
    tp, total, ex, draft, kept = manifest["tp"], 0, 0, 0, 0
    for name, t in manifest["tensors"].items():
        n = _per_rank(t["shape"], t["dtype"], t["shard_dim"], tp)
        total += n
        if name.startswith("mtp.") and not mtp:
            continue
        kept += n
        ex += n if ".experts." in name else 0
        draft += n if name.startswith("mtp.") else 0
    ranks = [r["bytes"] for r in manifest.get("ranks", [])]
    if ranks and max(ranks) != total:
        raise ValueError(f"{MANIFEST}: ranks[].bytes {max(ranks)} != {total}, the sum over "
                         f"its tensors")
    return WeightBytes(kept, ex, draft, "manifest")


def read_model(path: str | Path) -> tuple[ModelConfig, dict | None, int]:
    """MODEL (original dir, converted dir or config.json) -> (config, manifest, max positions)."""
    p = Path(path)
    if p.is_dir():
        manifest = load_manifest(p) if (p / MANIFEST).exists() else None
        p = p / "config.json"
    elif p.suffix == ".json":
        manifest = None
    else:
        raise ValueError(f"{path}: not a directory or a config.json")
    return ModelConfig.from_file(p), manifest, model_limit(p)


def plan(model: str | Path | ModelConfig, tp: int | None = None, gpu_mem: int = 80 * GiB,
         utilization: float = 0.90, experts: str | None = None, kv_cache_dtype: str = "bf16",
         max_model_len: int | None = None, max_num_seqs: int = MAX_NUM_SEQS,
         max_num_batched_tokens: int | None = None,
         num_snapshot_slots: int | None = None, mtp: bool = False, rollback: int = 8,
         block_size: int | None = None, prefill_graph_tokens: int | None = None) -> Plan:
    """The computed plan for MODEL on cards of `gpu_mem` bytes. max_model_len None: the longest
    that fits, up to the model's limit; given: ValueError (what to change) unless it fits.
    max_num_batched_tokens None: the engine's default on CUDA (pick_batched_tokens);
    prefill_graph_tokens None: the engine's default (pick_prefill_graphs), 0: none."""
    args = dict(tp=tp, gpu_mem=gpu_mem, utilization=utilization, experts=experts,
                kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len,
                max_num_seqs=max_num_seqs, num_snapshot_slots=num_snapshot_slots, mtp=mtp,
                rollback=rollback, block_size=block_size)
    if max_num_batched_tokens is None:
        t, p = pick_batched_tokens(lambda t: plan(model, max_num_batched_tokens=t,
                                                  prefill_graph_tokens=prefill_graph_tokens,
                                                  **args))
        why = "" if t == BATCHED_TOKENS[1] else (f" ({BATCHED_TOKENS[1]} would cost more than "
                                                 "10 % of the KV capacity, or not fit)")
        return Plan(**{**p.to_dict(), "notes": p.notes + (
            f"--max-num-batched-tokens not given: {t}{why}",)})
    if prefill_graph_tokens is None:
        T = max_num_batched_tokens
        p = pick_prefill_graphs(lambda pg: plan(model, max_num_batched_tokens=T,
                                                prefill_graph_tokens=pg, **args), T)
        P = p.prefill_graph_tokens
        note = (f"--prefill-graph-tokens not given: {P}" if P else
                "--prefill-graph-tokens not given: 0 (prefill graphs would cost more than 10 % "
                "of the KV capacity, or not fit)")
        return Plan(**{**p.to_dict(), "notes": p.notes + (note,)})
    pg = prefill_graph_count(prefill_graph_tokens, max_num_batched_tokens)
    if isinstance(model, ModelConfig):
        cfg, manifest, limit = model, None, max_positions(model)
    else:
        cfg, manifest, limit = read_model(model)
    notes = []
    if manifest is not None:
        if tp is not None and tp != manifest["tp"]:
            raise ValueError(f"{model} is converted for --tp {manifest['tp']}: drop --tp or "
                             f"convert again with --tp {tp}")
        have = manifest["schemes"]["experts"]
        if experts is not None and experts != have:
            raise ValueError(f"{model} holds --experts {have}: drop --experts or convert again")
        tp, experts = manifest["tp"], have
        weights = manifest_weight_bytes(manifest, mtp)
    else:
        tp, experts = tp or 4, experts or "int8"
        weights = weight_bytes(cfg, tp, experts, mtp=mtp)
    if weights.planned:
        notes.append(f"--experts {experts} is planned: no converter or kernel writes it yet; its "
                     f"weights are projected ({EXPERT_SCHEMES[experts]:.4f} B per expert weight)")
    layout = cache_layout(cfg, kv_cache_dtype, block_size, rollback=rollback,
                          draft_layers=cfg.num_mtp_stages if mtp and cfg.variant == "flash" else 0)
    used = weights.per_rank + runtime_reserve(tp)
    info = dict(tp=tp, experts=experts, weight_bytes=weights.per_rank,
                max_num_batched_tokens=max_num_batched_tokens, planned=weights.planned)

    def attempt(length: int) -> Plan:
        ws = workspace(cfg, tp, max_num_batched_tokens, length, max_num_seqs).total
        gr = graph_reserve(cfg, tp, length, max_num_seqs) + (
            prefill_graph_reserve(cfg, tp, pg, length, max_num_seqs) if pg else 0)
        return fit(layout, gpu_mem - used, gpu_mem, max_model_len=length, max_num_seqs=max_num_seqs,
                   utilization=utilization, workspace_bytes=ws, graph_bytes=gr,
                   prefill_graph_tokens=pg,
                   num_snapshot_slots=num_snapshot_slots, model_limit=limit,
                   notes=tuple(notes), **info)

    longest = longest_fit(attempt, layout.block_size, limit)
    if max_model_len is None:
        if longest == 0:
            attempt(layout.block_size)             # raises: not even one block fits
        max_model_len = min(limit, longest)
        if max_model_len < limit:
            notes.append(f"--max-model-len not given: {max_model_len}, the longest that fits "
                         f"(the model allows {limit})")
    elif max_model_len > limit:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's "
                         f"max_position_embeddings {limit}")
    p = attempt(max_model_len)
    return Plan(**{**p.to_dict(), "longest_context": longest, "notes": tuple(notes)})


def format_plan(p: Plan) -> str:
    """The human table printed by `backfit plan`."""
    rows = [
        ("tensor parallel", f"{p.tp} ranks, every rank holds the whole KV cache"),
        ("card", f"{_gib(p.gpu_mem_bytes)} x {p.gpu_memory_utilization} = "
                 f"{_gib(int(p.gpu_mem_bytes * p.gpu_memory_utilization))} budget per rank"),
        ("weights per rank", f"{_gib(p.weight_bytes_per_rank)} (experts {p.experts}"
                             f"{', planned' if p.planned else ''})"),
        ("runtime reserve", _gib(p.used_bytes - p.weight_bytes_per_rank)),
        ("activation workspace", f"{_gib(p.workspace_bytes)} ({p.max_num_batched_tokens} tokens "
                                 f"per step)"),
        ("CUDA-graph reserve", f"{_gib(p.graph_reserve_bytes)} (decode up to {p.max_num_seqs}"
                               + (f", prefill up to {p.prefill_graph_tokens} tokens)"
                                  if p.prefill_graph_tokens else ", no prefill graphs)")),
        ("KV pool", f"{_gib(p.kv_pool_bytes)} = {p.num_slots} slots x "
                    f"{p.slot_bytes / MiB:.1f} MiB + {p.num_snapshot_slots} prefix snapshots x "
                    f"{p.snapshot_bytes / MiB:.2f} MiB + {p.num_blocks} blocks x "
                    f"{p.block_bytes / MiB:.3f} MiB ({p.block_size} tokens)"),
        ("KV bytes per token", f"{p.kv_bytes_per_token:,.3f} ({p.kv_cache_dtype})"),
        ("KV bytes per sequence", f"{_gib(p.kv_bytes_per_sequence)} at {p.max_model_len:,} tokens"),
        ("KV capacity", f"{p.kv_capacity_tokens:,} tokens"),
        ("longest context", f"{p.longest_context:,} tokens"),
        ("max model len", f"{p.max_model_len:,} tokens"),
        ("concurrency", f"{p.max_concurrency_at_max_model_len} sequence(s) at max model len "
                        f"(max-num-seqs {p.max_num_seqs})"),
    ]
    w = max(len(k) for k, _ in rows)
    lines = [f"{k:<{w}}  {v}" for k, v in rows]
    return "\n".join(lines + [f"note: {n}" for n in p.notes])
