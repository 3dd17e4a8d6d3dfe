"""ForwardBatch's per-token and per-sequence tensors (runtime/batch.py) and the host -> device
copies the forward makes. CPU: the values. GPU (marker gpu): a chunked-prefill step and an eager
decode step of the runner on the triton kernels make no host sync at all (torch.cuda's sync
debug mode): each sync drains the stream, and the host then has to refill it launch by launch
(the 8K prefill spent ~12 ms of ~100 idle that way before these copies went through pinned
memory)."""

import warnings

import pytest
import torch

from backfit.runtime.batch import ForwardBatch, to_device


def test_token_seq_start_and_last_rows():
    b = ForwardBatch.build([(7, [1, 2, 3], 10), (4, [5], 0), (9, [6, 7], 3)], "cpu")
    seq, start = b.token_seq_start
    assert seq.dtype == start.dtype == torch.int32
    assert seq.tolist() == [0, 0, 0, 1, 2, 2] and start.tolist() == [10, 10, 10, 0, 3, 3]
    assert b.token_seq_start[0] is seq                                 # built once per batch
    assert b.last_rows_host() == [2, 3, 5] and b.last_rows().tolist() == [2, 3, 5]
    assert b.tokens.tolist() == [1, 2, 3, 5, 6, 7]
    assert b.positions.tolist() == [10, 11, 12, 0, 3, 4]


def test_to_device_on_cpu():
    t = to_device([[1, 2], [3, 4]], torch.int32, "cpu")
    assert t.dtype == torch.int32 and t.tolist() == [[1, 2], [3, 4]]


def _eager_runner(tiny_converted):
    """A triton runner on the tiny int8 model without graphs (skips where this process already
    runs the torch backend: the backend is set once per process)."""
    from backfit.runtime import kernels as kpkg
    from backfit.runtime.runner import ModelRunner, RunnerConfig
    if kpkg._backend not in (None, "triton"):
        pytest.skip("this process already runs the torch backend")
    return ModelRunner(RunnerConfig(str(tiny_converted(1, "int8")), device="cuda",
                                    kernels="triton", max_num_seqs=2, max_model_len=256,
                                    block_size=16, num_blocks=40, enforce_eager=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefill_and_decode_steps_make_no_host_sync(tiny_converted, tp1_process):
    from backfit.runtime.runner import StepInput, StepSeq
    r = _eager_runner(tiny_converted)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 500, (150,), generator=g).tolist()
    tables = (tuple(range(16)), tuple(range(16, 32)))
    steps = [StepInput((StepSeq(0, 0, tables[0], 0, tuple(prompt[:100]), True),)),
             StepInput((StepSeq(0, 0, tables[0], 100, tuple(prompt[100:]), True),
                        StepSeq(1, 1, tables[1], 0, tuple(prompt[:40]), True))),
             StepInput((StepSeq(0, 0, tables[0], 150, (5,), True),
                        StepSeq(1, 1, tables[1], 40, (6,), True)))]
    for st in steps:                                # warm-up: compiles, workspaces
        r.forward(st)
    torch.cuda.synchronize()
    for st in steps:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                r.forward(st)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # torch's own line for each sync (the mode's one-off "prototype feature" notice is not)
        syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
        assert not syncs, syncs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_overlapped_step_parts_make_no_host_sync(tiny_converted, tp1_process):
    """The parts of an overlapped engine step (docs/ENGINE.md §6) queue without a host sync: a
    decode step whose tokens are placeholders filled from the last step's device ids (and its
    logits equal those of the same step with the ids written out), SamplingBatch.build of
    greedy, top-p / top-k, seeded, biased and min_tokens rows, sample, and to_host_async; only
    PendingSample.wait waits (on its event)."""
    from backfit.engine.sampling_params import SamplingParams
    from backfit.runtime.runner import StepInput, StepSeq
    from backfit.runtime.sampling import SamplingBatch, sample
    r = _eager_runner(tiny_converted)
    tables = (tuple(range(16)), tuple(range(16, 32)))
    r.forward(StepInput((StepSeq(0, 0, tables[0], 0, tuple(range(3, 60)), True),
                         StepSeq(1, 1, tables[1], 0, tuple(range(7, 40)), True))))
    real = StepInput((StepSeq(0, 0, tables[0], 57, (5,), True),
                      StepSeq(1, 1, tables[1], 33, (6,), True)))
    holes = StepInput((StepSeq(0, 0, tables[0], 57, (-2,), True),
                       StepSeq(1, 1, tables[1], 33, (-1,), True)))
    prev = torch.tensor([6, 5], device="cuda")
    want = r.forward(real).logits.clone()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9, seed=3,
                                                            logit_bias={9: 2.0}, min_tokens=4)]
    torch.cuda.synchronize()
    syncs = {}

    def quiet(label, fn):                           # fn() -> its result; syncs by part
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        n = sum("called a synchronizing" in str(w.message) for w in caught)
        if n:
            syncs[label] = n
        return out
    V = r.cfg.vocab_size
    got = quiet("forward with placeholders", lambda: r.forward(holes, prev).logits)
    greedy = quiet("build greedy", lambda: SamplingBatch.build(params[:1] * 2, [[], []],
                                                               [[1], [2]], V, got.device))
    ids = quiet("sample greedy", lambda: sample(got, greedy).token_ids)
    for label, p in (("top_p", SamplingParams(temperature=0.8, top_p=0.9)),
                     ("top_k", SamplingParams(temperature=0.8, top_k=5)),
                     ("seed", SamplingParams(temperature=0.8, seed=3)),
                     ("logit_bias", SamplingParams(temperature=0, logit_bias={9: 2.0})),
                     ("min_tokens", SamplingParams(temperature=0, min_tokens=4)),
                     ("presence", SamplingParams(temperature=0, presence_penalty=0.5))):
        sb = quiet(f"build {label}", lambda: SamplingBatch.build([params[0], p], [[5, 6], [7]],
                                                                 [[1, 2], [3]], V, got.device,
                                                                 eos_token_id=1))
        quiet(f"sample {label}", lambda: sample(got, sb))
    sb = SamplingBatch.build(params, [[5, 6], [7]], [[1, 2], [3]], V, got.device, eos_token_id=1)
    so = sample(got, sb)
    pending = quiet("to_host_async", so.to_host_async)
    assert not syncs, syncs
    assert torch.equal(got, want)
    host = pending.wait()
    assert host.token_ids[0] == int(want[0].argmax()) == int(ids[0])
    assert greedy.greedy is None and greedy.temperature is None     # nothing copied
