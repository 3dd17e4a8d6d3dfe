"""The memory planner against hand computations from dsv4-model.md, and `backfit plan`."""

import json
import math

import pytest
from click.testing import CliRunner

from backfit.capacity import (GiB, fit, manifest_weight_bytes, parse_bytes, plan, runtime_reserve,
                              weight_bytes)
from backfit.cli import main
from backfit.config import ModelConfig
from backfit.formats import load_manifest
from backfit.runtime.cache.layout import cache_layout

from support import SHARED
from test_inventory import FLASH_DIMS


def _flash() -> ModelConfig:
    """The published Flash config from shared/ when present, else the built-in Flash dims."""
    path = SHARED / "tools" / "configs" / "deepseek-v4-flash.json"
    if path.exists():
        return ModelConfig.from_file(path)
    from backfit.synthetic import tiny_config_dict
    return ModelConfig.from_dict(tiny_config_dict("flash", **FLASH_DIMS))


def _flash_json(tmp_path):
    from backfit.synthetic import tiny_config_dict
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config_dict("flash", **FLASH_DIMS)))
    return path


# ---- KV bytes: dsv4-model.md 5.4.10 and docs/ENGINE.md section 2 ----------------------------

def test_flash_kv_bytes_per_token_and_slot_by_hand():
    cfg = _flash()
    D, W, K, csa, hca, m = 512, 128, 8, 21, 20, 128          # 43 layers: 2 window, 21 CSA, 20 HCA
    bf16 = cache_layout(cfg, "bf16")
    assert (bf16.count("window"), bf16.count("csa"), bf16.count("hca")) == (2, csa, hca)
    # per token: CSA 256 B entry + 64 B indexer key, HCA 8 B: 6,880 B (dsv4-model.md 5.4.10)
    assert bf16.kv_bytes_per_token == 21 * (256 + 64) + 20 * 8 == 6880
    assert bf16.block_size == 128 and bf16.block_bytes == 128 * 6880
    int8 = cache_layout(cfg, "int8")                        # 512 B + a 4-byte scale per entry
    assert int8.kv_bytes_per_token == csa * (D + 4 + 128 * 2) / 4 + hca * (D + 4) / m == 4133.625
    # slot without rollback: 43 x 128 x 512 x 2 = 5.6 MB window, ~12.2 MB FP32 compressor rows
    k0 = cache_layout(cfg, "bf16", rollback=0)
    window = sum(lay.window_bytes for lay in k0.layers)
    rows = sum(lay.rows_bytes for lay in k0.layers)
    assert window == 43 * 128 * 512 * 2 and round(window / 1e6, 1) == 5.6
    assert round(rows / 1e6, 1) == 12.2
    # with K = 8 (ENGINE.md section 2)
    hand = (43 * (W + K) * D * 2 + csa * ((8 + K) * 2 * D * 4 * 2 + (8 + K) * 256 * 4 * 2)
            + hca * (m + K) * D * 4 * 2)
    assert bf16.slot_bytes == hand
    assert cache_layout(cfg, "bf16", draft_layers=1).slot_bytes == hand + (W + K) * D * 2
    # a prefix-cache snapshot (ENGINE.md section 3): W - 1 window rows a layer + 4 rows of each
    # CSA compressor, c and z: 6.15 MiB, 7.3 blocks of 128 tokens
    snap = 43 * (W - 1) * D * 2 + csa * 4 * (2 * D + 256) * 4 * 2
    assert bf16.snapshot_bytes == snap == 6452224
    assert cache_layout(cfg, "bf16", draft_layers=1).snapshot_bytes == snap + (W - 1) * D * 2
    assert int8.snapshot_bytes == snap - 43 * (W - 1) * (D - 4) == 3678036


def _ring_keeps(rows: int, needed, K: int, upto: int = 300) -> bool:
    """Ring of `rows` indexed by pos % rows. From any length L' (reached directly or by rolling
    back up to K tokens, which leaves the same last writers), one forward writes positions
    L' .. L'+K (a verify step: K drafts + 1) before reading. Does every older position a new
    token needs still own its row?"""
    for start in range(upto):
        ring = [-1] * rows
        for p in range(start + K + 1):
            ring[p % rows] = p
        for q in range(start, start + K + 1):
            if any(ring[p % rows] != p for p in needed(q) if 0 <= p < start):
                return False
    return True


