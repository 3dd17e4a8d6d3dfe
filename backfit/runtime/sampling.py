"""Batched sampler on device: penalties, logit bias and min_tokens, then greedy argmax or
temperature -> top-k -> top-p -> min-p -> a draw, plus raw logprobs; no host sync until the
host reads the result (to_host; or to_host_async, which waits on an event of its own, not on the
stream, so the next step can be queued behind it: the engine's overlap).

Every host -> device copy of a step goes through pinned memory without a sync (the per-row
columns in ONE copy); an all-greedy step without penalties, bias or bans copies nothing, and
the raw logprobs are computed only when a row asks for them: argmax is then the whole step.

Parameters are duck-typed (any object with the `backfit.engine.SamplingParams` field names), so
the runtime never imports the engine.

- Logprobs are "raw": log_softmax of the model's logits BEFORE penalties, bias, min_tokens,
  temperature and truncation (vLLM's default `logprobs_mode="raw_logprobs"`). They describe the
  model, not the sampling distribution, and are the same whatever the request's sampling knobs.
- Draws use the exponential race: argmax(p / q) with q ~ Exp(1) i.i.d. picks i with probability
  p_i (the Gumbel-max trick in another form) and needs no cumulative sum and no host sync.
- A seeded row draws its q from its own generator seeded by `row_seed(seed, n)` with n = tokens
  already generated, so a request's tokens do not depend on the rest of the batch nor on its row.
  Unseeded rows share one generator.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from backfit.runtime.batch import to_device

__all__ = ["SamplingBatch", "SampleOutput", "PendingSample", "HostSample", "process_logits",
           "target_probs", "sample", "prompt_logprobs", "row_seed", "uniforms", "exponentials"]

_EPS = 1e-5                  # temperature below this is greedy (vLLM's _SAMPLING_EPS)
_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def row_seed(seed: int, step: int) -> int:
    """63-bit generator seed for draw number `step` of a request seeded with `seed`."""
    return _splitmix64(_splitmix64(seed & _M64) ^ step) >> 1


def _flat(rows: list[int], lists: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [R], lists (R sequences of ids) -> (row index, id) flat int64 tensors on device.
    array('q') + frombuffer converts ids ~4x faster than torch.tensor(list)."""
    lens = torch.tensor([len(x) for x in lists], dtype=torch.int64)
    r = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lens)
    parts = [torch.frombuffer(array("q", x), dtype=torch.int64) for x in lists if len(x)]
    c = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    both = to_device(torch.stack((r, c)), torch.int64, device)
    return both[0], both[1]


