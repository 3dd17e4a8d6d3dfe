"""The start-up budget: activation workspace, graph reserve, runtime reserve, and `fit`.

Shared by the engine's runner (measured free memory after loading) and `backfit plan`
(backfit/capacity.py: computed from the inventory). Pure Python; the derivation of every term is
in backfit/capacity.py's docstring and docs/DEPLOY.md (§4, Capacity).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from backfit.config import ModelConfig
from backfit.runtime.cache.layout import CacheLayout

__all__ = ["GiB", "MiB", "SCORE_CHUNK", "GRAPH_BYTES", "CONTEXT_BYTES", "NCCL_BYTES", "Workspace",
           "workspace", "capture_sizes", "graph_reserve", "runtime_reserve", "Plan", "fit",
           "BATCHED_TOKENS", "pick_batched_tokens", "PREFILL_GRAPH_MAX", "PREFILL_GRAPH_MIN",
           "PIECE_BYTES", "prefill_sizes", "prefill_graph_count", "prefill_graph_reserve",
           "pick_prefill_graphs", "max_positions", "model_limit", "longest_fit"]

GiB = 2 ** 30
MiB = 2 ** 20
SCORE_CHUNK = 256                       # query rows per indexer / attention score block
GRAPH_BYTES = 16 * MiB                  # per captured graph: 5.5 MiB measured for 1,720 nodes
CONTEXT_BYTES = 3 * GiB // 4            # CUDA context + cuBLAS (685 MiB measured, H200)
NCCL_BYTES = GiB // 2                   # estimate, tp > 1
# --max-num-batched-tokens when not given: the larger where it costs at most 10 % of the KV
# capacity, else the smaller (pick_batched_tokens). Prefill chunks run eagerly, and one TP-4
# rank's 43-layer eager step costs ~0.3 s of host time below ~8K tokens (H200, 2026-12-03:
# 512 / 2,048 / 8,192 tokens: wall 247 / 304 / 440 ms, GPU busy 63 / 131 / 427 ms), so a
# larger chunk is nearly free in time: an 8K prompt's TTFT 1,138 -> 443 ms
BATCHED_TOKENS = (2048, 8192)
# Prefill graphs (runtime/graphs/prefill.py): the largest padded token count by default; above
# it a chunk is GPU-bound (the same slice, eager: 8,192 tokens 440 ms wall for 427 ms of GPU work)
PREFILL_GRAPH_MAX = 2048
PREFILL_GRAPH_MIN = 64                  # the smallest padded count (mhc's prefill path from 64)
PIECE_BYTES = MiB                       # per captured prefill piece (~40 nodes; decode: above)


@dataclass(frozen=True)
class Workspace:
    """Per-rank activation bytes of one forward (module docstring: how each term is derived)."""
    streams: int
    attention: int
    moe: int
    scores: int
    logits: int

    @property
    def total(self) -> int:
        return self.streams + max(self.attention, self.moe) + self.scores + self.logits


def workspace(cfg: ModelConfig, tp: int, tokens: int, max_model_len: int, num_seqs: int,
              act_bytes: int = 2, score_chunk: int = SCORE_CHUNK) -> Workspace:
    T, A, H, D = tokens, act_bytes, cfg.hidden_size, cfg.head_dim
    NH, IH, IHD, I = cfg.num_attention_heads // tp, cfg.index_n_heads // tp, cfg.index_head_dim, \
        cfg.moe_intermediate_size // tp
    k, E, V, W, topk = cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.vocab_size, \
        cfg.sliding_window, cfg.index_topk
    ratios = {cfg.ratio(i) for i in range(cfg.num_hidden_layers)}
    hca = min((r for r in ratios if r > 4), default=0)
    L = max_model_len
    streams = 3 * T * cfg.hc_mult * H * A + T * H * 4
    attention = T * (cfg.q_lora_rank + 2 * NH * D + D + cfg.o_groups // tp * cfg.o_lora_rank
                     + IH * IHD) * A + T * 2 * (2 * D + 2 * IHD) * 4
    moe = T * (E * 4 + k * (2 * H * A + 2 * I * 4 + I * A) + 2 * I * 4)
    C = min(T, score_chunk)
    entries = max(topk, -(-L // hca) if hca else 0)
    index = C * -(-L // 4) * 4 + C * topk * 4 if 4 in ratios else 0     # [C, L/4] + [C, topk]
    scores = index + 2 * C * NH * (W + entries) * 4                    # [C, NH/tp, W + n] x2
    logits = num_seqs * (V // tp * 4 + V * 16)
    return Workspace(streams, attention, moe, scores, logits)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes with a CUDA graph (runtime/graphs/): 1, 2, 4, every multiple of 8,
    and max_num_seqs itself."""
    sizes = {1, 2, 4, max_num_seqs} | set(range(8, max_num_seqs + 1, 8))
    return sorted(s for s in sizes if 1 <= s <= max_num_seqs)


