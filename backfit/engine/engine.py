"""LLMEngine: add_request / step / abort / generate over the scheduler and the TP ranks.

No HTTP and no asyncio here (async_engine.py wraps it). One step:
  scheduler.schedule()        which chunks and decode tokens run (engine/scheduler.py)
  ranks.forward(StepInput)    one batched forward on every TP rank (runtime/workers.py)
  sample                      rank 0 only, batched on device (runtime/sampling.py), the ids
                              copied to the host asynchronously
  scheduler.advance           num_computed moves on, blocks register, placeholder tokens
  resolve                     the host reads the ids: scheduler.resolve (token-level stops),
                              TextStream.append (detokenized deltas, stop strings)
Every request gets RequestOutput deltas; the last one has finish_reason and usage.

Async scheduling (--async-scheduling, on by default on CUDA; docs/ENGINE.md §6): a
step resolves the step before it only after launching itself, so the GPU runs step N+1 while
the host reads, detokenizes and stops step N and schedules N+2. Step N+1's decode tokens are
step N's placeholders, filled on the device from its sampled ids (at tp > 1 the other ranks
take them from rank 0 in a broadcast inside the step). Outputs come one step later,
and a request that stops at step N has computed one wasted row in N+1 (dropped). Steps whose
running requests use repetition / frequency / presence penalties run without overlap (the
penalties need the token history on the host).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from backfit.config import ModelConfig
from backfit.engine.block_manager import BlockManager
from backfit.engine.sampling_params import SamplingParams
from backfit.engine.scheduler import ScheduledSeq, ScheduledStep, Scheduler
from backfit.engine.sequence import Sequence
from backfit.engine.speculative import SpecStats, VerifyResult, verify
from backfit.engine.tokenizer import TextStream, load_tokenizer
from backfit.runtime.runner import RunnerConfig, StepInput, StepSeq, resolve_kernels
from backfit.runtime.sampling import PendingSample, SamplingBatch, prompt_logprobs, sample
from backfit.runtime.workers import RankGroup
from backfit.vision import check_counts
from backfit.vision.block import N_TYPES

__all__ = ["EngineConfig", "RequestOutput", "Usage", "LLMEngine", "SPEC_MAX_BATCH"]

# speculation off while more requests than this decode (--speculative-disable-by-batch-size):
# where a verify step stops paying for itself. Measured (H100, docs/SPECULATIVE.md §5): on the
# TP-4 slice at batch 1 a DSpark k 5 step costs 2.27 plain steps (wins from an accepted length
# of 2.3); at batch 8 (4 layers) the step cost 4.6 plain ones and lost at every accepted length
# up to 4.5. Batches 2-4 are not measured: 4 is below the measured loss.
SPEC_MAX_BATCH = 4


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tp: int = 1
    dtype: str = "bfloat16"
    device: str = "cpu"
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None     # None: the runner's (2,048, or 8,192 on CUDA
    #                                               where the KV pool can afford it)
    max_model_len: int | None = 8192              # None: the longest the KV pools hold, up to
    #                                               the model's limit (the runner picks it)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_blocks: int | None = None
    num_snapshot_slots: int | None = None         # prefix-cache snapshots (None: max_num_seqs)
    prefix_snapshot_interval: int | None = None   # blocks between periodic snapshots (0: none;
    #                                               None: the token budget in blocks; §3)
    gpu_memory_utilization: float = 0.90
    cpu_kv_cache_gib: float = 4.0
    seed: int = 0                                 # unseeded requests draw from this stream
    kernels: str | None = None                    # triton | torch; None: triton on CUDA, else torch
    enforce_eager: bool = False                   # True: no CUDA graphs at all
    prefill_graph_tokens: int | None = None       # RunnerConfig's (None: auto, 0: eager)
    async_scheduling: bool | None = None          # overlap a step's host part with the next
    #                                               step's GPU work; None: on with CUDA
    speculative_method: str | None = None         # "mtp" (Flash) | "dspark" (0731)
    num_speculative_tokens: int = 0               # k: drafts verified per decode step
    speculative_disable_by_batch_size: int | None = None   # no speculation with more decoding
    #                                               requests than this (None: SPEC_MAX_BATCH)

    def __post_init__(self):
        resolve_kernels(self.kernels, self.device)   # a bad choice fails before ranks start

    @property
    def overlap(self) -> bool:
        if self.async_scheduling is not None:
            return self.async_scheduling
        return str(self.device).startswith("cuda")

    def runner_config(self) -> RunnerConfig:
        return RunnerConfig(self.model, self.dtype, self.device, self.kv_cache_dtype,
                            self.block_size, self.max_num_seqs, self.max_num_batched_tokens,
                            self.max_model_len, self.num_snapshot_slots, self.num_blocks,
                            self.gpu_memory_utilization, self.cpu_kv_cache_gib, self.kernels,
                            self.enforce_eager, self.prefill_graph_tokens,
                            self.speculative_method, self.num_speculative_tokens,
                            self.spec_max_batch)

    @property
    def spec_max_batch(self) -> int:
        """Decoding requests above which no step speculates."""
        limit = self.speculative_disable_by_batch_size
        return SPEC_MAX_BATCH if limit is None else limit


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int                            # prompt tokens served by the prefix cache


@dataclass
class RequestOutput:
    """One request's delta from one step (text and ids since the last output)."""
    request_id: int
    text: str
    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]] | None]] | None = None
    finished: bool = False
    finish_reason: str | None = None              # "stop" | "length" | "abort"
    stop_reason: str | int | None = None          # matched stop string / stop token id
    usage: Usage | None = None                    # on the last output
    prompt_logprobs: list | None = None           # first output only, when asked
    num_cached_tokens: int = 0                    # prompt tokens served by the prefix cache, on
    #                                               every output (a caller that stops reading
    #                                               before the last one still knows: stop strings)


