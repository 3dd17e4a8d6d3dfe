"""Images through all three protocols on a live server over the real tiny Vision-Exp engine
(CPU), with the official `openai` and `anthropic` SDKs: data URLs, http(s) URLs fetched from a
loopback host, Anthropic base64 and url sources, images inside tool results; usage and
count_tokens count the image positions; a quoted placeholder in any text stays text; every bad
image is the protocol's own 400 naming the part (96 images in one request: test_server_vision_96.py)."""

import base64
import json
import urllib.request

import anthropic
import openai
import pytest
import support
from live_server import ImageHost, real_server

from backfit.server.images import MediaLimits
from backfit.verify.image_prompts import synthetic_png
from backfit.vision import lead_pad, prepare

V = 512                                                 # the tiny vocabulary
PNG, PNG_B = synthetic_png(64, 48, seed=0), synthetic_png(64, 48, seed=1)
PLACEHOLDERS = "<｜deepseek_image｜> and <|place_holder_mm_span_0431|>"


def data_url(png: bytes = PNG, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def host():
    h = ImageHost(PNG, PNG_B, slow_s=4.0)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def vsrv(tiny_converted):
    """The live server: images up to 200 kB, fetched within 1.5 s, from 127.0.0.1 only."""
    with support.one_thread():
        srv = real_server(tiny_converted(1, "int8", "vision"),
                          media=MediaLimits(max_bytes=200_000, timeout_s=1.5,
                                            allowed_domains=("127.0.0.1",)))
        yield srv
        srv.stop()


def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


def claude(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=120)


def post(srv, path, body):
    req = urllib.request.Request(srv.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def tokens(srv, messages) -> list[int]:
    st, out = post(srv, "/tokenize", {"messages": messages})
    assert st == 200, out
    return out["tokens"]


def one_block(ids: list[int], png: bytes = PNG) -> None:
    """ids hold exactly png's block: its lead pad for where it starts, then the pad-free block."""
    at = next(i for i, t in enumerate(ids) if t >= V)
    block = prepare(png, _vision()).block
    assert sum(t >= V for t in ids) == lead_pad(at) + len(block)
    assert [t - V for t in ids[at + lead_pad(at):at + lead_pad(at) + len(block)]] == \
        list(block.types)


def _vision():
    from backfit.synthetic_vision import vision_keys
    from backfit.config import VisionConfig
    return VisionConfig.from_dict(vision_keys(), "tiny")


USER = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                     {"type": "image_url", "image_url": {"url": data_url()}}]}]


def test_chat_completions_image_part(vsrv):
    """A data URL, plain and streamed: usage counts the image's block (= /tokenize)."""
    ids = tokens(vsrv, USER)
    one_block(ids)
    c = oai(vsrv)
    r = c.chat.completions.create(model="m", messages=USER, max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].finish_reason == "length"
    chunks = list(c.chat.completions.create(model="m", messages=USER, max_tokens=3,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
        r.choices[0].message.content


def test_responses_input_image(vsrv, host):
    """input_image by data URL and by http URL (fetched): the same prompt as Chat's."""
    c = oai(vsrv)
    for url in (data_url(), host.url + "/a.png"):
        r = c.responses.create(model="m", max_output_tokens=3, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": url}]}])
        assert r.status == "incomplete" and r.usage.input_tokens == len(tokens(vsrv, USER))


def test_anthropic_image_blocks_and_tool_result_images(vsrv, host):
    """A base64 image block in the user turn and a url image inside a tool result: both
    counted by count_tokens and by usage (two blocks)."""
    msgs = [{"role": "user", "content": [
                {"type": "text", "text": "Look."},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(PNG).decode()}}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot",
                                               "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "the screen:"},
                {"type": "image", "source": {"type": "url", "url": host.url + "/b.png"}}]}]}]
    tools = [{"name": "shot", "input_schema": {"type": "object"}}]
    c = claude(vsrv)
    n = c.messages.count_tokens(model="m", messages=msgs, tools=tools).input_tokens
    text_only = json.loads(json.dumps(msgs))
    del text_only[0]["content"][1], text_only[2]["content"][0]["content"][1]
    blocks = n - c.messages.count_tokens(model="m", messages=text_only, tools=tools).input_tokens
    size = len(prepare(PNG, _vision()).block)               # b.png: the same grid
    assert 2 * size <= blocks <= 2 * size + 10      # + lead pads (<= 3) and "\n\n" (<= 2) each
    r = c.messages.create(model="m", max_tokens=3, messages=msgs, tools=tools)
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == n
    r = c.messages.create(model="m", max_tokens=64, messages=msgs, tools=tools,   # a forced
                          tool_choice={"type": "any"}, thinking={"type": "disabled"})   # call:
    assert r.usage.output_tokens == 64        # the continuation (prompt + the forced opener,
    assert r.content[0].text.startswith("\n\n<｜DSML｜tool_calls>")   # images kept) ran


