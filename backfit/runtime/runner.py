"""ModelRunner: one rank's model and cache pools; runs one engine step (docs/ENGINE.md §4).

A step is plain data (StepInput: picklable, broadcast to every TP rank): per sequence its slot,
block table, start and new token ids, plus the prefix-cache snapshots to restore before the
forward and to save after it (docs/ENGINE.md §3). forward(step) runs every prefill chunk and decode token in ONE batch and returns FP32
logits [num_sampled, vocab] for the sequences that sample (their last token), plus every row of
the sequences that asked for prompt logprobs. Sampling is the engine's (rank 0 only).

Pool sizing (size_pools) is the planner's `fit` (runtime/cache/budget.py, also behind
`backfit plan`): on CUDA, the memory free after loading, less (1 - gpu_memory_utilization) of the
card and the activation workspace of a max_num_batched_tokens step, goes to the slots (running
sequences) and the prefix-cache snapshots first and to blocks after; on CPU, --cpu-kv-cache-gib is the budget. Byte counts
come from runtime/cache/layout.py, which a test holds equal to what PagedCache allocates.

Kernels (--kernels): "triton" (default on CUDA) or "torch" (default on CPU, the reference path);
the runner sets the process-wide runtime.kernels backend once, before the model is built, and
stacks the experts for the fused MoE right after loading (MoE.prepare_kernels).

CUDA graphs (runtime/graphs/): with the triton kernels on CUDA, pure-decode steps replay a
graph captured at start-up for the smallest batch size that holds them; prefill and mixed steps
of up to prefill_graph_tokens replay piecewise graphs (runtime/graphs/prefill.py: the
cache-free parts of each layer captured per padded token count, the attention cores eager);
larger steps and --enforce-eager run eagerly. At tp > 1 every rank captures the same sizes in
the same order, the NCCL all-reduces inside (every rank then replays the same graph for a step:
the step is broadcast, and whether a graph fits depends on the step alone).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from backfit.config import ModelConfig
from backfit.runtime.batch import ForwardBatch, fill_placeholders_, to_device
from backfit.runtime.cache.layout import default_block_size
from backfit.runtime.cache.paged import PagedCache, check_block_size

__all__ = ["RunnerConfig", "StepSeq", "StepInput", "ModelRunner", "resolve_kernels"]


@dataclass(frozen=True)
class RunnerConfig:
    model: str                               # converted directory
    dtype: str = "bfloat16"                  # activations: bfloat16 | float32
    device: str = "cpu"
    kv_cache_dtype: str = "auto"             # auto (= activations) | bf16 | int8
    block_size: int | None = None            # tokens per block; None: default_block_size
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None   # None: budget.pick_batched_tokens on CUDA
    #                                               (2,048 or 8,192), 2,048 elsewhere
    max_model_len: int | None = 8192         # None: the longest the pools hold (size_pools)
    num_snapshot_slots: int | None = None    # prefix-cache snapshots (a pool of their own);
    #                                          None: = max_num_seqs
    num_blocks: int | None = None            # None: from memory (size_pools)
    gpu_memory_utilization: float = 0.90
    cpu_kv_cache_gib: float = 4.0
    kernels: str | None = None               # triton | torch; None: triton on CUDA, torch on CPU
    enforce_eager: bool = False              # True: no CUDA graphs at all
    prefill_graph_tokens: int | None = None  # prefill / mixed steps up to this many tokens
    #                                          replay piecewise graphs; None: auto (up to
    #                                          budget.PREFILL_GRAPH_MAX where they cost at most
    #                                          10 % of the KV capacity); 0: eager
    speculative_method: str | None = None    # "mtp" (Flash) | "dspark" (0731): load the drafter
    num_speculative_tokens: int = 0          # k drafted tokens a speculative step verifies
    speculative_max_batch: int = 16          # speculative steps' graphs up to this many seqs


@dataclass(frozen=True)
class StepSeq:
    seq_id: int
    slot: int
    block_table: tuple[int, ...]
    start: int                               # tokens already in the cache
    tokens: tuple[int, ...]                  # new tokens (a prefill chunk or one decode token)
    sample: bool                             # return the last row's logits
    all_logits: bool = False                 # return every row (prompt logprobs, echo)
    draft: int = 0                           # > 0: draft this many tokens after `tokens` (one
    #                                          token, x_c) and verify them: every row sampled
    temperature: float = 0.0                 # draft draws (0: greedy drafts)
    images: tuple = ()                       # Vision-Exp: (ImageSpan, PreparedImage) of every
    #                                          image block inside this chunk (whole)


@dataclass(frozen=True)
class StepInput:
    seqs: tuple[StepSeq, ...]
    restores: tuple[tuple[int, int, int], ...] = ()   # (snapshot, seq slot, boundary): before
    saves: tuple[tuple[int, int, int], ...] = ()      # (seq slot, snapshot, boundary): after
    draft_seed: int = 0                          # seeds the draft draws (alike on every rank)


@dataclass
class StepOutput:
    logits: torch.Tensor | None              # [num sample seqs, V] FP32, in step order (a graph
    #                                          replay: a view, valid until the next forward)
    all_logits: dict[int, torch.Tensor] = field(default_factory=dict)   # seq_id -> [n, V]
    draft: object | None = None              # model.draft.Draft of the drafting sequences


def resolve_kernels(kernels: str | None, device: str | torch.device) -> str:
    """The kernel backend for --kernels on `device`; raises ValueError with what to change."""
    from backfit.runtime.kernels import KERNEL_BACKENDS
    cuda = torch.device(device).type == "cuda"
    name = kernels if kernels is not None else ("triton" if cuda else "torch")
    if name not in KERNEL_BACKENDS:
        raise ValueError(f"--kernels {name!r}: choose one of {', '.join(KERNEL_BACKENDS)}")
    if name == "triton" and not cuda:
        raise ValueError(f"--kernels triton needs a CUDA device (got --device {device}); "
                         "use --kernels torch on CPU")
    return name


class ModelRunner:
    def __init__(self, rc: RunnerConfig):
        from backfit.runtime.kernels import set_kernel_backend
        from backfit.runtime.loader import load_model
        from backfit.runtime.model.transformer import Transformer
        self.rc, self.timings = rc, {}
        self.kernels = resolve_kernels(rc.kernels, rc.device)
        set_kernel_backend(self.kernels)                # once per process (raises on a change)
        self.cfg = ModelConfig.from_file(Path(rc.model) / "config.json")
        self.dtype = getattr(torch, rc.dtype)
        self.device = torch.device(rc.device)
        self.block_size = rc.block_size or default_block_size(self.cfg)
        check_block_size(self.cfg, self.block_size)
        self.kv = rc.kv_cache_dtype
        if self.kv == "bf16":                         # = the activations, which must be bf16
            if self.dtype != torch.bfloat16:
                raise ValueError("--kv-cache-dtype bf16 needs bfloat16 activations (or use auto)")
            self.kv = "auto"
        elif self.kv not in ("auto", "int8"):
            raise ValueError(f"--kv-cache-dtype {self.kv!r}: choose auto, bf16 or int8")
        from backfit.runtime.drafting import check_speculative
        check_speculative(rc.speculative_method, rc.num_speculative_tokens, self.cfg)
        t = time.perf_counter()
        self.model = Transformer(self.cfg, self.dtype, mtp=rc.speculative_method is not None)
        load_model(self.model, rc.model, self.device)
        if self.kernels == "triton":                    # stacked experts before pool sizing
            self.model.prepare_kernels()
        self.timings["weights_s"] = time.perf_counter() - t
        t = time.perf_counter()
        self.num_slots, self.num_snapshot_slots, self.num_blocks = self.size_pools()
        self.cache = PagedCache(self.cfg, self.num_slots, self.num_blocks, self.block_size,
                                self.dtype, self.kv, self.device, mtp_layers=len(self.model.mtp),
                                num_snapshots=self.num_snapshot_slots)
        self.drafting = None
        if rc.speculative_method is not None:
            from backfit.runtime.drafting import Drafting
            self.drafting = Drafting(self.model, self.cache, self.num_slots,
                                     rc.num_speculative_tokens, self.num_snapshot_slots)
        self.timings["pools_s"] = time.perf_counter() - t
        self.image_cache = None                         # Vision-Exp: aligner rows by image key
        if self.cfg.vision is not None:
            from backfit.runtime.images import EmbeddingCache
            self.image_cache = EmbeddingCache(self.model)
        self.graphs = self.prefill_graphs = self.spec_graphs = None
        self._sampled_rows = 0                          # of the last step (its ids: `prev`)
        if self.use_graphs:
            self.capture_graphs()

    @property
    def use_graphs(self) -> bool:
        return (self.kernels == "triton" and self.device.type == "cuda"
                and not self.rc.enforce_eager)

    def capture_graphs(self, log=None) -> None:
        """Capture the decode graphs (runtime/graphs/) over the current pools; progress goes
        to stderr (stdout may be the generated text)."""
        import sys
        log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        from backfit.runtime.graphs import DecodeGraphs
        nblk = -(-self.rc.max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self.model, self.cache, self.rc.max_num_seqs, nblk,
                                   self.drafting)
        self.graphs.capture(log)
        self.timings["graphs_s"] = self.graphs.capture_s
        bad = self.graphs.check()                  # every rank reaches the same verdict
        if bad is not None:
            log(f"warning: {bad}; decode runs eagerly (please report this; --enforce-eager "
                "skips the capture)")
            self.graphs = None
        if self.drafting is not None and self.rc.speculative_max_batch > 0:
            from backfit.runtime.graphs import SpecGraphs
            self.spec_graphs = SpecGraphs(self.model, self.cache, self.drafting,
                                          min(self.rc.speculative_max_batch, self.rc.max_num_seqs),
                                          nblk)
            self.spec_graphs.capture(log)
            self.timings["spec_graphs_s"] = self.spec_graphs.capture_s
        if self.prefill_graph_tokens:
            from backfit.runtime.graphs import PrefillGraphs
            self.prefill_graphs = PrefillGraphs(self.model, self.prefill_graph_tokens,
                                                self.device)
            self.prefill_graphs.capture(log)
            self.timings["prefill_graphs_s"] = self.prefill_graphs.capture_s
            bad = self.prefill_graphs.check()
            if bad is not None:
                log(f"warning: {bad}; prefill steps run eagerly (please report this; "
                    "--prefill-graph-tokens 0 skips the capture)")
                self.prefill_graphs = None

    def size_pools(self) -> tuple[int, int, int]:
        """(slots, snapshots, blocks) from the planner's `fit` (runtime/cache/budget.py), the same
        arithmetic as `backfit plan`, on measured free memory; raises with what to change. Sets
        self.max_num_batched_tokens (the engine's chunk budget: rc's, else on CUDA
        pick_batched_tokens, else 2,048) and self.prefill_graph_tokens (rc's, else on CUDA with
        graphs budget.pick_prefill_graphs: up to 2,048 where the graphs cost at most 10 % of the
        KV capacity; 0: none). rc.max_model_len None: the longest the pools hold (a multiple
        of the block size, up to the model's limit, as vLLM picks it), set in self.rc. At tp > 1
        every rank takes the smallest of the ranks' length, slots, snapshots, blocks and budget: rank 0's
        block manager hands out block ids for all of them (self.plan stays this rank's own
        plan)."""
        from backfit.runtime.cache.budget import longest_fit, model_limit
        from backfit.runtime.distributed import min_over_ranks
        rc = self.rc
        if rc.max_model_len is None:                  # the longest that fits, on every rank
            def attempt(n: int):
                return self._plan(replace(rc, max_model_len=n))
            longest = longest_fit(attempt, self.block_size,
                                  model_limit(Path(rc.model) / "config.json"))
            if longest == 0:
                attempt(self.block_size)              # raises: what to change
            longest = int(min_over_ranks([longest], self.device)[0])
            self.rc = rc = replace(rc, max_model_len=longest)
        T, layout = self._plan(rc)
        blocks = self.plan.num_blocks
        if rc.num_blocks is None and self.device.type == "cpu":   # no more than can be used
            blocks = min(blocks, layout.blocks_for(rc.max_model_len) * rc.max_num_seqs)
        slots, snaps, blocks, self.max_num_batched_tokens, pg = min_over_ranks(
            [self.plan.num_slots, self.plan.num_snapshot_slots, blocks, T,
             self.plan.prefill_graph_tokens], self.device)
        self.prefill_graph_tokens = pg            # every rank's count is 0 or >= 64
        return slots, snaps, blocks

    def _plan(self, rc: RunnerConfig):
        """size_pools' plan for rc (max_model_len given): sets self.plan; -> (the token budget
        T, the cache layout). Raises ValueError (what to change) when rc does not fit."""
        from backfit.runtime.cache.budget import (BATCHED_TOKENS, PREFILL_GRAPH_MAX, GiB, fit,
                                                  graph_reserve, pick_batched_tokens,
                                                  pick_prefill_graphs, prefill_graph_count,
                                                  prefill_graph_reserve, workspace)
        from backfit.runtime.cache.layout import cache_layout
        from backfit.runtime.distributed import get_tp_info
        pg_req = rc.prefill_graph_tokens             # None: auto
        if pg_req is not None:
            prefill_graph_count(pg_req, pg_req)      # raises on a bad value, on any device
        pg_on = self.use_graphs and pg_req != 0
        act = "fp32" if self.dtype == torch.float32 else "bf16"
        layout = cache_layout(self.cfg, act if self.kv == "auto" else "int8", self.block_size,
                              act_dtype=act, draft_layers=len(self.model.mtp))
        kw = dict(max_model_len=rc.max_model_len, max_num_seqs=rc.max_num_seqs,
                  num_snapshot_slots=rc.num_snapshot_slots, tp=get_tp_info().size)
        measured = rc.num_blocks is None and self.device.type == "cuda"   # the default picked
        T = rc.max_num_batched_tokens or (None if measured else BATCHED_TOKENS[0])   # below
        pg_fixed = prefill_graph_count(pg_req or PREFILL_GRAPH_MAX, T) if pg_on and T else 0
        if rc.num_blocks is not None:                         # fixed (tests, CPU runs)
            snaps = rc.max_num_seqs if rc.num_snapshot_slots is None else rc.num_snapshot_slots
            n = layout.slot_bytes * rc.max_num_seqs + layout.snapshot_bytes * max(snaps, 0) \
                + rc.num_blocks * layout.block_bytes
            self.plan = fit(layout, n, n, utilization=1.0, max_num_batched_tokens=T,
                            prefill_graph_tokens=pg_fixed, **kw)
        elif self.device.type == "cuda":                      # after loading: what is really free
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            gb = graph_reserve(self.cfg, kw["tp"], rc.max_model_len, rc.max_num_seqs) \
                if self.use_graphs else 0
            A = self.dtype.itemsize

            def plan_pg(t: int, pg: int):
                ws = workspace(self.cfg, kw["tp"], t, rc.max_model_len, rc.max_num_seqs,
                               act_bytes=A).total
                pb = prefill_graph_reserve(self.cfg, kw["tp"], pg, rc.max_model_len,
                                           rc.max_num_seqs, A) if pg else 0
                return fit(layout, free, total, utilization=rc.gpu_memory_utilization,
                           workspace_bytes=ws, graph_bytes=gb + pb, max_num_batched_tokens=t,
                           prefill_graph_tokens=pg, **kw)

            def plan_for(t: int):                 # budget.pick_prefill_graphs where auto
                if pg_on and pg_req is None:
                    return pick_prefill_graphs(lambda pg: plan_pg(t, pg), t)
                return plan_pg(t, prefill_graph_count(pg_req, t) if pg_on else 0)
            T, self.plan = (T, plan_for(T)) if T else pick_batched_tokens(plan_for)
        else:                                                 # CPU: --cpu-kv-cache-gib
            budget = int(rc.cpu_kv_cache_gib * GiB)
            self.plan = fit(layout, budget, budget, utilization=1.0, max_num_batched_tokens=T,
                            **kw)
        return T, layout

    def _context(self, X: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor, seqs) -> None:
        """The drafter's context after a forward of chunks (runtime/drafting.py)."""
        from backfit.runtime.drafting import RowPlan
        lens = [len(s.tokens) for s in seqs]
        slots = to_device([s.slot for s, n in zip(seqs, lens) for _ in range(n)], torch.int64,
                          X.device)
        self.drafting.context(X, self.model.taps, tokens, pos, slots,
                              RowPlan(lens, self.drafting.ring, X.device))

    def _spec_replay(self, step: StepInput) -> StepOutput | None:
        """A speculative decode step on SpecGraphs: (logits of every row, the Draft), or None
        when no graph holds it (then it runs eagerly)."""
        from backfit.runtime.model.draft import Draft
        seqs = step.seqs
        temps = [s.temperature for s in seqs]
        got = self.spec_graphs.run([(s.tokens[0], s.start, s.slot, s.block_table) for s in seqs],
                                   temps, step.draft_seed)
        if got is None:
            return None
        logits, ids, dlogits = got
        probs = None
        if any(t > 0 for t in temps):             # the q each sampled draft was drawn from
            t = to_device(temps, torch.float32, dlogits.device).clamp(min=1e-5)
            probs = torch.softmax(dlogits / t[:, None, None], -1)
        self._snapshots(step.saves, save=True)
        return StepOutput(logits, draft=Draft(ids, probs, dlogits, None))

    @torch.no_grad()
    def forward(self, step: StepInput, prev: torch.Tensor | None = None) -> StepOutput:
        """One step. prev (the overlapped engine step): the last step's sampled ids [R] on the
        device, which a new token -1 - r stands for (filled on the device, no host sync). At
        tp > 1 rank 0 passes them and every rank takes them from rank 0 (one broadcast on the
        model's group, in step order on every rank; R = the last step's sampling rows)."""
        from backfit.runtime.distributed import broadcast_from_rank0, get_tp_info
        self._snapshots(step.restores, save=False)
        seqs = step.seqs
        holes = any(min(s.tokens) < 0 for s in seqs)
        tp = get_tp_info()
        if holes and tp.rank != 0:                    # filled by the broadcast below
            prev = torch.empty(self._sampled_rows, dtype=torch.int64, device=self.device)
        if holes and prev is None:
            raise ValueError("the step has placeholder tokens but no previous sampled ids")
        if holes and tp.size > 1:
            prev = broadcast_from_rank0(prev.contiguous())
        self._sampled_rows = sum(s.sample + s.draft for s in seqs)
        if self.spec_graphs is not None and not holes and all(
                s.draft == self.drafting.k and len(s.tokens) == 1 and not s.all_logits
                for s in seqs):                   # draft + verify + context in one replay
            out = self._spec_replay(step)
            if out is not None:
                return out
        draft = None
        if any(s.draft for s in seqs):            # d_1..d_k of each, filled in as placeholders
            if holes:
                raise ValueError("a speculative step cannot take an overlapped step's tokens")
            draft = self.drafting.draft([s for s in seqs if s.draft], step.draft_seed)
            prev, holes, r, k = draft.ids.flatten(), True, 0, draft.ids.shape[1]
            expanded = []
            for s in seqs:
                expanded.append(dataclasses.replace(s, tokens=s.tokens + tuple(
                    -1 - r - j for j in range(s.draft))))
                r += k if s.draft else 0
            seqs = expanded
        images = self._images(seqs)
        graphs = images is None                   # steps with images run eagerly: the graphs
        if graphs and self.graphs is not None and all(   # embed plain ids only
                len(s.tokens) == 1 and s.sample and not s.all_logits for s in seqs):
            logits = self.graphs.run([(s.tokens[0], s.start, s.slot, s.block_table) for s in seqs],
                                     prev if holes else None)
            if logits is not None:
                self._snapshots(step.saves, save=True)
                return StepOutput(logits)
        X = None
        if graphs and self.prefill_graphs is not None and any(len(s.tokens) > 1 for s in seqs):
            X = self.prefill_graphs.hidden([(s.seq_id, s.tokens, s.start, s.slot, s.block_table)
                                            for s in seqs], self.cache, prev if holes else None)
            if X is not None and self.drafting is not None:
                T = X.shape[0]
                stage = self.prefill_graphs.stage
                self._context(X, stage[0, :T], stage[1, :T], seqs)
        if X is None:                                             # eager
            batch = ForwardBatch.build([(s.seq_id, list(s.tokens), s.start) for s in seqs],
                                       self.device, [s.slot for s in seqs],
                                       [s.block_table for s in seqs], images)
            if holes:
                fill_placeholders_(batch.tokens, prev)
            X = self.model.hidden(batch, self.cache)              # [T, hc, d]
            if self.drafting is not None:
                self._context(X, batch.tokens, batch.positions, seqs)
        ends = list(itertools.accumulate(len(s.tokens) for s in seqs))
        out = StepOutput(None, draft=draft)
        rows = []                                 # the sampled rows (host ints): the last row,
        for i, s in enumerate(seqs):              # every row of a drafting sequence
            if s.sample:
                first = ends[i] - 1 - (s.draft if s.draft else 0)
                rows += range(first, ends[i])
        if rows:
            every = len(rows) == X.shape[0]       # pure decode: rows 0..T-1, no gather
            out.logits = self.model.logits(
                X, None if every else to_device(rows, torch.int64, X.device))
        lo = 0
        for s in seqs:
            if s.all_logits:
                out.all_logits[s.seq_id] = self.model.logits(X[lo:lo + len(s.tokens)])
            lo += len(s.tokens)
        self._snapshots(step.saves, save=True)
        return out

    def _images(self, seqs):
        """The step's image blocks as BatchImages (runtime/images.py: the tower for images not
        seen yet, the count check of every sequence), or None without images."""
        if self.image_cache is None:
            if any(s.images for s in seqs):
                raise ValueError("this checkpoint has no vision tower; the step has images")
            return None
        from backfit.runtime.images import batch_images
        return batch_images(self.model, self.image_cache,
                            [(s.tokens, s.start, s.images) for s in seqs])

    def _snapshots(self, copies, save: bool) -> None:
        """Prefix-cache snapshots (docs/ENGINE.md §3): saves (seq slot, snapshot, boundary) after
        the forward, restores (snapshot, seq slot, boundary) before it; the drafter's with them."""
        for a, b, boundary in copies:
            slot, snap = (a, b) if save else (b, a)
            if save:
                self.cache.snapshots.save(slot, snap, boundary)
            else:
                self.cache.snapshots.restore(snap, slot, boundary)
            if self.drafting is not None:
                self.drafting.snapshot(slot, snap, boundary, save)
