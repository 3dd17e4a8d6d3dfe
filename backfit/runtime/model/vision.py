"""The Vision-Exp image tower on the runtime: ViT + aligner (dsv4-vision.md sections 8-9).

    patches [N_i, 3·p·p] per image -> patch_embed -> blocks -> norm -> aligner -> [gh_i·gw_i, H]

Every image of a call runs through each linear together (the rows of all images concatenated,
sum N_i = P), so the weights are read once per block, not once per image; attention is one
SDPA call per image (full bidirectional softmax over its own patches, no mask, scale d^-0.5).
Per block, with D the vision width, nh heads of d = D / nh:
    y = rmsnorm(x, norm1, 1e-6)                          [P, D]  (FP32 math, FP32 weight)
    q, k, v = split(wqkv y + b)                          [P, nh, d] each
    q, k = rope2d(q), rope2d(k)                          FP32, cast back (half-split per head)
    x += wo(concat_i SDPA(q_i, k_i, v_i)) + b
    x += w2(silu(g) · u),  g | u = w1 rmsnorm(x, norm2)  (no biases; SiLU product in FP32)
The aligner folds each 3 x 3 window of an image's ViT grid (zero-padded right / bottom) into one
9·D feature (channel-major), then Linear + exact GELU (FP32) + Linear -> one LM row per window,
row-major over the gh x gw grid (the caller orders them into the N-layout, vision.ImageBlock).
The cos / sin tables are built on the CPU in FP32 and then moved (section 8's numerics note).

Weights stay BF16 as on disk (replicated on every rank: docs/FORMAT.md); each linear runs in the
activation dtype (a BF16 model: BF16 GEMMs; FP32 for the exact checks). Images are grouped so a
call holds at most MAX_PATCHES patch rows ([P, 2·inter] is the largest activation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backfit.config import ModelConfig, VisionConfig
from backfit.runtime.layers import RMSNorm

__all__ = ["Aligner", "MAX_PATCHES", "SENTINELS", "VisionTower", "add_sentinels", "rope2d",
           "sentinel_table"]

MAX_PATCHES = 16384       # patch rows per tower call: [P, 2 x 2816] BF16 = 185 MB at the real dims
# the Transformer's LM-space vectors by block type (vision.block: START 0, PAD 1, IMAGE 2,
# NEW_LINE 3, END 4); IMAGE rows come from the aligner
SENTINELS = ("image_start", "image_pad", None, "image_newline", "image_end")


class _Linear(nn.Module):
    """y = x Wᵀ (+ b): weight [out, in] and bias [out] BF16 buffers, replicated (checkpoint names
    `.weight` / `.bias`), run in x's dtype."""

    def __init__(self, n_in: int, n_out: int, bias: bool = True):
        super().__init__()
        self.register_buffer("weight", torch.empty(n_out, n_in, dtype=torch.bfloat16))
        self.register_buffer("bias", torch.empty(n_out, dtype=torch.bfloat16) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), b)


