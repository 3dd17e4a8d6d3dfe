"""Tensor parallelism: tp = 2 and 4 (gloo on CPU, one process per rank, each loading only its
own rank files of a conversion made with --tp N) give the tp = 1 logits, for the INT8 and the
lossless conversion.

Covers sharded int8 scales (wq_b, wo_b, shared/routed experts by intermediate dim), the
vocab-parallel embedding/head, the head-split sink and indexer (partial scores all-reduced
before top-k), and decode steps through the state on every rank.

The sequence is long enough that the indexer really selects: a CSA layer (ratio 4) has
(p + 1) // 4 complete entries at position p, more than index_topk = 16 from p = 68 on, so for
most positions a wrong partial score (a missing all-reduce, a head scaled on one rank only)
changes WHICH entries are attended, not just their weights. A spy on Indexer.select counts the
rows where k < valid entries, on every rank, and the test asserts they are the majority.
"""

import contextlib
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from backfit.runtime.batch import ForwardBatch

S, PREFILL = 168, 156         # 100 of 168 positions select 16 of more than 16 entries
STRICT_MIN = 0.5              # share of indexer rows with k < valid entries, asserted


def _tokens() -> torch.Tensor:
    return torch.randint(0, 512, (S,), generator=torch.Generator().manual_seed(11))


@contextlib.contextmanager
def _spy_on_indexer():
    """Wrap Indexer.select in this process; yields counters {"rows", "strict"}: indexer rows
    seen, and rows where top-k is strictly smaller than the number of valid entries."""
    from backfit.runtime.model import compressor
    seen = {"rows": 0, "strict": 0}
    orig = compressor.Indexer.select

    def select(self, qI, w, keys, valid):                 # valid [n, E] -> sel, ok [n, k]
        sel, ok = orig(self, qI, w, keys, valid)
        seen["rows"] += valid.shape[0]
        seen["strict"] += int((valid.sum(-1) > sel.shape[1]).sum())
        return sel, ok
    compressor.Indexer.select = select
    try:
        yield seen
    finally:
        compressor.Indexer.select = orig


def _run(model, tokens):
    """(full-sequence logits [S, V], prefill + decode logits [S, V], indexer counters)."""
    with _spy_on_indexer() as seen:
        full = model(ForwardBatch.single(tokens))
        st = model.new_state()
        outs = [model(ForwardBatch.single(tokens[:PREFILL]), st)]
        for p in range(PREFILL, S):
            outs.append(model(ForwardBatch.single(tokens[p:p + 1], start=p), st))
    return full, torch.cat(outs), seen


def _worker(rank: int, size: int, port: int, root: str, out: str) -> None:
    torch.set_num_threads(1)
    from backfit.config import ModelConfig
    from backfit.runtime.distributed import destroy_distributed, init_distributed
    from backfit.runtime.loader import load_model
    from backfit.runtime.model.transformer import Transformer
    init_distributed(rank, size, port)
    try:
        model = Transformer(ModelConfig.from_file(Path(root) / "config.json"), torch.float32)
        report = load_model(model, root)
        full, inc, seen = _run(model, _tokens())
        torch.save({"full": full, "inc": inc, "report": report, "indexer": seen},
                   f"{out}/rank{rank}.pt")
    finally:
        destroy_distributed()


@pytest.fixture(scope="module")
def tp1_logits(tiny_converted, build_model):
    """kind -> tp = 1 result of the same conversion kind (built lazily, once)."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            cache[kind] = _run(build_model(tiny_converted(1, kind)), _tokens())
        return cache[kind]
    return get


@pytest.mark.parametrize("kind,tp", [("int8", 2), ("int8", 4), ("bf16", 2), ("bf16", 4)])
def test_tp_matches_tp1(kind, tp, tiny_converted, tp1_logits, rel_err, tmp_path):
    from backfit.runtime.distributed import free_port
    root = tiny_converted(tp, kind)
    want_full, want_inc, seen1 = tp1_logits(kind)
    assert seen1["rows"] > 0, "the indexer never ran at tp 1"
    mp.spawn(_worker, args=(tp, free_port(), str(root), str(tmp_path)), nprocs=tp, join=True)
    for r in range(tp):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got["report"]["rank"] == r and got["report"]["files"] > 0
        seen = got["indexer"]
        assert seen == seen1, f"rank {r} ran the indexer on other rows: {seen} vs {seen1}"
        assert seen["strict"] >= STRICT_MIN * seen["rows"], \
            f"top-k < valid entries on only {seen['strict']}/{seen['rows']} indexer rows"
        for key, want in (("full", want_full), ("inc", want_inc)):
            err = rel_err(got[key], want)
            assert err.max() < 1e-4, f"{kind} tp={tp} rank {r} {key}: max rel err {err.max():.2e}"
            assert torch.equal(got[key].argmax(-1), want.argmax(-1))


def _pools_worker(rank: int, size: int, port: int, root: str, out: str) -> None:
    torch.set_num_threads(1)
    from backfit.runtime.distributed import destroy_distributed, init_distributed
    from backfit.runtime.runner import ModelRunner, RunnerConfig
    init_distributed(rank, size, port)
    try:                               # rank 1 has twice rank 0's memory (as a fuller card)
        r = ModelRunner(RunnerConfig(root, dtype="float32", max_num_seqs=2, max_model_len=16384,
                                     cpu_kv_cache_gib=0.02 * (rank + 1)))
        torch.save({"own": r.plan.num_blocks, "blocks": r.num_blocks, "slots": r.num_slots,
                    "snaps": r.num_snapshot_slots, "pool": r.cache.num_blocks,
                    "tokens": r.max_num_batched_tokens},
                   f"{out}/pools{rank}.pt")
    finally:
        destroy_distributed()


def test_ranks_agree_on_the_smallest_pools(tiny_converted, tmp_path):
    """Each rank sizes its pools from its own memory, but rank 0's block manager hands out block
    ids for every rank: all ranks take the smallest slots, blocks and chunk budget (a rank with
    more blocks than rank 0 is harmless; fewer would be written out of bounds)."""
    from backfit.runtime.distributed import free_port
    mp.spawn(_pools_worker, args=(2, free_port(), str(tiny_converted(2)), str(tmp_path)),
             nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"pools{r}.pt") for r in range(2))
    assert r0["own"] < r1["own"]                       # they planned apart ...
    for r in (r0, r1):                                 # ... and run alike, on rank 0's pools
        assert r["blocks"] == r["pool"] == r0["own"] and r["tokens"] == 2048
    assert r0["slots"] == r1["slots"] == 2                # the running sequences; the prefix
    assert r0["snaps"] == r1["snaps"] == 2                # snapshots are a pool of their own