@dataclass
class SamplingBatch:
    """Per-row sampling tensors for one step, [B] unless noted; None where no row needs them."""

    vocab_size: int
    greedy: torch.Tensor | None          # bool; None when all_greedy
    all_greedy: bool
    temperature: torch.Tensor | None     # fp32; 1 on greedy rows; None when all_greedy
    top_k: torch.Tensor | None           # int64; V where off
    max_top_k: int                       # host: largest k in use (torch.topk width, no sync)
    top_p: torch.Tensor | None           # fp32; 1 where off
    min_p: torch.Tensor | None           # fp32; 0 where off
    presence: torch.Tensor | None        # fp32
    frequency: torch.Tensor | None       # fp32
    out_counts: torch.Tensor | None      # [B, V] fp32: count of each id in the OUTPUT so far
    repetition: torch.Tensor | None      # fp32
    seen: torch.Tensor | None            # [B, V] bool: id occurs in prompt or output
    bias: tuple | None                   # (rows, ids, values) flat
    banned: tuple | None                 # (rows, ids) flat: stop ids while output < min_tokens
    seeds: list[tuple[int, int]]         # (row, row_seed) for seeded sampled rows
    num_logprobs: list[int | None]       # per row: None, or top-n (0 = sampled token only)
    generator: torch.Generator | None    # for unseeded rows; None: torch's default

    @classmethod
    def build(cls, params: list, output_ids: list[list[int]], prompt_ids: list[list[int]],
              vocab_size: int, device, eos_token_id: int | None = None,
              generator: torch.Generator | None = None) -> SamplingBatch:
        """Pack B requests' parameters and token histories into device tensors (once per step).

        Host cost is O(B + tokens of the rows that use penalties): penalty-free rows add no ids."""
        B, V = len(params), vocab_size
        if not (len(output_ids) == len(prompt_ids) == B):
            raise ValueError(f"params, output_ids and prompt_ids must have one entry per row, got "
                             f"{B}, {len(output_ids)}, {len(prompt_ids)}")
        f32 = dict(dtype=torch.float32, device=device)
        greedy = [p.temperature < _EPS for p in params]
        temp = [1.0 if g else float(p.temperature) for g, p in zip(greedy, params)]
        sampled = [p for g, p in zip(greedy, params) if not g]
        k = [min(p.top_k, V) if (not g and p.top_k > 0) else V for g, p in zip(greedy, params)]
        use_k = any(x < V for x in k)
        use_p = any(p.top_p < 1 for p in sampled)
        use_min_p = any(p.min_p > 0 for p in sampled)

        pen = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
        rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1]
        out_counts = seen = None
        if pen:                          # counts[b, id] += 1 for each output id of row b
            r, c = _flat(pen, [output_ids[i] for i in pen], device)
            out_counts = torch.zeros(B, V, **f32).index_put_(
                (r, c), torch.ones(c.shape, **f32), accumulate=True)
        if rep:                          # seen[b, id] for prompt + output ids of row b
            text = [[t for t in prompt_ids[i] if t < V] for i in rep]   # (no image-block ids)
            r, c = _flat(rep + rep, text + [output_ids[i] for i in rep], device)
            seen = torch.zeros(B, V, dtype=torch.bool, device=device).index_put_(
                (r, c), torch.ones_like(c, dtype=torch.bool))

        bias = banned = None
        rows, ids, vals = [], [], []
        for i, p in enumerate(params):
            for t, v in p.logit_bias:
                rows.append(i), ids.append(t), vals.append(float(v))
        if rows:
            if max(ids) >= V:
                raise ValueError(f"logit_bias token id {max(ids)} is out of range for vocab {V}")
            ri = to_device([rows, ids], torch.int64, device)
            bias = (ri[0], ri[1], to_device(vals, torch.float32, device))
        rows, ids = [], []
        for i, (p, out) in enumerate(zip(params, output_ids)):
            if len(out) < p.min_tokens:
                eos = () if p.ignore_eos or eos_token_id is None else (eos_token_id,)
                for t in dict.fromkeys(eos + tuple(p.stop_token_ids)):
                    rows.append(i), ids.append(t)
        if rows:
            if max(ids) >= V:
                raise ValueError(f"stop token id {max(ids)} is out of range for vocab {V}")
            ri = to_device([rows, ids], torch.int64, device)
            banned = (ri[0], ri[1])

        # the per-row columns the step uses, in ONE pinned copy: [C, B] fp32 (ids < 2^24: exact)
        cols = {}
        if not all(greedy):
            cols["greedy"], cols["temperature"] = [float(g) for g in greedy], temp
        if use_k:
            cols["top_k"] = [float(x) for x in k]
        if use_p:
            cols["top_p"] = [1.0 if g else p.top_p for g, p in zip(greedy, params)]
        if use_min_p:
            cols["min_p"] = [0.0 if g else p.min_p for g, p in zip(greedy, params)]
        if pen:
            cols["presence"] = [float(p.presence_penalty) for p in params]
            cols["frequency"] = [float(p.frequency_penalty) for p in params]
        if rep:
            cols["repetition"] = [float(p.repetition_penalty) for p in params]
        dev = dict(zip(cols, to_device(list(cols.values()), torch.float32, device))) if cols \
            else {}
        seeds = [(i, row_seed(p.seed, len(out))) for i, (g, p, out)
                 in enumerate(zip(greedy, params, output_ids)) if not g and p.seed is not None]
        return cls(
            vocab_size=V, greedy=dev["greedy"] > 0.5 if "greedy" in dev else None,
            all_greedy=all(greedy), temperature=dev.get("temperature"),
            top_k=dev["top_k"].long() if use_k else None,
            max_top_k=max(x for x in k if x < V) if use_k else V,
            top_p=dev.get("top_p"), min_p=dev.get("min_p"),
            presence=dev.get("presence"), frequency=dev.get("frequency"), out_counts=out_counts,
            repetition=dev.get("repetition"),
            seen=seen, bias=bias, banned=banned, seeds=seeds,
            num_logprobs=[p.logprobs for p in params], generator=generator)


@dataclass
class HostSample:
    """SampleOutput on the host: ids, their raw logprobs (None where no row asked), top-n
    (id, logprob) lists or None."""

    token_ids: list[int]
    logprobs: list[float] | list[None]
    top: list[list[tuple[int, float]] | None]


