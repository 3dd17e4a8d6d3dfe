"""Small per-token kernels, one launch each instead of several torch ops, SM80-safe, no host
sync: the MoE block's (runtime/model/moe.py on the triton backend) and the embedding's.

  swiglu(gu, limit)   gu [T, 2I] act dtype = the fused gate|up projection ->
                      h = silu(min(g, L)) · clamp(u, ±L) [T, I] in gu.dtype (FP32 math; the
                      shared expert: no routing weight)
  route(logits, ...)  the router after its FP32 projection: s = sqrt(softplus(logits)), experts
                      = top-k of s + bias (or tid2eid[token] on hash layers; Vision-Exp image
                      rows, token >= vocab: top-k of s + bias_vl), weights
                      s[expert] / Σ s[expert] · routed_scaling_factor -> ids [T, k] int64,
                      weights [T, k] FP32; best first, ties to the lower expert id.
  moe_combine(out, k, shared, dtype)   the routed experts' per-pair outputs out [T·k, D] bf16
                      -> y [T, D] = Σ_j out[t·k+j] (FP32, j in order) + shared[t] (FP32 of the
                      bf16 shared-expert output), stored in `dtype` (bf16 at tp 1, FP32 before
                      the all-reduce): one launch for torch's cast, sum, add (and cast back).
  combine_later(...)  moe_combine's inputs checked and kept unsummed (PairSum): the consumer,
                      kernels.mhc.decode.hc_post, sums them in the same order in its own launch.
  embed_streams(weight, ids, S, dtype)   the tp-1 embedding straight into the mHC streams:
                      X [T, S, d] = weight[clamp(ids, 0, V-1)] in `dtype`, S equal copies (torch:
                      clamp, gather, repeat = 3 launches); exact (a copy). start=: one rank's
                      vocab shard (rows outside it 0, for the all-reduce; torch: 7 launches).
  fill_placeholders_(tokens, prev)   the overlapped engine step's decode tokens: every
                      placeholder -1 - r of tokens [T] (int32 or int64, any stride) becomes
                      prev[r] (the last step's sampled ids, still on the device), in place: one
                      launch (torch: 6).
Triton's exp/log differ from torch's in the last bits: FP32 rounding, and a top-k order that
can differ from torch's only between scores equal to FP32 rounding.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["swiglu", "route", "moe_combine", "combine_later", "PairSum", "embed_streams"]


@triton.jit
def _swiglu_kernel(GU, H, I, stride_gu, LIMIT: tl.constexpr, BI: tl.constexpr):
    t, ib = tl.program_id(0).to(tl.int64), tl.program_id(1)
    c = ib * BI + tl.arange(0, BI)
    ok = c < I
    g = tl.load(GU + t * stride_gu + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + t * stride_gu + I + c, mask=ok, other=0.0).to(tl.float32)
    g = tl.minimum(g, LIMIT)                                     # gate: upper clamp only
    u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)                 # up: both sides
    tl.store(H + t * I + c, (g * tl.sigmoid(g) * u).to(H.dtype.element_ty), mask=ok)


_KEY_MIN = tl.constexpr(-(2 ** 63))     # below every top-k key: taken or not an expert


@triton.jit
def _route_row(LOGITS, BIAS, TID2EID, TOKENS, IDX, W, E, scale, t, K: tl.constexpr,
               HASH: tl.constexpr, BE: tl.constexpr, KP: tl.constexpr, CG: tl.constexpr,
               BIAS_VL, V, VL: tl.constexpr):
    """Token t: E router logits -> K expert ids (best first) and normalised weights. CG: the
    logits are read from L2 (written by other programs of the same launch: kernels.router).
    VL (Vision-Exp): a token id >= V is an image-block row: it selects the top-k of s + BIAS_VL
    (on a hash layer too, whose tid2eid it never reads; dsv4-vision.md 11.1)."""
    e = tl.arange(0, BE)
    ok = e < E
    if CG:
        x = tl.load(LOGITS + t * E + e, mask=ok, other=0.0, cache_modifier=".cg")
    else:
        x = tl.load(LOGITS + t * E + e, mask=ok, other=0.0)
    y = tl.exp(-tl.abs(x))                                       # softplus = max(x,0)+log1p(y)
    u = 1.0 + y
    log1p = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))   # Goldberg: accurate for tiny y
    sp = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p)       # torch's threshold 20
    s = tl.sqrt(sp)                                              # [BE] sqrt(softplus)
    j = tl.arange(0, KP)
    ids = tl.zeros((KP,), tl.int64)
    if HASH:
        tok = tl.load(TOKENS + t)
        if VL:
            tok = tl.where(tok >= V, 0, tok)                     # never index with a block id
        ids = tl.load(TID2EID + tok * K + j, mask=j < K, other=0).to(tl.int64)
    if (not HASH) or VL:
        if HASH:
            sb = s
        else:
            sb = s + tl.load(BIAS + e, mask=ok, other=0.0)
        if VL:
            img = tl.load(TOKENS + t) >= V
            sb = tl.where(img, s + tl.load(BIAS_VL + e, mask=ok, other=0.0), sb)
        sel = _topk_ids(sb, e, ok, j, BE, K, KP)
        if HASH:
            ids = tl.where(img, sel, ids)
        else:
            ids = sel
    w = tl.sum(tl.where(e[None, :] == ids[:, None], s[None, :], 0.0), axis=1)   # s[ids], [KP]
    w = tl.where(j < K, w, 0.0)
    w = w / tl.sum(w, axis=0) * scale
    tl.store(IDX + t * K + j, ids, mask=j < K)
    tl.store(W + t * K + j, w, mask=j < K)


@triton.jit
def _topk_ids(sb, e, ok, j, BE: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):
    """The K best of the selection scores sb [BE] (ok: real experts) as ids [KP], best first:
    K rounds of argmax, one reduction each, over the scores' bits in signed-integer order
    (+ 0.0: -0 as +0, which compare equal) and BE-1-e, so the max key is the best score and,
    among equal scores, the lowest id."""
    b = (sb + 0.0).to(tl.int32, bitcast=True)
    b = b ^ ((b >> 31) & 0x7FFFFFFF)                             # float order as int order
    key = tl.where(ok, (b.to(tl.int64) << 32) | (BE - 1 - e), _KEY_MIN)
    ids = tl.zeros((KP,), tl.int64)
    for i in tl.static_range(K):
        pick = BE - 1 - (tl.max(key, axis=0) & 0xFFFFFFFF)
        ids = tl.where(j == i, pick.to(tl.int64), ids)
        key = tl.where(e == pick, _KEY_MIN, key)
    return ids


@triton.jit
def _route_kernel(LOGITS, BIAS, TID2EID, TOKENS, IDX, W, E, scale, BIAS_VL, V,
                  K: tl.constexpr, HASH: tl.constexpr, BE: tl.constexpr, KP: tl.constexpr,
                  VL: tl.constexpr):
    _route_row(LOGITS, BIAS, TID2EID, TOKENS, IDX, W, E, scale, tl.program_id(0).to(tl.int64),
               K, HASH, BE, KP, False, BIAS_VL, V, VL)


@triton.jit
def _pair_acc(OUT, SH, t, c, ok, D, K: tl.constexpr, SHARED: tl.constexpr):
    """Token t's columns c (ok) of the combine in FP32: Σ_j OUT[t·K + j] with j in order (a fixed
    sum), then SH[t] + that; moe_combine's kernel and mhc_decode's hc_post (PairSum) share it."""
    acc = tl.load(OUT + t * K * D + c, mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(1, K):
        acc += tl.load(OUT + (t * K + j) * D + c, mask=ok, other=0.0).to(tl.float32)
    if SHARED:
        acc = tl.load(SH + t * D + c, mask=ok, other=0.0).to(tl.float32) + acc
    return acc


@triton.jit
def _combine_kernel(OUT, SH, Y, D, K: tl.constexpr, SHARED: tl.constexpr, BD: tl.constexpr):
    t, db = tl.program_id(0).to(tl.int64), tl.program_id(1)
    c = db * BD + tl.arange(0, BD)
    ok = c < D
    acc = _pair_acc(OUT, SH, t, c, ok, D, K, SHARED)
    tl.store(Y + t * D + c, acc.to(Y.dtype.element_ty), mask=ok)


class PairSum(NamedTuple):
    """moe_combine(out, k, shared, dtype) not launched yet (combine_later)."""
    out: torch.Tensor                    # [T·k, D] bf16, contiguous
    k: int
    shared: torch.Tensor | None          # [T, D] contiguous, or None
    dtype: torch.dtype                   # the sum's rounding (moe_combine's output dtype)


def _check_combine(out: torch.Tensor, k: int, shared: torch.Tensor | None) -> tuple[int, int]:
    P, D = out.shape
    if k < 1 or P % k or not out.is_contiguous():
        raise ValueError(f"moe_combine: contiguous out [T*k, D] with k={k}, got {list(out.shape)}")
    T = P // k
    if shared is not None and (tuple(shared.shape) != (T, D) or not shared.is_contiguous()):
        raise ValueError(f"moe_combine: shared must be contiguous [{T}, {D}], "
                         f"got {list(shared.shape)}")
    return T, D


def combine_later(out: torch.Tensor, k: int, shared: torch.Tensor | None = None,
                  dtype: torch.dtype = torch.float32) -> PairSum:
    """moe_combine's arguments, checked, as a PairSum for kernels.mhc.decode.hc_post."""
    _check_combine(out, k, shared)
    return PairSum(out, k, shared, dtype)