def prefill_sizes(max_tokens: int) -> list[int]:
    """Padded token counts with prefill graphs: 64, 128, ... doubling, with 1,536 between 1,024
    and 2,048 (less padding where a step starts to be GPU-bound), up to max_tokens (included
    when it is not one of them); [] below 64 (mhc's prefill path starts at 64 tokens)."""
    lo = PREFILL_GRAPH_MIN
    if max_tokens < lo:
        return []
    sizes = {lo << k for k in range(max_tokens.bit_length()) if lo << k <= max_tokens}
    return sorted(sizes | {x for x in (1536, max_tokens) if x <= max_tokens})


def prefill_graph_count(requested: int, tokens: int) -> int:
    """--prefill-graph-tokens `requested` at a token budget of `tokens` -> the largest padded
    count captured (0: none; a step never holds more than the budget); ValueError on a value
    that is neither 0 nor at least PREFILL_GRAPH_MIN."""
    if requested < 0 or 0 < requested < PREFILL_GRAPH_MIN:
        raise ValueError(f"--prefill-graph-tokens {requested}: 0 (eager prefill) or at least "
                         f"{PREFILL_GRAPH_MIN}")
    P = min(requested, tokens)
    return P if P >= PREFILL_GRAPH_MIN else 0


def prefill_graph_reserve(cfg: ModelConfig, tp: int, tokens: int, max_model_len: int,
                          num_seqs: int, act_bytes: int = 2) -> int:
    """The prefill pieces of prefill_sizes(tokens) in one pool: a `tokens` step's streams twice
    (the pieces' own, and every size's last streams, which stay alive: 64 + ... + tokens <
    2·tokens rows of one third of the streams term), its larger sub-layer (the pieces'
    intermediates), the attention term again (the static pre / o buffers the pieces and the
    eager cores exchange), PIECE_BYTES a piece. H200, the 43-layer TP-4 slice at 2,048 tokens
    (2026-12-03): 0.90 GiB in the pool and buffers (graphs' own driver memory not counted)
    against 1.10 GiB here."""
    ws = workspace(cfg, tp, tokens, max_model_len, num_seqs, act_bytes=act_bytes)
    pieces = len(prefill_sizes(tokens)) * (cfg.num_hidden_layers + 1)
    return 2 * ws.streams + max(ws.attention, ws.moe) + ws.attention + pieces * PIECE_BYTES


def graph_reserve(cfg: ModelConfig, tp: int, max_model_len: int, max_num_seqs: int) -> int:
    """The decode graphs of capture_sizes sharing one pool (a max_num_seqs step's workspace)."""
    pool = workspace(cfg, tp, max_num_seqs, max_model_len, max_num_seqs).total
    return pool + len(capture_sizes(max_num_seqs)) * GRAPH_BYTES


def runtime_reserve(tp: int) -> int:
    return CONTEXT_BYTES + (NCCL_BYTES if tp > 1 else 0)