def test_placeholder_strings_in_text_stay_text(vsrv):
    """The image placeholder and a reserved mm-span string quoted in system, user and tool text:
    200 on every protocol, no image positions, the same count as any text (B2-B4)."""
    msgs = [{"role": "system", "content": f"Say {PLACEHOLDERS}"},
            {"role": "user", "content": f"Quote {PLACEHOLDERS}."}]
    ids = tokens(vsrv, msgs)
    assert max(ids) < V
    r = oai(vsrv).chat.completions.create(model="m", messages=msgs, max_tokens=2)
    assert r.usage.prompt_tokens == len(ids)
    r = oai(vsrv).responses.create(model="m", max_output_tokens=2, instructions=msgs[0]["content"],
                                   input=msgs[1]["content"])
    assert r.usage.input_tokens == len(ids)
    am = [{"role": "user", "content": msgs[1]["content"]},
          {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                             "input": {}}]},
          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                        "content": PLACEHOLDERS}]}]
    r = claude(vsrv).messages.create(model="m", max_tokens=2, system=msgs[0]["content"],
                                     messages=am, tools=[{"name": "f", "input_schema": {}}])
    assert r.stop_reason in ("max_tokens", "end_turn", "tool_use")


def _truncated():
    return PNG[:len(PNG) // 2]


BAD = [  # (url or (media_type, data), what the error says)
    (data_url(_truncated()), "cannot decode image"),
    ("data:image/png;base64,@@@@", "not valid base64"),
    (data_url(PNG, "text/plain"), "is not an image"),
    (data_url(b"\x89PNG" + b"0" * 300_000), "at most 200,000 bytes"),
    ("file:///etc/passwd", "data: URL or an http(s) URL"),
    ("http://localhost/a.png", "not allowed"),
    ("/big.png", "at most 200,000 bytes"),
    ("/text", "is not an image"),
    ("/redir", "redirects are not followed"),
    ("/nope.png", "HTTP 404"),
    ("/slow", "timed out"),
]


@pytest.mark.parametrize("url,why", BAD, ids=[w for _, w in BAD])
def test_bad_images_are_400s_in_each_protocol_shape(vsrv, host, url, why):
    url = host.url + url if url.startswith("/") else url
    st, out = post(vsrv, "/v1/chat/completions", {"model": "m", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]})
    assert st == 400 and why in out["error"]["message"], out
    assert out["error"]["param"] == "messages[0].content[0]"
    st, out = post(vsrv, "/v1/responses", {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": url}]}]})
    assert st == 400 and why in out["error"]["message"] and out["error"]["param"] == \
        "input[0].content[0]", out
    src = {"type": "url", "url": url}
    if url.startswith("data:"):
        mime, data = url[5:].split(";base64,")
        src = {"type": "base64", "media_type": mime, "data": data}
    with pytest.raises(anthropic.BadRequestError) as e:
        claude(vsrv).messages.create(model="m", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image", "source": src}]}])
    assert why in e.value.body["error"]["message"]


def test_too_many_images_is_a_400_before_any_is_loaded(vsrv):
    """97 > the default --limit-mm-per-prompt 96 (undecodable bytes: never decoded)."""
    junk = {"type": "image_url", "image_url": {"url": data_url(b"junk")}}
    with pytest.raises(openai.BadRequestError) as e:
        oai(vsrv).chat.completions.create(model="m", max_tokens=2, messages=[
            {"role": "user", "content": [junk] * 97}])
    assert "97 images" in e.value.message and "--limit-mm-per-prompt" in e.value.message
