"""A random converted DeepSeek-V4-Flash model built directly on one device, at the REAL
dimensions (or --tiny ones), in a ModelRunner over paged pools of random contents: what the GPU
benchmarks (bench_decode.py, profile_step.py) measure. Layers 0..N-1 of the real schedule, TP
rank 0 of a --tp-shard K slice (collectives counted, not run); weights in the converted layout
(int8_g128 FP8 linears with FP32 scales, bf16 wo_a, copied BF16 linears, int8_mx32 experts,
tid2eid rows of distinct experts), re-laid-out as mx4_e2m1 by to_mx4 with the same values, or
built as mx4_e2m1 from the start (experts="mx4": a slice that cannot hold its INT8 experts).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from backfit.config import ModelConfig  # noqa: E402
from backfit.runtime import kernels as kpkg  # noqa: E402
from backfit.runtime.layers import Linear, RMSNorm  # noqa: E402
from backfit.synthetic import tiny_config_dict  # noqa: E402

FLASH = dict(hidden_size=4096, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64,
             q_lora_rank=1024, o_groups=8, o_lora_rank=1024, n_routed_experts=256,
             num_experts_per_tok=6, moe_intermediate_size=2048, index_n_heads=64,
             index_head_dim=128, index_topk=512, sliding_window=128)
FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4]               # 43 layers (dsv4-model.md §2.1)
TINY = dict(hidden_size=256, num_attention_heads=16, head_dim=256, qk_rope_head_dim=64,
            q_lora_rank=128, o_groups=8, o_lora_rank=128, n_routed_experts=16,
            num_experts_per_tok=6, moe_intermediate_size=256, index_n_heads=16,
            index_head_dim=128, index_topk=16, sliding_window=16)
TINY_RATIOS = [0, 0, 4, 8] * 11
FP8 = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "indexer.wq_b", "shared_experts.w1",
       "shared_experts.w2", "shared_experts.w3")           # -> int8_g128 (FORMAT.md)
E2M1_X2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
COMM = {"all_reduce": 0, "all_reduce_bytes": 0, "all_gather": 0, "all_gather_bytes": 0}


def raw_config(layers: int, tiny: bool, variant: str = "flash") -> dict:
    """variant flash (the MTP block) or 0731 (three DSpark stages, taps after the last three
    layers)."""
    dims, ratios = (TINY, TINY_RATIOS) if tiny else (FLASH, FLASH_RATIOS)
    return tiny_config_dict(variant, 129280 if not tiny else 512, **dims,
                            main_ratios=ratios[:layers])


def patch_collectives() -> None:
    """TP rank 0 alone: collectives return their input and are counted (calls, bytes); the
    vision tower's row exchange returns zeros for the other ranks' images (rank 0 runs its
    share of the tower, as at TP K)."""
    from backfit.runtime import images, layers
    from backfit.runtime.model import attention, compressor, moe

    def counted(kind):
        def f(x, *a, **k):
            COMM[kind] += 1
            COMM[kind + "_bytes"] += x.numel() * x.element_size()
            return x
        return f
    def gathered(x, dim=-1):                                # the full shape, the bytes of
        from backfit.runtime.distributed import get_tp_info   # one rank's part copied
        COMM["all_gather"] += 1
        COMM["all_gather_bytes"] += x.numel() * x.element_size()
        return torch.cat([x] * get_tp_info().size, dim=dim)
    def gathered_rows(x, sizes):                          # runtime/images.py's exchange:
        from backfit.runtime.distributed import get_tp_info   # this rank's rows, the others'
        COMM["all_gather"] += 1                               # as zeros of their sizes
        COMM["all_gather_bytes"] += x.numel() * x.element_size()
        me = get_tp_info().rank
        return [x if r == me else x.new_zeros(n, *x.shape[1:]) for r, n in enumerate(sizes)]
    for mod in (layers, moe, compressor, attention):       # every module that imports it
        if hasattr(mod, "all_reduce"):
            mod.all_reduce = counted("all_reduce")
    layers.all_gather = gathered
    images.all_gather_rows = gathered_rows


def scheme_of(name: str) -> str:
    if ".experts." in name:
        return "int8_mx32"
    if name.endswith("attn.wo_a"):
        return "bf16"
    return "int8_g128" if name.endswith(FP8) else "copy"


def fill_linear(m: Linear, name: str, dev, experts: str = "int8") -> None:
    """Random weights in m's scheme, scaled so a layer keeps the activation size (W ~ 1/√K);
    experts "mx4": routed experts as mx4_e2m1 straight away (codes of to_mx4's value set, the
    same exponents), so a slice never holds its INT8 experts (they fill an 80 GB card)."""
    N, K, s = m.out_features, m.in_features, scheme_of(name)
    if s == "int8_mx32" and experts == "mx4":
        c = torch.randint(0, 16, (N, K), device=dev, dtype=torch.uint8)     # e2m1 codes
        e = 128 - round(math.log2(5 * K ** 0.5))
        m.load("mx4_e2m1", (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous(),
               torch.randint(e - 1, e + 2, (N, K // 32), device=dev, dtype=torch.uint8), name)
        return
    if s == "int8_g128":
        q = torch.randint(-127, 128, (N, K), device=dev, dtype=torch.int8)
        sc = torch.rand(N, K // 128, device=dev) * 0.2 + 0.9
        m.load(s, q, sc * (3 ** 0.5 / 127 / K ** 0.5), name)
    elif s == "int8_mx32":
        vals = torch.tensor(E2M1_X2, dtype=torch.int8, device=dev)
        q = vals[torch.randint(0, 16, (N, K), device=dev)]
        e = 128 - round(math.log2(5 * K ** 0.5))            # 2^(e-128)·|q|~5 = 1/√K
        m.load(s, q, torch.randint(e - 1, e + 2, (N, K // 32), device=dev, dtype=torch.uint8), name)
    else:
        m.load(s, torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5, None, name)


def fill_random(model, cfg: ModelConfig, dev, experts: str = "int8") -> None:
    """Every Linear and buffer of the model (routed experts in `experts`: fill_linear); tid2eid
    rows are distinct experts per token."""
    for mname, mod in model.named_modules():
        if isinstance(mod, Linear):
            fill_linear(mod, mname, dev, experts)
        for bname, buf in list(mod.named_buffers(recurse=False)):
            if buf is None or isinstance(mod, RMSNorm) or bname == "inv_freq" or \
                    (isinstance(mod, Linear) and bname in ("weight", "scale")):
                continue                                 # loaded above / ones / computed
            if bname == "tid2eid":
                E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
                rows = [torch.rand(65536, E, device=dev).argsort(-1)[:, :k]
                        for _ in range(0, buf.shape[0], 65536)]
                buf.copy_(torch.cat(rows)[:buf.shape[0]])
            elif bname.endswith("_fn"):
                buf.normal_(0, buf.shape[1] ** -0.5)
            elif bname.endswith(("_base", "bias", "attn_sink", "ape")):
                buf.normal_(0, 0.1)
            elif bname.endswith("_scale"):
                buf.fill_(0.5)
            elif bname == "weight":                      # embed rows ~1, head ~1/√d
                buf.normal_(0, 1 if mname == "embed" else buf.shape[1] ** -0.5)


def build_runner(raw: dict, dev: str, slots: int, blocks: int, max_len: int, mtp: bool = False,
                 snapshots: int = 0, experts: str = "int8"):
    """A ModelRunner around a random model and random pools (no converted directory); mtp: with
    the checkpoint's drafter blocks and their pools (r.drafting is set by the caller);
    `snapshots` prefix-cache snapshots (bench_engine.py --shared-prefix); experts "mx4": the
    routed experts built in 4 bits (fill_linear)."""
    from backfit.runtime.cache.paged import PagedCache
    from backfit.runtime.model.transformer import Transformer
    from backfit.runtime.cache.layout import default_block_size
    from backfit.runtime.runner import ModelRunner, RunnerConfig
    cfg = ModelConfig.from_dict(raw)
    with torch.device(dev):
        model = Transformer(cfg, torch.bfloat16, mtp=mtp)
    fill_random(model, cfg, dev, experts)
    r = ModelRunner.__new__(ModelRunner)
    eager = dict(enforce_eager=True) if "enforce_eager" in RunnerConfig.__dataclass_fields__ else {}
    r.rc = RunnerConfig("(random)", device=dev, max_num_seqs=slots, num_snapshot_slots=snapshots,
                        max_model_len=max_len, **eager)
    r.timings, r.cfg, r.dtype, r.device = {}, cfg, torch.bfloat16, torch.device(dev)
    r.kernels, r.graphs = "torch", None
    r.prefill_graphs, r.prefill_graph_tokens = None, 0     # bench_engine --prefill-graphs
    r.drafting, r.image_cache, r._sampled_rows = None, None, 0   # what __init__ sets besides
    r.block_size, r.kv, r.model = default_block_size(cfg), "auto", model
    r.num_slots, r.num_blocks, r.max_num_batched_tokens = slots, blocks, 2048
    r.num_snapshot_slots = snapshots
    r.cache = PagedCache(cfg, slots, blocks, r.block_size, torch.bfloat16, "auto", dev,
                         mtp_layers=len(model.mtp), num_snapshots=snapshots)
    r.drafting = r.spec_graphs = None
    for lp in r.cache.layers:
        lp.ring.data.normal_()
        for p in lp.parts():
            p.c.normal_(), p.z.normal_(), p.entries.data.normal_()
    return r


def rank_runner(raw: dict, dev: str, slots: int, ctx: int, prefill: int = 0,
                tp_shard: int = 1, mtp: bool = False, snapshots: int = 0, experts: str = "int8"):
    """build_runner as TP rank 0 of tp_shard (its shard of every split weight; collectives
    counted no-ops, patch_collectives), pools for `slots` sequences of up to ctx tokens (+ 8)
    or one prefill of `prefill` tokens; max_model_len max(ctx, prefill) + 16. The set-up that
    bench_decode.py, bench_ab.py and profile_step.py share."""
    from backfit.runtime.cache.layout import default_block_size
    from backfit.runtime.distributed import get_tp_info, set_tp_info, tp_is_set
    if not tp_is_set():                                 # a second model in the same process
        set_tp_info(0, tp_shard)
        patch_collectives()
    if get_tp_info().size != tp_shard:
        raise RuntimeError(f"this process is already TP rank 0 of {get_tp_info().size}")
    bs = default_block_size(ModelConfig.from_dict(raw))
    blocks = max(slots * math.ceil((ctx + 8) / bs), math.ceil(prefill / bs)) + 1
    return build_runner(raw, dev, slots, blocks, max(ctx, prefill) + 16, mtp, snapshots, experts)


def use_backend(r, be: str) -> None:
    """Switch the kernel backend in-process (the engine sets it once) and stack the experts."""
    kpkg._backend = r.kernels = be
    if be == "triton":
        r.model.prepare_kernels()


def capture_graphs(r):
    """The runner's decode CUDA graphs over the current weights and pools (None: the runner has
    no graphs); left detached (r.graphs = None) so rows choose per step."""
    if r.device.type != "cuda" or "enforce_eager" not in type(r.rc).__dataclass_fields__ \
            or not hasattr(r, "capture_graphs"):
        return None
    r.rc = dataclasses.replace(r.rc, enforce_eager=False)
    r.capture_graphs()
    g, r.graphs = r.graphs, None
    return g


def to_mx4(r, check: tuple[int, ...] = (1, 64, 512)) -> dict:
    """Routed experts int8_mx32 -> mx4_e2m1 in place, the same values: e2m1 code of q/2, packed
    two per byte (low nibble = element 2j, FORMAT.md), exponent byte unchanged. Returns the
    rel. difference of layer 0's MoE output (routed + shared) between the schemes at T in `check`
    (current backend; same weights: float accumulation order only) and the conversion time.
    A slice whose INT8 weights nearly fill the card checks T = 1 only (the sorted path's
    temporaries at T = 512 do not fit beside them)."""
    t0, dev = time.perf_counter(), r.device
    lut = torch.zeros(256, dtype=torch.uint8)
    for code, q in enumerate(E2M1_X2):
        if code != 8:                                    # -0 -> code 0 (equal values)
            lut[q % 256] = code
    lut = lut.to(dev)
    ffn, g = r.model.layers[0].ffn, torch.Generator().manual_seed(7)
    xs = [(torch.randn(T, r.cfg.hidden_size, generator=g).bfloat16().to(dev),
           torch.randint(2, r.cfg.vocab_size, (T,), generator=g).to(dev)) for T in check]
    with torch.no_grad():
        before = [ffn(x, tok).float() for x, tok in xs]
        ex0 = ffn.experts[0].w2.dequantized(torch.bfloat16)
        for li, lay in enumerate(r.model.layers):
            lay.ffn.stacked = None                       # the int8 stacks go with their views
            for e, ex in enumerate(lay.ffn.experts):
                for lin in ("w1", "w3", "w2"):
                    m = getattr(ex, lin)
                    c = lut[m.weight.view(torch.uint8).long()]                 # [N, K] codes
                    m.load("mx4_e2m1", (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous(),
                           m.scale.clone(), f"layers.{li}.ffn.experts.{e}.{lin}")
        assert torch.equal(ffn.experts[0].w2.dequantized(torch.bfloat16), ex0), "to_mx4"
        if r.kernels == "triton":
            use_backend(r, "triton")
        after = [ffn(x, tok).float() for x, tok in xs]
    rel = [float((a - b).norm() / b.norm()) for a, b in zip(after, before)]
    return dict(moe_rel=dict(zip(check, rel)), convert_s=time.perf_counter() - t0)


def sync(dev) -> None:
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, reps: int, cuda: bool) -> float:
    """Median ms of reps calls of fn after one warm-up: CUDA events on the GPU, wall clock
    on the CPU."""
    fn()
    sync("cuda" if cuda else "cpu")
    ts = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def step_input(r, B: int, start: int, n: int = 1, seed: int = 0):
    from backfit.runtime.runner import StepInput, StepSeq
    nb = math.ceil((start + n) / r.block_size)
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(2, r.cfg.vocab_size, (B, n), generator=g).tolist()
    return StepInput(tuple(StepSeq(i, i, tuple(range(i * nb, (i + 1) * nb)), start,
                                   tuple(toks[i]), True) for i in range(B)))
