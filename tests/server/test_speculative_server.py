"""Speculation under the server's forced outputs (CPU, the tiny Flash checkpoint, MTP k 3): a
named tool_choice (the forced opener), a reasoning budget (`</think>` forced after N reasoning
tokens) and a stop string reached inside an accepted run give, through the official SDKs, the
same text, tool calls, finish reasons and usage as the same server without speculation. The
forced phases are separate engine requests (server/bridge.py), each a prompt the drafter must
follow from its first token. The tiny model's own MTP block accepts almost nothing, so the
drafts come from an oracle: the plain server's continuation of the same history (recorded),
every third position wrong, so runs are accepted and cut by stops, budgets and limits."""

from __future__ import annotations

import anthropic
import openai
import pytest
import torch
from live_server import real_server
from support import one_thread

from backfit.runtime.model.draft import Draft

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def record(srv) -> list[list[int]]:
    """Every finished sequence of srv's engine: prompt + output ids."""
    seen, eng = [], srv.engine
    inner = eng.generate

    async def spy(ids, params, *images):
        out = list(ids)
        async for o in inner(ids, params, *images):
            out += o.token_ids
            yield o
        seen.append(out)
    eng.generate = spy
    return seen


def oracle(srv, plain_seqs: list[list[int]], k: int) -> None:
    """srv's drafts := the recorded plain continuation of each sequence's own history (3, a
    wrong guess, where none is recorded), every third position off by one id."""
    eng = srv.engine

    def draft(seqs, seed):
        ids = []
        for s in seqs:
            have = eng.engine.requests[s.seq_id].seq.all_ids[:s.start] + [s.tokens[0]]
            full = next((f for f in plain_seqs if f[:len(have)] == have), [])
            row = [full[s.start + j] if s.start + j < len(full) else 3 for j in range(1, k + 1)]
            ids.append([t + 1 if (s.start + j) % 3 == 0 else t for j, t in enumerate(row, 1)])
        ids = torch.tensor(ids)
        return Draft(ids, None, torch.zeros(*ids.shape, eng.engine.model_cfg.vocab_size), None)
    eng.engine.ranks.runner.drafting.draft = draft


@pytest.fixture(scope="module")
def servers(tiny_converted):
    conv = tiny_converted(1)
    with one_thread():
        plain = real_server(conv)
        spec = real_server(conv, engine_kw=dict(speculative_method="mtp",
                                                num_speculative_tokens=3))
        try:
            yield plain, spec
        finally:
            plain.stop(), spec.stop()


def _chat(srv, **kw):
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
    r = c.chat.completions.create(model="m", temperature=0, **kw)
    m = r.choices[0].message
    calls = [(t.function.name, t.function.arguments) for t in m.tool_calls or ()]
    return (m.content, getattr(m, "reasoning_content", None), calls, r.choices[0].finish_reason,
            r.usage.completion_tokens)


def _messages(srv, **kw):
    c = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=120)
    m = c.messages.create(model="m", extra_body={"temperature": 0}, **kw)
    return [b.model_dump(exclude={"signature"}) for b in m.content], m.stop_reason, \
        m.usage.output_tokens


def test_forced_tool_call_reasoning_budget_and_stops_equal_plain(servers):
    plain, spec = servers
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    cases = [
        lambda s: _chat(s, messages=msgs, tools=TOOLS, max_tokens=40,
                        tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        lambda s: _chat(s, messages=msgs, tools=TOOLS, max_tokens=40, tool_choice="required",
                        extra_body={"chat_template_kwargs": {"thinking": False}}),
        lambda s: _messages(s, messages=msgs, max_tokens=24,
                            thinking={"type": "enabled", "budget_tokens": 5}),
        lambda s: _chat(s, messages=msgs, max_tokens=30,
                        extra_body={"chat_template_kwargs": {"thinking": False}}),
    ]
    seen = record(plain)
    want = [case(plain) for case in cases]
    oracle(spec, seen, 3)
    for i, case in enumerate(cases):
        assert case(spec) == want[i], i
    # the stop string: a piece of the plain reply's text, so it lands inside a run
    text = _chat(plain, messages=msgs, max_tokens=30,
                 extra_body={"chat_template_kwargs": {"thinking": False}})[0]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    kw = dict(messages=msgs, max_tokens=30, stop=[stop],
              extra_body={"chat_template_kwargs": {"thinking": False}})
    got_plain = _chat(plain, **kw)
    assert _chat(spec, **kw) == got_plain
    st = spec.engine.stats()
    assert st["spec_decode_num_drafts"] > 10
    assert st["spec_decode_num_accepted_tokens_per_pos"][1] > 0       # runs of 2+ accepted
