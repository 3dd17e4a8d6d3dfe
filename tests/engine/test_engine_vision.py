"""Image requests through the engine on the tiny Vision-Exp model (CPU, float32, int8 conversion).

Reference for every check: the same request run alone, greedy, uncached, or the plain runtime
(DecodeState, one full forward then token by token). Blocks of 16 tokens and 128-160-token
chunks, so an image block (98-101 positions for the 64x48 images, 122-125 for 320x400) takes
most of a chunk and the scheduler must move cuts around it; the runner's count check refuses a forward that splits one, so a wrong cut fails
loudly. The prefix cache keys on image content: a conversation that resends its images reuses
them, a different image of the same grid does not.
"""

from types import SimpleNamespace

import pytest

from backfit.engine.block_manager import BlockManager
from backfit.engine.engine import EngineConfig, LLMEngine
from backfit.engine.sampling_params import SamplingParams
from backfit.engine.scheduler import Scheduler
from backfit.engine.sequence import Sequence
from backfit.runtime.batch import ForwardBatch
from backfit.runtime.images import EmbeddingCache, batch_images
from backfit.verify.image_prompts import synthetic_png
from backfit.vision import prepare, splice

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def conv(tiny_converted):
    return tiny_converted(1, "int8", "vision")


def make(conv, **kw) -> LLMEngine:
    base = dict(model=str(conv), dtype="float32", block_size=16, max_num_seqs=8,
                max_num_batched_tokens=160, max_model_len=1024, num_blocks=200,
                async_scheduling=False)
    base.update(kw)
    return LLMEngine(EngineConfig(**base))


@pytest.fixture(scope="module")
def plain(conv):
    e = make(conv, enable_prefix_caching=False)
    yield e
    e.close()


@pytest.fixture(scope="module")
def imgs(plain):
    """Three images: a, b (same size and grid as a, other content), c (another grid)."""
    vc = plain.model_cfg.vision
    return [prepare(synthetic_png(w, h, seed=s), vc) for w, h, s in
            ((64, 48, 0), (64, 48, 1), (320, 400, 2))]


def vprompt(e, parts):
    """parts: text lengths (ints: ids drawn from the length) and images -> VisionPrompt."""
    segs = [[0]] + [[3 + (7 * k + n) % 500 for k in range(n)] if isinstance(n, int) else n
                    for n in parts]
    return splice(segs, e.model_cfg.vocab_size)


def add(e, vp, params=GREEDY):
    return e.add_request(list(vp.ids), params, images=tuple(zip(vp.spans, vp.images)))


def run(e, vps, params=GREEDY, stagger=False, usage=None):
    """Every prompt to the end (staggered: one new request every other step) -> tokens;
    usage (a dict): filled with each request's final Usage by index."""
    got, ids, pending, step = {}, {}, list(enumerate(vps)), 0
    while pending or e.has_unfinished():
        if pending and (not stagger or step % 2 == 0):
            i, vp = pending.pop(0)
            ids[add(e, vp, params)] = i
            if not stagger:
                continue
        for o in e.step():
            got.setdefault(ids[o.request_id], []).extend(o.token_ids)
            if o.finished and usage is not None:
                usage[ids[o.request_id]] = o.usage
        step += 1
    return [got[i] for i in range(len(vps))]


@pytest.fixture(scope="module")
def cases(plain, imgs):
    """Prompts with one image at each lead-pad residue, two images, and a text-only one."""
    a, b, c = imgs
    vps = [vprompt(plain, [20, a, 30]), vprompt(plain, [21, a, 12]), vprompt(plain, [22, c, 5]),
           vprompt(plain, [7, b, 40, c, 9]), vprompt(plain, [30])]
    assert len({vp.spans[0].lead for vp in vps[:3]}) == 3
    return vps, [run(plain, [vp])[0] for vp in vps]


