"""Reference vision path (dsv4-vision.md sections 8-11), independent of the runtime.

    tower:      patches [N, 3*p*p] -> ViT [N, D]: patch Linear, pre-norm blocks (fused wqkv, 2-D
                RoPE half-split over each head, full softmax attention over the image, SwiGLU
                w1 = [gate | up]), final RMSNorm (eps 1e-6, not the LM's)
    aligner:    3x3 fold (zero pad right/bottom, channel-major 9D features) -> Linear + exact
                GELU + Linear -> [gh * gw, H], rows row-major over the LM grid
    embed:      the LM input: text rows from embed.weight, image-block rows overwritten by the
                sentinels and the aligner rows (in N-layout order, perm), before hc expansion
    routing:    ImageRows.is_image (all five block types) -> bias_vl in every gate (route)
    visibility: in-span positions [IMAGE_START, IMAGE_END] see the whole span in the window
                branch (window_bounds); compressed entries and the indexer stay causal

Shapes: N = ViT patches of one image, D = vision dim, nh = vision heads, d = head dim, S = prompt
positions, H = LM hidden. Float32 throughout for the exact reference; with Numerics.act bfloat16
activations are stored in BF16 between ops as the reference's BF16 tower does (norms, RoPE and
softmax in FP32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backfit.config import ModelConfig, VisionConfig
from backfit.verify.ref_blocks import Numerics, rms_norm
from backfit.vision.block import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_PAD, IMAGE_START

__all__ = ["ImageRows", "aligner", "embed_with_images", "image_embeddings", "image_rows",
           "image_visibility", "rope2d", "vit", "window_bounds"]

ATTN_CHUNK = 1024       # ViT queries per softmax block: [nh, chunk, N] scores at a time
SENTINELS = {IMAGE_START: "image_start", IMAGE_PAD: "image_pad", IMAGE_NEW_LINE: "image_newline",
             IMAGE_END: "image_end"}


# ---- ViT -----------------------------------------------------------------------------------
def rope2d(n_h: int, n_w: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, d/2] float32 (built on the CPU, section 8): patch (r, c) of the row-major
    n_h x n_w grid turns dims (j, d/2 + j) by r * inv[j] for j < d/4, by c * inv[j - d/4] above,
    inv[i] = theta^(-4i/d)."""
    half = head_dim // 2
    inv = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half)    # [d/4]
    r = torch.arange(n_h, dtype=torch.float32).repeat_interleave(n_w)             # [N] row
    c = torch.arange(n_w, dtype=torch.float32).repeat(n_h)                        # [N] column
    ang = torch.cat([r[:, None] * inv, c[:, None] * inv], dim=1)                  # [N, d/2]
    return torch.cos(ang), torch.sin(ang)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotation of x [N, nh, d] in float32: [x1 cos - x2 sin, x2 cos + x1 sin]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _lin(x: torch.Tensor, P, name: str, nx: Numerics, bias: bool = True) -> torch.Tensor:
    """A BF16-on-disk Linear (+ bias), output stored in nx.act."""
    y = F.linear(x.to(nx.act), P[name + ".weight"].to(nx.act))
    return y + P[name + ".bias"].to(nx.act) if bias else y


def _block(x: torch.Tensor, P, vc: VisionConfig, cos: torch.Tensor, sin: torch.Tensor,
           nx: Numerics) -> torch.Tensor:
    """One pre-norm ViT block over one image: x [N, D] -> [N, D]."""
    N, nh, d = x.shape[0], vc.n_heads, vc.head_dim
    qkv = _lin(rms_norm(x, P["norm1.weight"], vc.norm_eps), P, "attn.wqkv", nx)   # [N, 3D]
    q, k, v = (t.reshape(N, nh, d) for t in qkv.chunk(3, dim=-1))
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    o = torch.empty(N, nh, d, dtype=nx.act, device=x.device)
    for a in range(0, N, ATTN_CHUNK):                                   # full, unmasked softmax
        s = torch.einsum("qhd,khd->hqk", q[a:a + ATTN_CHUNK].float(), k.float()) * d ** -0.5
        o[a:a + ATTN_CHUNK] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v.float()).to(nx.act)
    x = x + _lin(o.reshape(N, nh * d), P, "attn.wo", nx)
    gate, up = _lin(rms_norm(x, P["norm2.weight"], vc.norm_eps), P, "mlp.w1", nx,
                    bias=False).float().chunk(2, dim=-1)
    return x + _lin((F.silu(gate) * up).to(nx.act), P, "mlp.w2", nx, bias=False)


def vit(params, vc: VisionConfig, images: list[tuple[torch.Tensor, int, int]],
        nx: Numerics) -> list[torch.Tensor]:
    """images: (patches [N, 3*p*p], n_h, n_w) each -> ViT outputs [N, D] each (after the final
    norm). params(prefix) -> a parameter source (reference.LayerParams); one block's weights
    are held at a time and run over every image."""
    top = params("vision.")
    xs = [_lin(p, top, "patch_embed.proj", nx) for p, _, _ in images]
    tables = [tuple(t.to(xs[0].device) for t in rope2d(h, w, vc.head_dim, vc.rope_theta))
              for _, h, w in images]
    for b in range(vc.n_layers):
        P = params(f"vision.blocks.{b}.")
        xs = [_block(x, P, vc, cos, sin, nx) for x, (cos, sin) in zip(xs, tables)]
        del P
    return [rms_norm(x, top["norm.weight"], vc.norm_eps) for x in xs]


