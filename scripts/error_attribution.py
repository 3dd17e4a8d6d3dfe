"""Where does the INT8 conversion error come from? (a diagnostic)

    python scripts/error_attribution.py CKPT [PATTERN ...] [--positions 512]

Runs the FP32 reference on the original checkpoint twice per PATTERN: once as is, once with
every FP8 linear whose full name matches the regular expression PATTERN replaced by its INT8
round trip (the converter's per-(row, 128) quantizer, then dequantized). Everything else stays
exact, so each line shows what those tensors alone cost: mean KL, top-1 agreement and relative
logit error over the built-in prompts, then the relative error of the residual after each layer.
With no PATTERN it runs ".*" (all FP8 linears: the whole conversion error, without the runtime).

Example: python scripts/error_attribution.py /tmp/v/orig ".*" "\\.attn\\." "shared_experts" "layers\\.0\\."
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from backfit.quant import dequant_int8_groups, quantize_int8_groups
from backfit.verify.compare import logit_metrics
from backfit.verify.prompts import PROMPTS
from backfit.verify.reference import LayerParams, Reference
from backfit.verify.run import prompt_sequences


class _RoundTrip(LayerParams):
    """LayerParams whose matching FP8 weights come back INT8-quantized and dequantized."""

    pattern: re.Pattern | None = None

    def load(self, name: str) -> torch.Tensor:
        t = super().load(name)
        full = self.prefix + name
        if self.pattern is not None and self.ckpt.entries[full].dtype == "F8_E4M3" \
                and self.pattern.search(full):
            t = dequant_int8_groups(*quantize_int8_groups(t))
        return t


class _Ref(Reference):
    def params(self, prefix: str) -> LayerParams:
        return _RoundTrip(self.ckpt, prefix, self.cfg, self.device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("patterns", nargs="*", default=[".*"])
    ap.add_argument("--positions", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ref = _Ref(args.ckpt)
    seqs = prompt_sequences(args.ckpt / "tokenizer.json", PROMPTS, args.positions, ref.cfg.bos_token_id)

    def run(pattern: str | None) -> list[dict]:
        _RoundTrip.pattern = re.compile(pattern) if pattern is not None else None
        return [ref.forward(s, capture=True) for s in seqs]

    base = run(None)
    ref_logits = torch.cat([o["logits"] for o in base])
    print(f"{'pattern':28s} {'kl_mean':>9s} {'top1':>6s} {'rel':>6s} | residual rel error per layer")
    for pattern in args.patterns:
        got = run(pattern)
        m = logit_metrics(torch.cat([o["logits"] for o in got]), ref_logits)
        per_layer = []
        for layer in range(ref.cfg.num_hidden_layers):
            a = torch.cat([o["hidden"][layer] for o in got])
            b = torch.cat([o["hidden"][layer] for o in base])
            per_layer.append(f"{((a - b).norm() / b.norm()).item():.4f}")
        print(f"{pattern:28s} {m['kl_mean']:9.2e} {m['top1']:6.3f} {m['rel']:6.4f} | "
              + " ".join(per_layer), flush=True)


if __name__ == "__main__":
    main()