def test_alone_matches_the_plain_runtime(plain, cases):
    """Engine greedy (chunked around the image) = argmax of the runtime's full forward with the
    image, then decoding token by token."""
    model = plain.ranks.runner.model
    vp, want = cases[0][0], cases[1][0]
    st, ids, out = model.new_state(), list(vp.ids), []
    b = ForwardBatch.build([(0, ids, 0)], images=batch_images(
        model, EmbeddingCache(model), [(ids, 0, list(zip(vp.spans, vp.images)))]))
    logits = model(b, st, last_only=True)
    for _ in range(len(want)):
        out.append(int(logits[-1].argmax()))
        logits = model(ForwardBatch.single([out[-1]], start=len(ids) + len(out) - 1), st,
                       last_only=True)
    assert out == want


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_batched_equals_alone(conv, cases, overlap):
    """All five arriving at staggered steps, chunked (128 tokens) and batched = each alone; the
    tower ran once per distinct image (a is in two prompts)."""
    vps, want = cases
    e = make(conv, max_num_batched_tokens=128, enable_prefix_caching=False,
             async_scheduling=overlap)
    try:
        assert run(e, vps, stagger=True) == want
        assert e.ranks.runner.image_cache.tower_images == 3
        assert e.block_manager.num_free_blocks == e.num_blocks
    finally:
        e.close()


def test_prefix_cache_keys_on_image_content(conv, plain, imgs):
    """The same prompt again hits the cache up to its last block boundary (the tower does not
    run again); a conversation that resends its image (prompt + answer + more text) reuses it;
    image b (same grid, so the same ids as a) in the same place hits only the text before its
    block, and answers as b does uncached."""
    a, b, _ = imgs
    vp_a, vp_b = vprompt(plain, [40, a, 50]), vprompt(plain, [40, b, 50])
    assert vp_a.ids == vp_b.ids
    want_a, want_b = run(plain, [vp_a])[0], run(plain, [vp_b])[0]   # uncached
    e = make(conv)
    try:
        usage: dict = {}
        assert run(e, [vp_a], usage=usage) == [want_a] and usage[0].cached_tokens == 0
        assert run(e, [vp_a], usage=usage) == [want_a]
        assert usage[0].cached_tokens == len(vp_a.ids) // 16 * 16     # past the image block
        assert e.ranks.runner.image_cache.tower_images == 1
        more = vprompt(plain, [40, a, 50])                             # + answer + new text
        turn2 = splice([list(more.ids[:more.spans[0].start]), a,
                        list(more.ids[more.spans[0].start + more.spans[0].length:]) + want_a
                        + [9, 10, 11, 12, 13]], plain.model_cfg.vocab_size)
        want2 = run(plain, [turn2])[0]
        assert run(e, [turn2], usage=usage) == [want2]
        assert usage[0].cached_tokens >= len(vp_a.ids) // 16 * 16
        assert run(e, [vp_b], usage=usage) == [want_b]
        assert usage[0].cached_tokens <= vp_b.spans[0].start              # the text only
        assert e.ranks.runner.image_cache.tower_images == 2
    finally:
        e.close()


def test_dspark_speculation_with_images(conv, cases):
    """Vision-Exp's DSpark stages draft after image prompts (their draft rows are text: the
    stages' bias_vl unused, dsv4-vision.md 11.3): greedy speculation = the plain greedy tokens."""
    vps, want = cases
    e = make(conv, speculative_method="dspark", num_speculative_tokens=3,
             enable_prefix_caching=False)
    try:
        assert run(e, vps) == want
        assert e.spec.num_drafts > 0
    finally:
        e.close()


def test_preemption_recomputes_images(conv, cases):
    """A pool too small for all five at once: preempted requests recompute their prompts (and
    images) and still answer as alone."""
    vps, want = cases
    e = make(conv, num_blocks=24, max_model_len=384, enable_prefix_caching=False)
    try:
        assert run(e, vps) == want
        assert e.scheduler.num_preemptions > 0
    finally:
        e.close()