def aligner(x: torch.Tensor, n_h: int, n_w: int, P, vc: VisionConfig,
            nx: Numerics) -> torch.Tensor:
    """ViT output [N, D] of an n_h x n_w grid -> LM rows [gh * gw, H], row-major over the grid.

    Zero-padded to multiples of r at the bottom / right, then each r x r window becomes one
    feature vector ordered (channel, dy, dx)."""
    r, D = vc.downsample_ratio, x.shape[-1]
    gh, gw = -(-n_h // r), -(-n_w // r)
    g = x.new_zeros(gh * r, gw * r, D)
    g[:n_h, :n_w] = x.reshape(n_h, n_w, D)
    f = g.reshape(gh, r, gw, r, D).permute(0, 2, 4, 1, 3).reshape(gh * gw, D * r * r)
    h = F.gelu(_lin(f, P, "aligner.w1", nx).float())                   # exact (erf) GELU
    return _lin(h.to(nx.act), P, "aligner.w2", nx)


def image_embeddings(params, cfg: ModelConfig, images, nx: Numerics,
                     device: torch.device) -> list[torch.Tensor]:
    """PreparedImages -> their aligner rows [gh * gw, H] each (row-major; not yet permuted)."""
    vc = cfg.vision
    inputs = [(im.patches(torch.float32).to(device), im.plan.n_vit_h, im.plan.n_vit_w)
              for im in images]
    outs = vit(params, vc, inputs, nx)
    P = params("")
    return [aligner(x, h, w, P, vc, nx) for x, (_, h, w) in zip(outs, inputs)]


# ---- the LM side ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ImageRows:
    """What the decoder layers need of an image prompt: which rows route by bias_vl, and the
    window key bounds (first, last) [S] of every query (window_bounds)."""

    is_image: torch.Tensor                  # [S] bool: id >= vocab_size (all five block types)
    window: tuple[torch.Tensor, torch.Tensor]


def image_visibility(ids: torch.Tensor, vocab_size: int,
                     max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(left, right) [S] long: for a position i in a span IMAGE_START a .. IMAGE_END b
    (inclusive), left = min(i - a, max_tokens - 1), right = min(b - i, max_tokens); 0 outside
    (the leading IMAGE_PAD of a block is outside: it precedes IMAGE_START)."""
    S = ids.numel()
    left = torch.zeros(S, dtype=torch.long, device=ids.device)
    right = torch.zeros_like(left)
    starts = (ids == vocab_size + IMAGE_START).nonzero().flatten().tolist()
    ends = (ids == vocab_size + IMAGE_END).nonzero().flatten().tolist()
    if len(starts) != len(ends) or any(not a < b for a, b in zip(starts, ends)) or \
            any(not b < a for b, a in zip(ends, starts[1:])):
        raise ValueError(f"image spans do not pair up: IMAGE_START at {starts}, "
                         f"IMAGE_END at {ends}")
    for a, b in zip(starts, ends):
        pos = torch.arange(a, b + 1, device=ids.device)
        left[a:b + 1] = (pos - a).clamp(max=max_tokens - 1)
        right[a:b + 1] = (b - pos).clamp(max=max_tokens)
    return left, right


def window_bounds(left: torch.Tensor, right: torch.Tensor, window: int,
                  max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Window keys of each query i, as (first, last) [S] inclusive: the causal window
    [i - window + 1, i] unioned with [i - left, i + right], clipped to the sequence and to a
    width of window + max_tokens keys (the reference's index matrix)."""
    S = left.numel()
    i = torch.arange(S, device=left.device)
    first = torch.minimum(i - (window - 1), i - left).clamp(min=0)
    last = torch.minimum(i + right, first + min(S, window + max_tokens) - 1)
    return first, last


def image_rows(ids: torch.Tensor, cfg: ModelConfig) -> ImageRows:
    """The routing rows and window bounds of a spliced prompt's ids [S]."""
    left, right = image_visibility(ids, cfg.vocab_size, cfg.vision.max_n_token)
    window = window_bounds(left, right, cfg.sliding_window, cfg.vision.max_n_token)
    return ImageRows(ids >= cfg.vocab_size, window)


def embed_with_images(embed_rows, ids: torch.Tensor, images, params, cfg: ModelConfig,
                      nx: Numerics, device: torch.device) -> tuple[torch.Tensor, ImageRows]:
    """The LM input of an image prompt: [S, H] in nx.act and its ImageRows.

    embed_rows(ids) -> [S, H] text embedding rows (reference._embed); ids: the spliced prompt
    (text ids and vocab_size + type); images: its PreparedImages in prompt order."""
    V = cfg.vocab_size
    image = image_rows(ids, cfg)                                        # spans must pair up
    types = torch.where(image.is_image, ids - V, -1)
    e = embed_rows(torch.where(image.is_image, 0, ids)).clone()         # [S, H], safe row 0
    P = params("")
    for t, name in SENTINELS.items():
        e[types == t] = P[name].to(e.dtype)
    rows = image_embeddings(params, cfg, images, nx, device)
    starts = (types == IMAGE_START).nonzero().flatten().tolist()
    ends = (types == IMAGE_END).nonzero().flatten().tolist()
    if len(starts) != len(images):
        raise ValueError(f"{len(starts)} image blocks in the ids but {len(images)} images")
    for a, b, im, r in zip(starts, ends, images, rows):
        slots = a + (types[a:b + 1] == IMAGE).nonzero().flatten()       # IMAGE slots, in order
        if slots.numel() != r.shape[0]:
            raise ValueError(f"image at position {a}: {r.shape[0]} embedding rows for "
                             f"{slots.numel()} IMAGE slots")
        e[slots] = r[torch.tensor(im.block.perm, device=r.device)].to(e.dtype)
    if int((types == IMAGE).sum()) != sum(r.shape[0] for r in rows):
        raise ValueError("IMAGE ids outside the image spans")
    return e, image