@dataclass(frozen=True)
class Plan:
    """One rank's memory plan. Sizes in bytes; capacity and lengths in tokens."""
    tp: int
    gpu_mem_bytes: int
    gpu_memory_utilization: float
    kv_cache_dtype: str
    experts: str
    weight_bytes_per_rank: int
    used_bytes: int                        # weights + runtime reserve (or measured)
    workspace_bytes: int
    graph_reserve_bytes: int
    kv_pool_bytes: int                     # slots + snapshots + blocks
    slot_bytes: int
    num_slots: int                         # sequence slots: max_num_seqs
    num_snapshot_slots: int                # prefix-cache snapshots (docs/ENGINE.md §3)
    snapshot_bytes: int
    block_size: int
    block_bytes: int
    num_blocks: int
    kv_bytes_per_token: float
    kv_bytes_per_sequence: int             # slot + blocks at max_model_len
    kv_capacity_tokens: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_concurrency_at_max_model_len: int
    longest_context: int                   # one sequence, this workspace, model limit
    planned: bool = False
    notes: tuple[str, ...] = ()
    prefill_graph_tokens: int = 0          # the largest padded count with prefill graphs; 0: none

    def to_dict(self) -> dict:
        return asdict(self)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def fit(layout: CacheLayout, free_bytes: int, total_bytes: int, *, max_model_len: int,
        max_num_seqs: int, utilization: float = 0.90, workspace_bytes: int = 0,
        graph_bytes: int = 0, num_snapshot_slots: int | None = None,
        weight_bytes: int | None = None, tp: int = 1, experts: str = "",
        max_num_batched_tokens: int = 0, prefill_graph_tokens: int = 0,
        model_limit: int | None = None, planned: bool = False, notes: tuple[str, ...] = ()) -> Plan:
    """Size the pools from what is free on one rank: measured (torch.cuda.mem_get_info() after
    loading weights and starting NCCL) or computed (total - weights - runtime reserve).
    Raises ValueError saying what to change when max_model_len (or anything at all) does not fit."""
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization {utilization}: must be in (0, 1]")
    if max_model_len < 1 or max_num_seqs < 1:
        raise ValueError("--max-model-len and --max-num-seqs must be at least 1")
    snaps = max_num_seqs if num_snapshot_slots is None else num_snapshot_slots
    if snaps < 0:
        raise ValueError(f"--num-snapshot-slots {snaps}: must be >= 0")
    used = total_bytes - free_bytes
    budget = int(total_bytes * utilization)
    pool = budget - used - workspace_bytes - graph_bytes
    fixed = max_num_seqs * layout.slot_bytes + snaps * layout.snapshot_bytes
    blocks_free = pool - fixed
    need = layout.blocks_for(max_model_len)
    num_blocks = max(blocks_free // layout.block_bytes, 0)
    if num_blocks < need:
        fits = num_blocks * layout.block_size
        head = (f"--max-model-len {max_model_len} needs {_gib(need * layout.block_bytes)} of KV "
                f"blocks per rank but {_gib(blocks_free)} is left" if fits else
                f"no KV cache fits: {_gib(layout.block_bytes - blocks_free)} short of one block")
        where = (f"{_gib(budget)} budget = {_gib(total_bytes)} x {utilization}, less "
                 f"{_gib(used)} weights and runtime, {_gib(workspace_bytes)} workspace, "
                 f"{_gib(graph_bytes)} graphs, {max_num_seqs} slots x "
                 f"{layout.slot_bytes / MiB:.1f} MiB + {snaps} snapshots x "
                 f"{layout.snapshot_bytes / MiB:.1f} MiB")
        fixes = [f"lower --max-model-len to at most {fits}" if fits else "",
                 "raise --gpu-memory-utilization" if utilization < 0.99 else "",
                 "use --kv-cache-dtype int8" if layout.kv_dtype != "int8" else "",
                 "use a larger --tp", "fewer --max-num-seqs or snapshot slots",
                 "a smaller --max-num-batched-tokens",
                 "4-bit experts (--experts mx4)" if experts != "mx4" else ""]
        raise ValueError(f"{head} ({where}); to fit: {', '.join(f for f in fixes if f)}")
    cap = num_blocks * layout.block_size
    return Plan(gpu_mem_bytes=total_bytes, gpu_memory_utilization=utilization,
                kv_cache_dtype=layout.kv_dtype, used_bytes=used, workspace_bytes=workspace_bytes,
                graph_reserve_bytes=graph_bytes,
                kv_pool_bytes=fixed + num_blocks * layout.block_bytes,
                slot_bytes=layout.slot_bytes, num_slots=max_num_seqs, num_snapshot_slots=snaps,
                snapshot_bytes=layout.snapshot_bytes,
                block_size=layout.block_size, block_bytes=layout.block_bytes, num_blocks=num_blocks,
                kv_bytes_per_token=layout.kv_bytes_per_token,
                kv_bytes_per_sequence=layout.sequence_bytes(max_model_len), kv_capacity_tokens=cap,
                max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                max_concurrency_at_max_model_len=min(max_num_seqs, num_blocks // need),
                longest_context=min(cap, model_limit or cap), tp=tp, experts=experts,
                weight_bytes_per_rank=used if weight_bytes is None else weight_bytes,
                max_num_batched_tokens=max_num_batched_tokens, planned=planned, notes=notes,
                prefill_graph_tokens=prefill_graph_tokens)


def pick_batched_tokens(plan_for) -> tuple[int, Plan]:
    """The default --max-num-batched-tokens and its plan: plan_for(T) -> Plan (ValueError when
    nothing fits) for T in BATCHED_TOKENS; the larger T unless its KV capacity is below 90 % of
    the smaller's (e.g. TP 4, INT8 experts, 80 GiB at 0.95: 27,904 tokens against 232,832) or
    it does not fit. Raises the smaller T's ValueError when neither fits."""
    small, large = BATCHED_TOKENS
    base = plan_for(small)
    try:
        big = plan_for(large)
    except ValueError:
        return small, base
    if big.kv_capacity_tokens >= 0.9 * base.kv_capacity_tokens:
        return large, big
    return small, base


def pick_prefill_graphs(plan_pg, tokens: int) -> Plan:
    """The default prefill graphs and their plan: plan_pg(P) -> Plan with the reserve of
    prefill graphs up to P tokens (P = 0: none; ValueError when nothing fits). P = min(tokens,
    PREFILL_GRAPH_MAX) unless that plan's KV capacity is below 90 % of P = 0's or it does not
    fit; then none. Raises P = 0's ValueError when nothing fits."""
    base = plan_pg(0)
    P = prefill_graph_count(PREFILL_GRAPH_MAX, tokens)
    if not P:
        return base
    try:
        with_graphs = plan_pg(P)
    except ValueError:
        return base
    return with_graphs if with_graphs.kv_capacity_tokens >= 0.9 * base.kv_capacity_tokens \
        else base


def max_positions(cfg: ModelConfig) -> int:
    """The model's context limit from YaRN: original_max_position_embeddings x factor (Flash 1M)."""
    rs = cfg.rope_scaling or {}
    return int(rs.get("original_max_position_embeddings", 0) * rs.get("factor", 1)) or 2 ** 20


def model_limit(config_json: str | Path) -> int:
    """The longest context a checkpoint allows: its config.json's max_position_embeddings, else
    max_positions (YaRN)."""
    p = Path(config_json)
    return int(json.loads(p.read_text()).get("max_position_embeddings")
               or max_positions(ModelConfig.from_file(p)))


def longest_fit(attempt, block_size: int, limit: int) -> int:
    """Largest length (a multiple of block_size, or the model limit) for which attempt(length)
    does not raise ValueError; 0 when none does (a binary search: attempt is pure arithmetic)."""
    def ok(n):
        try:
            attempt(n)
            return True
        except ValueError:
            return False
    if ok(limit):
        return limit
    lo, hi = 0, limit // block_size           # ok(lo·B) (lo=0 trivially), not ok(hi·B)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid * block_size) else (lo, mid)
    return lo * block_size
