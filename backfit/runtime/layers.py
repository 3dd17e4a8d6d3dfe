"""Building blocks: quantized Linear, tensor-parallel linears/embedding/head, RMSNorm, RoPE.

Parallel layers take GLOBAL sizes and own their shard (the converted directory is already split
by rank, docs/FORMAT.md): ColumnParallel splits the output dim, RowParallel the input dim and
all-reduces, VocabParallel splits vocabulary rows. Weights are filled by runtime.loader.
Plain-torch path: the weight is dequantized per call in the activation dtype; with the "triton"
backend Linear (bf16 x), Linear.forward_f32 and ParallelHead (CUDA bf16 x) use kernels.linear.gemm.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from backfit.formats import INT8_GROUP, MX_GROUP
from backfit.quant import dequant_int8_groups, dequant_int8_mx, dequant_mx4
from backfit.runtime.distributed import all_gather, all_reduce, get_tp_info
from backfit.runtime.kernels import get_kernel_backend, kernel_path

__all__ = ["LINEAR_SCHEMES", "Linear", "FusedProjection", "ColumnParallelLinear",
           "RowParallelLinear", "VocabParallelEmbedding", "ParallelHead", "RMSNorm", "Rotary", "yarn_inv_freq"]

# scheme -> (weight dtype, scale dtype, scale group along K); "copy" is a BF16/F32 weight kept as is
LINEAR_SCHEMES = {
    "int8_g128": (torch.int8, torch.float32, INT8_GROUP),
    "int8_mx32": (torch.int8, torch.uint8, MX_GROUP),
    "mx4_e2m1": (torch.uint8, torch.uint8, MX_GROUP),     # weight [out, in/2]: 2 codes per byte
    "bf16": (torch.bfloat16, None, None),
    "copy": (None, None, None),
}
_KERNEL_SCHEMES = ("int8_g128", "bf16", "copy")      # Linear schemes kernels.linear.gemm runs


def _on_gpu(x: torch.Tensor) -> bool:
    """Whether the FP32-output kernels may take x (CUDA only: on CPU the reference is used)."""
    return kernel_path(x)


class Linear(nn.Module):
    """y = x @ W^T, W [out_features, in_features] (local shard) held quantized by scheme.

    Computes in x.dtype (float32 or bfloat16): the weight is dequantized to that dtype.
    """

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme: str | None = None
        self.register_buffer("weight", None)
        self.register_buffer("scale", None)

    def load(self, scheme: str, weight: torch.Tensor, scale: torch.Tensor | None = None,
             name: str = "") -> None:
        """Take this rank's weight (and scale); checks dtype and shape against the scheme."""
        if scheme not in LINEAR_SCHEMES:
            raise ValueError(f"{name}: unknown scheme {scheme!r}")
        wdt, sdt, group = LINEAR_SCHEMES[scheme]
        shape = (self.out_features, self.in_features // (2 if scheme == "mx4_e2m1" else 1))
        if tuple(weight.shape) != shape:
            raise ValueError(f"{name}: weight shape {list(weight.shape)}, expected {list(shape)}")
        if wdt is not None and weight.dtype != wdt:
            raise ValueError(f"{name}: scheme {scheme} needs {wdt}, got {weight.dtype}")
        if wdt is None and not weight.is_floating_point():
            raise ValueError(f"{name}: copied weight must be floating point, got {weight.dtype}")
        if sdt is None:
            if scale is not None:
                raise ValueError(f"{name}: scheme {scheme} has no scale")
        else:
            sshape = (self.out_features, self.in_features // group)
            if scale is None or scale.dtype != sdt or tuple(scale.shape) != sshape:
                got = None if scale is None else (scale.dtype, list(scale.shape))
                raise ValueError(f"{name}: scale must be {sdt}{list(sshape)}, got {got}")
        self.scheme, self.weight, self.scale = scheme, weight, scale

    @property
    def loaded(self) -> bool:
        return self.weight is not None

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The local weight [out, in] in `dtype` (exact for bf16/copy and for int8_mx32/mx4_e2m1
        in bf16 or float32, which hold every MXFP4 value; q*scale for int8_g128)."""
        if self.scheme == "int8_g128":
            w = dequant_int8_groups(self.weight, self.scale)
        elif self.scheme == "int8_mx32":
            w = dequant_int8_mx(self.weight, self.scale, MX_GROUP)
        elif self.scheme == "mx4_e2m1":                   # 16-entry e2m1 table x 2^(e-127)
            w = dequant_mx4(self.weight, self.scale, MX_GROUP)
        elif self.scheme in ("bf16", "copy"):
            w = self.weight
        else:
            raise RuntimeError(f"Linear {self.out_features}x{self.in_features} was never loaded")
        return w.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if get_kernel_backend() == "triton" and x.dtype == torch.bfloat16 \
                and self.scheme in _KERNEL_SCHEMES:
            from backfit.runtime.kernels.linear import linear       # imports triton on first use
            return linear(x, self.weight, self.scale, self.scheme)
        return F.linear(x, self.dequantized(x.dtype))

    def norm_folds(self, x: torch.Tensor) -> bool:
        """Whether forward_normed(x, norm) runs as one launch: kernel path, bf16 x, int8_g128 /
        bf16 weight, at a shape kernels.linear.gemv takes on its cuda variant
        (kernels.linear.gemv.norm_fold)."""
        if not (kernel_path(x) and x.dtype == torch.bfloat16 and self.scheme in _KERNEL_SCHEMES
                and self.weight.dtype in (torch.int8, torch.bfloat16)):
            return False
        from backfit.runtime.kernels.linear import GEMV_MAX_M, norm_fold
        M = x.numel() // x.shape[-1]
        return 0 < M <= GEMV_MAX_M and norm_fold(M, *self.weight.shape, self.scheme == "int8_g128")

    def forward_normed(self, x: torch.Tensor, norm: "RMSNorm") -> torch.Tensor:
        """self(norm(x)): one GEMV launch with the RMSNorm inside where norm_folds(x), else the
        two calls (the norm's Σx² in the GEMV's order: its bf16 input may differ by an ulp)."""
        if not self.norm_folds(x):
            return self(norm(x))
        from backfit.runtime.kernels.linear import gemv_linear
        return gemv_linear(x, self.weight, self.scale, self.scheme, norm=(norm.weight, norm.eps))

    def forward_f32(self, x: torch.Tensor) -> torch.Tensor:
        """x [.., in] bf16 or fp32 -> FP32 [.., out] = x·W^T in FP32 (router, compressors).

        Triton backend, CUDA bf16 x, bf16/copy(bf16)/int8_g128 weight: the a16 kernel with FP32
        output (no FP32 copy of the weight). Else the reference: F.linear in FP32, weight upcast.
        """
        if get_kernel_backend() == "triton" and x.dtype == torch.bfloat16 and _on_gpu(x) \
                and self.scheme in _KERNEL_SCHEMES and self.weight.dtype != torch.float32:
            from backfit.runtime.kernels.linear import linear       # imports triton on first use
            return linear(x, self.weight, self.scale, self.scheme, out_dtype=torch.float32)
        return F.linear(x.float(), self.dequantized(torch.float32))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, scheme={self.scheme}"


class FusedProjection:
    """Linears that read one input, as ONE kernel launch (a post-load step of the triton path).

    `fuse` concatenates their weights (and scales) by rows and makes every member's weight a row
    view of the result, so nothing is added to memory and the members still work alone; None when
    their schemes or dtypes differ or the scheme has no kernel. A call returns the members'
    outputs, views of one [.., ΣN] result; with out_dtype FP32 each equals `forward_f32`'s.
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None, scheme: str,
                 sizes: list[int]):
        self.weight, self.scale, self.scheme, self.sizes = weight, scale, scheme, sizes

    @classmethod
    def fuse(cls, linears: list[Linear]) -> "FusedProjection | None":
        first = linears[0]
        if len(linears) < 2 or first.scheme not in _KERNEL_SCHEMES or any(
                m.scheme != first.scheme or m.in_features != first.in_features
                or m.weight.dtype != first.weight.dtype for m in linears) \
                or first.weight.dtype == torch.float32:
            return None
        weight = torch.cat([m.weight for m in linears])
        scale = torch.cat([m.scale for m in linears]) if first.scale is not None else None
        sizes, lo = [], 0
        for m in linears:                                  # members become views: no copy kept
            n = m.weight.shape[0]
            m.weight = weight[lo:lo + n]
            if scale is not None:
                m.scale = scale[lo:lo + n]
            sizes.append(n)
            lo += n
        return cls(weight, scale, first.scheme, sizes)

    def joint(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """x [.., K] bf16 (the kernel's activations) -> the members' outputs side by side
        [.., ΣN] (one launch)."""
        from backfit.runtime.kernels.linear import linear
        return linear(x, self.weight, self.scale, self.scheme, out_dtype=out_dtype)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16):
        return self.joint(x, out_dtype).split(self.sizes, dim=-1)


class ColumnParallelLinear(Linear):
    """Output dim split across ranks: y_local = x @ W_r^T, [.., out/tp]; no communication."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, get_tp_info().shard(out_features, "output dim"))


class RowParallelLinear(Linear):
    """Input dim split across ranks: y = Σ_r x_r @ W_r^T (all-reduce unless reduce=False).

    reduce=False lets a caller sum several partial products (MoE experts) before one all-reduce.
    """

    def __init__(self, in_features: int, out_features: int, reduce: bool = True):
        super().__init__(get_tp_info().shard(in_features, "input dim"), out_features)
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return all_reduce(y) if self.reduce else y


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab/tp, dim] per rank; ids outside this rank's range give 0, then all-reduce."""

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        tp = get_tp_info()
        self.part = tp.shard(vocab_size, "vocab_size")
        self.start = tp.rank * self.part
        self.register_buffer("weight", torch.empty(self.part, dim, dtype=dtype))

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if get_tp_info().size == 1:          # 2 launches in the decode graph instead of 7
            return self.weight[ids.clamp(0, self.part - 1)].to(dtype)  # [T, dim]
        local = ids - self.start
        outside = (local < 0) | (local >= self.part)
        e = self.weight[local.clamp(0, self.part - 1)].to(dtype)       # [T, dim]
        return all_reduce(e.masked_fill(outside[:, None], 0))

    def streams(self, ids: torch.Tensor, dtype: torch.dtype, S: int) -> torch.Tensor:
        """The embedding as the S mHC streams [T, S, dim] (S plain copies); on the triton path
        one launch (kernels.pointwise.embed_streams) for clamp, gather and repeat at tp 1, and at
        tp > 1 one for the shard's gather + mask, then the all-reduce and one copy."""
        if kernel_path(self.weight):
            from backfit.runtime.kernels.pointwise import embed_streams
            if get_tp_info().size == 1:
                return embed_streams(self.weight, ids, S, dtype)
            e = all_reduce(embed_streams(self.weight, ids, 1, dtype, start=self.start))
            return e.expand(-1, S, -1).contiguous()        # [T, 1, d] summed, then S copies
        return self(ids, dtype)[:, None, :].repeat(1, S, 1)


class ParallelHead(nn.Module):
    """LM head, vocab rows split: logits_r = h @ W_r^T in FP32, all-gathered to [T, vocab]."""

    def __init__(self, dim: int, vocab_size: int, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        part = get_tp_info().shard(vocab_size, "vocab_size")
        self.register_buffer("weight", torch.empty(part, dim, dtype=dtype))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # FP32 logits as in the reference (dsv4-model.md 5.6): small logit gaps survive
        if get_kernel_backend() == "triton" and h.dtype == torch.bfloat16 and _on_gpu(h) \
                and self.weight.dtype == torch.bfloat16:
            # a16 kernel on the BF16 weight, FP32 accumulate and output: no 1 GB FP32 upcast
            from backfit.runtime.kernels.linear import linear
            logits = linear(h, self.weight, None, "bf16", out_dtype=torch.float32)
            return all_gather(logits, dim=-1)
        return all_gather(F.linear(h.float(), self.weight.float()), dim=-1)


class RMSNorm(nn.Module):
    """y = w ⊙ x·rsqrt(mean(x²)+eps), computed in FP32 with an FP32 weight, cast back to x.dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernel_path(x):                                             # one launch (kernels.rope_norm)
            from backfit.runtime.kernels.rope_norm import rms_norm
            return rms_norm(x, self.weight, self.eps)
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps) * self.weight
        return y.to(x.dtype)


def yarn_inv_freq(rope_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """Per-pair frequencies f_i [rope_dim/2] (float64); YaRN-interpolated when `scaling` is given.

    dsv4-model.md 5.4.3: ramp over pair index i between low=floor(..β_fast..) and
    high=ceil(..β_slow..); f' = f(1-ramp) + (f/factor)·ramp. No mscale (attention factor 1).
    """
    i = torch.arange(rope_dim // 2, dtype=torch.float64)
    f = base ** (-2 * i / rope_dim)
    if not scaling:
        return f
    factor = float(scaling["factor"])
    orig = float(scaling["original_max_position_embeddings"])

    def corr_dim(beta: float) -> float:
        return rope_dim * math.log(orig / (beta * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(float(scaling["beta_fast"]))), 0)
    high = min(math.ceil(corr_dim(float(scaling["beta_slow"]))), rope_dim - 1)
    if low == high:
        high += 0.001                                      # avoid a zero-width ramp
    ramp = ((i - low) / (high - low)).clamp(0, 1)
    return f * (1 - ramp) + (f / factor) * ramp


class Rotary(nn.Module):
    """Interleaved (GPT-J) RoPE on the LAST rope_dim dims: pairs (2i, 2i+1) rotate by pos·f_i."""

    def __init__(self, rope_dim: int, base: float, scaling: dict | None = None):
        super().__init__()
        self.rope_dim = rope_dim
        self.register_buffer("inv_freq", yarn_inv_freq(rope_dim, base, scaling), persistent=False)

    def cos_sin(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [n] int -> cos, sin [n, rope_dim/2] float32 (angles formed in float64)."""
        ang = pos.to(torch.float64)[:, None] * self.inv_freq.to(pos.device)[None]
        return ang.cos().float(), ang.sin().float()

    def forward(self, x: torch.Tensor, pos: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [n, ..., D] with pos [n]; returns a new tensor with the last rope_dim dims rotated."""
        if kernel_path(x):                                             # bit-equal, one launch
            from backfit.runtime.kernels.rope_norm import rope
            return rope(x, pos, self.inv_freq, self.rope_dim, inverse)
        cos, sin = self.cos_sin(pos)
        if inverse:
            sin = -sin
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
        cos, sin = cos.view(shape), sin.view(shape)
        r = self.rope_dim
        a, b = x[..., -r::2].float(), x[..., -r + 1::2].float()          # [n, ..., r/2] each
        rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        return torch.cat((x[..., :-r], rot.to(x.dtype)), dim=-1)
