"""Tensor parallelism: tp = 2 and 4 (gloo on CPU, one process per rank, each loading only its
own rank files of an int8 conversion made with --tp N) give the tp = 1 logits.

Covers sharded int8 scales (wq_b, wo_b, shared/routed experts by intermediate dim), the
vocab-parallel embedding/head, the head-split sink and indexer (partial scores all-reduced
before top-k), and a decode step through the state on every rank.
"""

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from backfit.runtime.batch import ForwardBatch

S, PREFILL = 40, 30


def _tokens() -> torch.Tensor:
    return torch.randint(0, 512, (S,), generator=torch.Generator().manual_seed(11))


def _run(model, tokens):
    """(full-sequence logits [S, V], prefill + decode logits [S, V])."""
    full = model(ForwardBatch.single(tokens))
    st = model.new_state()
    outs = [model(ForwardBatch.single(tokens[:PREFILL]), st)]
    for p in range(PREFILL, S):
        outs.append(model(ForwardBatch.single(tokens[p:p + 1], start=p), st))
    return full, torch.cat(outs)


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
        full, inc = _run(model, _tokens())
        torch.save({"full": full, "inc": inc, "report": report}, f"{out}/rank{rank}.pt")
    finally:
        destroy_distributed()


@pytest.fixture(scope="module")
def tp1_logits(int8_dirs, build_model):
    return _run(build_model(int8_dirs[1]), _tokens())


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_tp1(tp, int8_dirs, tp1_logits, rel_err, tmp_path):
    from backfit.runtime.distributed import free_port
    mp.spawn(_worker, args=(tp, free_port(), str(int8_dirs[tp]), str(tmp_path)), nprocs=tp, join=True)
    want_full, want_inc = tp1_logits
    for r in range(tp):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got["report"]["rank"] == r and got["report"]["files"] > 0
        for key, want in (("full", want_full), ("inc", want_inc)):
            err = rel_err(got[key], want)
            assert err.max() < 1e-4, f"tp={tp} rank {r} {key}: max rel err {err.max():.2e}"
            assert torch.equal(got[key].argmax(-1), want.argmax(-1))