@dataclass
class _Request:
    seq: Sequence
    stream: TextStream
    prompt_logprobs: list | None = None


@dataclass
class _Launched:
    """A step on the device, not yet read by the host."""
    sched: ScheduledStep
    rows: list[ScheduledSeq]                      # the sampling rows, in row order
    tokens: torch.Tensor | None                   # [len(rows)] int64 on the device
    host: PendingSample | None                    # the same ids (and logprobs) on their way
    all_logits: dict                              # seq_id -> [n, V] (prompt logprobs)
    verified: VerifyResult | None = None          # the speculative rows' emitted tokens (read)


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.model_cfg = ModelConfig.from_file(Path(cfg.model) / "config.json")
        self.tokenizer = load_tokenizer(cfg.model)
        self.ranks = RankGroup(cfg.runner_config(), cfg.tp)
        r = self.ranks.runner
        self.block_size, self.num_blocks = r.block_size, r.num_blocks
        self.max_model_len = r.rc.max_model_len      # resolved (cfg's, or the longest that fits)
        self.timings = dict(r.timings)
        self.block_manager = BlockManager(r.num_blocks, r.block_size, cfg.max_num_seqs,
                                          r.num_snapshot_slots, cfg.enable_prefix_caching)
        self.max_num_batched_tokens = cfg.max_num_batched_tokens or r.max_num_batched_tokens
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs,
                                   self.max_num_batched_tokens, self.max_model_len,
                                   cfg.enable_chunked_prefill, self.model_cfg.eos_token_id,
                                   cfg.num_speculative_tokens, cfg.spec_max_batch,
                                   cfg.prefix_snapshot_interval)
        self.spec = SpecStats(cfg.num_speculative_tokens)
        self.requests: dict[int, _Request] = {}
        self.prompt_tokens_total = self.generation_tokens_total = 0
        self._ids = itertools.count()
        self._gen = torch.Generator(device=r.device).manual_seed(cfg.seed)
        self._host_gen = torch.Generator().manual_seed(cfg.seed)   # the draft draws' seeds
        self.overlap = cfg.overlap
        self._pending: _Launched | None = None    # overlap: the step launched last, unread

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: int | None = None, images: tuple = ()) -> int:
        """Queue a request; raises ValueError (clear message) if it can never run. images:
        a Vision-Exp prompt's (ImageSpan, PreparedImage) pairs (backfit.vision.splice), its
        ids vocab_size + type at their blocks."""
        params = params or SamplingParams()
        rid = next(self._ids) if request_id is None else request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid} is already in use")
        self._check_ids(prompt_ids, images, params)
        seq = Sequence(rid, [int(t) for t in prompt_ids], params, images)
        self.scheduler.add(seq)                      # raises for oversized requests
        limit = self.max_model_len - len(prompt_ids)
        text = [t for t in prompt_ids if t < self.model_cfg.vocab_size] if images else prompt_ids
        stream = TextStream(self.tokenizer, params, self.model_cfg.eos_token_id, text, limit)
        self.requests[rid] = _Request(seq, stream)
        self.prompt_tokens_total += len(prompt_ids)
        return rid

    def _check_ids(self, prompt_ids: list[int], images: tuple, params: SamplingParams) -> None:
        """Text ids in the vocabulary; image-block ids exactly at the images' blocks."""
        V = self.model_cfg.vocab_size
        if images and self.model_cfg.vision is None:
            raise ValueError(f"{len(images)} image(s) given, but this model reads no images "
                             f"(config.json has no vision tower)")
        top = V + (N_TYPES if images else 0)
        bad = [t for t in prompt_ids if not 0 <= int(t) < top]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {V})")
        if images and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are not available for prompts with images")
        if images:                                # blocks exactly where the images say
            check_counts(prompt_ids, [sp for sp, _ in images],
                         [im.plan.gh * im.plan.gw for _, im in images], V)

    def abort(self, request_id: int) -> RequestOutput | None:
        """Stop a request now and give back everything it holds; None if it is not known."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.abort(request_id)
        self._drain_if_idle()
        return RequestOutput(request_id, "", [], finished=True, finish_reason="abort",
                             usage=self._usage(req.seq),
                             num_cached_tokens=req.seq.num_cached_tokens)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step, then read the one launched before it (overlap) or this
        one (no overlap); returns the outputs of the step read."""
        if self._pending is not None and not self._can_overlap():
            return self._resolve_pending()        # the next step needs every token on the host
        sched = self.scheduler.schedule()
        launched = None
        if sched.seqs:
            launched = self._launch(sched)
            self.scheduler.advance(sched)
        outputs = self._resolve_pending()         # the step before, while this one runs
        self._pending = launched
        if not self._can_overlap():               # no overlap (or a request that needs the
            outputs += self._resolve_pending()    # host's tokens joined): read it now
        else:
            self._drain_if_idle()
        return outputs

    def _can_overlap(self) -> bool:
        """Overlap the next step with this one's read-back: not when a request needs the
        host's token history (penalties) or the next step may speculate (its positions depend
        on this step's accepted drafts)."""
        sch = self.scheduler
        speculating = sch.k > 0 and (sch.spec_max_batch is None
                                     or len(sch.running) <= sch.spec_max_batch)
        return self.overlap and not speculating and \
            not any(s.params.has_penalties for s in sch.running)

    def _drain_if_idle(self) -> None:
        """Read the pending step now when none of its requests is live (its rows were wasted):
        the blocks of the requests that ended go back at once, not at the next step."""
        p = self._pending
        if p is not None and not any(s.seq.seq_id in self.requests for s in p.sched.seqs):
            self._resolve_pending()

    def _launch(self, sched: ScheduledStep) -> _Launched:
        """Forward + sampling on the device, the ids' copy to the host started; no host sync."""
        prev = self._pending.tokens if self._pending is not None else None
        step = StepInput(tuple(self._step_seq(s) for s in sched.seqs), tuple(sched.restores),
                         tuple(sched.saves),
                         int(torch.randint(1 << 62, (), generator=self._host_gen)))
        out = self.ranks.forward(step, prev)
        rows = [s for s in sched.seqs if s.sample and not s.draft]
        spec = [s for s in sched.seqs if s.draft]
        logits = out.logits
        verified = None
        if spec:                                  # rows: 1 for a plain seq, 1 + k verifying
            at, plain_at, spec_at = 0, [], []
            for s in sched.seqs:
                if s.sample:
                    (spec_at if s.draft else plain_at).extend(range(at, at + 1 + s.draft))
                    at += 1 + s.draft
            dev = logits.device
            verified = verify(logits[torch.tensor(spec_at, device=dev)], spec, out.draft,
                              self.model_cfg.vocab_size, self.model_cfg.eos_token_id, self._gen)
            logits = logits[torch.tensor(plain_at, device=dev)] if rows else None
        tokens = host = None
        if rows:
            seqs = [s.seq for s in rows]
            sb = SamplingBatch.build([q.params for q in seqs], [q.output_ids for q in seqs],
                                     [q.prompt_ids for q in seqs], self.model_cfg.vocab_size,
                                     logits.device, self.model_cfg.eos_token_id, self._gen)
            so = sample(logits, sb)
            tokens, host = so.token_ids, so.to_host_async()
        return _Launched(sched, rows, tokens, host, out.all_logits, verified)

    def _step_seq(self, s: ScheduledSeq) -> StepSeq:
        """A scheduled chunk as the runner's StepSeq, with a verifying sequence's draft count
        and draw temperature and the images whose blocks the chunk holds."""
        seq = s.seq
        temp = seq.params.temperature if s.draft else 0.0
        return StepSeq(seq.seq_id, seq.slot, tuple(seq.block_table), s.start,
                       tuple(s.token_ids), s.sample, self._wants_prompt_logprobs(s), s.draft,
                       temp, self._chunk_images(seq, s.start, s.start + len(s.token_ids)))

    @staticmethod
    def _chunk_images(seq: Sequence, start: int, end: int) -> tuple:
        """The (span, image) pairs whose blocks lie in positions start .. end-1 (the scheduler
        never splits one): the runner runs the tower for those it has not seen."""
        return tuple(p for p in seq.images if start <= p[0].start < end)

    def _resolve_pending(self) -> list[RequestOutput]:
        p, self._pending = self._pending, None
        return [] if p is None else self._resolve(p)

    def _resolve(self, launched: _Launched) -> list[RequestOutput]:
        """Read a launched step: prompt logprobs, sampled ids, stops, text deltas."""
        def live(s: ScheduledSeq) -> bool:            # its request is still being served
            req = self.requests.get(s.seq.seq_id)
            return req is not None and req.seq is s.seq

        for s in launched.sched.seqs:                 # prompt logprobs of this chunk (echo)
            if s.seq.seq_id in launched.all_logits and live(s):
                self._add_prompt_logprobs(s, launched.all_logits[s.seq.seq_id])
        rows = launched.rows
        host = launched.host.wait() if rows else None
        sampled = {s.seq.seq_id: t for s, t in zip(rows, host.token_ids)} if rows else {}
        lps = {s.seq.seq_id: [(host.logprobs[b], host.top[b])] for b, s in enumerate(rows)}
        v = launched.verified
        if v is not None:                             # the verifying rows, already read
            spec = [s for s in launched.sched.seqs if s.draft]
            rows = rows + spec
            for s, toks, lp, k in zip(spec, v.tokens, v.logprobs, v.drafted):
                sampled[s.seq.seq_id], lps[s.seq.seq_id] = toks, lp
                if live(s):
                    self.spec.add(k, len(toks) - 1)
        finished = {q.seq_id: q for q in self.scheduler.resolve(launched.sched, sampled)}
        outputs = []
        for s in rows:
            if not live(s):                           # ended (abort, a stop) before this step
                continue                              # was read: its row was wasted
            rid = s.seq.seq_id
            req = self.requests[rid]
            got = sampled[rid]
            toks = got if isinstance(got, list) else [got]
            lp = lps.get(rid) if s.seq.params.logprobs is not None else None
            outs = []                                 # one output a token, as without drafts:
            for i, tok in enumerate(toks):            # reasoning counts and logprob splits
                delta = req.stream.append(tok)        # downstream stay per token
                o = RequestOutput(rid, delta.text, [tok],
                                  num_cached_tokens=s.seq.num_cached_tokens)
                if lp is not None:
                    o.logprobs = lp[i:i + 1]
                outs.append(o)
                if delta.finished:                    # a stop inside the run: the rest is
                    break                             # not delivered
            n = len(outs)
            if n < len(toks):                         # usage counts what was delivered
                del s.seq.output_ids[s.start + len(s.token_ids) - s.seq.num_prompt + n:]
            self.generation_tokens_total += n
            if req.prompt_logprobs is not None:
                outs[0].prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
            o = outs[-1]
            if delta.finished or rid in finished:
                if rid not in finished:              # a stop string: the scheduler frees it
                    self.scheduler.finish(rid, delta.finish_reason)
                reason = delta.finish_reason or finished[rid].finish_reason
                o.finished, o.finish_reason, o.stop_reason = True, reason, delta.stop_reason
                o.usage = self._usage(s.seq)
                del self.requests[rid]
            outputs += outs
        return outputs

    def _wants_prompt_logprobs(self, s) -> bool:
        return s.seq.params.prompt_logprobs is not None and s.start < s.seq.num_prompt

    def _add_prompt_logprobs(self, s, logits: torch.Tensor) -> None:
        """Logprob of each prompt token given the ones before it (the first has none)."""
        req, seq = self.requests[s.seq.seq_id], s.seq
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None] if s.start == 0 else []
        n_prompt = min(len(s.token_ids), seq.num_prompt - s.start)
        nxt = seq.prompt_ids[s.start + 1:s.start + n_prompt + 1]   # targets inside the prompt
        if nxt:
            lp = prompt_logprobs(logits[:len(nxt)], torch.tensor(nxt, device=logits.device),
                                 seq.params.prompt_logprobs).to_host()
            req.prompt_logprobs += [(t, l, top) for t, l, top in zip(nxt, lp.logprobs, lp.top)]

    def stats(self) -> dict:
        """Counters and gauges for /metrics (plain numbers; read from the engine thread)."""
        bm, sch = self.block_manager, self.scheduler
        return {"num_requests_running": len(sch.running), "num_requests_waiting": len(sch.waiting),
                "kv_cache_usage": 1 - bm.num_free_blocks / bm.num_blocks,
                "num_blocks": bm.num_blocks, "num_free_blocks": bm.num_free_blocks,
                "num_free_slots": bm.num_free_slots, "num_preemptions": sch.num_preemptions,
                "prefix_cache_queries": bm.cache_query_tokens,
                "prefix_cache_hits": bm.cache_hit_tokens,
                "prompt_tokens": self.prompt_tokens_total,
                "generation_tokens": self.generation_tokens_total,
                "spec_decode_num_drafts": self.spec.num_drafts,
                "spec_decode_num_draft_tokens": self.spec.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.spec.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.spec.accepted_per_pos)}

    def _usage(self, seq: Sequence) -> Usage:
        return Usage(seq.num_prompt, seq.num_output, seq.num_cached_tokens)

    # ---- convenience ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 | None = None) -> list[dict]:
        """Run prompts to completion -> [{text, token_ids, finish_reason, usage}] in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        acc = {i: {"text": "", "token_ids": [], "finish_reason": None, "usage": None,
                   "logprobs": []} for i in ids}
        while self.has_unfinished():
            for o in self.step():
                a = acc[o.request_id]
                a["text"] += o.text
                a["token_ids"] += o.token_ids
                a["logprobs"] += o.logprobs or []
                if o.finished:
                    a["finish_reason"], a["usage"] = o.finish_reason, o.usage
        return [acc[i] for i in ids]

    def close(self) -> None:
        self.ranks.close()
