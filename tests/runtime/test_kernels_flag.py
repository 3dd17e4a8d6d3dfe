"""--kernels triton|torch through the engine: defaults, clear errors, set once per process, and
(on a GPU) greedy output of the Triton kernels equal to the torch path on the tiny checkpoint.

CPU part: resolve_kernels' defaults (triton on CUDA, torch on CPU) and errors, EngineConfig and
the CLI refusing triton on CPU with one line, and ModelRunner setting the process-wide backend
(and refusing to change it). GPU part (marker gpu): two fresh processes (the backend is set once
per process), the same prompts greedy through LLMEngine on CUDA in BF16, token ids compared;
with two GPUs also TP 2 with CUDA graphs (NCCL inside) against TP 2 eager.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from backfit.cli import main
from backfit.engine.engine import EngineConfig
from backfit.runtime import kernels as kpkg
from backfit.runtime.runner import ModelRunner, RunnerConfig, resolve_kernels

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def conv(tiny_converted):
    return tiny_converted(1, "int8")


def test_resolve_defaults_and_errors():
    assert resolve_kernels(None, "cpu") == "torch"
    assert resolve_kernels(None, "cuda") == "triton"
    assert resolve_kernels(None, torch.device("cuda", 1)) == "triton"
    assert resolve_kernels("torch", "cuda") == "torch"
    with pytest.raises(ValueError, match="--kernels triton needs a CUDA device"):
        resolve_kernels("triton", "cpu")
    with pytest.raises(ValueError, match="choose one of torch, triton"):
        resolve_kernels("cuda", "cuda")


def test_engine_config_checks_before_any_rank_starts():
    with pytest.raises(ValueError, match="use --kernels torch on CPU"):
        EngineConfig("no-such-dir", device="cpu", kernels="triton")
    assert EngineConfig("x").runner_config().kernels is None            # resolved per rank
    assert EngineConfig("x", device="cuda", kernels="torch").runner_config().kernels == "torch"


def test_cli_one_line_errors(conv):
    r = CliRunner().invoke(main, ["generate", str(conv), "--prompt", "hi", "--tp", "1",
                                  "--kernels", "triton"])
    assert r.exit_code == 1
    assert r.output.strip().splitlines() == [
        "error: --kernels triton needs a CUDA device (got --device cpu); use --kernels torch "
        "on CPU"]
    r = CliRunner().invoke(main, ["generate", str(conv), "--prompt", "hi", "--kernels", "cuda"])
    assert r.exit_code == 2 and "'cuda' is not one of 'triton', 'torch'" in r.output


def test_runner_sets_the_backend_once(conv, tp1_process, monkeypatch):
    rc = RunnerConfig(str(conv), dtype="float32", max_num_seqs=2, max_model_len=128,
                      num_blocks=8)
    monkeypatch.setattr(kpkg, "_backend", "triton")         # as if a kernel run came first
    with pytest.raises(RuntimeError, match="already set to 'triton'"):
        ModelRunner(rc)
    monkeypatch.setattr(kpkg, "_backend", None)
    r = ModelRunner(rc)                                      # CPU default: the torch path
    assert r.kernels == "torch" and kpkg.get_kernel_backend() == "torch"
    assert all(layer.ffn.stacked is None for layer in r.model.layers)   # nothing stacked


_GREEDY = """
import json, sys
from backfit.engine.engine import EngineConfig, LLMEngine
from backfit.engine.sampling_params import SamplingParams
from backfit.runtime.kernels import get_kernel_backend
spec = json.loads(sys.argv[6])
e = LLMEngine(EngineConfig(sys.argv[1], device="cuda", dtype="bfloat16", kernels=sys.argv[2],
                           enforce_eager=sys.argv[3] == "eager", max_num_seqs=4,
                           max_model_len=256, block_size=16, num_blocks=64,
                           async_scheduling=sys.argv[4] == "async", tp=int(sys.argv[5]),
                           **spec))
prompts = [[0] + [(37 * i + 11 * j) % 500 + 3 for j in range(5 + 9 * i)] for i in range(4)]
out = e.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
m, g, pg = e.ranks.runner.model, e.ranks.runner.graphs, e.ranks.runner.prefill_graphs
sg = e.ranks.runner.spec_graphs
print(json.dumps({"backend": get_kernel_backend(), "replays": g.replays if g else 0,
                  "prefill_steps": pg.steps if pg else 0,
                  "spec_replays": sg.replays if sg else 0, "stats": e.stats(),
                  "stacked": [bool(lay.ffn.stacked) for lay in m.layers],
                  "tokens": [o["token_ids"] for o in out]}))