def rope2d(n_h: int, n_w: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n_h·n_w, d/2] FP32 on the CPU: patch (r, c) of the row-major grid turns the
    head's dims (j, d/2 + j) by r·f_j for j < d/4 and by c·f_{j - d/4} above, f_i = θ^(-4i/d)."""
    half = head_dim // 2
    f = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half)      # [d/4]
    r = torch.arange(n_h, dtype=torch.float32)[:, None].expand(n_h, n_w).reshape(-1)
    c = torch.arange(n_w, dtype=torch.float32)[None, :].expand(n_h, n_w).reshape(-1)
    ang = torch.cat((r[:, None] * f, c[:, None] * f), dim=1)                         # [N, d/2]
    return ang.cos(), ang.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [P, nh, d]: [x1 cos - x2 sin, x2 cos + x1 sin] over the head's halves, in FP32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.nh, self.d = vc.n_heads, vc.head_dim
        self.wqkv = _Linear(vc.dim, 3 * vc.dim)          # rows [q | k | v], heads contiguous
        self.wo = _Linear(vc.dim, vc.dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                sizes: list[int]) -> torch.Tensor:
        P = x.shape[0]
        q, k, v = self.wqkv(x).view(P, 3, self.nh, self.d).unbind(1)               # [P, nh, d]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        o = torch.empty_like(q)
        lo = 0
        for n in sizes:                                   # one image: [1, nh, n, d]
            s = slice(lo, lo + n)
            o[s] = F.scaled_dot_product_attention(
                *(t[s].transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1)
            lo += n
        return self.wo(o.reshape(P, self.nh * self.d))


class _MLP(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.w1 = _Linear(vc.dim, 2 * vc.inter_dim, bias=False)   # rows [gate | up]
        self.w2 = _Linear(vc.inter_dim, vc.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.w1(x).float().chunk(2, dim=-1)
        return self.w2((F.silu(g) * u).to(x.dtype))


class _Block(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(vc.dim, vc.norm_eps)
        self.attn = _Attention(vc)
        self.norm2 = RMSNorm(vc.dim, vc.norm_eps)
        self.mlp = _MLP(vc)

    def forward(self, x, cos, sin, sizes):
        x = x + self.attn(self.norm1(x), cos, sin, sizes)
        return x + self.mlp(self.norm2(x))


class _PatchEmbed(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.proj = _Linear(vc.patch_dim, vc.dim)


class VisionTower(nn.Module):
    """The ViT (checkpoint prefix `vision.`): patches -> [N, D] per image, after the final norm."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.vc = vc
        self.patch_embed = _PatchEmbed(vc)
        self.blocks = nn.ModuleList(_Block(vc) for _ in range(vc.n_layers))
        self.norm = RMSNorm(vc.dim, vc.norm_eps)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """patches [P, 3·p·p] (the images' rows concatenated, each row-major over its grid),
        grids [(n_h, n_w)] per image -> [P, D] in patches' dtype."""
        tables = [rope2d(h, w, self.vc.head_dim, self.vc.rope_theta) for h, w in grids]
        cos, sin = (torch.cat(t).to(patches.device) for t in zip(*tables))
        sizes = [h * w for h, w in grids]
        x = self.patch_embed.proj(patches)
        for blk in self.blocks:
            x = blk(x, cos, sin, sizes)
        return self.norm(x)


class Aligner(nn.Module):
    """The 3 x 3 fold and its two linears (checkpoint prefix `aligner.`)."""

    def __init__(self, vc: VisionConfig, hidden: int):
        super().__init__()
        self.r = vc.downsample_ratio
        self.w1 = _Linear(vc.aligner_dim, hidden)
        self.w2 = _Linear(hidden, hidden)

    def fold(self, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """One image's ViT rows [n_h·n_w, D] -> [gh·gw, D·r·r]: zero-padded to multiples of r
        at the bottom / right, each window's feature ordered (channel, dy, dx)."""
        r, D = self.r, x.shape[-1]
        gh, gw = -(-n_h // r), -(-n_w // r)
        g = x.new_zeros(gh * r, gw * r, D)
        g[:n_h, :n_w] = x.view(n_h, n_w, D)
        return g.view(gh, r, gw, r, D).permute(0, 2, 4, 1, 3).reshape(gh * gw, D * r * r)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        """Folded features [n, 9·D] -> LM rows [n, H] (exact GELU in FP32)."""
        return self.w2(F.gelu(self.w1(f).float()).to(f.dtype))


def add_sentinels(model: nn.Module, cfg: ModelConfig) -> None:
    """The four LM-space vectors as top-level BF16 buffers [H] (checkpoint names image_*)."""
    for name in SENTINELS:
        if name is not None:
            model.register_buffer(name, torch.empty(cfg.hidden_size, dtype=torch.bfloat16))


def sentinel_table(model: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """[5, H] in dtype indexed by block type; the IMAGE row (2) is zeros (aligner rows go there)."""
    rows = [getattr(model, n) if n is not None else torch.zeros_like(model.image_start)
            for n in SENTINELS]
    return torch.stack(rows).to(dtype)


@torch.no_grad()
def image_embeddings(tower: VisionTower, aligner: Aligner, images, dtype: torch.dtype,
                     device: torch.device) -> list[torch.Tensor]:
    """PreparedImages (backfit.vision) -> their aligner rows [gh·gw, H] in dtype, row-major
    (not yet in N-layout order). Images are run in groups of at most MAX_PATCHES patches (an
    image larger than that alone)."""
    out: list[torch.Tensor] = []
    group: list = []

    def run():
        grids = [(im.plan.n_vit_h, im.plan.n_vit_w) for im in group]
        patches = torch.cat([im.patches(torch.float32) for im in group]).to(device, dtype)
        x, lo, feats = tower(patches, grids), 0, []
        for h, w in grids:
            feats.append(aligner.fold(x[lo:lo + h * w], h, w))
            lo += h * w
        e = aligner(torch.cat(feats))
        out.extend(e.split([f.shape[0] for f in feats]))
        group.clear()

    for im in images:
        if group and sum(g.n_patches for g in group) + im.n_patches > MAX_PATCHES:
            run()
        group.append(im)
    if group:
        run()
    return out
