"""Decode and prefill of DeepSeek-V4-Flash layers at the REAL dimensions, through the engine.

    python3 scripts/bench_decode.py [--layers 4] [--tp-shard 1] [--out bench_decode.json]
                                    [--batches 1,8,32,64] [--long 32768] [--no-hf] [--tiny]
                                    [--experts int8|mx4|both] [--graphs on|off|both]

One process: (1) ceilings: copy bandwidth (read + write bytes of a 4 GiB copy), BF16 (8192^3
matmul) and INT8 (8192^3 torch._int_mm) peaks; (2) a random converted model built on the GPU
in the converted layout (int8_g128 FP8 linears, bf16 wo_a, copied BF16 linears, int8_mx32
experts; docs/FORMAT.md) for layers 0..N-1 of the real schedule (0, 0, 4, 128, 4, ...), as TP
rank 0 of --tp-shard K (collectives become counted no-ops); (3) decode ms/step at each batch,
short context (512) and --long, through ModelRunner.forward over the paged pools (random
contents, fake positions), with the "torch" and the "triton" kernel backend; prefill of one
1K and one 8K sequence; (4) a torch.profiler breakdown of the batch-1 step (kernels, launches
per step, device time per module); (5) Hugging Face transformers' DeepseekV4ForCausalLM (BF16,
eager, same dims and layers, its own cache, tid2eid = distinct experts) decoding batch 1 and 8.
Roofline: decode floor = bytes the step must read / copy BW: every non-routed weight + scale,
the head, the distinct experts the step routes to (counted), the embedding rows, and per
sequence per layer the window (128 x 512), the CSA top-k entries + every indexer key, the HCA
entries (BF16). Prefill floor = FLOPs of the int8_g128 linears / INT8 peak + every other FLOP
(experts, wo_a, copied linears, head, attention QK/PV, indexer) / BF16 peak, or bytes / BW if
larger. --tiny runs the same code at small dims on CPU (torch path only; a dry run). The model
and runner are built by bench_model.py.

--experts both (default): after the int8_mx32 rows the routed experts are re-laid-out in place
as mx4_e2m1 with the SAME values (code of q/2, exponent byte unchanged: 2^(e-128)·q =
2^(e-127)·q/2; checked on one linear) and measured again; the roofline then counts the 4-bit
expert bytes (codes K/2 + exponents K/32 per row). To keep the run near 7 minutes the mx4 pass
has no torch-backend rows (that path is the per-expert LUT dequantization loop, a reference) and
no torch profile; "mx4_vs_int8" holds the MoE output difference of one layer between the
two schemes (same weights: float accumulation order only). --graphs both (default): each triton
decode row is timed eagerly and replaying the runner's CUDA graphs (captured once per scheme;
no graph rows where the runner has no enforce_eager field). Rows carry "experts" and "graphs"
(True: replayed, False: eager).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from backfit.config import ModelConfig  # noqa: E402
from backfit.runtime.layers import Linear  # noqa: E402
from backfit.runtime.model.moe import Gate  # noqa: E402
from bench_model import (COMM, capture_graphs, median_ms, rank_runner,  # noqa: E402
                         raw_config, step_input, sync, to_mx4, use_backend)


def time_forward(r, make, warm: int, reps: int) -> float:
    """Median wall ms of runner.forward(step), synchronized per step (the engine's sampler reads
    the tokens back every step, so a step ends with a sync there too). The StepInputs are built
    before the clock starts (the scheduler's part is bench_engine.py's), 4x reps for steps under
    ~50 ms (a 5-sample median of a ~1.3 ms step moved by ±0.1-0.3 ms between runs)."""
    steps = [make(i) for i in range(warm)]
    for st in steps:
        r.forward(st)
    sync(r.device)
    t = time.perf_counter()
    r.forward(make(warm))
    sync(r.device)
    n = reps * 4 if time.perf_counter() - t < 0.05 else reps
    steps = [make(warm + i) for i in range(n)]
    ts = []
    for st in steps:
        t = time.perf_counter()
        r.forward(st)
        sync(r.device)
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def routed_experts(r, step) -> list[int]:
    """Distinct experts each layer routes to in this step (one untimed forward)."""
    seen = []
    orig = Gate.route

    def route(self, x, tokens):
        idx, w = orig(self, x, tokens)
        seen.append(int(idx.unique().numel()))
        return idx, w
    Gate.route = route
    try:
        r.forward(step)
    finally:
        Gate.route = orig
    return seen


def model_bytes(r) -> dict:
    """Bytes of the weights: non-routed linears + small buffers, head, one routed expert."""
    lin = buf = 0
    for name, mod in r.model.named_modules():
        if isinstance(mod, Linear) and ".experts." not in name:
            lin += sum(t.numel() * t.element_size() for t in (mod.weight, mod.scale)
                       if t is not None)
        for bname, b in mod.named_buffers(recurse=False):
            if b is not None and not isinstance(mod, Linear) and bname not in ("tid2eid",) \
                    and name not in ("embed", "head"):
                buf += b.numel() * b.element_size()
    ex = r.model.layers[0].ffn.experts[0]
    expert = sum(t.numel() * t.element_size() for m in (ex.w1, ex.w2, ex.w3)
                 for t in (m.weight, m.scale))
    head = r.model.head.weight
    return dict(linears=lin, buffers=buf, head=head.numel() * head.element_size(), expert=expert)


def kv_bytes(cfg: ModelConfig, ctx: int, layers: int) -> int:
    """KV bytes one sequence's decode token must read (BF16): window, CSA top-k + indexer keys,
    HCA entries."""
    D, n = cfg.head_dim, 0
    for l in range(layers):
        ratio = cfg.ratio(l)
        n += min(ctx + 1, cfg.sliding_window) * D * 2
        e = (ctx + 1) // ratio if ratio else 0
        if ratio == 4:
            n += min(e, cfg.index_topk) * D * 2 + e * cfg.index_head_dim * 2
        elif ratio:
            n += e * D * 2
    return n


def prefill_flops(r, T: int, tp: int) -> tuple[float, float]:
    """(INT8-linear FLOPs, other FLOPs) of one T-token prefill from position 0 (this rank)."""
    cfg, i8 = r.cfg, 0.0
    other = 2.0 * T * r.model.head.weight.numel()
    for name, mod in r.model.named_modules():
        if isinstance(mod, Linear) and ".experts." not in name:
            f = 2.0 * T * mod.weight.numel()
            i8, other = (i8 + f, other) if mod.scheme == "int8_g128" else (i8, other + f)
    k, ex = cfg.num_experts_per_tok, r.model.layers[0].ffn.experts[0]
    other += len(r.model.layers) * 2.0 * T * k * sum(m.out_features * m.in_features
                                                      for m in (ex.w1, ex.w2, ex.w3))
    p = torch.arange(T, dtype=torch.float64)
    Hl, IHl = cfg.num_attention_heads // tp, cfg.index_n_heads // tp
    for l in range(len(r.model.layers)):
        ratio = cfg.ratio(l)
        keys = torch.clamp(p + 1, max=cfg.sliding_window)
        if ratio:
            e = torch.div(p + 1, ratio, rounding_mode="floor")
            keys = keys + (e.clamp(max=cfg.index_topk) if ratio == 4 else e)
            if ratio == 4:
                other += float(2 * IHl * cfg.index_head_dim * e.sum())
        other += float(4 * Hl * cfg.head_dim * keys.sum())              # QK and PV
    return i8, other


def profile_targets():
    """(owner, attribute, label): the functions whose device time the profile attributes."""
    from backfit.runtime import layers
    from backfit.runtime.model import attention, block, compressor, moe
    return [(block.Block, "forward", "block"), (attention.Attention, "forward", "attn"),
            (attention.Attention, "core", "attn.core"),
            (compressor.Compressor, "project", "attn.compressor"),
            (compressor.Compressor, "update", "attn.compressor"),
            (compressor.Indexer, "queries", "attn.indexer"),
            (compressor.Indexer, "select", "attn.indexer"), (moe.MoE, "forward", "moe"),
            (moe.Gate, "route", "moe.router"), (moe.Expert, "forward", "moe.expert_mlp"),
            (block, "hc_pre", "mhc"), (block, "hc_post", "mhc"), (layers.ParallelHead, "forward", "head"),
            (layers.VocabParallelEmbedding, "forward", "embed")]


def profile_step(r, step, steps: int = 3) -> dict:
    """torch.profiler over `steps` runner.forward calls: kernels per step, GPU busy ms, top
    kernels; per part the host wall ms (inclusive: attn holds attn.core/compressor/indexer, moe
    holds router and expert_mlp) and the GPU kernel ms and launches (exclusive: each kernel goes to
    the innermost part whose GPU-side annotation span holds its start; "other" = outside all)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    saved = []
    for owner, attr, lab in profile_targets():
        orig = getattr(owner, attr)

        def wrapped(*a, _f=orig, _l=lab, **k):
            with record_function(_l):
                return _f(*a, **k)
        saved.append((owner, attr, orig))
        setattr(owner, attr, wrapped)
    try:
        r.forward(step)
        sync(r.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                r.forward(step)
            sync(r.device)
    finally:
        for owner, attr, orig in reversed(saved):
            setattr(owner, attr, orig)
    names = {t[2] for t in profile_targets()}
    CUDA = torch.autograd.DeviceType.CUDA
    evs = list(prof.events())
    spans = sorted(((e.time_range.start, e.time_range.end, e.name) for e in evs
                    if e.device_type == CUDA and e.name in names), key=lambda x: x[1] - x[0])
    kern: dict[str, list] = {}
    part_gpu: dict[str, float] = {}
    part_n: dict[str, int] = {}
    for e in evs:
        if e.device_type != CUDA or e.name in names:
            continue
        us = e.time_range.elapsed_us()
        kern.setdefault(e.name, []).append(us)
        t0 = e.time_range.start                        # innermost annotation span holding it
        lab = next((n for a, b, n in spans if a <= t0 <= b), "other")
        part_gpu[lab] = part_gpu.get(lab, 0.0) + us
        part_n[lab] = part_n.get(lab, 0) + 1
    host: dict[str, float] = {}
    for e in evs:
        if e.device_type != CUDA and e.name in names:  # inclusive host wall time of each part
            host[e.name] = host.get(e.name, 0.0) + e.time_range.elapsed_us()
    total = sum(sum(v) for v in kern.values())
    top = sorted(kern.items(), key=lambda kv: -sum(kv[1]))[:15]
    return dict(launches_per_step=sum(len(v) for v in kern.values()) / steps,
                busy_ms_per_step=total / 1e3 / steps,
                part_host_ms={k: v / 1e3 / steps for k, v in host.items()},
                part_gpu_ms={k: v / 1e3 / steps for k, v in part_gpu.items()},
                part_launches={k: v / steps for k, v in part_n.items()},
                top_kernels=[dict(name=n[:90], calls_per_step=len(v) / steps,
                                  ms_per_step=sum(v) / 1e3 / steps) for n, v in top])


def ceilings(dev: str) -> dict:
    """Copy bandwidth (TB/s, read + write), BF16 and INT8 matmul peaks (TFLOP/s), median of 10."""
    def ms(fn):
        return median_ms(fn, 10, cuda=True)
    src = torch.empty(1 << 31, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    bw = 4 * src.numel() / ms(lambda: dst.copy_(src)) / 1e9
    del src, dst
    a, b = (torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16) for _ in range(2))
    bf16 = 2 * 8192 ** 3 / ms(lambda: a @ b) / 1e9
    ai = torch.randint(-127, 128, (8192, 8192), device=dev, dtype=torch.int8)
    bi = torch.randint(-127, 128, (8192, 8192), device=dev, dtype=torch.int8).t()
    int8 = 2 * 8192 ** 3 / ms(lambda: torch._int_mm(ai, bi)) / 1e9
    return dict(copy_TBps=bw, bf16_TFLOPs=bf16, int8_TOPs=int8)


def hf_decode(raw: dict, dev: str, batches, ctx: int, reps: int) -> dict:
    """transformers' DeepseekV4ForCausalLM, BF16, eager, random weights, its own cache: ms per
    decode step after a ctx-token prefill."""
    import transformers
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    d = dict(raw)
    n = d["num_hidden_layers"]
    ratios = d.pop("compress_ratios")[:n]
    names = {0: "sliding_attention", 4: "compressed_sparse_attention"}
    d["layer_types"] = [names.get(x, "heavily_compressed_attention") for x in ratios]
    hca = [x for x in ratios if x not in (0, 4)]
    d["compress_rates"] = {"compressed_sparse_attention": 4,
                           "heavily_compressed_attention": hca[0] if hca else 128}
    nh = d.pop("num_hash_layers")
    d["mlp_layer_types"] = ["hash_moe" if i < nh else "moe" for i in range(n)]
    d.pop("quantization_config", None)
    cfg = DeepseekV4Config(**d)
    with torch.device(dev):
        m = DeepseekV4ForCausalLM._from_config(cfg, dtype=torch.bfloat16,
                                               attn_implementation="eager").eval()
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    for name, b in m.named_buffers():
        if name.endswith("tid2eid"):                    # a zero table routes everything to 0
            b.copy_(torch.rand(b.shape[0], E, device=dev).argsort(-1)[:, :k])
    out = {"transformers": transformers.__version__,
           "experts_implementation": str(getattr(cfg, "_experts_implementation", None))}
    with torch.no_grad():
        for B in batches:
            ids = torch.randint(2, cfg.vocab_size, (B, ctx), device=dev)
            o = m(input_ids=ids, use_cache=True, logits_to_keep=1)
            pkv, ts = o.past_key_values, []
            tok = o.logits[:, -1:].argmax(-1)
            for i in range(2 + reps):
                sync(dev)
                t = time.perf_counter()
                o = m(input_ids=tok, past_key_values=pkv, use_cache=True)
                tok = o.logits[:, -1:].argmax(-1)
                sync(dev)
                ts.append((time.perf_counter() - t) * 1e3)
            out[f"b{B}_ms"] = statistics.median(ts[2:])
    del m
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tp-shard", type=int, default=1)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--ctx", type=int, default=512, help="short context (tokens cached)")
    ap.add_argument("--long", type=int, default=32768, help="long context; 0 = skip")
    ap.add_argument("--prefill", default="1024,8192")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="small dims on CPU (dry run)")
    ap.add_argument("--experts", choices=("int8", "mx4", "both"), default="both",
                    help="routed-expert scheme(s): int8_mx32, mx4_e2m1 (same values), both")
    ap.add_argument("--graphs", choices=("on", "off", "both"), default="both",
                    help="triton decode rows eager, replaying CUDA graphs, or both")
    ap.add_argument("--out", default="bench_decode.json")
    a = ap.parse_args()
    dev = "cpu" if a.tiny else "cuda"
    batches = [int(x) for x in a.batches.split(",")]
    prefills = [int(x) for x in a.prefill.split(",") if x]
    ctxs = [a.ctx] + ([a.long] if a.long else [])
    raw = raw_config(a.layers, a.tiny)
    res: dict = dict(args=vars(a), torch=torch.__version__, device=dev)
    try:                  # BENCH_COMMIT: the caller's commit (the lent machine's copy of the
        # working tree carries a stale .git, so rev-parse there names an older commit)
        res["commit"] = os.environ.get("BENCH_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
            text=True).stdout.strip()
        res["dirty_files"] = len(subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=ROOT,
                                                capture_output=True, text=True).stdout.split("\n")) - 1
    except OSError:
        res["commit"] = None
    if dev == "cuda":
        import triton
        res.update(gpu=torch.cuda.get_device_name(), triton=triton.__version__)
        res["ceilings"] = ceil = ceilings(dev)
    else:
        ceil = dict(copy_TBps=0.05, bf16_TFLOPs=1.0, int8_TOPs=1.0)   # nominal, dry run only
    B_max = max(batches)
    t = time.perf_counter()
    r = rank_runner(raw, dev, B_max, max(ctxs), max(prefills + [0]), a.tp_shard,
                    experts="mx4" if a.experts == "mx4" else "int8")  # INT8 fills an 80 GB card
    res["build_s"] = time.perf_counter() - t
    tp, L, cfg = a.tp_shard, a.layers, r.cfg
    schemes = ["int8", "mx4"] if a.experts == "both" else [a.experts]
    modes = {"on": [True], "off": [False], "both": [False, True]}[a.graphs]
    rows = []
    for scheme in schemes:
        if scheme == "mx4":
            use_backend(r, "torch" if a.tiny else "triton")
            if a.experts == "both":                         # else built as mx4_e2m1
                res["mx4_vs_int8"] = to_mx4(r)
                print(json.dumps({"mx4_vs_int8": res["mx4_vs_int8"]}), flush=True)
        mb = model_bytes(r)
        res[f"model_bytes_{scheme}"] = mb
        if a.tiny:
            backends = ["torch"]
        else:                                 # mx4: no torch rows (the reference loop)
            backends = ["torch", "triton"] if scheme == "int8" else ["triton"]
        for be in backends:
            use_backend(r, be)
            graphs = capture_graphs(r) if be == "triton" and True in modes else None
            if be == "triton":
                res[f"graphs_capture_s_{scheme}"] = graphs and graphs.capture_s  # None: none
            for ctx in ctxs:
                for B in batches:
                    mk = lambda i, B=B, ctx=ctx: step_input(r, B, ctx + i % 4, seed=i)  # noqa: E731
                    COMM.update({k: 0 for k in COMM})
                    ex = routed_experts(r, mk(0))               # eager: the router runs
                    comm = dict(COMM)
                    byt = (mb["linears"] + mb["buffers"] + mb["head"] + sum(ex) * mb["expert"]
                           + B * cfg.hidden_size * 2 + B * kv_bytes(cfg, ctx, L))
                    floor = byt / (ceil["copy_TBps"] * 1e9)
                    for g in (modes if be == "triton" else [False]):
                        if g and graphs is None:
                            continue                    # no graphs in this runner / device
                        r.graphs = graphs if g else None
                        ms = time_forward(r, mk, 2, a.reps)
                        r.graphs = None
                        rows.append(dict(kind="decode", kernels=be, experts=scheme,
                                         graphs=g, batch=B,
                                         ctx=ctx, ms=ms, tokens_s=B / ms * 1e3, bytes=byt,
                                         floor_ms=floor, roofline=floor / ms,
                                         experts_per_layer=ex, comm=comm))
                        print(json.dumps(rows[-1]), flush=True)
            for T in prefills:
                mk = lambda i, T=T: step_input(r, 1, 0, n=T, seed=i)  # noqa: E731
                ms = time_forward(r, mk, 1, max(2, a.reps // 2))
                i8, oth = prefill_flops(r, T, tp)
                cfloor = (i8 / ceil["int8_TOPs"] + oth / ceil["bf16_TFLOPs"]) / 1e9
                floor = max(cfloor, (mb["linears"] + mb["head"] + L * cfg.n_routed_experts *
                                     mb["expert"]) / (ceil["copy_TBps"] * 1e9))
                rows.append(dict(kind="prefill", kernels=be, experts=scheme, graphs=False,
                                 batch=1, ctx=T, ms=ms, tokens_s=T / ms * 1e3, flops_int8=i8,
                                 flops_other=oth, floor_ms=floor, roofline=floor / ms,
                                 bf16_peak_frac=(i8 + oth) / (ms * 1e-3) / 1e12
                                 / ceil["bf16_TFLOPs"]))
                print(json.dumps(rows[-1]), flush=True)
            key = f"profile_{be}" + ("" if scheme == "int8" else f"_{scheme}")
            res[key] = profile_step(r, step_input(r, 1, a.ctx))           # eager
            print(json.dumps({key: res[key]}), flush=True)
            del graphs
            if dev == "cuda":
                torch.cuda.empty_cache()
    res["rows"] = rows
    del r
    if dev == "cuda":
        torch.cuda.empty_cache()
    if not a.no_hf and a.tp_shard == 1:                  # a TP slice has no HF counterpart
        hb = [b for b in batches if b <= 8]
        res["hf"] = hf_decode(raw, dev, hb, a.ctx, a.reps)
        print(json.dumps({"hf": res["hf"]}), flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print_table(res)


def print_table(res: dict) -> None:
    c = res.get("ceilings", {})
    print(f"\n{res.get('gpu', res['device'])}  commit {res['commit']}  layers "
          f"{res['args']['layers']}  tp-shard {res['args']['tp_shard']}  ceilings: copy "
          f"{c.get('copy_TBps', 0):.2f} TB/s, bf16 {c.get('bf16_TFLOPs', 0):.0f} TFLOP/s, "
          f"int8 {c.get('int8_TOPs', 0):.0f} TOP/s")
    print(f"{'kind':8} {'kernels':7} {'experts':7} {'graphs':6} {'batch':>5} {'ctx':>6} "
          f"{'ms':>9} {'tok/s':>9} {'floor ms':>9} {'roofline':>8}")
    for w in res["rows"]:
        g = "on" if w.get("graphs") else "off"
        print(f"{w['kind']:8} {w['kernels']:7} {w.get('experts', 'int8'):7} {g:6} "
              f"{w['batch']:5d} {w['ctx']:6d} {w['ms']:9.2f} {w['tokens_s']:9.1f} "
              f"{w['floor_ms']:9.3f} {100 * w['roofline']:7.1f}%")
    if "mx4_vs_int8" in res:
        print("mx4 vs int8 MoE (layer 0, same weights), rel diff:",
              ", ".join(f"T {t}: {x:.1e}" for t, x in res["mx4_vs_int8"]["moe_rel"].items()))
    for key in ("profile_torch", "profile_triton", "profile_torch_mx4", "profile_triton_mx4"):
        p = res.get(key)
        if p:
            parts = ", ".join(f"{k} {v:.2f}/{p['part_gpu_ms'].get(k, 0):.2f}"
                              for k, v in sorted(p["part_host_ms"].items()))
            print(f"{key.replace('profile_', 'profile b1 ')}: {p['launches_per_step']:.0f} "
                  f"launches/step, GPU busy {p['busy_ms_per_step']:.2f} ms/step; host/GPU ms "
                  f"per part: {parts}")
    if "hf" in res:
        print("transformers:", {k: (round(v, 2) if isinstance(v, float) else v)
                                for k, v in res["hf"].items()})


if __name__ == "__main__":
    main()