@dataclass
class SampleOutput:
    """Device tensors: token_ids [B] int64, logprobs [B] fp32 (raw, of token_ids; None when no
    row asks for logprobs), top_ids / top_logprobs [B, n] for n = the largest request (rows
    slice their own n), or None."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    num_logprobs: list[int | None]

    def to_host_async(self) -> "PendingSample":
        """Start the copies to the host (pinned, asynchronous on CUDA) behind the sampling
        kernels; PendingSample.wait() gives the HostSample, waiting for those copies only (an
        event), not for what is queued on the stream after them."""
        ts = [self.token_ids, self.logprobs, self.top_ids, self.top_logprobs]
        host = [None if t is None else t.to("cpu", non_blocking=True) for t in ts]
        event = None
        if self.token_ids.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.token_ids.device))
        return PendingSample(host, event, self.num_logprobs)

    def to_host(self) -> HostSample:
        """Copy everything to the host with a single synchronisation."""
        return self.to_host_async().wait()


@dataclass
class PendingSample:
    """A SampleOutput on its way to the host (to_host_async)."""

    host: list                           # CPU tensors (pinned: valid once the event is done)
    event: torch.cuda.Event | None
    num_logprobs: list[int | None]

    def wait(self) -> HostSample:
        if self.event is not None:
            self.event.synchronize()
        ids_t, lps_t, top_i_t, top_l_t = self.host
        ids = ids_t.tolist()
        lps = [None] * len(ids) if lps_t is None else lps_t.tolist()
        top_i = top_l = None
        if top_i_t is not None:
            top_i, top_l = top_i_t.tolist(), top_l_t.tolist()
        top = [None if n is None else list(zip(top_i[b][:n], top_l[b][:n])) if n else []
               for b, n in enumerate(self.num_logprobs)]
        return HostSample(ids, lps, top)


def _top_k_top_p(y: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """y [B, V] -> y with ids outside the row's top-k, then outside its top-p nucleus, at -inf.
    Ties at the k-th value are kept (so a row may keep more than k ids when logits tie)."""
    V = y.shape[1]
    if batch.top_p is None:          # top-k alone: threshold at the k-th largest, no full sort
        vals = y.topk(batch.max_top_k, dim=-1).values                   # [B, kmax] descending
        thr = vals.gather(1, (batch.top_k.clamp(max=batch.max_top_k) - 1)[:, None])
        thr = thr.masked_fill(batch.top_k[:, None] >= V, float("-inf"))  # rows with top-k off
        return y.masked_fill(y < thr, float("-inf"))
    srt, idx = y.sort(dim=-1)                                           # [B, V] ascending
    if batch.top_k is not None:
        thr = srt.gather(1, (V - batch.top_k).clamp(min=0)[:, None])   # k-th largest
        srt = srt.masked_fill(srt < thr, float("-inf"))
    cum = srt.softmax(-1).cumsum(-1)                                    # [B, V] mass up to here
    drop = cum <= (1 - batch.top_p)[:, None]    # the low tail holding <= 1-p of the mass
    drop[:, -1] = False                         # the most likely id always stays
    return y.scatter(1, idx, srt.masked_fill(drop, float("-inf")))


def exponentials(shape, batch: SamplingBatch, device) -> torch.Tensor:
    """q [B, V] ~ Exp(1): shared generator for all rows, then seeded rows overwritten from their
    own generator (the one per-row loop of the step; no host sync)."""
    q = torch.empty(shape, dtype=torch.float32, device=device)
    q.exponential_(generator=batch.generator)
    for row, s in batch.seeds:
        g = torch.Generator(device=device)
        g.manual_seed(s)
        q[row].exponential_(generator=g)
    return q.clamp_(min=1e-30)       # q = 0 would turn p / q into inf (or nan for p = 0)


def uniforms(n: int, batch: SamplingBatch, device) -> torch.Tensor:
    """u [B] ~ U(0, 1), as exponentials: seeded rows from a generator of their own (seeded apart
    from their exponential draws), the rest from the shared one."""
    u = torch.rand(n, generator=batch.generator, device=device)
    for row, s in batch.seeds:
        g = torch.Generator(device=device)
        g.manual_seed(s ^ 0x5DEECE66D)
        u[row] = torch.rand((), generator=g, device=device)
    return u


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [B, V] -> fp32 after repetition, frequency and presence penalties, logit bias
    and the min_tokens ban (vLLM's order; a copy when any applies, else logits as FP32, which
    may be logits itself: read it, do not write it); greedy rows take the argmax of this."""
    if logits.dim() != 2 or logits.shape[1] != batch.vocab_size:
        raise ValueError(f"logits must be [B, {batch.vocab_size}], got {tuple(logits.shape)}")
    if logits.shape[0] != len(batch.num_logprobs):
        raise ValueError(f"logits have {logits.shape[0]} rows, the batch "
                         f"{len(batch.num_logprobs)}")
    edits = (batch.repetition, batch.out_counts, batch.bias, batch.banned)
    x = logits.float()
    if all(e is None for e in edits):
        return x                      # nothing to change: no copy (the caller only reads x)
    x = x.clone()
    if batch.repetition is not None:  # CTRL / vLLM: positive logits divided, negative multiplied
        r = batch.repetition[:, None]
        x = torch.where(batch.seen, torch.where(x > 0, x / r, x * r), x)
    if batch.out_counts is not None:  # OpenAI: - frequency * count - presence * [count > 0]
        x -= batch.frequency[:, None] * batch.out_counts
        x -= batch.presence[:, None] * (batch.out_counts > 0).float()
    if batch.bias is not None:
        x.index_put_(batch.bias[:2], batch.bias[2], accumulate=True)
    if batch.banned is not None:      # -inf made on the device: `x[banned] = -inf` copies a
        inf = torch.full((), float("-inf"), device=x.device)        # host value (a sync)
        x.index_put_(batch.banned, inf)
    return x


