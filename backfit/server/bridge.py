"""asyncio ↔ engine: admit, stream, parse, abort on disconnect; the only server file that
imports `backfit.engine`.

    Bridge.generate(ids, params)  -> RequestOutput deltas (+ KEEPALIVE markers)   legacy paths
    Bridge.stream(prompt, params, tools=, stop=) -> neutral events (+ KEEPALIVE)   chat paths
        TextDelta / ReasoningDelta / ToolCall* ... Usage, Finish (a FinishWithUsage: .usage)
        (+ TokenLogprobs of the answer's tokens when params.logprobs is set)

Both raise, before their first event: `EngineUnavailable` (→ 503: loading, dead, draining),
`QueueFull` (→ 429, 529 on the Anthropic path; with Retry-After), `ContextTooLong` (a ValueError
→ 400 context_length_exceeded) and ValueError (→ 400). Closing the iterator — the handler task
is cancelled on a client disconnect (`handler_cancellation=True`), or the caller stops early —
cancels the engine stream, which aborts the request before the engine's next step (its slot and
blocks are free within one step). An engine failure after the first event ends the stream with
Finish(reason="error"). If nothing comes for `keepalive_s` seconds (long prefill), a KEEPALIVE
marker is yielded; SSE writers render it as a comment / ping.

A prompt with `forced` output (chat_format.Forced: tool_choice required / named, a reasoning
budget) runs as two engine requests that read as one: the reasoning up to the model's
`</think>` (a stop token) or the budget, then prompt + that output + what is forced (`</think>`
where the model did not write it — budget spent, or an EOS before a forced call — and the
tool-call opener) continued within the same max_tokens, its prefix from the prefix cache.
Forced tokens reach the parser as output and count in completion_tokens; penalties and
min_tokens see only the continuation's own output.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from backfit.engine.async_engine import AsyncEngine, EngineDeadError
from backfit.engine.engine import EngineConfig, RequestOutput
from backfit.engine.engine import Usage as EngineUsage
from backfit.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from backfit.engine.tokenizer import load_tokenizer
from backfit.server.chat_format import THINK_END, ChatEncoder, Prompt
from backfit.server.parser import OutputParser
from backfit.server.protocol import Finish, TokenLogprobs, Usage

__all__ = [
    "CTX",
    "KEEPALIVE",
    "MAX_LOGPROBS",
    "AsyncEngine",
    "Bridge",
    "ContextTooLong",
    "EngineConfig",
    "EngineUnavailable",
    "FinishWithUsage",
    "KeepAlive",
    "QueueFull",
    "RequestOutput",
    "SamplingParams",
    "ServerContext",
    "ServerShutdown",
    "load_tokenizer",
]


class QueueFull(RuntimeError):
    """Every running slot and the waiting queue are taken: reject now (pitfall #20)."""
    retry_after = 2


class EngineUnavailable(RuntimeError):
    """Not loaded yet, shutting down, or dead: 503."""
    retry_after = 5


class ServerShutdown(EngineDeadError):
    """Put into every open stream on SIGINT/SIGTERM: each ends with an error event."""


class ContextTooLong(ValueError):
    """prompt + max tokens > max_model_len (400, code context_length_exceeded)."""


class KeepAlive:
    """Marker: nothing happened for keepalive_s; write an SSE comment / ping."""

    def __repr__(self):
        return "KEEPALIVE"


KEEPALIVE = KeepAlive()


@dataclass(frozen=True)
class FinishWithUsage(Finish):
    """The last event of Bridge.stream: a Finish that also carries the request's Usage (the same
    Usage is yielded as its own event just before it)."""
    usage: Usage | None = None


class Bridge:
    def __init__(self, engine, *, max_model_len: int | None, max_num_seqs: int,
                 max_queue: int = 256, keepalive_s: float = 10.0, metrics=None,
                 default_max_tokens: int | None = None):
        self.engine = engine
        self.max_model_len = max_model_len              # None until a loading engine picks it
        self.default_max_tokens = default_max_tokens    # the cap of a request that sets none
        self.capacity = max_num_seqs + max_queue          # running + waiting, admitted at most
        self.keepalive_s = keepalive_s
        self.metrics = metrics
        self.active = 0                                   # open streams (admitted requests)
        self.draining = False
        self._queues: set[asyncio.Queue] = set()

    def stop_admitting(self) -> int:
        """A drain's first step: /health answers 503 and new requests get 503 with Retry-After
        (a router retries them on another replica); admitted requests run on. -> how many."""
        self.draining = True
        return self.active

    def abort_all(self) -> int:
        """Refuse new requests (503) and end every open stream with an error; -> how many."""
        self.draining = True
        for q in self._queues:
            q.put_nowait(ServerShutdown("the server is shutting down"))
        return len(self._queues)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every admitted request to finish; -> whether they
        did (polled every 50 ms: a drain's wait, not a hot path)."""
        end = time.monotonic() + timeout
        while self.active and time.monotonic() < end:
            await asyncio.sleep(0.05)
        return self.active == 0

    @property
    def state(self) -> str:
        """loading | ok | draining | failed (the engine died): what /health reports."""
        if getattr(self.engine, "error", None) is not None:
            return "failed"
        if self.draining:
            return "draining"
        return "ok" if self.engine.ready.is_set() else "loading"

    @property
    def ready(self) -> bool:
        e = self.engine
        return (not self.draining and e.ready.is_set() and getattr(e, "error", None) is None)

    def stats(self) -> dict:
        return self.engine.stats()

    def _admit(self, ids: list[int], params: SamplingParams,
               admitted: bool = False) -> SamplingParams:
        if not self.ready and not (admitted and self.state == "draining"):  # a drain finishes
            why = "shutting down" if self.draining else \
                "failed" if getattr(self.engine, "error", None) else "loading"
            self._reject("unavailable")
            raise EngineUnavailable(f"the model is {why}; try again later")
        if self.active >= self.capacity and not admitted:     # (a forced continuation is in)
            self._reject("queue_full")
            raise QueueFull(f"Server is busy ({self.active} requests in flight), "
                            f"try again in {QueueFull.retry_after}s")
        if not ids:
            raise ValueError("the prompt is empty")
        n = len(ids)
        if params.max_tokens is None:
            if n >= self.max_model_len:
                raise ContextTooLong(self._too_long(n, 1))
            params = replace(params, max_tokens=self.cap(n))
        if n + params.max_tokens > self.max_model_len:
            raise ContextTooLong(self._too_long(n, params.max_tokens))
        return params

    def cap(self, n: int) -> int:
        """The output cap of a request with an n-token prompt that sets none: the rest of the
        context, or --default-max-tokens where that is smaller."""
        room = self.max_model_len - n
        return room if self.default_max_tokens is None else min(room, self.default_max_tokens)

    def _too_long(self, n: int, m: int) -> str:
        return (f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {n + m} tokens ({n} in the messages, {m} in the completion). "
                "Please reduce the length of the messages or completion.")

    def _reject(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected(reason)

    async def generate(self, ids: list[int], params: SamplingParams,
                       _state: dict | None = None,
                       images: tuple = ()) -> AsyncIterator[RequestOutput | KeepAlive]:
        """Engine outputs for raw token ids (legacy completions); see the module docstring.
        images: a Vision-Exp prompt's (ImageSpan, PreparedImage) pairs (Prompt.images).
        _state["stopped"] = True before closing: the caller ended it (a stop string), not the
        client (metrics); _state["continued"]: a forced continuation follows (metrics wait);
        "t0", "t_first", "n_out" carry the request's timing from the first part to the second."""
        _state = {} if _state is None else _state
        params = self._admit(ids, params, admitted="t0" in _state)
        self.active += 1
        q: asyncio.Queue = asyncio.Queue()
        self._queues.add(q)
        done = False

        async def pump():
            try:
                async for o in self.engine.generate(ids, params, images):
                    q.put_nowait(o)
                q.put_nowait(None)
            except asyncio.CancelledError:
                raise
            except BaseException as e:                 # noqa: BLE001 - handed to the consumer
                q.put_nowait(e)

        t0 = _state.setdefault("t0", time.monotonic())
        t_first, n_out, reason = _state.get("t_first"), _state.get("n_out", 0), None
        task = asyncio.ensure_future(pump())
        getter = None
        try:
            while True:
                if getter is None:
                    getter = asyncio.ensure_future(q.get())
                got, _ = await asyncio.wait({getter}, timeout=self.keepalive_s)
                if not got:
                    yield KEEPALIVE
                    continue
                item, getter = getter.result(), None
                if item is None:
                    break
                if isinstance(item, EngineDeadError):
                    raise EngineUnavailable(str(item)) if n_out == 0 and t_first is None else item
                if isinstance(item, BaseException):
                    raise item
                if item.token_ids and t_first is None:
                    t_first = time.monotonic()
                n_out += len(item.token_ids)
                if item.finished:
                    done, reason = True, item.finish_reason
                yield item
        finally:
            self.active -= 1
            self._queues.discard(q)
            for t in (getter, task):
                if t is not None and not t.done():
                    t.cancel()
                    with contextlib.suppress(BaseException):
                        await t
            _state.update(t_first=t_first, n_out=n_out)
            if self.metrics is not None and not _state.pop("continued", False):
                stopped = bool(_state.get("stopped"))
                self.metrics.request_done(t0, t_first, time.monotonic(), n_out,
                                          reason if done else "stop" if stopped else "abort",
                                          disconnected=not (done or stopped))

    async def stream(self, prompt: Prompt, params: SamplingParams, *, tools: bool,
                     stop=()) -> AsyncIterator[Any]:
        """Neutral protocol events for an encoded chat prompt; see the module docstring.
        stop: stop strings applied by the parser to content (not reasoning or arguments)."""
        parser = OutputParser(reasoning=prompt.reasoning_open, tools=tools, stop=tuple(stop))
        if prompt.cache_boundary:                   # a prefix-cache snapshot at the system end
            params = replace(params, cache_boundaries=params.cache_boundaries
                             + (prompt.cache_boundary,))
        state: dict = {}
        agen = self.generate(prompt.ids, params, state, prompt.images) \
            if prompt.forced is None else self._forced(prompt, params, state)
        n_out, usage, started, cached = 0, None, False, 0
        try:
            try:
                async for o in agen:
                    if o is KEEPALIVE:
                        yield o
                        continue
                    started = True
                    n_out += len(o.token_ids)
                    cached = o.num_cached_tokens    # (a stop string ends before the usage)
                    answer = parser.state != "REASONING"       # (the </think> chunk is not)
                    events = parser.feed(o.text, len(o.token_ids))
                    if o.logprobs and params.logprobs is not None and answer:  # forced: none
                        items = [(t, lp, top) for t, (lp, top) in zip(o.token_ids, o.logprobs)]
                        if o.finished and o.finish_reason == "stop" and o.stop_reason is None:
                            items = items[:-1]              # the EOS: not part of the answer
                        events.insert(0, TokenLogprobs(tuple(items)))
                    if o.finished or parser.done:
                        usage = o.usage
                        stop_seq = o.stop_reason if isinstance(o.stop_reason, str) else None
                        reason = o.finish_reason if o.finished else "stop"
                        events += parser.finish(reason or "stop", stop_seq)
                    for e in events:
                        if isinstance(e, Finish):
                            u = Usage(len(prompt.ids), usage.completion_tokens if usage else n_out,
                                      usage.cached_tokens if usage else cached,
                                      parser.reasoning_tokens)
                            state["stopped"] = True
                            yield u
                            yield FinishWithUsage(e.reason, e.stop_sequence, e.error, usage=u)
                            return
                        yield e
            except (EngineDeadError, RuntimeError) as e:
                if not started or isinstance(e, (QueueFull, EngineUnavailable)):
                    raise
                events = parser.finish("error")
                for ev in events:
                    if not isinstance(ev, Finish):
                        yield ev
                u = Usage(len(prompt.ids), n_out, cached, parser.reasoning_tokens)
                yield u
                yield FinishWithUsage("error", None, f"engine failed: {e}", usage=u)
        finally:
            await agen.aclose()


    async def _forced(self, prompt: Prompt, params: SamplingParams,
                      state: dict) -> AsyncIterator[RequestOutput | KeepAlive]:
        """generate()'s outputs for a prompt with forced output (module docstring): the
        reasoning's, the forced ones (`</think>` where the model did not write it, the opener),
        then the continuation's; the last one's usage covers all of them."""
        f = prompt.forced
        total = params.max_tokens if params.max_tokens is not None else self.cap(len(prompt.ids))
        out: list[int] = []                     # the reasoning as the continuation reads it
        forced, u1 = [RequestOutput(0, f.text, list(f.ids))], None
        if not prompt.reasoning_open and total - len(f.ids) < 1:
            async for o in self.generate(prompt.ids, params, state, prompt.images):
                yield o                             # max_tokens below the opener: not forced
            return
        if prompt.reasoning_open:
            cap = total if f.budget is None else max(1, min(f.budget, total))
            p1 = replace(params, max_tokens=cap, min_tokens=min(params.min_tokens, cap),
                         stop_token_ids=params.stop_token_ids + (f.think_end,),
                         include_stop_str_in_output=True)
            async with contextlib.aclosing(self.generate(prompt.ids, p1, state,
                                                         prompt.images)) as agen:
                async for o in agen:
                    if o is KEEPALIVE:
                        yield o
                        continue
                    if o.finished:
                        why = self._reasoning_end(o, f, len(out) + len(o.token_ids), cap, total)
                        if why is not None:         # continue: close it, force the opener
                            ids = o.token_ids[:-1] if why == "eos" else o.token_ids
                            if why != "closed":
                                forced.insert(0, RequestOutput(0, THINK_END, [f.think_end]))
                            n = len(out) + len(ids) + sum(len(x.token_ids) for x in forced)
                            if total - n < 1:
                                yield replace(o, finish_reason="length")   # no room left
                                return
                            state["continued"], u1 = True, o.usage or EngineUsage(0, 0, 0)
                            o = replace(o, token_ids=ids, finished=False, finish_reason=None,
                                        stop_reason=None, usage=None)
                    out += o.token_ids
                    yield o
            if u1 is None:
                return                              # it ended otherwise (length, abort)
        forced = [x for x in forced if x.token_ids]
        n_before = len(out) + sum(len(x.token_ids) for x in forced)
        p2 = replace(params, max_tokens=None if params.max_tokens is None else total - n_before,
                     min_tokens=max(0, params.min_tokens - n_before))
        agen = self.generate([*prompt.ids, *out, *(t for x in forced for t in x.token_ids)],
                             p2, state, prompt.images)     # (the images: in the prompt part)
        async with contextlib.aclosing(agen):
            try:
                first = await agen.__anext__()      # admission errors come before any event
            except StopAsyncIteration:
                return
            except (EngineUnavailable, ValueError) as e:
                if u1 is None:
                    raise
                raise EngineDeadError(f"the forced continuation could not start: {e}") from e
            def hit(n: int) -> int:                 # the prompt's, not the continuation's
                return u1.cached_tokens if u1 else min(n, len(prompt.ids))
            for x in forced:
                yield replace(x, num_cached_tokens=hit(getattr(first, "num_cached_tokens", 0)))
            o = first
            while True:
                if o is not KEEPALIVE:
                    o = replace(o, num_cached_tokens=hit(o.num_cached_tokens))
                if o is not KEEPALIVE and o.usage is not None:
                    u = o.usage
                    o = replace(o, usage=EngineUsage(len(prompt.ids),
                                                     n_before + u.completion_tokens,
                                                     hit(u.cached_tokens)))
                yield o
                try:
                    o = await agen.__anext__()
                except StopAsyncIteration:
                    return

    @staticmethod
    def _reasoning_end(o: RequestOutput, f, n: int, cap: int, total: int) -> str | None:
        """How the reasoning's last output (n tokens in all) ended, where the continuation
        takes over: "closed" (its </think>), "eos" (an EOS before it: a call is forced only),
        "budget" (the reasoning budget spent with room left); None: the reply ends here."""
        if o.finish_reason == "stop" and o.stop_reason == f.think_end:
            return "closed"
        if o.finish_reason == "stop" and o.stop_reason is None and f.ids:
            return "eos"
        if o.finish_reason == "length" and f.budget is not None and n >= cap and cap < total:
            return "budget"
        return None


@dataclass
class ServerContext:
    """What every handler needs: `request.app[CTX]`."""
    bridge: Bridge
    encoder: ChatEncoder
    model_name: str
    max_model_len: int
    api_key: str | None
    tokenizer: Any
    aliases: tuple[str, ...] = ()
    created: int = 0
    metrics: Any = None
    extra: dict | None = None
    images: Any = None            # server.images.ImageInput on a Vision-Exp model, else None
    tokenizer_config: dict | None = None          # tokenizer_config.json (raw-text BOS, info)


CTX = web.AppKey("ctx", ServerContext)