e.close()
"""


def _greedy(conv: Path, kernels: str, mode: str = "eager", sched: str = "sync",
            tp: int = 1, spec: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _GREEDY, str(conv), kernels, mode, sched, str(tp),
                        json.dumps(spec or {})],
                       env=env, capture_output=True, text=True, timeout=600)
    err = p.stderr
    assert p.returncode == 0, err[err.find("Traceback"):][:6000] or err[-6000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_greedy_triton_equals_torch(conv):
    """torch path = triton eager = triton with the decode steps replayed from CUDA graphs and
    the first step (78 prompt tokens) from the prefill pieces (padded to 128), with and without
    async scheduling (the overlapped step: decode tokens filled on the device)."""
    ref, got = _greedy(conv, "torch"), _greedy(conv, "triton")
    graphs = _greedy(conv, "triton", "graphs")
    overlapped = _greedy(conv, "triton", "graphs", "async")
    eager_overlapped = _greedy(conv, "triton", "eager", "async")
    assert ref["backend"] == "torch" and not any(ref["stacked"])
    assert got["backend"] == "triton" and all(got["stacked"])       # the fused MoE ran
    assert ref["replays"] == got["replays"] == 0
    assert graphs["replays"] >= 20                                  # decode steps were graphs
    assert graphs["prefill_steps"] >= 1 and got["prefill_steps"] == 0   # the 78-token prefill
    assert all(len(t) == 24 for t in got["tokens"])
    assert got["tokens"] == ref["tokens"]
    assert graphs["tokens"] == ref["tokens"]
    assert overlapped["replays"] >= 20
    assert overlapped["tokens"] == eager_overlapped["tokens"] == ref["tokens"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp2_graphs_equal_tp2_eager(tiny_converted):
    """TP 2 on two GPUs (two rank processes, NCCL): the decode steps replayed from CUDA graphs
    that hold the NCCL all-reduces give the eager TP-2 engine's greedy tokens, with and without
    async scheduling (rank 1 takes the placeholders' ids from rank 0 by an eager broadcast
    between replays). Not against tp 1: NCCL sums the two partials in another order."""
    conv2 = tiny_converted(2, "int8")
    eager = _greedy(conv2, "triton", "eager", "sync", tp=2)
    graphs = _greedy(conv2, "triton", "graphs", "sync", tp=2)
    overlapped = _greedy(conv2, "triton", "graphs", "async", tp=2)
    assert eager["replays"] == 0 and all(len(t) == 24 for t in eager["tokens"])
    assert graphs["replays"] >= 20 and overlapped["replays"] >= 20
    assert graphs["prefill_steps"] >= 1                             # NCCL inside the pieces
    assert graphs["tokens"] == eager["tokens"]
    assert overlapped["tokens"] == eager["tokens"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant,method,k", [("flash", "mtp", 3), ("0731", "dspark", 5)])
def test_speculative_graphs_give_the_plain_greedy_tokens(tiny_converted, variant, method, k):
    """Speculative decoding on the triton kernels: draft + verify + the drafter's context
    replayed as one CUDA graph a step (runtime/graphs/spec.py: a verify batch whose rows share
    a slot), the same steps eager, and plain decoding all give the same greedy tokens; the
    drafts were verified and the graphs replayed."""
    conv = tiny_converted(1, "int8", variant)
    spec = dict(speculative_method=method, num_speculative_tokens=k)
    plain = _greedy(conv, "triton", "graphs")
    graphs = _greedy(conv, "triton", "graphs", spec=spec)
    eager = _greedy(conv, "triton", "eager", spec=spec)
    # 3 sequences x 24 tokens; a step that accepts emits up to k + 1 of them (DSpark k 5: 9
    # steps were seen), so a handful of replays already shows the graph path ran
    assert graphs["spec_replays"] >= 5 and eager["spec_replays"] == 0
    assert graphs["stats"]["spec_decode_num_drafts"] >= 5
    assert graphs["tokens"] == eager["tokens"] == plain["tokens"]
