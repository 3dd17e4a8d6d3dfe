"""Does the synthetic checkpoint behave like a trained model? Margins, clamps, router bias.

Writes the tiny Flash checkpoint (real 129,280 vocab with the DeepSeek tokenizer, and the small
512 byte-level vocab), runs backfit.verify.reference.Reference in float32 over ~300 tokens of
real text and prints:
  - top-1 margin (logit1 - logit2) and max softmax prob: min / p10 / p50 / p90
  - fraction of SwiGLU gate / up elements clamped (swiglu_limit), routed and shared experts
  - fraction of (token, scored layer) pairs whose top-k expert SET changes because of gate.bias,
    and the fraction of the k selected slots that the bias swaps

    python benchmarks/report_margins.py [--tokens 300] [--seed 0] [--workdir /tmp/margins]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from backfit.synthetic import write_checkpoint
from backfit.verify.ref_blocks import MoEStats
from backfit.verify.reference import Reference

TEXT = """\
The harbour town woke slowly that morning. Fishermen hauled their nets onto the stone quay while
the baker on Mill Street opened his shutters and set out the first loaves of the day. Children
ran past the church with their satchels bouncing, late again for the schoolmaster, who stood at
the gate with his watch in his hand and a look of weary patience on his face.
Nobody in the town remembered exactly when the lighthouse keeper had stopped coming down for
supplies. Some said it was the winter of the great storm, when the waves reached the second
window of the tower and the lamp burned all night for eleven nights in a row. Others insisted
he had simply grown tired of people and their questions, and that the boy who rowed out every
Thursday with bread, oil and newspapers was the only person he still trusted.
In the spring a surveyor arrived from the capital with a leather case full of instruments and a
letter from the ministry. The new coastal railway, he explained to the mayor, would need a
bridge across the estuary, and the old lighthouse stood exactly where the engineers wanted to
put the northern pier. The mayor read the letter twice, folded it carefully, and invited the
surveyor to dinner, which everyone understood to mean that nothing would be decided soon.
That evening the boy rowed out earlier than usual. The sea was calm and green, the gulls were
quiet, and the keeper was waiting for him on the rocks, as if he had already heard the news.
"""


def pct(x: torch.Tensor, qs=(0.0, 0.1, 0.5, 0.9)) -> str:
    v = torch.quantile(x.double(), torch.tensor(qs, dtype=torch.float64))
    return " / ".join(f"{a:.3f}" for a in v.tolist())


def report(ckpt: Path, n_tokens: int) -> dict:
    from tokenizers import Tokenizer
    ids = Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(TEXT).ids[:n_tokens]
    ref = Reference(ckpt)
    ref.stats = MoEStats()
    t0 = time.time()
    logits = ref.forward(torch.tensor(ids))["logits"]
    top2 = logits.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    pmax = torch.softmax(logits, dim=-1).max(dim=-1).values
    st = ref.stats
    return {
        "tokens": len(ids), "seconds": time.time() - t0, "margin": pct(margin), "pmax": pct(pmax),
        "routed gate / up clamped": f"{st.frac('routed.gate'):.4%} / {st.frac('routed.up'):.4%}",
        "shared gate / up clamped": f"{st.frac('shared.gate'):.4%} / {st.frac('shared.up'):.4%}",
        "bias changes selected set": f"{st.frac('bias_changed_selection'):.2%} of tokens, "
                                     f"{st.frac('bias_swapped_experts'):.2%} of slots",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=None, help="reuse checkpoints written here")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 avoids OpenMP stalls)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="margins-"))
    for name, small in (("real vocab 129280", False), ("small vocab 512", True)):
        ckpt = work / f"flash-seed{args.seed}-{'small' if small else 'real'}"
        if not (ckpt / "config.json").exists():
            write_checkpoint(ckpt, "flash", seed=args.seed, small_vocab=small)
        r = report(ckpt, args.tokens)
        print(f"== tiny flash, {name}, seed {args.seed}: {r.pop('tokens')} tokens "
              f"({r.pop('seconds'):.1f} s)")
        print(f"   {'quantiles':28s} min / p10 / p50 / p90")
        for k, v in r.items():
            print(f"   {k:28s} {v}")


if __name__ == "__main__":
    main()
