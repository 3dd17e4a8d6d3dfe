"""The DSV4 output parser: well-formed output, split invariance (fuzz), streaming, bad DSML."""

import itertools
import json
import random

import pytest

from backfit.server.parser import OutputParser, fold
from backfit.server.protocol import ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallStart

D = "｜DSML｜"


def invoke(name, *params):
    body = "\n".join(f'<{D}parameter name="{k}" string="{s}">{v}</{D}parameter>'
                     for k, s, v in params)
    return f'<{D}invoke name="{name}">\n{body}\n</{D}invoke>'


def block(*invokes):
    return f"\n\n<{D}tool_calls>\n" + "\n".join(invokes) + f"\n</{D}tool_calls>"


# reasoning + text + three calls, multi-byte characters everywhere, a quote and a newline to escape
RICH = ("用户想知道天气 🌦 — check <both> cities.</think>Sure: I’ll look up 巴黎 & Köln ✓"
        + block(invoke("get_weather", ("city", "true", 'Pa"ris\n🗼'), ("days", "false", "3")),
                invoke("get_weather", ("city", "true", "Köln"),
                       ("opts", "false", '{"unit": "°C", "hours": [1, 2]}')),
                invoke("now")))


def run(chunks, reasoning=True, tools=True, reason="stop", **kw):
    ids = itertools.count()
    p = OutputParser(reasoning, tools, make_id=lambda: f"call_{next(ids)}", **kw)
    events = []
    for c in chunks:
        events += p.feed(c)
    return events + p.finish(reason)


def folded(chunks, **kw):
    return fold(run(chunks, **kw))


def test_well_formed_output_matches_the_reference_decoding():
    m = folded([RICH])
    assert m.reasoning == "用户想知道天气 🌦 — check <both> cities."
    assert m.content == "Sure: I’ll look up 巴黎 & Köln ✓"
    assert [(c.id, c.name, c.error) for c in m.tool_calls] == [
        ("call_0", "get_weather", None), ("call_1", "get_weather", None), ("call_2", "now", None)]
    # arguments built as the reference decode_dsml_to_arguments does
    assert m.tool_calls[0].arguments == '{"city": "Pa\\"ris\\n🗼", "days": 3}'
    assert json.loads(m.tool_calls[1].arguments) == {"city": "Köln",
                                                     "opts": {"unit": "°C", "hours": [1, 2]}}
    assert m.tool_calls[2].arguments == "{}"
    assert (m.finish.reason, m.finish.error) == ("tool_calls", None)


def _splits(text, rng, n_random=60):
    yield [text]
    for i in range(1, len(text)):                   # every cut into two pieces
        yield [text[:i], text[i:]]
    yield list(text)                                # one char at a time
    for _ in range(n_random):                       # random multi-piece cuts
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(2, 12)))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)], strict=True)]


def _byte_splits(text, rng):
    data = text.encode()
    for i in range(1, len(data)):                   # cuts inside multi-byte characters too
        yield [data[:i], data[i:]]
    yield [data[i:i + 1] for i in range(len(data))]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(data)), 8))
        yield [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)], strict=True)]


MALFORMED = {
    "bad_invoke_header": f"ok</think>hi\n\n<{D}tool_calls>\n<{D}invoke nam=\"f\">\n",
    "text_between_params": ("ok</think>" + block(invoke("f", ("a", "true", "x")))
                            .replace(f"</{D}parameter>\n", f"</{D}parameter>\noops ")),
    "duplicate_param": "ok</think>" + block(invoke("f", ("a", "true", "1"), ("a", "true", "2"))),
    "empty_block": f"ok</think>text\n\n<{D}tool_calls>\n</{D}tool_calls> tail",
    "bad_json_body": "ok</think>" + block(f'<{D}invoke name="f">\n{{"a": 1,}}\n</{D}invoke>'),
    "second_call_broken": ("ok</think>" + block(invoke("f", ("a", "false", "[1]")),
                                                f'<{D}invoke name="g">\n<{D}parameter name="b">')),
}


STOPPED = "Answer: 42 — done.</think>Result ✓ 42 END! never shown" + block(invoke("f"))


@pytest.mark.parametrize("name,text,kw", [("rich", RICH, {}), ("stop", STOPPED, {"stop": ["END!"]}),
                                          *((k, v, {}) for k, v in MALFORMED.items())])
def test_same_events_folded_for_every_split(name, text, kw):
    rng = random.Random(7)
    want = folded([text], **kw)
    for chunks in _splits(text, rng):
        assert folded(chunks, **kw) == want, (name, chunks)
    for chunks in _byte_splits(text, rng):
        assert folded(chunks, **kw) == want, (name, "bytes", chunks)


def test_no_dsml_or_partial_tag_reaches_text_or_arguments():
    for chunks in _splits(RICH, random.Random(3), n_random=20):
        for e in run(chunks):
            if isinstance(e, (TextDelta, ReasoningDelta, ToolCallArgsDelta)):
                assert D not in e.text and "</think" not in e.text and "\ufffd" not in e.text


def test_long_string_argument_streams_as_it_arrives():
    long = "line of a long file ✓\n" * 40
    text = "x</think>" + block(invoke("write", ("path", "true", "a.txt"), ("body", "true", long)))
    p = OutputParser(True, True)
    cut = text.index(long) + len(long) // 2         # halfway through the value
    events = []
    for ch in text[:cut]:
        events += p.feed(ch)
    streamed = "".join(e.text for e in events if isinstance(e, ToolCallArgsDelta))
    assert streamed.startswith('{"path": "a.txt", "body": "line of a long file ✓\\n')
    assert len(streamed) > len(long) // 2           # the value came out before it closed
    events += p.feed(text[cut:]) + p.finish()
    assert json.loads(fold(events).tool_calls[0].arguments)["body"] == long


