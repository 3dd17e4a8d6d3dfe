"""lm-evaluation-harness's `local-completions` against a live tiny server on a local task (a task
yaml and a jsonl written here; nothing downloaded): in token and text mode, with the Hugging Face
tokenizer and with the server's remote tokenizer (`/tokenizer_info` + `/tokenize`), every
loglikelihood equals the engine's own (the prompt logprobs of the same ids, read from the
engine directly). A BOS the shipped tokenizer does not add shifts text mode by one token.

lm_eval is in the `test` extra (CI runs this module); without it installed the module skips."""

from __future__ import annotations

import json
import os
import shutil

import pytest

for _k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_k, "1")          # before datasets is imported: never download
lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.lmeval

TASK = "backfit_tiny_choice"
DOCS = [{"question": "The harbour town", "choices": [" is quiet", " sleeps", " by the sea"],
         "answer": 0},
        {"question": "Two and two make", "choices": [" four", " five"], "answer": 0},
        {"question": "héllo 你好, 123", "choices": [" world", "!", " 4567"], "answer": 2}]
YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
target_delimiter: ""
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, tiny_converted):
    d = tmp_path_factory.mktemp("lmeval")
    (d / "data.jsonl").write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in DOCS))
    (d / f"{TASK}.yaml").write_text(YAML.format(task=TASK, data=d / "data.jsonl"))
    tok = d / "tokenizer"                   # the tokenizer files alone (no tiny config.json)
    tok.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny_converted(1, "int8") / f, tok / f)
    os.environ["HF_DATASETS_CACHE"] = str(d / "hf_cache")
    return d


def run_lm_eval(srv, task_dir, **model_args) -> list[list[float]]:
    """simple_evaluate -> each doc's loglikelihood per choice, in document order."""
    from lm_eval.tasks import TaskManager
    args = {"model": "deepseek-v4-flash", "base_url": srv.url + "/v1/completions",
            "num_concurrent": 1, "max_retries": 1, **model_args}
    out = lm_eval.simple_evaluate(
        model="local-completions", model_args=args, tasks=[TASK], log_samples=True,
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) for r in s["resps"]] for s in samples]


def engine_loglikelihoods(srv, tokenizer) -> list[list[float]]:
    """The engine's own: prompt logprobs of ids(context + continuation), split as lm-eval's
    causal _encode_pair splits (at the context's own token count)."""
    from backfit.server.bridge import SamplingParams

    async def prompt_logprobs(ids):
        async for o in srv.engine.generate(ids, SamplingParams(max_tokens=1, temperature=0,
                                                               prompt_logprobs=0)):
            if o.prompt_logprobs is not None:
                return [None if e is None else e[1] for e in o.prompt_logprobs]
    out = []
    for doc in DOCS:
        lls = []
        for choice in doc["choices"]:
            whole = tokenizer.encode(doc["question"] + choice).ids
            n_ctx = len(tokenizer.encode(doc["question"]).ids)
            lps = srv.call(prompt_logprobs(whole))
            lls.append(sum(lps[n_ctx:]))
        out.append(lls)
    return out


def test_local_completions_token_and_text_mode_match_the_engine(real, task_dir):
    want = engine_loglikelihoods(real, real.ctx.tokenizer)
    hf = {"tokenizer_backend": "huggingface", "tokenizer": str(task_dir / "tokenizer")}
    modes = {"token": {**hf, "tokenized_requests": True},
             "text": {**hf, "tokenized_requests": False},
             "remote_token": {"tokenizer_backend": "remote", "tokenized_requests": True},
             "remote_text": {"tokenizer_backend": "auto", "tokenized_requests": False}}
    for mode, args in modes.items():
        got = run_lm_eval(real, task_dir, **args)
        assert [len(x) for x in got] == [len(x) for x in want], mode
        for g, w in zip(got, want):
            assert g == pytest.approx(w, abs=1e-4), (mode, got, want)
