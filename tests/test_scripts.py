"""The GPU benchmarks run only on the lent machine; what of them can break on a refactor without
a GPU is checked here."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


def test_bench_decode_profile_targets_exist():
    """bench_decode.py's profiler wraps runtime methods by name; a renamed one (Attention._attend,
    moved in 746676a) crashed the benchmark on the H200 after its decode rows."""
    import bench_decode

    for owner, attr, label in bench_decode.profile_targets():
        assert callable(getattr(owner, attr, None)), f"{owner.__name__}.{attr} ({label})"


def test_bench_vision_tiny_dry_run(tmp_path):
    """scripts/bench_vision.py --tiny (the CPU dry run of the GPU benchmark): both parts run
    through the runtime and the engine as the real-dims run does, and write their rows; as TP
    rank 0 of 2, the tower's shared images through bench_model's no-op row exchange."""
    import json
    import os
    import subprocess
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "scripts" / "bench_vision.py"), "--tiny",
                        "--sizes", "384x384", "--images", "1,2", "--image-size", "64x48",
                        "--tp-shard", "2", "--json", str(tmp_path / "v.json")],
                       capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root)))
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads((tmp_path / "v.json").read_text())
    assert out["tower"][0]["vit_grid"] == "28x28" and out["tower"][0]["tower_ms"] > 0
    assert [row["images"] for row in out["ttft"]] == [1, 2]
    assert out["ttft"][1]["image_positions"] > 2 * 98 and out["ttft"][1]["ttft_ms"] > 0


def test_replicas_arguments_devices_and_router_flags():
    """scripts/replicas.py (its processes: tests/deploy): flags after `--` go to every replica,
    replica ports follow the router's, replica i of k GPUs each sees devices i*k .. i*k+k-1, and
    the router gets the replicas, the policy and the extra flags last (they override)."""
    import replicas

    args, serve = replicas.parse(["/m", "--replicas", "3", "--port", "9000",
                                  "--router-arg=--cache-threshold=0.5", "--", "--tp", "4"])
    assert (args.replicas, args.replica_base_port, serve) == (3, 9001, ["--tp", "4"])
    assert [replicas.devices(i, 4) for i in range(3)] == ["0,1,2,3", "4,5,6,7", "8,9,10,11"]
    cmd = replicas.router_cmd(args, ["http://127.0.0.1:9001", "http://127.0.0.1:9002"])
    assert cmd[cmd.index("--worker-urls") + 1:cmd.index("--policy")] == \
        ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert cmd[cmd.index("--policy") + 1] == "cache_aware" and cmd[-1] == "--cache-threshold=0.5"


def test_bench_engine_shared_prefix_dry_run(tiny_converted):
    """bench_engine.py --shared-prefix on the tiny model (the CPU dry run of the GPU step in
    gpu_check.sh): the warm session reuses the 200-token prefix up to the hint's block boundary
    (blocks of 64: 192), or without the hint up to the last periodic snapshot (a 128-token
    budget: every 128 tokens)."""
    import bench_engine
    from support import one_thread
    with one_thread():
        rows = bench_engine.main(["--model", str(tiny_converted(1, "int8")), "--dtype", "float32",
                                  "--shared-prefix", "200", "--prompt-len", "70",
                                  "--output-len", "2", "--reps", "1",
                                  "--max-num-batched-tokens", "128"])
    assert [(r["mode"], r["warm_cached_tokens"]) for r in rows] == [("hint", 192),
                                                                    ("periodic", 128)]
    assert all(r["ttft_cold_ms"] > 0 and r["ttft_warm_ms"] > 0 for r in rows)


def test_profile_step_names_each_kernel_by_its_room():
    """profile_step.py --spec attributes a trace's kernels to the room of runtime/kernels they
    come from (and the rest to torch): a kernel moved or renamed must still be found."""
    import profile_step

    rooms = profile_step.kernel_rooms()
    want = {"_mx4_gemv_mma_kernel": "moe", "_a16_kernel": "linear", "_post_mix_kernel": "mhc",
            "_rows_kernel": "cache", "_pick_probs_kernel": "pick", "_router_kernel": "router",
            "_decode_kernel": "attention"}
    assert {k: profile_step.part_of(k, rooms) for k in want} == want
    assert profile_step.part_of("void at::native::index_elementwise_kernel<128, 4>", rooms) \
        == "torch"


def test_bench_spec_ab_cuts_gemv_entries_to_the_rows_it_compares(tmp_path):
    """bench_spec_ab.py --gemv-table: bench_gemv.py's winners join GEMV_TABLE from --min-m up
    (the shipped M = 1-2 entries keep deciding there); a range wholly below is dropped."""
    import json
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_spec_ab

    f = tmp_path / "t.json"
    f.write_text(json.dumps({"table": [["int8", [8, 8], [4, 4], [1, 4], {"BN": 1}],
                                       ["bf16", [2, 2], [4, 4], [1, 2], {"BN": 2}]]}))
    assert bench_spec_ab.extra_entries([str(f)], 3) == [
        ("int8", (8, 8), (4, 4), (3, 4), {"BN": 1})]


def test_bench_model_builds_4bit_experts_without_int8():
    """bench_model.build_runner(experts="mx4"): the routed experts are mx4_e2m1 from the start
    (a slice with a drafter cannot hold its INT8 experts on an 80 GB card), the MTP block's too,
    the shared expert stays INT8, and the MoE runs."""
    import torch

    import bench_model
    from backfit.runtime.distributed import get_tp_info, set_tp_info, tp_is_set
    if not tp_is_set():
        set_tp_info(0, 1)
    assert get_tp_info().size == 1
    raw = bench_model.raw_config(2, True, "flash")
    r = bench_model.build_runner(raw, "cpu", 1, 8, 64, mtp=True, experts="mx4")
    ffn = r.model.layers[0].ffn
    assert ffn.experts[0].w1.scheme == "mx4_e2m1" and ffn.shared_experts.w1.scheme == "int8_g128"
    assert r.model.mtp[0].ffn.experts[3].w2.scheme == "mx4_e2m1"
    w1 = ffn.experts[0].w1
    assert w1.weight.dtype == torch.uint8 and w1.weight.shape[1] * 2 == w1.in_features
    x = torch.randn(3, raw["hidden_size"]).bfloat16()
    y = ffn(x, torch.tensor([5, 6, 7])).float()
    assert torch.isfinite(y).all() and 0.05 < y.std() / x.float().std() < 20


def test_critical_path_walks_back_through_the_last_finished_kernel(tmp_path):
    """scripts/critical_path.py on a two-stream trace log: the path skips a side-stream kernel
    that overlaps it, follows one the main stream waited for, and is cut into layers at every
    second post_mix."""
    import critical_path as cp
    rows = [(0.0, 2.0, "_post_mix_kernel"), (2.5, 6.0, "_gemv_kernel"),
            (2.6, 9.0, "_a16_kernel"),                     # side stream, longer: waited for
            (9.4, 12.0, "_decode_kernel"), (12.4, 14.0, "_post_mix_kernel"),
            (12.5, 13.0, "_swiglu_kernel"),                # side stream, overlapped: not on it
            (14.4, 20.0, "_mx4_gemv_word_kernel"), (20.4, 22.0, "_post_mix_kernel"),
            (22.5, 30.0, "_gemv_kernel"), (30.4, 31.0, "_post_mix_kernel"),
            (31.4, 32.0, "_post_mix_kernel")]
    log = ["== plain: 11 kernels"] + [f"{s:9.1f} gap    0.4 dur {e - s:7.1f}  {n}"
                                       for s, e, n in rows] + ["== spec: 0 kernels"]
    f = tmp_path / "t.txt"
    f.write_text("\n".join(log) + "\n")
    ev = cp.read_section(f.read_text(), "plain")
    assert len(ev) == 11
    path = [n for _, _, n in cp.critical_path(ev)]
    assert "_a16_kernel" in path and "_swiglu_kernel" not in path
    assert path[:4] == ["_post_mix_kernel", "_a16_kernel", "_decode_kernel", "_post_mix_kernel"]
    ls = cp.layers(cp.critical_path(ev), "_post_mix_kernel", 2)
    assert [len(x) for x in ls] == [5, 3]
    waits = cp.ahead(ev, ls[0])      # off the path, started after the previous one: ahead of it
    assert [round(w, 1) for w, _ in waits] == [0.0, 0.6, 0.4, 0.4, 0.4]
    assert [[n for _, _, n in g] for _, g in waits] == [
        [], ["_gemv_kernel"], [], [], ["_swiglu_kernel"]]


_PERSISTENT_CHECK = """
import torch
import bench_persistent as bp
c = bp.Chain(chain=((48, 64), (24, 32), (40, 16)), device="cpu")
launched = c.outputs(lambda: c.launched(bn=16, bk=16, warps=1))
persistent = c.outputs(lambda: c.persistent(1, bn=16, bk=16, warps=1))
ref = c.reference(launched)
for o, p, r in zip(launched, persistent, ref):
    assert torch.equal(o, p)
    torch.testing.assert_close(o.float(), r.float(), rtol=8e-3, atol=1e-3)