def test_tool_call_start_comes_once_with_name_before_arguments():
    events = run(list(RICH))
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [(s.index, s.name) for s in starts] == [(0, "get_weather"), (1, "get_weather"),
                                                   (2, "now")]
    first_args = next(i for i, e in enumerate(events) if isinstance(e, ToolCallArgsDelta))
    assert events.index(starts[0]) < first_args


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_dsml_falls_back_to_text_and_is_flagged(name):
    m = folded([MALFORMED[name]])
    assert m.finish.error and "malformed DSML" in m.finish.error
    assert D in m.content                           # the raw markup is shown, not swallowed
    assert all(c.error or json.loads(c.arguments) is not None for c in m.tool_calls)


def test_malformed_details():
    m = folded([MALFORMED["second_call_broken"]])
    assert [(c.name, c.arguments, c.error is None) for c in m.tool_calls[:1]] == [
        ("f", '{"a": [1]}', True)]
    assert m.tool_calls[1].name == "g" and m.tool_calls[1].error
    assert m.finish.reason == "tool_calls"          # the good call stands
    m = folded([MALFORMED["empty_block"]])
    assert m.content == f"text\n\n<{D}tool_calls>\n</{D}tool_calls> tail" and not m.tool_calls


def test_direct_json_invoke_body():
    body = '{"city": "Paris", "days": [1, 2]}'
    text = "r</think>" + block(f'<{D}invoke name="f">\n{body}\n</{D}invoke>', invoke("g"))
    for chunks in _splits(text, random.Random(2), n_random=5):
        m = folded(chunks)
        assert [(c.name, json.loads(c.arguments), c.error) for c in m.tool_calls] == [
            ("f", json.loads(body), None), ("g", {}, None)]
        assert m.content == "" and m.finish.error is None


def test_non_json_value_becomes_a_string_and_is_flagged():
    m = folded(["r</think>" + block(invoke("f", ("n", "false", "three"), ("x", "false", "NaN")))])
    assert json.loads(m.tool_calls[0].arguments) == {"n": "three", "x": "NaN"}
    assert m.tool_calls[0].error is None and "not JSON" in m.finish.error


def test_output_cut_inside_a_call():
    text = "r</think>a" + block(invoke("f", ("s", "true", "abcdef")))
    cut = text.index("abc") + 3
    m = folded([text[:cut]], reason="length")
    assert (m.content, m.finish.reason) == ("a", "length")
    assert m.tool_calls[0].arguments == '{"s": "abc' and "unterminated" in m.tool_calls[0].error
    m = folded([text[:text.index("invoke") + 8]], reason="length")   # cut in the invoke header
    assert m.content == "a" and not m.tool_calls and "unterminated" in m.finish.error


def test_tools_off_means_dsml_is_content():
    text = "r</think>echo: " + block(invoke("f", ("s", "true", "1")))
    assert folded([text], tools=False).content == "echo: " + block(invoke("f", ("s", "true", "1")))


def test_lenient_openers():
    call = invoke("f", ("s", "true", "1"))
    for text in ["r</think>no blank line<" + D + "tool_calls>\n" + call,      # no \n\n, no close
                 "r</think>orphan\n\n" + call,                                  # opener missing
                 "thinking then straight to a call" + block(call)]:           # inside reasoning
        for chunks in _splits(text, random.Random(1), n_random=5):
            m = folded(chunks)
            assert [(c.name, c.arguments, c.error) for c in m.tool_calls] == [
                ("f", '{"s": "1"}', None)], text
            assert D not in m.content + m.reasoning and m.finish.error is None


def test_chat_mode_text_after_block_stop_strings_and_eos():
    text = "a" + block(invoke("f")) + "\n\nafter STOP hidden"
    m = folded(list(text), reasoning=False, stop=["STOP"])
    assert (m.reasoning, m.content) == ("", "aafter ")
    assert (m.finish.reason, m.finish.stop_sequence) == ("stop", "STOP")
    p = OutputParser(False, True)                    # stop strings matched by the engine
    m = fold(p.feed("a" + block(invoke("f"))) + p.finish("stop", stop_sequence="STOP"))
    assert (m.finish.reason, m.finish.stop_sequence, len(m.tool_calls)) == ("stop", "STOP", 1)
    m = folded(["hello <｜end▁of", "▁sentence｜>junk"], reasoning=False, tools=False)
    assert (m.content, m.finish.reason) == ("hello ", "stop")


def test_held_back_text_is_flushed_at_the_end():
    assert folded(["2 <", "｜DS"], reasoning=False).content == "2 <｜DS"
    assert folded(["still thinking </thi"]).reasoning == "still thinking </thi"
    assert folded(["x</think>ends with blank\n\n"]).content == "ends with blank\n\n"


def test_reasoning_tokens_count_up_to_the_end_of_thinking():
    p = OutputParser(True, False)
    for tok in ["Hmm", " ok", "</", "think>", "Hi", "!"]:
        p.feed(tok, n_tokens=1)
    p.finish()
    assert p.reasoning_tokens == 4
    q = OutputParser(False, False)
    q.feed("Hi", n_tokens=1)
    assert q.reasoning_tokens == 0
