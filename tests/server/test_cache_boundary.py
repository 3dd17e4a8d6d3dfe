"""The chat server tells the prefix cache where an agent's sessions diverge: the encoded prompt's
`cache_boundary` (the ids before the first User token: BOS, system prompt, tools) reaches the
engine as SamplingParams.cache_boundaries (docs/ENGINE.md §3), so a second session with the same
system prompt and tools hits the cache there exactly."""

import asyncio
import threading

from backfit.engine.engine import RequestOutput, Usage
from backfit.server.bridge import KEEPALIVE, Bridge, SamplingParams
from backfit.server.chat_template import USER
from backfit.server.protocol import ChatRequest, Message, Tool

TOOLS = (Tool.function("get_weather", "Weather for a city",
                       {"type": "object", "properties": {"city": {"type": "string"}}}),)
SYSTEM = "You are a coding agent. " * 20


class _Cfg:
    max_model_len, max_num_seqs = 4096, 4


class RecordingEngine:
    """AsyncEngine's surface: records (ids, params) and answers one finished delta."""

    def __init__(self):
        self.cfg, self.ready, self.error, self.calls = _Cfg(), threading.Event(), None, []
        self.ready.set()

    def stats(self):
        return {}

    async def generate(self, ids, params, images=()):
        self.calls.append((list(ids), params))
        await asyncio.sleep(0)
        o = RequestOutput(0, "hi", [5], finished=True, finish_reason="stop")
        o.usage = Usage(len(ids), 1, 0)
        yield o


def _req(user: str, system: str | None = SYSTEM) -> ChatRequest:
    msgs = ((Message("system", system),) if system is not None else ()) + (Message("user", user),)
    return ChatRequest(messages=msgs, tools=TOOLS, thinking=False)


def test_the_boundary_is_where_two_sessions_diverge(encoder):
    a, b = encoder.encode_request(_req("Fix the bug.")), encoder.encode_request(_req("Hello"))
    cb = a.cache_boundary
    assert cb == b.cache_boundary and cb > 100                  # BOS + system + tools
    assert a.ids[:cb] == b.ids[:cb] and a.ids[cb] == encoder.tokenizer.token_to_id(USER)
    assert encoder.encode_request(_req("Hello", system=None)).cache_boundary < cb


def test_the_bridge_passes_it_to_the_engine(encoder):
    prompt, eng = encoder.encode_request(_req("Fix the bug.")), RecordingEngine()
    bridge = Bridge(eng, max_model_len=4096, max_num_seqs=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, cache_boundaries=(3,))

    async def go():
        return [e async for e in bridge.stream(prompt, params, tools=True) if e is not KEEPALIVE]
    asyncio.run(go())
    (ids, sent), = eng.calls
    assert ids == prompt.ids and sent.cache_boundaries == (3, prompt.cache_boundary)
