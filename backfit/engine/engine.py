"""LLMEngine: add_request / step / abort / generate over the scheduler and the TP ranks.

No HTTP and no asyncio here (async_engine.py wraps it). One step:
  scheduler.schedule()        which chunks and decode tokens run (engine/scheduler.py)
  ranks.forward(StepInput)    one batched forward on every TP rank (runtime/workers.py)
  sample                      rank 0 only, batched on device (runtime/sampling.py)
  scheduler.postprocess       tokens appended, token-level stops, blocks registered
  TextStream.append           detokenized deltas, stop strings (engine/tokenizer.py)
Every request gets RequestOutput deltas; the last one has finish_reason and usage.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from backfit.config import ModelConfig
from backfit.engine.block_manager import BlockManager
from backfit.engine.sampling_params import SamplingParams
from backfit.engine.scheduler import Scheduler
from backfit.engine.sequence import Sequence
from backfit.engine.tokenizer import TextStream, load_tokenizer
from backfit.runtime.runner import RunnerConfig, StepInput, StepSeq, resolve_kernels
from backfit.runtime.sampling import SamplingBatch, prompt_logprobs, sample
from backfit.runtime.workers import RankGroup

__all__ = ["EngineConfig", "RequestOutput", "Usage", "LLMEngine"]


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tp: int = 1
    dtype: str = "bfloat16"
    device: str = "cpu"
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_blocks: int | None = None
    num_snapshot_slots: int | None = None
    gpu_memory_utilization: float = 0.90
    cpu_kv_cache_gib: float = 4.0
    seed: int = 0                                 # unseeded requests draw from this stream
    kernels: str | None = None                    # triton | torch; None: triton on CUDA, else torch
    enforce_eager: bool = False                   # True: no CUDA graphs for decode steps

    def __post_init__(self):
        resolve_kernels(self.kernels, self.device)   # a bad choice fails before ranks start

    def runner_config(self) -> RunnerConfig:
        return RunnerConfig(self.model, self.dtype, self.device, self.kv_cache_dtype,
                            self.block_size, self.max_num_seqs, self.max_num_batched_tokens,
                            self.max_model_len, self.num_snapshot_slots, self.num_blocks,
                            self.gpu_memory_utilization, self.cpu_kv_cache_gib, self.kernels,
                            self.enforce_eager)


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


@dataclass
class _Request:
    seq: Sequence
    stream: TextStream
    prompt_logprobs: list | None = None


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.model_cfg = ModelConfig.from_file(Path(cfg.model) / "config.json")
        self.tokenizer = load_tokenizer(cfg.model)
        self.ranks = RankGroup(cfg.runner_config(), cfg.tp)
        r = self.ranks.runner
        self.block_size, self.num_blocks = r.block_size, r.num_blocks
        self.timings = dict(r.timings)
        self.block_manager = BlockManager(r.num_blocks, r.block_size, cfg.max_num_seqs,
                                          r.num_snapshot_slots, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs,
                                   cfg.max_num_batched_tokens, cfg.max_model_len,
                                   cfg.enable_chunked_prefill, self.model_cfg.eos_token_id)
        self.requests: dict[int, _Request] = {}
        self.prompt_tokens_total = self.generation_tokens_total = 0
        self._ids = itertools.count()
        self._gen = torch.Generator(device=r.device).manual_seed(cfg.seed)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: int | None = None) -> int:
        """Queue a request; raises ValueError (clear message) if it can never run."""
        params = params or SamplingParams()
        rid = next(self._ids) if request_id is None else request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid} is already in use")
        V = self.model_cfg.vocab_size
        bad = [t for t in prompt_ids if not 0 <= int(t) < V]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {V})")
        seq = Sequence(rid, [int(t) for t in prompt_ids], params)
        self.scheduler.add(seq)                      # raises for oversized requests
        limit = self.cfg.max_model_len - len(prompt_ids)
        stream = TextStream(self.tokenizer, params, self.model_cfg.eos_token_id, prompt_ids, limit)
        self.requests[rid] = _Request(seq, stream)
        self.prompt_tokens_total += len(prompt_ids)
        return rid

    def abort(self, request_id: int) -> RequestOutput | None:
        """Stop a request now and give back everything it holds; None if it is not known."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.abort(request_id)
        return RequestOutput(request_id, "", [], finished=True, finish_reason="abort",
                             usage=self._usage(req.seq))

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if not sched.seqs:
            return []
        step = StepInput(tuple(StepSeq(s.seq.seq_id, s.seq.slot, tuple(s.seq.block_table),
                                       s.start, tuple(s.token_ids), s.sample,
                                       self._wants_prompt_logprobs(s))
                               for s in sched.seqs),
                         tuple(sched.restores), tuple(sched.saves))
        out = self.ranks.forward(step)
        for s in sched.seqs:                          # prompt logprobs of this chunk (echo)
            if s.seq.seq_id in out.all_logits:
                self._add_prompt_logprobs(s, out.all_logits[s.seq.seq_id])
        rows = [s for s in sched.seqs if s.sample]
        sampled, host = {}, None
        if rows:
            seqs = [s.seq for s in rows]
            sb = SamplingBatch.build([q.params for q in seqs], [q.output_ids for q in seqs],
                                     [q.prompt_ids for q in seqs], self.model_cfg.vocab_size,
                                     out.logits.device, self.model_cfg.eos_token_id, self._gen)
            host = sample(out.logits, sb).to_host()
            sampled = {q.seq_id: t for q, t in zip(seqs, host.token_ids)}
        finished = {q.seq_id: q for q in self.scheduler.postprocess(sched, sampled)}
        self.generation_tokens_total += len(sampled)
        outputs = []
        for b, s in enumerate(rows):
            rid = s.seq.seq_id
            req = self.requests[rid]
            tok = sampled[rid]
            delta = req.stream.append(tok)
            o = RequestOutput(rid, delta.text, [tok])
            if s.seq.params.logprobs is not None:
                o.logprobs = [(host.logprobs[b], host.top[b])]
            if req.prompt_logprobs is not None:
                o.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
            if delta.finished or rid in finished:
                if rid not in finished:              # a stop string: the scheduler frees it
                    self.scheduler.finish(rid, delta.finish_reason)
                reason = delta.finish_reason or finished[rid].finish_reason
                o.finished, o.finish_reason, o.stop_reason = True, reason, delta.stop_reason
                o.usage = self._usage(s.seq)
                del self.requests[rid]
            outputs.append(o)
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
                "generation_tokens": self.generation_tokens_total}

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
