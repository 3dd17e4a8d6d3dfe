"""The reference ViT + aligner (backfit/verify/ref_vision.py) against a straight PyTorch port of
dsv4-vision.md sections 8-9 written here (nn.Linear, SDPA, F.unfold: other ops, other order),
on the random weights of the tiny Vision-Exp checkpoint; and the fusion of section 10."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backfit.checkpoint import SafetensorsDir
from backfit.config import ModelConfig
from backfit.verify import ref_vision
from backfit.verify.image_prompts import synthetic_png
from backfit.verify.reference import Reference
from backfit.vision import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_PAD, IMAGE_START, prepare, splice
from support import one_thread

# FP32 both sides; SDPA vs einsum softmax and other summation orders: measured 3.2e-7 / 3.7e-7
# relative on these two images (max |diff| / max |ref|), so 1e-5 is 27x the floor, and a wrong
# axis, order or activation (>= 1e-2) is far above it
TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


class StraightTower(torch.nn.Module):
    """Sections 8-9 as written: one image per call, SDPA without mask or scale."""

    def __init__(self, src: SafetensorsDir, cfg: ModelConfig):
        super().__init__()
        self.v, self.src = cfg.vision, src

    def w(self, name):
        return self.src.read(name).float()

    def norm(self, x, name):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * self.w(name)

    def rope(self, n_h, n_w):
        d = self.v.head_dim // 2                                    # rotary width per axis x 2
        inv = 1.0 / (self.v.rope_theta ** (torch.arange(0, d, 2).float() / d))
        rows, cols = torch.meshgrid(torch.arange(n_h), torch.arange(n_w), indexing="ij")
        ang = torch.cat([rows.reshape(-1, 1) * inv, cols.reshape(-1, 1) * inv], 1)
        return ang.cos()[:, None], ang.sin()[:, None]

    def forward(self, patches, n_h, n_w):
        v, N = self.v, patches.shape[0]
        x = F.linear(patches, self.w("vision.patch_embed.proj.weight"),
                     self.w("vision.patch_embed.proj.bias"))
        cos, sin = self.rope(n_h, n_w)
        for b in range(v.n_layers):
            p = f"vision.blocks.{b}."
            qkv = F.linear(self.norm(x, p + "norm1.weight"), self.w(p + "attn.wqkv.weight"),
                           self.w(p + "attn.wqkv.bias"))
            q, k, val = qkv.view(N, 3, v.n_heads, v.head_dim).unbind(1)
            rot = [torch.cat([t[..., :v.head_dim // 2] * cos - t[..., v.head_dim // 2:] * sin,
                              t[..., v.head_dim // 2:] * cos + t[..., :v.head_dim // 2] * sin], -1)
                   for t in (q, k)]
            o = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (*rot, val)))
            x = x + F.linear(o.transpose(0, 1).reshape(N, -1), self.w(p + "attn.wo.weight"),
                             self.w(p + "attn.wo.bias"))
            g, u = F.linear(self.norm(x, p + "norm2.weight"), self.w(p + "mlp.w1.weight")).split(
                v.inter_dim, -1)
            x = x + F.linear(F.silu(g) * u, self.w(p + "mlp.w2.weight"))
        x = self.norm(x, "vision.norm.weight")
        r = v.downsample_ratio
        grid = F.pad(x.T.reshape(1, -1, n_h, n_w), (0, -n_w % r, 0, -n_h % r))
        f = F.unfold(grid, r, stride=r)[0].T                        # [gh*gw, D*9], (c, dy, dx)
        h = F.gelu(F.linear(f, self.w("aligner.w1.weight"), self.w("aligner.w1.bias")))
        return F.linear(h, self.w("aligner.w2.weight"), self.w("aligner.w2.bias"))


@pytest.fixture(scope="module")
def ref(tiny_vision):
    return Reference(tiny_vision)


@pytest.fixture(scope="module")
def images(ref):
    """320x400: a 31x25 ViT grid (neither side a multiple of 3: the aligner pads both, and the
    two RoPE axes differ); 2000x120: 10x78, stretched."""
    return [prepare(synthetic_png(320, 400, 0), ref.cfg.vision),
            prepare(synthetic_png(2000, 120, 1), ref.cfg.vision)]


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_tower_matches_straight_port(ref, images):
    mine = ref_vision.image_embeddings(ref.params, ref.cfg, images, ref.nx, ref.device)
    straight = StraightTower(ref.ckpt, ref.cfg)
    for img, rows in zip(images, mine):
        want = straight(img.patches(), img.plan.n_vit_h, img.plan.n_vit_w)
        assert rows.shape == (img.plan.gh * img.plan.gw, ref.cfg.hidden_size) == want.shape
        assert _rel(rows, want) <= TOL
        assert rows.std(0).mean() > 0.2 * rows.abs().mean()          # rows differ: no constant


def test_bf16_tower_is_close(ref, images, tiny_vision):
    """The BF16 mode (activations stored in BF16, norms/RoPE/softmax FP32) stays near FP32."""
    r16 = Reference(tiny_vision, dtype=torch.bfloat16)
    a = ref_vision.image_embeddings(ref.params, ref.cfg, images[:1], ref.nx, ref.device)[0]
    b = ref_vision.image_embeddings(r16.params, r16.cfg, images[:1], r16.nx, r16.device)[0]
    assert b.dtype == torch.bfloat16 and 1e-4 < _rel(b.float(), a) < 0.05


def test_fusion_puts_rows_and_sentinels_in_place(ref, images):
    """Section 10: text rows from embed.weight, the four sentinels by type, IMAGE slots take the
    aligner rows in N-layout order (slot k of the block gets row perm[k])."""
    p = splice([[0, 5, 6], images[0], [7, 8, 9, 10], images[1], [11]], ref.cfg.vocab_size)
    ids = torch.tensor(p.ids)
    e, rows = ref_vision.embed_with_images(ref._embed, ids, p.images, ref.params, ref.cfg,
                                           ref.nx, ref.device)
    emb, src, V = ref.ckpt.read("embed.weight").float(), ref.ckpt, ref.cfg.vocab_size
    text = ids < V
    assert torch.equal(e[text], emb[ids[text]])
    names = {IMAGE_START: "image_start", IMAGE_PAD: "image_pad",
             IMAGE_NEW_LINE: "image_newline", IMAGE_END: "image_end"}
    for t, name in names.items():
        at = ids == V + t
        assert at.any() and torch.equal(e[at], src.read(name).float().expand(int(at.sum()), -1))
    straight = StraightTower(ref.ckpt, ref.cfg)
    for span, img in zip(p.spans, p.images):
        want = straight(img.patches(), img.plan.n_vit_h, img.plan.n_vit_w)
        pos = [i for i in range(span.start, span.start + span.length) if ids[i] == V + IMAGE]
        gw = img.plan.gw
        # slot order written out from section 7: row pairs, column by column
        order = [r * gw + c for k in range(0, img.plan.gh, 2) for c in range(gw)
                 for r in (k, k + 1) if r < img.plan.gh]
        assert _rel(e[pos], want[order]) <= TOL
    assert torch.equal(rows.is_image, ids >= V)


def test_count_mismatch_and_stray_ids_are_refused(ref, images):
    p = splice([[0, 5], images[0], [7]], ref.cfg.vocab_size)
    with pytest.raises(ValueError, match="1 image blocks in the ids but 2 images"):
        ref.forward(p.ids, images=[images[0], images[0]])
    with pytest.raises(ValueError, match="token id out of range"):
        ref.forward(p.ids)                                           # image ids without images
    # an IMAGE slot removed from the block: 97 slots for 98 rows
    ids = list(p.ids)
    ids[ids.index(ref.cfg.vocab_size + IMAGE)] = ref.cfg.vocab_size + IMAGE_PAD
    with pytest.raises(ValueError, match="embedding rows for .* IMAGE slots"):
        ref.forward(ids, images=p.images)


def test_aligner_rows_look_like_embeddings(ref, images):
    """docs/SYNTHETIC.md: the synthetic aligner writes into the embedding rows' subspace at
    about their RMS (measured 1.25x), so image rows are neither noise nor a different scale."""
    rows = ref_vision.image_embeddings(ref.params, ref.cfg, images, ref.nx, ref.device)
    emb = ref.ckpt.read("embed.weight").float()
    basis = torch.linalg.svd(emb, full_matrices=False).Vh[:ref.cfg.hidden_size // 8]
    scale = emb.square().mean(1).sqrt().median()
    for r in rows:
        assert 0.5 < r.square().mean(1).sqrt().median() / scale < 2
        assert ((r @ basis.T).norm() / r.norm()) > 0.9
