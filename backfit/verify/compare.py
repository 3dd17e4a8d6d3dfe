"""Comparison metrics between a candidate and a reference: tensors, hidden states, logits."""

from __future__ import annotations

import torch

__all__ = ["tensor_metrics", "logit_metrics", "format_table"]


def tensor_metrics(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """max |diff|, relative Frobenius error and cosine of two same-shape tensors (float64).

    NaN in either tensor makes max_abs and rel NaN; rel is inf where ref is all zero and got is not.
    """
    g, r = got.double().flatten(), ref.double().flatten()
    d = g - r
    rn, dn = r.norm().item(), d.norm().item()
    cos = (g @ r / (g.norm() * r.norm()).clamp(min=1e-300)).item() if g.numel() else 1.0
    # a NaN anywhere stays NaN (never 0): judges treat NaN as a breach; 0 reference -> inf
    rel = dn / rn if rn > 0 else (0.0 if dn == 0 else float("inf"))
    return {"max_abs": d.abs().max().item() if d.numel() else 0.0, "rel": rel, "cos": cos}


def logit_metrics(got: torch.Tensor, ref: torch.Tensor, k: int = 5) -> dict:
    """Logits [S, V] against reference logits [S, V].

    kl = KL(softmax(ref) || softmax(got)) per position (mean and max); top1 = share of positions
    whose argmax agrees; topk = mean overlap of the k best ids; max_dlogit = max |got - ref|.
    """
    lp_ref = torch.log_softmax(ref.double(), -1)
    lp_got = torch.log_softmax(got.double(), -1)
    kl = (lp_ref.exp() * (lp_ref - lp_got)).sum(-1)
    top_ref, top_got = ref.topk(k, -1).indices, got.topk(k, -1).indices
    overlap = (top_ref[:, :, None] == top_got[:, None, :]).any(-1).double().mean(-1)
    return {"positions": ref.shape[0], "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
            "top1": (top_ref[:, 0] == top_got[:, 0]).double().mean().item(),
            f"top{k}": overlap.mean().item(), "max_dlogit": (got - ref).abs().max().item(),
            **{k2: v for k2, v in tensor_metrics(got, ref).items() if k2 == "rel"}}


def format_table(rows: list[tuple[str, dict]], keys: list[str]) -> str:
    """Plain-text table: one row per (label, metrics)."""
    width = max([len(r[0]) for r in rows] + [5])
    out = [f"{'':{width}}  " + "  ".join(f"{k:>10}" for k in keys)]
    for label, m in rows:
        cells = []
        for k in keys:
            v = m.get(k)
            cells.append(f"{v:>10.3e}" if isinstance(v, float) else f"{str(v):>10}")
        out.append(f"{label:{width}}  " + "  ".join(cells))
    return "\n".join(out)
