"""Per-layer perturbation gain of a checkpoint under the FP32 reference (a diagnostic).

    python scripts/perturbation_gain.py CKPT_DIR

For each layer l >= 1: feed the reference's own input X_l plus Gaussian noise of relative size
1e-3 and print the output's relative change divided by the input's (gain < 1 contracts), the
attention output's size relative to one stream, and how much the layer changes the stream.
"""
import sys

import torch

from backfit.verify.ref_attention import attention
from backfit.verify.ref_blocks import hc_pre, rms_norm
from backfit.verify.reference import Reference, decoder_layer


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    torch.set_num_threads(1)
    ref = Reference(sys.argv[1])
    cfg = ref.cfg
    tokens = torch.randint(3, 250, (128,), generator=torch.Generator().manual_seed(0))
    hs = ref.forward(tokens, capture=True)["hidden"]
    g = torch.Generator().manual_seed(1)
    for l in range(1, cfg.num_hidden_layers):
        X, P = hs[l - 1], ref.params(f"layers.{l}.")
        d = torch.randn(X.shape, generator=g) * X.std() * 1e-3
        run = lambda x: decoder_layer(x, tokens, P, cfg, cfg.ratio(l), cfg.is_hash_layer(l), ref.nx)  # noqa: E731
        Y0, Y1 = run(X), run(X + d)
        u, _, _ = hc_pre(X, P["hc_attn_fn"], P["hc_attn_base"], P["hc_attn_scale"], cfg)
        a = attention(rms_norm(u, P["attn_norm.weight"], cfg.rms_norm_eps), P, cfg, cfg.ratio(l), ref.nx)
        print(f"layer {l}: gain {rel(Y1, Y0) / rel(X + d, X):.2f}  "
              f"|attn out|/|stream| {a.norm().item() / (X.norm().item() / 2):.2f}  "
              f"|Y-X|/|X| {rel(Y0, X):.2f}", flush=True)


if __name__ == "__main__":
    main()
