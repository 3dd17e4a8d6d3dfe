"""`backfit verify --drafts`: the runtime's drafter against the reference's, on the original.

The runtime (engine path: paged pools, the drafter's context after every chunk, the drafter of
runtime/drafting.py; the kernels with --kernels triton) prefills each prompt in chunks of
`every` tokens and drafts k tokens after each chunk (the next prompt token as x_{p+1}); the
reference drafts after the same prefix (Reference.mtp_draft / dspark_draft, sharing no runtime
code). Compared: the draft logits of every row up to the first row where the two drafted
different tokens (later rows draft from different inputs), and DSpark's raw confidences of row 0.

Gates as the target's logits: "semantics" (lossless weights, FP32) holds the rows to float
rounding (rel <= 1e-4, top-1 all); "conversion" / "precision" hold top-1 agreement >= 0.9 and
mean KL <= 2e-2 (a drafter's logits, measured on the tiny checkpoints: docs/VERIFICATION.md).
"""

from __future__ import annotations

from pathlib import Path

import torch

from backfit.config import ModelConfig

__all__ = ["DRAFT_LIMITS", "draft_pass", "reference_drafts", "judge_drafts"]

DRAFT_LIMITS = {"semantics": {"rel_max": 1e-4, "top1_min": 1.0},
                "conversion": {"top1_min": 0.9, "kl_mean_max": 2e-2},
                "precision": {"top1_min": 0.9, "kl_mean_max": 2e-2}}


def _k(cfg: ModelConfig) -> int:
    return 3 if cfg.variant == "flash" else cfg.dspark_block_size


def draft_pass(converted: str, seqs: list[list[int]], dtype: str, device: str,
               kernels: str | None, every: int) -> list[dict]:
    """Runs on every rank: each sequence in chunks of `every` tokens through the paged pools,
    k drafts after each chunk that leaves a next token -> [{seq, n, ids [k], logits [k, V],
    confidence [k] or None}] (CPU tensors)."""
    from backfit.runtime.batch import ForwardBatch
    from backfit.runtime.cache.layout import default_block_size
    from backfit.runtime.cache.paged import PagedCache
    from backfit.runtime.drafting import Drafting, RowPlan
    from backfit.runtime.loader import load_model
    from backfit.runtime.model.transformer import Transformer
    from backfit.runtime.runner import StepSeq
    cfg = ModelConfig.from_file(Path(converted) / "config.json")
    if kernels:
        from backfit.runtime.kernels import set_kernel_backend
        set_kernel_backend(kernels)
    model = Transformer(cfg, getattr(torch, dtype), mtp=True)
    load_model(model, converted, device)
    if kernels == "triton":
        model.prepare_kernels()
    B = default_block_size(cfg)
    need = [-(-(len(s) + 8) // B) for s in seqs]
    cache = PagedCache(cfg, len(seqs), sum(need), B, model.dtype, "auto", device,
                       mtp_layers=len(model.mtp))
    drafting, out, first = Drafting(model, cache, len(seqs), _k(cfg)), [], 0
    for i, s in enumerate(seqs):
        table = tuple(range(first, first + need[i]))
        first += need[i]
        for a in range(0, len(s) - 1, every):
            n = min(len(s) - 1, a + every)
            b = ForwardBatch.build([(i, s[a:n], a)], device, slots=[i], block_tables=[table])
            with torch.no_grad():
                X = model.hidden(b, cache.bind(b))
                drafting.context(X, model.taps, b.tokens, b.positions,
                                 torch.full((n - a,), i, device=X.device),
                                 RowPlan([n - a], drafting.ring, X.device))
                d = drafting.draft([StepSeq(i, i, table, n, (s[n],), True, draft=drafting.k)], 0)
            out.append({"seq": i, "n": n, "ids": d.ids[0].cpu(), "logits": d.logits[0].float().cpu(),
                        "confidence": None if d.confidence is None else d.confidence[0].cpu()})
    return out


def reference_drafts(original: Path, seqs: list[list[int]], points: list[dict],
                     device: str = "cpu") -> list[dict]:
    """The reference's drafts at the runtime's points (same prefixes and x_{p+1})."""
    from backfit.verify.reference import Reference
    ref = Reference(original, device=device)
    k = _k(ref.cfg)
    pres = {i: ref.prefix(torch.tensor(s, device=device)) for i, s in enumerate(seqs)}
    out = []
    for pt in points:
        s, n = seqs[pt["seq"]], pt["n"]
        if ref.cfg.variant == "flash":
            d = ref.mtp_draft(pres[pt["seq"]], s[n], k, length=n)
            out.append({"ids": d.tokens.cpu(), "logits": d.logits.float().cpu(),
                        "confidence": None})
        else:
            d = ref.dspark_draft(pres[pt["seq"]], s[n], length=n)
            out.append({"ids": d.tokens.cpu(), "logits": d.logits.float().cpu(),
                        "confidence": d.confidence.float().cpu()})
    return out


def judge_drafts(got: list[dict], want: list[dict], kind: str) -> tuple[dict, list[str]]:
    """Metrics over the comparable rows (up to each point's first differing draft) -> (metrics,
    problems)."""
    from backfit.verify.compare import logit_metrics, tensor_metrics
    rows_g, rows_w, conf = [], [], []
    for g, w in zip(got, want):
        same = (g["ids"] == w["ids"]).long().cumprod(0)
        n = 1 + int(same.sum()) if int(same.sum()) < len(same) else len(same)
        rows_g.append(g["logits"][:n]), rows_w.append(w["logits"][:n])
        if g["confidence"] is not None:
            conf.append((g["confidence"][:1], w["confidence"][:1]))
    lm = logit_metrics(torch.cat(rows_g), torch.cat(rows_w))
    if conf:
        lm["confidence_rel"] = tensor_metrics(torch.cat([c[0] for c in conf]),
                                              torch.cat([c[1] for c in conf]))["rel"]
    lim, problems = DRAFT_LIMITS[kind], []
    if not lm["top1"] >= lim["top1_min"]:
        problems.append(f"drafts: top-1 {lm['top1']:.3f} < {lim['top1_min']}")
    if "rel_max" in lim:
        for key in ("rel", "confidence_rel"):
            if key in lm and not lm[key] <= lim["rel_max"]:
                problems.append(f"drafts: {key} {lm[key]:.3g} > {lim['rel_max']}")
    if "kl_mean_max" in lim and not lm["kl_mean"] <= lim["kl_mean_max"]:
        problems.append(f"drafts: kl_mean {lm['kl_mean']:.3g} > {lim['kl_mean_max']}")
    return lm, problems
