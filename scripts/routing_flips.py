"""Routing flips: how often two converted dirs of one checkpoint pick different expert sets.

    python scripts/routing_flips.py CONVERTED_A CONVERTED_B      (both converted with --tp 1)

Runs the runtime (float32) on 256 random token ids with each directory and prints, per layer,
the share of tokens whose routed expert set differs, then the top-1 agreement of the logits.
"""
import sys
from pathlib import Path

import torch

from backfit.config import ModelConfig
from backfit.runtime.batch import ForwardBatch
from backfit.runtime.distributed import set_tp_info
from backfit.runtime.loader import load_model
from backfit.runtime.model.transformer import Transformer


def run(root: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    model = Transformer(ModelConfig.from_file(Path(root) / "config.json"), torch.float32, mtp=False)
    load_model(model, root)
    chosen: list[torch.Tensor] = []
    for layer in model.layers:
        gate, route = layer.ffn.gate, layer.ffn.gate.route

        def spy(x, tokens, route=route):
            idx, w = route(x, tokens)
            chosen.append(idx.sort(-1).values)
            return idx, w
        gate.route = spy
    tokens = torch.randint(3, 250, (256,), generator=torch.Generator().manual_seed(0))
    return chosen, model(ForwardBatch.single(tokens))


def main() -> None:
    torch.set_num_threads(1)
    set_tp_info(0, 1)
    (a, la), (b, lb) = run(sys.argv[1]), run(sys.argv[2])
    for i, (x, y) in enumerate(zip(a, b)):
        print(f"layer {i}: tokens with a different expert set {(x != y).any(-1).float().mean():.3f}")
    print(f"top-1 agreement {(la.argmax(-1) == lb.argmax(-1)).float().mean():.3f}")


if __name__ == "__main__":
    main()
