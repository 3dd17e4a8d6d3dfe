"""SamplingParams: vLLM defaults; every validation error names its field and range; normalising."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from backfit.engine.sampling_params import MAX_LOGPROBS, SamplingParams

BAD = [  # (field, value, message fragment)
    ("max_tokens", 0, "max_tokens must be an integer >= 1 or None, got 0"),
    ("max_tokens", 2.0, "max_tokens must be an integer >= 1 or None, got 2.0"),
    ("min_tokens", -1, "min_tokens must be an integer >= 0, got -1"),
    ("temperature", -1, "temperature must be >= 0, got -1"),
    ("temperature", float("nan"), "temperature must be >= 0, got nan"),
    ("temperature", "1", "temperature must be >= 0, got '1'"),
    ("top_k", -2, "top_k must be an integer >= 1, or 0/-1 (off), got -2"),
    ("top_k", 1.5, "top_k must be an integer >= 1, or 0/-1 (off), got 1.5"),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
    ("top_p", 1.01, "top_p must be in (0, 1], got 1.01"),
    ("min_p", -0.1, "min_p must be in [0, 1], got -0.1"),
    ("min_p", 1.5, "min_p must be in [0, 1], got 1.5"),
    ("seed", 1.0, "seed must be an integer or None, got 1.0"),
    ("seed", True, "seed must be an integer or None, got True"),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2], got 2.5"),
    ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2], got -3"),
    ("repetition_penalty", 0, "repetition_penalty must be in (0, 2], got 0"),
    ("repetition_penalty", 2.5, "repetition_penalty must be in (0, 2], got 2.5"),
    ("logit_bias", {-1: 1.0}, "logit_bias keys must be token ids >= 0, got -1"),
    ("logit_bias", {"abc": 1.0}, "logit_bias keys must be token ids >= 0, got 'abc'"),
    ("logit_bias", {5: 101}, "logit_bias values must be in [-100, 100], got 101 for 5"),
    ("logit_bias", {5: float("inf")}, "logit_bias values must be in [-100, 100], got inf for 5"),
    ("stop", ["ok", ""], "stop must be non-empty strings, got ('ok', '')"),
    ("stop", [1], "stop must be non-empty strings, got (1,)"),
    ("stop_token_ids", [3, -1], "stop_token_ids must be integers >= 0, got (3, -1)"),
    ("ignore_eos", 1, "ignore_eos must be true or false, got 1"),
    ("include_stop_str_in_output", "yes", "include_stop_str_in_output must be true or false"),
    ("skip_special_tokens", None, "skip_special_tokens must be true or false, got None"),
    ("logprobs", -1, "logprobs must be an integer >= 0 or None, got -1"),
    ("prompt_logprobs", 1.0, "prompt_logprobs must be an integer >= 0 or None, got 1.0"),
    ("cache_boundaries", [8, 0], "cache_boundaries must be token counts >= 1, got (8, 0)"),
    ("cache_boundaries", [True], "cache_boundaries must be token counts >= 1, got (True,)"),
]


@pytest.mark.parametrize("name,value,msg", BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_every_bad_value_is_a_one_line_error_naming_the_field(name, value, msg):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{name: value})
    assert str(e.value).startswith(msg) and "\n" not in str(e.value)
    assert str(e.value).startswith(name)


def test_every_field_has_a_bad_case():
    checked = {n for n, _, _ in BAD} | {"max_tokens"}
    assert {f.name for f in dataclasses.fields(SamplingParams)} <= checked


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=5).min_tokens == 5


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.max_tokens, p.min_tokens, p.temperature) == (16, 0, 1.0)
    assert (p.top_k, p.top_p, p.min_p) == (0, 1.0, 0.0)
    assert (p.seed, p.presence_penalty, p.frequency_penalty) == (None, 0, 0)
    assert p.repetition_penalty == 1.0
    assert (p.logit_bias, p.stop, p.stop_token_ids, p.ignore_eos) == ((), (), (), False)
    assert (p.logprobs, p.prompt_logprobs) == (None, None)
    assert (p.include_stop_str_in_output, p.skip_special_tokens) == (False, True)
    assert not p.greedy and not p.has_penalties


def test_normalisation_and_frozen():
    p = SamplingParams(stop="END", stop_token_ids=[7, 8], logit_bias={"12": 2, 3: -1.5},
                       top_k=-1, logprobs=50, prompt_logprobs=21, temperature=0)
    assert p.stop == ("END",) and p.stop_token_ids == (7, 8)
    assert p.logit_bias == ((3, -1.5), (12, 2.0))           # JSON string keys become ids
    assert p.top_k == 0                                     # -1 and 0 both mean off
    assert p.logprobs == MAX_LOGPROBS == 20 and p.prompt_logprobs == 20
    assert p.greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert hash(p) == hash(SamplingParams(stop=["END"], stop_token_ids=(7, 8), top_k=0,
                                          logit_bias=[("12", 2), (3, -1.5)], logprobs=20,
                                          prompt_logprobs=20, temperature=0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(cache_boundaries=[40, 8, 40]).cache_boundaries == (8, 40)


def test_all_stop_token_ids():
    p = SamplingParams(stop_token_ids=[5, 1])
    assert p.all_stop_token_ids(1) == (1, 5)
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).all_stop_token_ids(1) == (5,)


def test_no_torch_import():
    src = Path(__file__).resolve().parents[2] / "backfit" / "engine" / "sampling_params.py"
    mods = {a.name for n in ast.walk(ast.parse(src.read_text())) if isinstance(n, ast.Import)
            for a in n.names} | {n.module for n in ast.walk(ast.parse(src.read_text()))
                                 if isinstance(n, ast.ImportFrom)}
    assert not {m for m in mods if m and m.split(".")[0] in ("torch", "numpy", "backfit")}, mods
