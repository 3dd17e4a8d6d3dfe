"""AsyncEngine: streams from the engine thread, errors to the caller, cancel frees the cache."""

import asyncio

import pytest

from backfit.engine.async_engine import AsyncEngine
from backfit.engine.engine import EngineConfig, LLMEngine
from backfit.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def aengine(tiny_converted):
    import torch
    torch.set_num_threads(1)
    e = AsyncEngine(EngineConfig(str(tiny_converted(1, "int8")), dtype="float32", block_size=16,
                                 max_num_seqs=4, max_model_len=256, num_blocks=64))
    e.start()
    yield e
    e.shutdown()


async def _collect(e, prompt, params):
    text, ids, last = "", [], None
    async for o in e.generate(prompt, params):
        text, ids, last = text + o.text, ids + o.token_ids, o
    return text, ids, last


def test_streams_equal_the_sync_engine_and_run_concurrently(aengine):
    async def main():
        await aengine.wait_ready()
        ps = [[0] + list(range(10 + i, 40 + 3 * i)) for i in range(3)]
        results = await asyncio.gather(*[_collect(aengine, p, GREEDY) for p in ps])
        return ps, results
    ps, results = asyncio.run(main())
    sync = LLMEngine(aengine.cfg)                                  # its own pools and weights
    try:
        want = [sync.generate([p], GREEDY)[0] for p in ps]
    finally:
        sync.close()
    for (text, ids, last), w in zip(results, want):
        assert ids == w["token_ids"] and text == w["text"]
        assert last.finished and last.usage.completion_tokens == 10


def test_bad_request_raises_in_the_caller(aengine):
    async def main():
        await aengine.wait_ready()
        with pytest.raises(ValueError, match="vocabulary"):
            await _collect(aengine, [10**7], GREEDY)
    asyncio.run(main())


def test_cancel_frees_slot_and_blocks_within_a_step(aengine):
    bm = None

    async def main():
        nonlocal bm
        await aengine.wait_ready()
        bm = aengine.engine.block_manager
        start = (bm.num_free_blocks, bm.num_free_slots)
        agen = aengine.generate(list(range(5, 60)), SamplingParams(max_tokens=200,
                                                                   ignore_eos=True))
        await agen.__anext__()                                   # running, holds a slot
        assert bm.num_free_slots < start[1]
        await agen.aclose()                                      # the client went away
        for _ in range(200):                                     # the engine thread frees it
            if (bm.num_free_blocks, bm.num_free_slots) == start:
                break
            await asyncio.sleep(0.02)
        assert (bm.num_free_blocks, bm.num_free_slots) == start
        assert not aengine.engine.has_unfinished()
    asyncio.run(main())