@pytest.mark.parametrize("ratio", [4, 8, 128])
def test_ring_rows_survive_a_rollback_of_K_tokens(ratio):
    from backfit.synthetic import tiny_config_dict
    d = tiny_config_dict("flash", **{**FLASH_DIMS, "main_ratios": [0, ratio, ratio]})
    cfg = ModelConfig.from_dict(d)
    K = 8
    lay = cache_layout(cfg, rollback=K).layers[1]
    W = cfg.sliding_window
    window = lambda q: range(q - W + 1, q)                # noqa: E731  (W includes q itself)
    assert _ring_keeps(lay.window_rows, window, K)
    assert not _ring_keeps(lay.window_rows - 1, window, K)
    if ratio == 4:       # overlapped: the entry q completes pools blocks q//4 - 1 and q//4
        need = lambda q: range(4 * (q // 4 - 1), q)       # noqa: E731
    else:
        need = lambda q: range(ratio * (q // ratio), q)   # noqa: E731
    assert _ring_keeps(lay.comp_rows, need, K)
    assert not _ring_keeps(lay.comp_rows - 1, need, K)                # and no row to spare
    assert lay.index_rows == (lay.comp_rows if ratio == 4 else 0)


@pytest.mark.parametrize("kv, act", [("bf16", "bf16"), ("int8", "bf16"), ("fp32", "fp32")])
def test_layout_equals_the_bytes_the_paged_pools_allocate(kv, act):
    """The planner's numbers and the pools' own (built on the meta device) cannot drift."""
    import torch
    from backfit.runtime.cache.paged import PagedCache
    from backfit.synthetic import TINY_DIMS, tiny_config_dict
    dtype = torch.bfloat16 if act == "bf16" else torch.float32
    for cfg in (_flash(), ModelConfig.from_dict(tiny_config_dict("flash", **TINY_DIMS))):
        lay = cache_layout(cfg, kv, act_dtype=act, draft_layers=1)
        pools = PagedCache(cfg, 3, 5, lay.block_size, dtype, "int8" if kv == "int8" else "auto",
                           device="meta", mtp_layers=1, num_snapshots=2).nbytes()
        assert pools == {"slots": 3 * lay.slot_bytes, "blocks": 5 * lay.block_bytes,
                         "snapshots": 2 * lay.snapshot_bytes}


def test_layout_rejects_a_block_size_that_splits_an_entry():
    with pytest.raises(ValueError, match="multiple of every compression ratio"):
        cache_layout(_flash(), block_size=64)
    with pytest.raises(ValueError, match="choose one of"):
        cache_layout(_flash(), "fp8")


# ---- weights per rank: dsv4-model.md 6.1-6.3 ------------------------------------------------

def _hand_weights_tp4(mtp: bool = True) -> float:
    """Per-rank bytes of the TP4 INT8 conversion, from dsv4-model.md 6.1-6.3 and FORMAT.md."""
    base = (285.9e9 - 1e9) / 4 + 1e9          # 6.3: FP8 -> INT8, experts -> INT8; ~1 GB replicated
    mx_scales = 8.66e9 / 4                    # 6.3: one E8M0 byte per 32 expert weights (int8_mx32)
    wo_a = 43 * (8 * 1024) * (64 * 512 // 8) / 4   # FORMAT.md: wo_a stays BF16, +1 B per weight
    lin_scales = 5.86e9 * 4 / 128 / 4         # 6.2: 5.86 GB FP8 weights, FP32 scale per 128
    draft = 1.7e9 + 256 * 3 * 2048 * 4096 / 32 / 4   # 6.3 "+1.7", plus its expert scale bytes
    return base + mx_scales + wo_a + lin_scales + (draft if mtp else 0)


def test_flash_tp4_weights_per_rank_match_hand_computation():
    w = weight_bytes(_flash(), 4, "int8", mtp=True)
    hand = _hand_weights_tp4()
    assert abs(w.per_rank / hand - 1) < 0.01, (w.per_rank, hand)
    # 6.1: routed experts 277.03 B params, at 1 + 1/32 B each, split 4 ways (+ the MTP experts)
    experts = (277.03e9 + 256 * 3 * 2048 * 4096) * (1 + 1 / 32) / 4
    assert abs(w.experts / experts - 1) < 0.01
    assert weight_bytes(_flash(), 4, "int8", mtp=False).per_rank == w.per_rank - w.mtp


def test_mx4_halves_the_expert_weights_and_keeps_the_exponents():
    """mx4 is the converter's real mx4_e2m1 scheme now: its bytes come from plan_conversion."""
    i8, mx4 = weight_bytes(_flash(), 8, "int8"), weight_bytes(_flash(), 8, "mx4")
    assert not mx4.planned and not i8.planned
    assert mx4.experts * 33 == i8.experts * 17             # (0.5 + 1/32) / (1 + 1/32) = 17/33
    assert i8.per_rank - mx4.per_rank == i8.experts - mx4.experts


def test_flash_tp4_80gib_mx4_experts_hold_1m_tokens_at_090():
    """TP4 on 80 GiB cards, 4-bit experts, utilisation 0.90, defaults otherwise: the
    KV pool holds >= 1,048,576 tokens and one 1M-token sequence fits (bf16 KV, the default)."""
    p = plan(_flash(), tp=4, gpu_mem=80 * GiB, utilization=0.90, experts="mx4")
    assert not p.planned and p.experts == "mx4"
    assert p.kv_capacity_tokens >= 1048576, p.kv_capacity_tokens
    assert p.weight_bytes_per_rank == weight_bytes(_flash(), 4, "mx4").per_rank
    full = plan(_flash(), tp=4, gpu_mem=80 * GiB, utilization=0.90, experts="mx4",
                max_model_len=1048576)
    assert full.max_concurrency_at_max_model_len >= 1
    assert not any("planned" in n for n in full.notes)


# ---- the plan: TP4 / 80 GiB -----------------------------------------------------------------

def test_flash_tp4_80gib_int8_experts_do_not_fit_at_090():
    with pytest.raises(ValueError) as e:
        plan(_flash(), tp=4, gpu_mem=80 * GiB, utilization=0.90, experts="int8")
    msg = str(e.value)
    assert "\n" not in msg and "no KV cache fits" in msg
    for fix in ("--gpu-memory-utilization", "--kv-cache-dtype int8", "--tp", "4-bit experts"):
        assert fix in msg, fix


def test_flash_tp4_80gib_plan_by_hand():
    """TP4 on 80 GiB cards: bf16 KV fits at 0.95 once the MTP block and most slots are dropped."""
    cfg = _flash()
    p = plan(cfg, tp=4, gpu_mem=80 * GiB, utilization=0.95, experts="int8", kv_cache_dtype="bf16",
             max_num_seqs=8, mtp=False, max_model_len=262144)
    assert abs(p.weight_bytes_per_rank / _hand_weights_tp4(mtp=False) - 1) < 0.01
    assert p.kv_bytes_per_token == 6880 and p.block_bytes == 128 * 6880
    lay = cache_layout(cfg)
    slots = 8 * lay.slot_bytes + 8 * lay.snapshot_bytes                # 8 running + 8 snapshots
    free = int(80 * GiB * 0.95) - p.weight_bytes_per_rank - runtime_reserve(4) \
        - p.workspace_bytes - p.graph_reserve_bytes - slots
    assert p.num_blocks == free // (128 * 6880) and p.kv_capacity_tokens == 128 * p.num_blocks
    assert p.max_concurrency_at_max_model_len == p.num_blocks // (262144 // 128) >= 1
    assert p.kv_bytes_per_sequence == p.slot_bytes + 262144 * 6880
    assert 262144 < p.longest_context < 1048576
    assert (p.num_slots, p.num_snapshot_slots, p.snapshot_bytes) == (8, 8, lay.snapshot_bytes)
    # the workspace grows with the context (indexer scores over L/4 entries)
    longer = plan(cfg, tp=4, utilization=0.95, max_num_seqs=8, mtp=False, max_model_len=524288)
    assert longer.workspace_bytes > p.workspace_bytes


def test_fit_from_measured_numbers():
    lay = cache_layout(_flash(), "bf16")
    total, free = 80 * GiB, 10 * GiB          # e.g. torch.cuda.mem_get_info() after loading
    p = fit(lay, free, total, max_model_len=4096, max_num_seqs=4, utilization=0.9,
            workspace_bytes=GiB, graph_bytes=GiB // 2, num_snapshot_slots=0)
    pool = int(total * 0.9) - 70 * GiB - GiB - GiB // 2 - 4 * lay.slot_bytes
    assert p.num_blocks == pool // lay.block_bytes and p.num_slots == 4
    assert p.max_concurrency_at_max_model_len == 4                   # capped by max_num_seqs
    too_long = (p.num_blocks + 1) * 128
    fix = f"lower --max-model-len to at most {p.kv_capacity_tokens}"
    with pytest.raises(ValueError, match=fix):
        fit(lay, free, total, max_model_len=too_long, max_num_seqs=4, utilization=0.9,
            workspace_bytes=GiB, graph_bytes=GiB // 2, num_snapshot_slots=0)


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * GiB and parse_bytes("80 GB") == 80 * 10 ** 9
    assert parse_bytes("81920MiB") == 80 * GiB
    with pytest.raises(ValueError, match="cannot read"):
        parse_bytes("eighty")


# ---- the tiny checkpoint: manifest == inventory == bytes on disk ----------------------------

def test_tiny_converted_weights_from_manifest_inventory_and_files(tiny_converted, tiny_flash):
    conv = tiny_converted(2, "int8")
    m = load_manifest(conv)
    from_manifest = manifest_weight_bytes(m, mtp=True)
    cfg = ModelConfig.from_file(tiny_flash / "config.json")
    assert weight_bytes(cfg, 2, "int8", mtp=True).per_rank == from_manifest.per_rank
    assert weight_bytes(cfg, 2, "int8").per_rank == manifest_weight_bytes(m).per_rank
    for r in range(2):                          # payload = file size - 8-byte length - header
        payload = 0
        for f in (conv / f"rank{r}").glob("*.safetensors"):
            head = int.from_bytes(f.read_bytes()[:8], "little")
            payload += f.stat().st_size - 8 - head
        assert payload == from_manifest.per_rank


def _cli(*args):
    return CliRunner().invoke(main, ["plan", *map(str, args)])


def test_cli_json_on_the_tiny_converted_dir(tiny_converted):
    r = _cli(tiny_converted(2, "int8"), "--gpu-mem", "4GiB", "--max-model-len", "4096", "--json")
    assert r.exit_code == 0, r.output
    p = json.loads(r.output)
    for key in ("weight_bytes_per_rank", "kv_bytes_per_token", "kv_capacity_tokens",
                "max_concurrency_at_max_model_len"):
        assert key in p, key
    # tiny: D 256, layers [0, 0, 4, 8, 4, 8]: 2 x (512 + 128·2)/4 + 2 x 512/8 = 512 B per token
    assert p["kv_bytes_per_token"] == 512 and p["tp"] == 2 and p["block_size"] == 64
    assert p["max_concurrency_at_max_model_len"] == min(64, p["kv_capacity_tokens"] // 4096)
    r = _cli(tiny_converted(2, "int8"), "--tp", "4")
    assert r.exit_code == 1 and "converted for --tp 2" in r.output


def test_cli_flash_config_table_and_errors(tmp_path):
    cfg = _flash_json(tmp_path)
    r = _cli(cfg, "--tp", "8", "--json")
    assert r.exit_code == 0, r.output
    p = json.loads(r.output)
    assert p["kv_bytes_per_token"] == 6880 and p["max_model_len"] == 1048576
    assert p["weight_bytes_per_rank"] == weight_bytes(_flash(), 8).per_rank
    r = _cli(cfg, "--tp", "8")
    assert r.exit_code == 0 and "KV capacity" in r.output and "longest context" in r.output
    r = _cli(cfg, "--tp", "8", "--experts", "bf16", "--gpu-memory-utilization", "0.95",
             "--max-model-len", "1048576")
    assert r.exit_code == 1 and r.output.startswith("error: --max-model-len 1048576 needs")
    assert "lower --max-model-len to at most" in r.output and len(r.output.splitlines()) == 1
    r = _cli(cfg, "--gpu-mem", "lots")
    assert r.exit_code == 1 and "cannot read 'lots'" in r.output
    assert _cli(tmp_path / "missing.json").exit_code == 1
    assert math.isfinite(p["kv_capacity_tokens"])


def test_default_batched_tokens_is_8192_where_the_kv_pool_can_afford_it():
    """--max-num-batched-tokens default (budget.pick_batched_tokens, the engine's on CUDA and
    `backfit plan`'s): 8192 where it keeps >= 90 % of the 2048 plan's KV capacity, else 2048,
    and 2048 when 8192 does not fit at all."""
    from backfit.runtime.cache.budget import pick_batched_tokens
    mx4 = plan(_flash(), tp=4, gpu_mem=80 * GiB, utilization=0.90, experts="mx4")
    assert mx4.max_num_batched_tokens == 8192          # 4.34 M tokens against 4.57 M
    small = plan(_flash(), tp=4, gpu_mem=80 * GiB, utilization=0.90, experts="mx4",
                 max_num_batched_tokens=2048)
    assert 0.9 * small.kv_capacity_tokens <= mx4.kv_capacity_tokens < small.kv_capacity_tokens
    tight = plan(_flash(), tp=4, gpu_mem=80 * GiB, utilization=0.95, experts="int8")
    assert tight.max_num_batched_tokens == 2048        # 8192 would leave 27,904 of 232,832
    assert any("--max-num-batched-tokens not given: 2048 (8192 would cost" in n
               for n in tight.notes), tight.notes
    assert "--max-num-batched-tokens not given: 8192" in mx4.notes
    big = plan(_flash(), tp=4, gpu_mem=80 * GiB, utilization=0.95, experts="int8",
               max_num_batched_tokens=8192)
    assert big.kv_capacity_tokens < 0.9 * tight.kv_capacity_tokens

    def plan_for(t, fits=(2048, 8192), caps={2048: 100, 8192: 95}):
        if t not in fits:
            raise ValueError(f"{t} does not fit")
        return type("P", (), {"kv_capacity_tokens": caps[t], "t": t})()
    assert pick_batched_tokens(plan_for)[0] == 8192
    assert pick_batched_tokens(lambda t: plan_for(t, caps={2048: 100, 8192: 89}))[0] == 2048
    assert pick_batched_tokens(lambda t: plan_for(t, fits=(2048,)))[0] == 2048
    with pytest.raises(ValueError, match="2048 does not fit"):
        pick_batched_tokens(lambda t: plan_for(t, fits=()))


# ---- prefill graphs: the default and its cost ---------------------------------------------

def test_pick_prefill_graphs_keeps_them_within_ten_percent():
    from types import SimpleNamespace
    from backfit.runtime.cache.budget import pick_prefill_graphs

    def planner(with_cap, fail=False):
        def plan_pg(P):
            if P and fail:
                raise ValueError("does not fit")
            return SimpleNamespace(kv_capacity_tokens=with_cap if P else 1000,
                                   prefill_graph_tokens=P)
        return plan_pg
    assert pick_prefill_graphs(planner(950), 8192).prefill_graph_tokens == 2048   # 5 % less
    assert pick_prefill_graphs(planner(950), 512).prefill_graph_tokens == 512     # the budget
    assert pick_prefill_graphs(planner(850), 8192).prefill_graph_tokens == 0      # 15 % less
    assert pick_prefill_graphs(planner(950, fail=True), 8192).prefill_graph_tokens == 0
    assert pick_prefill_graphs(planner(950), 32).prefill_graph_tokens == 0        # < 64 tokens


def test_plan_counts_prefill_graphs_where_they_fit():
    """TP 4 on 80 GiB: with 4-bit experts the default keeps prefill graphs (their reserve
    counted, 1M-token contexts still fit at 0.90); INT8 experts at 0.95 have ~4 GiB of KV pool,
    where 1.1 GiB of graphs would cost > 10 %: off, with a note."""
    cfg = _flash()
    mx4 = plan(cfg, tp=4, experts="mx4", utilization=0.90)
    off = plan(cfg, tp=4, experts="mx4", utilization=0.90, prefill_graph_tokens=0)
    assert mx4.prefill_graph_tokens == 2048 and off.prefill_graph_tokens == 0
    assert mx4.graph_reserve_bytes - off.graph_reserve_bytes > GiB
    assert 0.9 * off.kv_capacity_tokens <= mx4.kv_capacity_tokens < off.kv_capacity_tokens
    assert mx4.kv_capacity_tokens >= 1_048_576
    assert "--prefill-graph-tokens not given: 2048" in mx4.notes
    int8 = plan(cfg, tp=4, experts="int8", utilization=0.95)
    assert int8.prefill_graph_tokens == 0
    assert any("prefill graphs would cost more than 10 %" in n for n in int8.notes)
    assert plan(cfg, tp=4, experts="mx4", max_num_batched_tokens=512).prefill_graph_tokens == 512
    with pytest.raises(ValueError, match="--prefill-graph-tokens 32: 0 .* at least 64"):
        plan(cfg, tp=4, experts="mx4", prefill_graph_tokens=32)