assert ref[-1].float().abs().max() > 0.1 and c.cnt.tolist() == [0, 0]
print("ok")
"""


def test_bench_persistent_chain_matches_torch_launched_and_persistent():
    """benchmarks/kernels/bench_persistent.py's GEMV chain (interpreted): a launch a phase and
    one persistent program through every phase (its grid barriers pass at once) give the same
    bits, within FP32 summation order of the torch chain, and leave the counters at 0. In a
    process of its own: TRITON_INTERPRET counts when triton.language is first imported (its
    tl.cdiv / tl.sum are then interpreted functions), which this process may have done already
    without it."""
    import os
    import subprocess
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(root / "benchmarks" / "kernels"), str(root)]))
    r = subprocess.run([sys.executable, "-c", _PERSISTENT_CHECK], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_bench_ab_switch_takes_a_literal_or_another_modules_object():
    """--switch module:NAME=literal, or =@module:NAME (a kernel of the same signature, say)."""
    import pytest
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_ab
    from backfit.runtime.kernels.mhc import core, decode
    m, name, value = bench_ab.parse_switch(
        "backfit.runtime.kernels.mhc.decode:FOLD={'bd_u': 1024, 'warps': 8}")
    assert (m, name, value) == (decode, "FOLD", {"bd_u": 1024, "warps": 8})
    m, name, value = bench_ab.parse_switch(
        "backfit.runtime.kernels.mhc.decode:_post_mix_kernel=@backfit.runtime.kernels.mhc.core:"
        "_post_kernel")
    assert m is decode and name == "_post_mix_kernel" and value is core._post_kernel
    for bad in ("backfit.runtime.kernels.mhc.decode:NOPE=1",
                "backfit.runtime.kernels.mhc.decode:FOLD=@backfit.runtime.kernels.mhc.core:NOPE",
                "backfit.runtime.kernels.mhc.decode:FOLD=dict("):
        with pytest.raises(SystemExit, match="--switch"):
            bench_ab.parse_switch(bad)
    both = bench_ab.parse_switches("backfit.runtime.kernels.mhc.decode:FOLD={};"
                                   "backfit.runtime.kernels.attention.decode:MAX_SPLIT=1")
    assert [(n, v) for _, n, v in both] == [("FOLD", {}), ("MAX_SPLIT", 1)]


def test_with_switches_sets_them_then_runs_the_command():
    """benchmarks/with_switches.py: each --switch set (and said on stderr) before the backfit
    command after `--` runs; no `--` or a switch that names nothing: a one-line error."""
    import os
    import subprocess
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    script = [sys.executable, str(root / "benchmarks" / "with_switches.py")]
    run = subprocess.run(script + ["--switch", "backfit.runtime.kernels.attention.decode:"
                                   "MAX_SPLIT=3", "--", "--help"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "decode.MAX_SPLIT = 3" in run.stderr and "Usage: backfit" in run.stdout
    for bad in (["--switch", "backfit.runtime.kernels.attention.decode:MAX_SPLIT=3"],
                ["--switch", "backfit.runtime.kernels.attention.decode:NO_SUCH=1", "--"]):
        run = subprocess.run(script + bad, capture_output=True, text=True, env=env, timeout=120)
        assert run.returncode != 0 and "--switch" in run.stderr, run.stderr[-2000:]
