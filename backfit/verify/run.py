"""`backfit verify`: the runtime on the converted checkpoint against the reference on the original.

Three checks, each number meaning one thing (docs/VERIFICATION.md):
  weights     every converted tensor dequantized vs the original dequantized (manifest-driven)
  hidden      per-layer 4-stream residual: max-abs, relative error, cosine; each layer's
              relative error is held to a limit (THRESHOLDS "hidden_*")
  logits      mean/max KL(ref || runtime), top-1 / top-5 agreement, max |dlogit|
Each is a gate of its own (report["gates"]): a check passes only when all three pass, and a NaN
metric always fails.
On a Vision-Exp checkpoint the sequences also hold image prompts (image_prompts.py: synthetic
images spliced between the text prompts): the runtime runs them through its tower, fusion,
bias_vl routing and in-span attention (image blocks never split across paged chunks), the
reference through its own (ref_vision.py), under the same three gates.
The thresholds depend on what is compared: a lossless conversion with float32 activations must
match to float rounding ("semantics"), the INT8 conversion with float32 activations must keep
top-1 and KL ("conversion"), and bfloat16 activations are judged against the reference's own
bfloat16 noise floor ("precision").
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from backfit.config import ModelConfig
from backfit.formats import load_manifest
from backfit.verify.compare import format_table, logit_metrics, tensor_metrics
from backfit.verify.prompts import PROMPTS
from backfit.verify.weights import check_weights

__all__ = ["verify", "THRESHOLDS", "hidden_limits", "prompt_sequences"]

THRESHOLDS = {
    # hidden_rel_max: per-layer relative (Frobenius) error of the 4-stream residual
    "semantics": {"rel_max": 1e-4, "top1_min": 1.0, "kl_mean_max": 1e-8, "hidden_rel_max": 1e-5},
    "conversion": {"top1_min": 0.99, "kl_mean_max": 1e-3, "hidden_rel_max": 1e-2},
    # precision: limits derived from the measured floor (reference bf16 vs reference fp32)
    "precision": {"top1_slack": 0.02, "kl_factor": 2.0, "kl_abs": 1e-3,
                  "hidden_factor": 2.0, "hidden_abs": 1e-2},
}


def prompt_sequences(tokenizer_json: Path, prompts: list[str], max_positions: int, bos: int) -> list[list[int]]:
    """BOS + each prompt's ids, cycling through the prompts until max_positions tokens in all."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_json))
    encoded = [[bos] + tok.encode(p, add_special_tokens=False).ids for p in prompts]
    seqs, total, i = [], 0, 0
    while total < max_positions:
        ids = encoded[i % len(encoded)][: max_positions - total]
        seqs.append(ids)
        total, i = total + len(ids), i + 1
    return seqs


def _ids(s) -> list[int]:
    """A sequence's ids: a list of ids, or a backfit.vision.VisionPrompt's."""
    return list(getattr(s, "ids", s))


def _items(s, a: int, b: int) -> tuple:
    """(tokens, start, (span, image) pairs) of positions a .. b-1 of a sequence, for
    runtime.images.batch_images (no images for a list of ids)."""
    pairs = [(sp, im) for sp, im in zip(getattr(s, "spans", ()), getattr(s, "images", ()))
             if a <= sp.start < b]
    return _ids(s)[a:b], a, pairs


def _chunks(s, n: int):
    """(a, b) prefill chunks of about n positions; a cut that would fall inside an image block
    moves to the block's start (or, for a block at the chunk's start, to its end)."""
    L, a = len(_ids(s)), 0
    while a < L:
        b = min(L, a + n)
        for sp in getattr(s, "spans", ()):
            if sp.start < b < sp.start + sp.length:
                b = sp.start if sp.start > a else sp.start + sp.length
        yield a, b
        a = b