def target_probs(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """process_logits' x [B, V] -> the distribution a sampled row draws from [B, V] fp32:
    temperature, then top-k and top-p, then min-p, softmax (greedy rows: temperature 1, not
    used). `sample` draws from it; speculative acceptance (runtime/speculative.py) accepts
    against it."""
    y = x / batch.temperature[:, None]
    if batch.top_k is not None or batch.top_p is not None:
        y = _top_k_top_p(y, batch)
    if batch.min_p is not None:       # drop ids below min_p x the row's largest probability
        p = y.softmax(-1)
        y = y.masked_fill(p < batch.min_p[:, None] * p.amax(-1, keepdim=True), float("-inf"))
    return y.softmax(-1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
    """logits [B, V] (any float dtype; computed in fp32) -> SampleOutput; see the module notes."""
    x = process_logits(logits, batch)
    raw = logits.float()
    ids = x.argmax(dim=-1)                                              # [B] greedy choice
    if not batch.all_greedy:
        p = target_probs(x, batch)                                      # [B, V]
        drawn = (p / exponentials(p.shape, batch, p.device)).argmax(dim=-1)
        ids = torch.where(batch.greedy, ids, drawn)
    if all(k is None for k in batch.num_logprobs):
        return SampleOutput(ids, None, None, None, list(batch.num_logprobs))
    lse = torch.logsumexp(raw, dim=-1)                                  # [B] raw normaliser
    logprobs = raw.gather(1, ids[:, None])[:, 0] - lse
    n = max((k for k in batch.num_logprobs if k), default=0)
    top_ids = top_lp = None
    if n:
        vals, top_ids = raw.topk(n, dim=-1)                             # [B, n]
        top_lp = vals - lse[:, None]
    return SampleOutput(ids, logprobs, top_ids, top_lp, list(batch.num_logprobs))


def prompt_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, n: int,
                    chunk: int = 1024) -> SampleOutput:
    """logits [T, V] at prompt positions, next_ids [T] (the prompt shifted by one) -> raw logprob
    of each next id and the top-n per position (legacy completions `echo`); `chunk` rows at a time
    bound the fp32 temporaries to chunk x V."""
    T = logits.shape[0]
    if logits.dim() != 2 or next_ids.shape != (T,) or T == 0:
        raise ValueError(f"need logits [T >= 1, V] and next_ids [T], got {tuple(logits.shape)} "
                         f"and {tuple(next_ids.shape)}")
    lp, ti, tl = [], [], []
    for s in range(0, T, chunk):
        x = logits[s:s + chunk].float()
        lse = torch.logsumexp(x, dim=-1)
        lp.append(x.gather(1, next_ids[s:s + chunk, None].long())[:, 0] - lse)
        if n:
            v, i = x.topk(n, dim=-1)
            ti.append(i), tl.append(v - lse[:, None])
    cat = lambda xs: torch.cat(xs) if xs else None                     # noqa: E731
    return SampleOutput(next_ids.long(), torch.cat(lp), cat(ti), cat(tl), [n] * T)
