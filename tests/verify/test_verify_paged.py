"""`backfit verify` on the engine's paged pools: the same gates hold when the runtime reads its
cache through block tables in prefill chunks (kv auto), int8 KV is measured (lossy, judged as a
conversion), and one long sequence (--long-context) crosses many blocks, windows and
compression periods. In-process, tp 1, tiny lossless checkpoint."""

import io

import pytest
from support import one_thread

from backfit.verify.run import verify


@pytest.fixture(scope="module")
def lossless(tiny_converted):
    return tiny_converted(1, "bf16")


def _run(tiny_flash, conv, **kw):
    with one_thread():
        return verify(tiny_flash, conv, out=io.StringIO(), **kw)


def test_paged_pools_pass_the_semantics_gate(tiny_flash, lossless):
    rep = _run(tiny_flash, lossless, kv_cache_dtype="auto", chunk=100)
    assert rep["check"] == "semantics" and rep["ok"], rep["problems"]
    assert rep["paged"]["kv_cache_dtype"] == "auto"


def test_int8_kv_is_lossy_but_within_the_conversion_gate(tiny_flash, lossless):
    rep = _run(tiny_flash, lossless, kv_cache_dtype="int8", chunk=100)
    assert rep["check"] == "conversion" and rep["ok"], rep["problems"]
    assert rep["logits"]["kl_mean"] > 1e-9                    # int8 storage does change logits
    assert rep["logits"]["top1"] >= 0.99


def test_long_context_one_sequence(tiny_flash, lossless):
    """2,048 tokens in chunks of 300: 128 window lengths, 512 CSA and 256 HCA entries, 32
    blocks of 64 in a reversed block table."""
    rep = _run(tiny_flash, lossless, long_context=2048, chunk=300)
    assert rep["positions"] == 2048 and rep["check"] == "semantics" and rep["ok"], rep["problems"]


def test_triton_kernels_need_cuda(tiny_flash, lossless):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        _run(tiny_flash, lossless, kernels="triton", device="cpu")
