"""AsyncEngine: the engine's step loop on its own thread, per-request async output streams.

The event loop never runs model code. Requests and aborts go to the engine thread through a
queue; every step's RequestOutputs come back with call_soon_threadsafe into one asyncio.Queue
per request. A consumer that stops iterating (a client disconnect cancels the task) aborts its
request, which the engine thread carries out before its next step, so its slot and blocks are
free within one step. If the engine fails, every open stream raises EngineDeadError.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
from typing import AsyncIterator

from backfit.engine.engine import EngineConfig, LLMEngine, RequestOutput
from backfit.engine.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError"]


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; no request can be served."""


class AsyncEngine:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.engine: LLMEngine | None = None
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._cmds: queue.Queue = queue.Queue()
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="backfit-engine", daemon=True)
        self._ids = itertools.count()

    @property
    def max_model_len(self) -> int | None:
        """The engine's context length: cfg's, resolved by the runner once loaded (cfg None:
        the longest the KV pools hold); None until then if cfg asked for that."""
        return self.engine.max_model_len if self.engine is not None else self.cfg.max_model_len

    def start(self) -> None:
        """Load the model on the engine thread (returns at once; `ready` is set when loaded)."""
        self._thread.start()

    async def wait_ready(self) -> None:
        while not self.ready.is_set():
            if self.error is not None:
                raise EngineDeadError(f"engine failed to start: {self.error}") from self.error
            await asyncio.sleep(0.05)

    # ---- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = LLMEngine(self.cfg)
            self.ready.set()
            while True:
                busy = self.engine.has_unfinished()
                try:
                    cmd = self._cmds.get_nowait() if busy else self._cmds.get()   # idle: block
                except queue.Empty:
                    cmd = None
                while cmd is not None:
                    if cmd[0] == "stop":
                        return
                    self._command(cmd)
                    try:
                        cmd = self._cmds.get_nowait()
                    except queue.Empty:
                        cmd = None
                if self.engine.has_unfinished():
                    for o in self.engine.step():
                        self._deliver(o)
        except BaseException as e:                    # noqa: BLE001 - reported to every stream
            self.error = e
            for rid in list(self._streams):
                self._deliver_error(rid, e)
        finally:
            if self.engine is not None:
                self.engine.close()

    def _command(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, fut, images = cmd
            try:
                fut.set_result(self.engine.add_request(prompt, params, request_id=rid,
                                                       images=images))
            except Exception as e:                    # a bad request: the caller's error
                fut.set_exception(e)
        elif kind == "abort":
            out = self.engine.abort(cmd[1])
            if out is not None:
                self._deliver(out)

    def _deliver(self, o: RequestOutput) -> None:
        entry = self._streams.get(o.request_id)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, o)

    def _deliver_error(self, rid: int, e: BaseException) -> None:
        loop, q = self._streams[rid]
        loop.call_soon_threadsafe(q.put_nowait, EngineDeadError(f"engine failed: {e!r}"))

    # ---- event-loop side -----------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams | None = None,
                       images: tuple = ()) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; raises ValueError for a request that cannot run.
        images: a Vision-Exp prompt's (ImageSpan, PreparedImage) pairs (LLMEngine.add_request)."""
        if self.error is not None:
            raise EngineDeadError(f"engine failed: {self.error!r}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        rid = next(self._ids)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), q)      # before any output can come
        self._cmds.put(("add", rid, list(prompt_ids), params, fut, tuple(images)))
        done = False
        try:
            await asyncio.wrap_future(fut)                          # ValueError: bad request
            while not done:
                o = await q.get()
                if isinstance(o, BaseException):
                    raise o
                done = o.finished
                yield o
        finally:
            self._streams.pop(rid, None)
            if not done:              # cancelled: free it (FIFO: after its add; unknown id: no-op)
                self._cmds.put(("abort", rid))

    def stats(self) -> dict:
        """The engine's counters (a snapshot: plain ints read without locking; fine for
        metrics), plus `ready`. Empty numbers before the model is loaded."""
        e = self.engine
        return {"ready": self.ready.is_set(), **(e.stats() if e is not None and self.ready.is_set()
                                                 else {})}

    def shutdown(self) -> None:
        self._cmds.put(("stop",))
        if self._thread.is_alive():
            self._thread.join(timeout=60)