def moe_combine(out: torch.Tensor, k: int, shared: torch.Tensor | None = None,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """out [T·k, D] bf16 pairs -> [T, D] `dtype`: Σ_j out[t·k + j] (+ shared [T, D]) in FP32."""
    T, D = _check_combine(out, k, shared)
    y = torch.empty(T, D, dtype=dtype, device=out.device)
    if T:
        BD = min(1024, triton.next_power_of_2(D))
        _combine_kernel[(T, triton.cdiv(D, BD))](out, shared if shared is not None else out, y,
                                                 D, K=k, SHARED=shared is not None, BD=BD,
                                                 num_warps=4)
    return y


def swiglu(gu: torch.Tensor, limit: float) -> torch.Tensor:
    """gu [T, 2I] (gate then up, unit stride in the last dim) -> h [T, I] in gu.dtype."""
    T, I2 = gu.shape
    if I2 % 2 or gu.stride(1) != 1:
        raise ValueError(f"swiglu: gu [T, 2I] with unit stride, got {list(gu.shape)} {gu.stride()}")
    I = I2 // 2
    h = torch.empty(T, I, dtype=gu.dtype, device=gu.device)
    if T:
        BI = min(1024, triton.next_power_of_2(I))
        _swiglu_kernel[(T, triton.cdiv(I, BI))](gu, h, I, gu.stride(0), LIMIT=float(limit), BI=BI,
                                                num_warps=4)
    return h


def route(logits: torch.Tensor, k: int, scale: float, bias: torch.Tensor | None = None,
          tid2eid: torch.Tensor | None = None, tokens: torch.Tensor | None = None,
          bias_vl: torch.Tensor | None = None, vocab: int = 0):
    """logits [T, E] FP32 (x·Gᵀ) -> (ids [T, k] int64, weights [T, k] FP32): bias [E] (scored
    routing) or tid2eid [vocab, k] with tokens [T] (hash routing). bias_vl [E] FP32 with tokens
    (Vision-Exp): rows whose token id is >= vocab select the top-k of s + bias_vl instead."""
    T, E = logits.shape
    if logits.dtype != torch.float32 or (bias is None) == (tid2eid is None) \
            or (tid2eid is not None and (tokens is None or tid2eid.shape[1] != k)) \
            or (bias_vl is not None and (tokens is None or bias_vl.shape != (E,) or vocab < 1)):
        raise ValueError("route: FP32 logits [T, E] and either bias [E] or tid2eid [vocab, k] "
                         "with tokens [T] (bias_vl [E]: with tokens and vocab)")
    logits = logits.contiguous()
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    w = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    if T:
        hashed, vl = tid2eid is not None, bias_vl is not None
        _route_kernel[(T,)](logits, bias if not hashed else logits,
                            tid2eid.contiguous() if hashed else ids,
                            tokens.contiguous() if hashed or vl else ids, ids, w, E, float(scale),
                            bias_vl if vl else logits, int(vocab), K=k, HASH=hashed,
                            BE=triton.next_power_of_2(E), KP=triton.next_power_of_2(k), VL=vl,
                            num_warps=4)
    return ids, w


@triton.jit
def _embed_kernel(W, IDS, X, V, D, start, S: tl.constexpr, BD: tl.constexpr,
                  SHARD: tl.constexpr = False):
    """Token t, columns [db·BD, +BD): S copies of row clamp(id, 0, V-1); SHARD (a vocab shard
    from row `start`): row id - start, zeros when outside [0, V) (VocabParallelEmbedding)."""
    t, db = tl.program_id(0).to(tl.int64), tl.program_id(1)
    local = tl.load(IDS + t).to(tl.int64) - start
    row = tl.minimum(tl.maximum(local, 0), V - 1)                       # ids.clamp(0, V-1)
    c = db * BD + tl.arange(0, BD)
    ok = c < D
    e = tl.load(W + row * D + c, mask=ok, other=0.0)
    if SHARD:
        e = tl.where((local >= 0) & (local < V), e, 0.0)
    e = e.to(X.dtype.element_ty)
    for s in tl.static_range(S):
        tl.store(X + (t * S + s) * D + c, e, mask=ok)


def embed_streams(weight: torch.Tensor, ids: torch.Tensor, S: int,
                  dtype: torch.dtype, start: int | None = None) -> torch.Tensor:
    """weight [V, d] (contiguous), ids [T] integer -> X [T, S, d] in `dtype`: S copies of the
    rows weight[clamp(ids, 0, V-1)]. start (a rank's vocab shard holding rows start..start+V-1):
    rows weight[ids - start], zeros for ids outside the shard (before the all-reduce)."""
    if weight.dim() != 2 or not weight.is_contiguous() or ids.dim() != 1 or S < 1 \
            or ids.dtype.is_floating_point:
        raise ValueError(f"embed_streams: contiguous weight [V, d], integer ids [T], S >= 1; got "
                         f"{list(weight.shape)}, {ids.dtype}{list(ids.shape)}, S={S}")
    V, D = weight.shape
    X = torch.empty(ids.shape[0], S, D, dtype=dtype, device=weight.device)
    if ids.shape[0]:
        BD = min(1024, triton.next_power_of_2(D))
        _embed_kernel[(ids.shape[0], triton.cdiv(D, BD))](weight, ids.contiguous(), X, V, D,
                                                          start or 0, S=S, BD=BD,
                                                          SHARD=start is not None, num_warps=4)
    return X


@triton.jit
def _placeholder_kernel(T, stride, PREV, n, BLOCK: tl.constexpr):
    """tokens[i·stride] = prev[-1 - t] where t < 0 (t: the token there), else unchanged."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    t = tl.load(T + i * stride, mask=ok, other=0)
    hole = t < 0
    v = tl.load(PREV + tl.where(hole, -1 - t, 0), mask=ok & hole, other=0)
    tl.store(T + i * stride, tl.where(hole, v.to(t.dtype), t), mask=ok & hole)


def fill_placeholders_(tokens: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """tokens [T] int32/int64 (a strided view is fine), prev [R] integer on the same device:
    every tokens[i] = -1 - r becomes prev[r] (r < R: the caller's contract), in place."""
    if tokens.dim() != 1 or prev.dim() != 1 or tokens.dtype not in (torch.int32, torch.int64) \
            or prev.dtype.is_floating_point or tokens.device != prev.device:
        raise ValueError(f"fill_placeholders_: int tokens [T] and integer prev [R] on one "
                         f"device; got {tokens.dtype}{list(tokens.shape)} on {tokens.device}, "
                         f"{prev.dtype}{list(prev.shape)} on {prev.device}")
    n = tokens.shape[0]
    if n:
        BLOCK = 256
        _placeholder_kernel[(triton.cdiv(n, BLOCK),)](tokens, tokens.stride(0), prev, n,
                                                      BLOCK=BLOCK, num_warps=2)
    return tokens