def test_bad_image_requests(plain, imgs):
    a = imgs[0]
    vp = vprompt(plain, [10, a, 5])
    with pytest.raises(ValueError, match="not an image block"):
        plain.add_request(list(vp.ids[1:]), GREEDY, images=tuple(zip(vp.spans, vp.images)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        plain.add_request(list(vp.ids), GREEDY)               # block ids without the images
    with pytest.raises(ValueError, match="prompt_logprobs"):
        add(plain, vp, SamplingParams(max_tokens=2, prompt_logprobs=1))
    small = make(plain.cfg.model, max_num_batched_tokens=90)
    try:
        with pytest.raises(ValueError, match="exceeds max_num_batched_tokens 90"):
            add(small, vp)
    finally:
        small.close()


# ---- the scheduler alone (plain Python) ------------------------------------------------------
def _seq(sid, n, blocks, params=SamplingParams(max_tokens=4)):
    """A Sequence of n ids with image blocks (start, length) (fake spans and images)."""
    images = tuple((SimpleNamespace(start=s, length=L, key=f"k{s}"), None) for s, L in blocks)
    return Sequence(sid, [5] * n, params, images)


@pytest.mark.parametrize("budget", [48, 64, 100])
def test_chunks_never_split_an_image_block(budget):
    """Every chunk boundary lies outside every block, whatever the budget and block size; the
    prefix-cache boundary (a chunk end, its snapshot saved) too."""
    bm = BlockManager(64, 16, 4, 4, True)
    sch = Scheduler(bm, 4, budget, 1024)
    seq = _seq(0, 300, [(10, 37), (60, 33), (94, 40), (250, 45)])
    sch.add(seq)
    ends, done = [], False
    while not done:                                   # the prefill, to its first sample
        step = sch.schedule()
        for item in step.seqs:
            ends.append(item.start + len(item.token_ids))
            done |= item.sample
        sch.advance(step)
        sch.resolve(step, {0: 1} if done else {})
    assert ends[-1] == 300 and not any(seq.inside_image(e) for e in ends)
    assert seq.cache_boundary(16) == 240 and 240 in ends      # 288, 272, 256: inside 250-294


def test_snapshot_boundaries_never_inside_an_image_block():
    """Every boundary chosen for a prefix-cache snapshot (a cache_boundaries hint, the periodic
    ones, the prefill's last) that falls inside an image block moves down to the last block
    boundary before the block, where the slot's state exists (the block runs in one chunk);
    the snapshots are saved there and nowhere inside a block. Blocks of 16, every 4 blocks."""
    bm = BlockManager(64, 16, 4, 8, True)
    sch = Scheduler(bm, 4, 512, 1024, snapshot_interval=4)
    hints = SamplingParams(max_tokens=4, cache_boundaries=(70, 215))      # both inside one
    seq = _seq(0, 300, [(40, 50), (200, 30)], hints)          # blocks 40-89 and 200-229
    sch.add(seq)
    saved, done = [], False
    while not done:
        step = sch.schedule()
        saved += [b for _, _, b in step.saves]
        done = any(item.sample for item in step.seqs)
        sch.advance(step)
        sch.resolve(step, {0: 1} if done else {})
    # 64 (periodic) and 70 -> 32; 215 -> 192 (also periodic); 128, 256; 288 the last
    assert saved == [32, 128, 192, 256, 288]
    assert not any(seq.inside_image(b) for b in saved)
    assert bm.plan_save(seq, 208, decode=False) is None       # inside 200-229: refused


def test_cache_hint_inside_an_image_is_reused_before_it(conv, plain, imgs):
    """The chat server's hint (the end of the system prompt and tools) inside an image block:
    its snapshot sits at the block boundary before the image, so a request that shares the
    prompt through the image and then diverges reuses exactly that much (the hint as given would
    cut the block: no snapshot at all); both answer as uncached."""
    a = imgs[0]
    vp1, vp2 = vprompt(plain, [40, a, 50]), vprompt(plain, [40, a, [11] * 50])
    span = vp1.spans[0]
    before = span.start // 16 * 16
    assert before > 0 and span.length > 16
    hinted = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                            cache_boundaries=(span.start + span.length // 2,))
    want1, want2 = run(plain, [vp1])[0], run(plain, [vp2])[0]
    e = make(conv, prefix_snapshot_interval=0)                # the hint and the last only
    try:
        usage: dict = {}
        assert run(e, [vp1], hinted, usage=usage) == [want1] and usage[0].cached_tokens == 0
        assert run(e, [vp2], hinted, usage=usage) == [want2]
        assert usage[0].cached_tokens == before
    finally:
        e.close()