def _runtime_pass(converted: str, seqs: list, dtype: str, device: str,
                  paged: dict | None = None) -> dict:
    """Runs on every rank: load this rank's shard, forward each sequence, capture layer outputs.

    paged=None: one full-sequence forward per sequence (a fresh DecodeState). Otherwise the
    engine's path: PagedCache pools (kv_cache_dtype auto|int8), every sequence in prefill chunks
    of paged["chunk"] tokens, Triton kernels when paged["kernels"] is "triton" (CUDA), each
    chunk replayed from the prefill CUDA graphs when paged["prefill_graphs"]."""
    from backfit.runtime.batch import ForwardBatch
    from backfit.runtime.distributed import get_tp_info
    from backfit.runtime.loader import load_model
    from backfit.runtime.model.transformer import Transformer

    cfg = ModelConfig.from_file(Path(converted) / "config.json")
    if paged and paged.get("kernels"):
        from backfit.runtime.kernels import set_kernel_backend
        from backfit.runtime.runner import resolve_kernels
        set_kernel_backend(resolve_kernels(paged["kernels"], device))
    model = Transformer(cfg, getattr(torch, dtype), mtp=False)
    load_model(model, converted, device)
    if paged and paged.get("kernels") == "triton":
        model.prepare_kernels()
    captured: list[list[torch.Tensor]] = [[] for _ in model.layers]
    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(lambda m, a, out, i=i: captured[i].append(out.float().cpu()))
    emb = None
    if cfg.vision is not None:                    # the tower's rows by image, for every chunk
        from backfit.runtime.images import EmbeddingCache, batch_images
        emb = EmbeddingCache(model)

    def images(items: list[tuple]):
        return None if emb is None else batch_images(model, emb, items)
    if paged is None:
        logits = [model(ForwardBatch.build([(0, _ids(s), 0)], device,
                                           images=images([_items(s, 0, len(_ids(s)))])))
                  .float().cpu() for s in seqs]
        return {"logits": torch.cat(logits), "hidden": [torch.cat(c) for c in captured]}
    from backfit.runtime.cache.layout import default_block_size
    from backfit.runtime.cache.paged import PagedCache
    B, n = default_block_size(cfg), paged["chunk"]
    need = [-(-len(_ids(s)) // B) for s in seqs]
    cache = PagedCache(cfg, len(seqs), sum(need), B, model.dtype, paged["kv_cache_dtype"], device)
    pg = None
    if paged.get("prefill_graphs"):       # the engine's prefill graphs, streams kept per layer
        from backfit.runtime.graphs import PrefillGraphs
        pg = PrefillGraphs(model, n, torch.device(device), keep_streams=True)
        pg.capture()
        if (bad := pg.check()) is not None:
            raise RuntimeError(bad)
    logits, first = [], 0
    for i, s in enumerate(seqs):
        table = list(range(first, first + need[i]))[::-1]         # reversed: tables must be read
        first += need[i]
        ids = _ids(s)
        for a, e in _chunks(s, n):
            t = time.perf_counter()
            item = _items(s, a, e)
            if pg is not None and not item[2]:   # the Blocks' hooks do not fire: pg.streams
                X = pg.hidden([(i, ids[a:e], a, i, table)], cache)
                logits.append(model.logits(X).float().cpu())
                for c, h in zip(captured, pg.streams):
                    c.append(h.float().cpu())
            else:
                b = ForwardBatch.build([(i, ids[a:e], a)], device, slots=[i],
                                       block_tables=[table], images=images([item]))
                logits.append(model(b, cache).float().cpu())
            if len(ids) > 4 * n and get_tp_info().rank == 0:   # long context: say where it is
                print(f"  runtime: tokens {a}-{e} of {len(ids)} in "
                      f"{time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    return {"logits": torch.cat(logits), "hidden": [torch.cat(c) for c in captured]}


def _reference_pass(original: Path, seqs: list, dtype: torch.dtype, device: str = "cpu") -> dict:
    """The reference's logits and per-layer hidden states of seqs, returned on the CPU. A seq is
    a list of ids, or a backfit.vision.VisionPrompt (image_prompts.py) on a Vision-Exp model."""
    from backfit.verify.reference import Reference
    ref = Reference(original, dtype=dtype, device=device)
    outs = [ref.forward(torch.tensor(_ids(s), device=device), capture=True,
                        images=getattr(s, "images", None)) for s in seqs]
    return {"logits": torch.cat([o["logits"].float().cpu() for o in outs]),
            "hidden": [torch.cat([o["hidden"][i].float().cpu() for o in outs])
                       for i in range(len(outs[0]["hidden"]))]}


def _over(value: float, limit: float) -> bool:
    """value breaches an upper limit; NaN always does (NaN > limit is False)."""
    return not value <= limit


def _judge(kind: str, lm: dict, floor: dict | None) -> list[str]:
    """Logit gate: the problems of the runtime's logit metrics lm against THRESHOLDS[kind]."""
    t, bad = THRESHOLDS[kind], []
    if kind == "semantics":
        if _over(lm["rel"], t["rel_max"]):
            bad.append(f"logit relative error {lm['rel']:.2e} > {t['rel_max']:.0e}")
    if kind == "precision":
        t = {"top1_min": floor["top1"] - t["top1_slack"],
             "kl_mean_max": max(t["kl_factor"] * floor["kl_mean"], t["kl_abs"])}
    if not lm["top1"] >= t["top1_min"]:
        bad.append(f"top-1 agreement {lm['top1']:.4f} < {t['top1_min']:.4f}")
    if _over(lm["kl_mean"], t["kl_mean_max"]):
        bad.append(f"mean KL {lm['kl_mean']:.2e} > {t['kl_mean_max']:.2e}")
    return bad


def hidden_limits(kind: str, floor_rel: list[float] | None, n_layers: int) -> list[float]:
    """Per-layer limit on the hidden-state relative error; precision scales the bf16 floor."""
    t = THRESHOLDS[kind]
    if kind == "precision":
        return [max(t["hidden_factor"] * f, t["hidden_abs"]) for f in floor_rel]
    return [t["hidden_rel_max"]] * n_layers


def _judge_hidden(rows: list[tuple[str, dict]], limits: list[float]) -> list[str]:
    """Hidden gate: every layer whose residual relative error breaches its limit."""
    return [f"{label} hidden relative error {m['rel']:.2e} > {lim:.1e}"
            for (label, m), lim in zip(rows, limits) if _over(m["rel"], lim)]


def verify(original: str | Path, converted: str | Path, tp: int | None = None,
           prompts: list[str] | None = None, max_positions: int = 512,
           activations: str = "float32", device: str = "cpu", json_out: str | Path | None = None,
           out=sys.stdout, kv_cache_dtype: str | None = None, kernels: str | None = None,
           long_context: int | None = None, chunk: int = 256,
           reference_device: str = "cpu", prefill_graphs: bool = False,
           images: int | None = None, drafts: bool = False, draft_every: int = 48) -> dict:
    """Run all checks, print the tables, return the report (report['ok'] says pass/fail).

    kv_cache_dtype / kernels / long_context run the runtime on the engine's paged pools (in
    prefill chunks of `chunk` tokens) instead of one full forward: int8 KV is lossy, so it is
    judged as a conversion; long_context=N checks ONE sequence of N tokens (the prompts cycled),
    where index overflows, wrong block tables and entry off-by-ones show. reference_device:
    where the reference runs (its code and weights stay independent of the runtime's).
    prefill_graphs (kernels triton on CUDA): every chunk through the engine's piecewise
    prefill graphs (runtime/prefill_graphs.py), padded to its size. images: image prompts
    (image_prompts.py) checked besides the text on a Vision-Exp checkpoint (default 2 there;
    none with long_context). drafts: the checkpoint's drafter (speculative decoding) against
    the reference's after every `draft_every` tokens of each text prompt (verify/drafts.py), a
    fourth gate."""
    if prefill_graphs and (kernels != "triton" or not str(device).startswith("cuda")):
        raise ValueError("--prefill-graphs needs --kernels triton --device cuda")
    from backfit.runtime.launch import run_on_ranks

    original, converted = Path(original), Path(converted)
    manifest = load_manifest(converted)
    tp = tp or manifest["tp"]
    cfg = ModelConfig.from_file(converted / "config.json")
    w_rows, w_problems = check_weights(original, converted)
    by_scheme: dict[str, list[float]] = {}
    for _, m in w_rows:
        by_scheme.setdefault(m["scheme"], []).append(m["rel"])
    print("weights (converted dequantized vs original dequantized):", file=out)
    print(format_table([(k, {"tensors": len(v), "rel_mean": sum(v) / len(v), "rel_max": max(v)})
                        for k, v in sorted(by_scheme.items())], ["tensors", "rel_mean", "rel_max"]), file=out)

    seqs = prompt_sequences(converted / "tokenizer.json", prompts or PROMPTS,
                            long_context or max_positions, cfg.bos_token_id)
    if long_context:                                   # one sequence: the prompts back to back
        seqs = [[t for s in seqs for t in s][:long_context]]
    n_img = images if images is not None else (2 if cfg.vision and not long_context else 0)
    if n_img and cfg.vision is None:
        raise ValueError(f"--images {n_img}: {converted} has no vision tower "
                         f"(config.json vision_n_layers)")
    if n_img:
        from backfit.verify.image_prompts import image_prompts
        seqs += image_prompts(converted / "tokenizer.json", cfg, n_img, prompts or PROMPTS)
        print(f"image prompts: {n_img} ({sum(len(s.ids) for s in seqs[-n_img:])} positions, "
              f"{sum(sp.length for s in seqs[-n_img:] for sp in s.spans)} in image blocks)",
              file=out)
    paged = None
    if kv_cache_dtype or kernels or long_context:
        paged = {"kv_cache_dtype": "auto" if kv_cache_dtype in (None, "auto", "bf16") else
                 kv_cache_dtype, "kernels": kernels, "chunk": chunk,
                 "prefill_graphs": prefill_graphs}
        print(f"runtime on paged pools: kv cache {paged['kv_cache_dtype']}, kernels "
              f"{kernels or 'torch'}, prefill chunks of {chunk}"
              + (" from the prefill CUDA graphs" if prefill_graphs else ""), file=out)
    def timed(what: str, fn, *a):                  # long runs say where the time goes
        t = time.perf_counter()
        r = fn(*a)
        print(f"  {what}: {time.perf_counter() - t:.1f} s", file=out, flush=True)
        return r

    ref = timed(f"reference pass (float32, {reference_device})", _reference_pass, original,
                seqs, torch.float32, reference_device)
    got = timed(f"runtime pass ({activations}, {device}, tp {tp})", run_on_ranks, _runtime_pass,
                tp, (str(converted), seqs, activations, device, paged), device)
    lossless = manifest["schemes"]["linears"] == manifest["schemes"]["experts"] == "bf16" \
        and (paged is None or paged["kv_cache_dtype"] != "int8")
    kind = "precision" if activations == "bfloat16" else ("semantics" if lossless else "conversion")
    floor, floor_rel = None, None
    if kind == "precision":
        ref16 = timed(f"reference pass (bfloat16, {reference_device})", _reference_pass,
                      original, seqs, torch.bfloat16, reference_device)
        floor = logit_metrics(ref16["logits"], ref["logits"])
        floor_rel = [tensor_metrics(h, r)["rel"] for h, r in zip(ref16["hidden"], ref["hidden"])]
    rows = [(f"layer {i}", tensor_metrics(g, r)) for i, (g, r) in enumerate(zip(got["hidden"], ref["hidden"]))]
    limits = hidden_limits(kind, floor_rel, len(rows))
    for (_, m), lim, f in zip(rows, limits, floor_rel or [None] * len(rows)):
        m["rel_limit"] = lim
        if f is not None:
            m["floor_rel"] = f
    lm = logit_metrics(got["logits"], ref["logits"])
    positions = sum(len(_ids(s)) for s in seqs)
    print(f"\nhidden states ({positions} positions, {len(seqs)} sequences, "
          f"activations {activations}, tp={tp}, reference on {reference_device}):", file=out)
    print(format_table(rows, ["max_abs", "rel", "cos", "rel_limit"] + (["floor_rel"] if floor_rel else [])),
          file=out)
    print("\nlogits:", file=out)
    keys = ["kl_mean", "kl_max", "top1", "top5", "max_dlogit", "rel"]
    print(format_table([("runtime", lm)] + ([("ref-bf16 floor", floor)] if floor else []), keys), file=out)
    # three gates (four with drafts), judged separately so a report says which one failed
    gates = {"weights": w_problems, "hidden": _judge_hidden(rows, limits),
             "logits": _judge(kind, lm, floor)}
    dm = None
    if drafts:
        from backfit.verify.drafts import draft_pass, judge_drafts, reference_drafts
        text = [s for s in seqs if isinstance(s, list)]   # the drafter passes take plain ids
        points = timed(f"runtime drafts ({activations}, {device})", run_on_ranks, draft_pass, tp,
                       (str(converted), text, activations, device, kernels, draft_every),
                       device)
        want = timed("reference drafts", reference_drafts, original, text, points,
                     reference_device)
        dm, gates["drafts"] = judge_drafts(points, want, kind)
        print(f"\ndrafts ({len(points)} drafts of {len(points[0]['ids'])} tokens, "
              f"{'MTP' if cfg.variant == 'flash' else 'DSpark'}):", file=out)
        print(format_table([("drafter", dm)], [k for k in keys if k in dm] +
                           (["confidence_rel"] if "confidence_rel" in dm else [])), file=out)
    problems = [p for g in gates.values() for p in g]
    report = {"check": kind, "activations": activations, "tp": tp, "positions": positions,
              "images": n_img,
              "paged": paged, "long_context": long_context, "reference_device": reference_device,
              "weights": {k: {"tensors": len(v), "rel_max": max(v)} for k, v in by_scheme.items()},
              "hidden": [{"layer": i, **m} for i, (_, m) in enumerate(rows)], "logits": lm,
              "floor": floor, "thresholds": THRESHOLDS[kind], "drafts": dm, "gates": gates,
              "problems": problems,
              "ok": not problems}
    print(f"\n{kind} check: " + ("PASS" if report["ok"] else "FAIL: " + "; ".join(problems)), file=out)
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=1) + "\n")
    return report
