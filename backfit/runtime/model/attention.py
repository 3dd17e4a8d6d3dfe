"""DeepSeek-V4 attention: MQA over one 512-d latent (K = V), window + compressed entries, sink.

dsv4-model.md 5.4. Per token x (after attn_norm):
  q  = wq_b(q_norm(wq_a x)) [H, D], unweighted per-head RMS, RoPE on the last R dims
  kv = kv_norm(wkv x) [D], RoPE on the last R dims       (one vector: key and value)
  keys = window (positions p-window+1 .. p) ∪ compressed entries (HCA: all complete ones;
         CSA: the indexer's top-k of the complete ones)
  o_h = Σ softmax-with-sink(q_h·k/√D) k ;  inverse RoPE on o by the query position
  out = wo_b(concat_g wo_a[g] o_g)         (grouped low-rank output, wo_a block-diagonal)
Heads (wq_b, sink, wo_a groups) are split across ranks; the latent KV and the compressors are
replicated; wo_b is row-parallel. Q/KV projections run on the whole batch; the attention core
reads the window and compressed entries and writes this batch's, nothing else: on the paged
pools with the Triton kernels (_kernels, all sequences at once), else per sequence in plain
torch against the layer cache's interface (model/attention_torch.py; runtime/state.py).
"""

from __future__ import annotations

import torch
from torch import nn

from backfit.config import ModelConfig
from backfit.runtime.batch import ForwardBatch
from backfit.runtime.distributed import all_reduce, get_tp_info
from backfit.runtime.kernels import get_kernel_backend, kernel_path
from backfit.runtime.layers import (ColumnParallelLinear, FusedProjection, Linear, RMSNorm,
                                    RowParallelLinear, Rotary)
from backfit.runtime.model import compressor as compressor_mod
from backfit.runtime.model.attention_decode import decode_step
from backfit.runtime.model.compressor import Compressor, HeadWeights, Indexer, ProjectedRows

__all__ = ["Attention", "WO_A_GEMV", "layer_rotary"]

# Decode batches on the triton path: the grouped wo_a as one block-diagonal GEMV (kernels.linear.
# gemv_grouped) at the shapes its table measured faster than the einsum (cuBLAS); False: einsum.
WO_A_GEMV = True
# Prefill / mixed batches on the triton path: the prefill attention's int32 positions and query
# blocks made once a forward (ForwardBatch.memo) and reused by every layer; False: every layer.
PREFILL_MEMO = True


def _paged(cache) -> bool:
    """The triton backend on the engine's paged pools (the kernels read them in place)."""
    return get_kernel_backend() == "triton" and hasattr(cache, "block_table")


def layer_rotary(cfg: ModelConfig, ratio: int) -> Rotary:
    """θ=rope_theta without YaRN on window-only layers; compress_rope_theta + YaRN otherwise."""
    if ratio == 0:
        return Rotary(cfg.rope_dim, cfg.rope_theta, None)
    return Rotary(cfg.rope_dim, cfg.compress_rope_theta, cfg.rope_scaling)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        tp = get_tp_info()
        self.cfg, self.ratio = cfg, ratio
        d, H, D = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.local_heads = tp.shard(H, "num_attention_heads")
        self.local_groups = tp.shard(cfg.o_groups, "o_groups")
        self.heads_per_group = H // cfg.o_groups
        self.window, self.scale, self.eps = cfg.sliding_window, D ** -0.5, cfg.rms_norm_eps
        self.q_chunk = 256            # queries per attention block (bounds prefill score memory)
        self.rope = layer_rotary(cfg, ratio)
        self.wq_a = Linear(d, cfg.q_lora_rank)                        # replicated
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = ColumnParallelLinear(cfg.q_lora_rank, H * D)      # by head
        self.wkv = Linear(d, D)                                       # single latent, replicated
        self.kv_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.register_buffer("attn_sink", torch.empty(self.local_heads, dtype=torch.float32))
        # wo_a [o_groups*o_lora, heads_per_group*D]: rows split by group; wo_b input split alike
        self.wo_a = ColumnParallelLinear(self.heads_per_group * D, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = RowParallelLinear(cfg.o_groups * cfg.o_lora_rank, d)
        self.compressor = (Compressor(d, D, ratio, ratio == 4, cfg.rms_norm_eps, self.rope)
                           if ratio else None)
        self.indexer = Indexer(cfg, self.rope) if ratio == 4 else None
        self.fused_a = self.fused_f32 = None          # FusedProjection (prepare_kernels)

    def prepare_kernels(self) -> None:
        """Post-load step of the triton path: the projections of x as two launches, wq_a|wkv
        (act dtype) and the compressors' wkv|wgate with the indexer's weights_proj (FP32 out)."""
        if self.fused_a is not None:
            return
        self.fused_a = FusedProjection.fuse([self.wq_a, self.wkv])
        f32 = []
        if self.compressor is not None:
            f32 += [self.compressor.wkv, self.compressor.wgate]
        if self.indexer is not None:
            f32 += [self.indexer.compressor.wkv, self.indexer.compressor.wgate,
                    self.indexer.weights_proj]
        self.fused_f32 = FusedProjection.fuse(f32) if f32 else None

    def _project(self, x: torch.Tensor, pos: torch.Tensor, decode_step: bool = False):
        """x [T, d] -> wq_a x, wkv x (act dtype), compressor (c, z), indexer compressor (c, z)
        and weights_proj x (bf16-rounded, FP32), the last three None where the layer has none.
        decode_step (the paged kernels' decode step follows) with fused projections and
        compressor.FUSED_DECODE: (c, z) are ProjectedRows (z without its ape row) and the weights
        a HeadWeights, both formed inside the decode step's compressor kernels."""
        return (*self._project_a(x), *self._project_f32(x, pos, decode_step))

    def _project_a(self, x: torch.Tensor):
        """x [T, d] -> (wq_a x, wkv x), act dtype (one fused launch on the kernel path)."""
        if kernel_path(x) and x.dtype == torch.bfloat16 and self.fused_a is not None:
            return self.fused_a(x)
        return self.wq_a(x), self.wkv(x)

    def _project_f32(self, x: torch.Tensor, pos: torch.Tensor, decode_step: bool = False):
        """x [T, d] -> _project's compressor rows, indexer compressor rows, weights_proj x."""
        fused = kernel_path(x) and x.dtype == torch.bfloat16
        comp = icomp = wraw = None
        if fused and self.fused_f32 is not None:
            out = self.fused_f32(x, torch.float32)
            defer = decode_step and compressor_mod.FUSED_DECODE      # ape, weights: in the kernel
            rows = ((lambda m, c, z: ProjectedRows(c, z)) if defer
                    else lambda m, c, z: m.with_ape(c, z, pos))
            comp = rows(self.compressor, out[0], out[1])
            if self.indexer is not None:
                icomp = rows(self.indexer.compressor, out[2], out[3])
                wraw = (HeadWeights(out[4], x.dtype, self.indexer.weight_scale) if defer
                        else out[4].to(x.dtype))                     # as weights_proj(x)
        else:
            if self.compressor is not None:
                comp = self.compressor.project(x, pos)
            if self.indexer is not None:
                icomp = self.indexer.compressor.project(x, pos)
                wraw = self.indexer.weights_proj(x)
        return comp, icomp, wraw

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        """x [T, d] (normed attention input) -> [T, d]; cache: this layer's, bound to the batch.
        The paged decode step (one token per sequence) has its own path (attention_decode); every
        other batch is post(core(pre(x))), the split runtime/prefill_graphs.py captures around
        (pre and post touch no cache and have shapes from T alone; core reads and writes it)."""
        if _paged(cache) and x.shape[0] == len(batch.seq_lens):
            return decode_step(self, x, batch, cache)
        pos = batch.positions
        return self.post(self.core(self.pre(x, pos), batch, cache), pos, x.dtype)

    def pre(self, x: torch.Tensor, pos: torch.Tensor) -> tuple:
        """Prefill / mixed batches, before the cache: x [T, d], pos [T] -> (q [T, Hl, D] normed
        and rotated, kv [T, D] normed and rotated, comp (c, z) or None, icomp (c, z) or None,
        qI [T, Hl, 128] or None, wI [T, Hl] or None): tensors of T rows, nothing else."""
        T, Hl, D = x.shape[0], self.local_heads, self.cfg.head_dim
        qa, kvx, comp, icomp, wraw = self._project(x, pos)
        qr = self.q_norm(qa)                                          # [T, q_lora]
        q, kv = self._q_kv(self.wq_b(qr).view(T, Hl, D), kvx, pos)
        qI = wI = None
        if self.indexer is not None:
            qI, wI = self.indexer.queries(qr, wraw, pos)
        return q, kv, comp, icomp, qI, wI

    def core(self, pre: tuple, batch: ForwardBatch, cache) -> torch.Tensor:
        """pre's tensors (T rows) -> o [T, Hl, D]: the compressors' updates, the attention over
        the cache and the chunks' kv stored in it. Paged pools on the triton path: o in the
        activation dtype, de-rotated (kernels; FP32 activations: FP32, rotated); else FP32,
        rotated (the torch loop, one sequence at a time)."""
        q, kv, comp, icomp, qI, wI = pre
        pos = batch.positions
        if _paged(cache):
            return self._kernels(q, kv, pos, batch, cache, comp,
                                 None if self.indexer is None else (qI, wI, icomp))
        from backfit.runtime.model.attention_torch import torch_core
        return torch_core(self, pre, batch, cache)

    def _q_kv(self, q: torch.Tensor, kvx: torch.Tensor, pos: torch.Tensor, kv=None):
        """q [T, Hl, D] (wq_b's output) -> per-head RMS + RoPE; kvx [T, D] -> kv_norm + RoPE,
        unless kv (made beside, KV_BESIDE) is given -> (q, kv) in q's dtype."""
        if kernel_path(q):              # norm + RoPE in one launch each (kernels.rope_norm)
            from backfit.runtime.kernels.rope_norm import rope
            r = self.rope
            q = rope(q, pos, r.inv_freq, r.rope_dim, norm=(None, self.eps))  # per-head RMS
            return q, (self._kv_rope(kvx, pos) if kv is None else kv)
        qf = q.float()
        q = (qf * torch.rsqrt(qf.square().mean(-1, keepdim=True) + self.eps)).to(q.dtype)
        return self.rope(q, pos), self.rope(self.kv_norm(kvx), pos)           # [T, Hl, D], [T, D]

    def kv(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [T, d] (normed attention input) -> its kv [T, D]: wkv, kv_norm, RoPE (as pre)."""
        kvx = self.wkv(x)
        if kernel_path(kvx):
            return self._kv_rope(kvx, pos)
        return self.rope(self.kv_norm(kvx), pos)

    def _kv_rope(self, kvx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Kernel path: RoPE(kv_norm(kvx)) [T, D] in one launch."""
        from backfit.runtime.kernels.rope_norm import rope
        r = self.rope
        return rope(kvx, pos, r.inv_freq, r.rope_dim, norm=(self.kv_norm.weight, self.kv_norm.eps))

    def post(self, o: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """o [T, Hl, D] FP32 -> inverse RoPE, grouped wo_a, wo_b -> [T, d]. An o already in
        `dtype` (not FP32) comes de-rotated from the kernels (decode_attention's out_rope; the
        prefill output's in-place inverse RoPE in _kernels). No cache: shapes from T alone."""
        T = o.shape[0]
        if o.dtype == torch.float32 and kernel_path(o):               # rounds to dtype inside
            from backfit.runtime.kernels.rope_norm import rope
            o = rope(o, pos, self.rope.inv_freq, self.rope.rope_dim, inverse=True, out_dtype=dtype)
        elif o.dtype == torch.float32:
            o = self.rope(o.to(dtype), pos, inverse=True)             # de-rotate by query position
        o = o.view(T, self.local_groups, self.heads_per_group * self.cfg.head_dim)  # g*hpg ..
        if self._wo_a_gemv(o):                                        # one launch, [T, Gl·o_lora]
            from backfit.runtime.kernels.linear import gemv_grouped
            return self.wo_b(gemv_grouped(o.flatten(1), self.wo_a.weight, self.cfg.o_lora_rank))
        wa = self.wo_a.dequantized(dtype).view(self.local_groups, self.cfg.o_lora_rank, -1)
        zg = torch.einsum("tgi,goi->tgo", o, wa)                      # [T, Gl, o_lora]
        return self.wo_b(zg.flatten(1))                               # all-reduce over ranks

    def _wo_a_gemv(self, o: torch.Tensor) -> bool:
        """wo_a takes gemv_grouped: kernel path, bf16 o and weight, a measured shape."""
        if not (WO_A_GEMV and kernel_path(o) and o.dtype == torch.bfloat16
                and self.wo_a.weight.dtype == torch.bfloat16 and self.wo_a.scheme == "bf16"):
            return False
        from backfit.runtime.kernels.linear import GEMV_MAX_M, gemv_lookup
        return o.shape[0] <= GEMV_MAX_M and gemv_lookup(
            o.shape[0], self.wo_a.weight.shape[0], o.shape[2], False, grouped=True) is not None

    def _decode_compress(self, mod: Compressor, kind: str, rows, head_w, cache, pos, dtype):
        """The decode step's batched compressor update (no host sync, CUDA graphs) of `kind`
        from rows (ProjectedRows: ape (and head_w) formed in the kernel, else (c, z))."""
        if isinstance(rows, ProjectedRows):
            mod.decode_update(cache, kind, rows.c, rows.z_raw, pos, dtype, ape_added=False,
                              head_w=head_w)
        elif rows is not None:
            mod.decode_update(cache, kind, rows[0], rows[1], pos, dtype)

    def _select(self, qI, wI, cache, pos, seq=None, q_rope=None) -> torch.Tensor:
        """CSA: the indexer's top-k entries per query over the paged index pool -> sel [T, k]
        (q_rope: qI unrotated, indexer_scores rotates it)."""
        from backfit.runtime.kernels.attention import indexer_scores, topk_select
        keys, _ = cache.entry_pool("index")
        sels = []
        for a in range(0, qI.shape[0], self.q_chunk):                 # bounds [n, NC] scores
            b = min(qI.shape[0], a + self.q_chunk)
            sc = indexer_scores(qI[a:b], wI[a:b], keys, cache.block_table(), pos[a:b],
                                None if seq is None else seq[a:b], q_rope=q_rope)
            sels.append(topk_select(all_reduce(sc), self.indexer.topk))
        return sels[0] if len(sels) == 1 else torch.cat(sels)

    def _kernels(self, q, kv, pos, batch: ForwardBatch, cache, comp, index, side=None,
                 kv_ready=None):
        """The attention core on the Triton kernels, reading the paged pools in place.

        Same order as the torch path: the compressors pool (and write) the entries this batch
        completes (all sequences at once in kernels, FUSED_PREFILL; else per sequence, torch),
        the kernels attend to ring positions before each chunk, the chunk's own kv in flight
        and the entries, then the chunks' kv go to the rings.
        Decode (one token per sequence) and chunked prefill / mixed batches. -> o [T, Hl, D]:
        FP32, or (BF16 activations) already de-rotated in the act dtype (post skips its RoPE).
        side: (events, sel) when forward queued the decode step's compressor update and the CSA
        selection on side streams (SIDE_STREAMS): waited for here, before the attention reads.
        kv_ready: the event of forward's kv chain (KV_BESIDE: kv normed, rotated and stored).
        """
        from backfit.runtime.kernels.attention import decode_attention
        T, lens = q.shape[0], batch.seq_lens
        decode = T == len(lens)
        seq = start = None
        if not decode:                        # per query: its sequence, its chunk's start
            seq, start = batch.token_seq_start
        if kv_ready is not None:
            torch.cuda.current_stream(q.device).wait_event(kv_ready)
        ring, ring_scale = cache.ring_pool()
        mode, ent, ent_scale, tables, sel = "window", None, None, None, None
        if comp is not None:
            if side is not None:              # queued beside the query path by forward
                for ev in side[0]:
                    torch.cuda.current_stream(q.device).wait_event(ev)
                sel = side[1]
            elif decode:                      # batched, no host sync (CUDA graphs)
                self._decode_compress(self.compressor, "comp", comp, None, cache, pos, q.dtype)
                if index is not None:
                    self._decode_compress(self.indexer.compressor, "index", index[2],
                                          index[1] if isinstance(index[1], HeadWeights) else
                                          None, cache, pos, q.dtype)
            elif self._fused_prefill(q):      # every sequence's chunk at once
                self.compressor.prefill_update(cache, "comp", *comp, pos, seq, start, q.dtype)
                if index is not None:
                    self.indexer.compressor.prefill_update(cache, "index", *index[2], pos, seq,
                                                           start, q.dtype)
            else:                             # one sequence at a time (the torch update)
                for s in batch.slices():
                    r = slice(s.lo, s.hi)
                    self.compressor.update(cache, s.index, "comp", comp[0][r], comp[1][r],
                                           s.start, q.dtype, read=False)
                    if index is not None:
                        self.indexer.compressor.update(cache, s.index, "index", index[2][0][r],
                                                       index[2][1][r], s.start, q.dtype,
                                                       read=False)
            mode, tables = "hca", cache.block_table()
            ent, ent_scale = cache.entry_pool("comp")
            if index is not None:                                     # CSA: indexer top-k
                sel = self._select(index[0], index[1], cache, pos, seq)
            if sel is not None:
                mode = "csa"
        args = (q, kv, pos, self.attn_sink, ring, ring_scale, cache.slot_ids(), self.window, mode,
                ent, ent_scale, tables, self.ratio, sel)
        if decode:          # bf16: de-rotated and rounded in the merge launch (post skips it)
            r = self.rope
            early = kv_ready is None and getattr(cache, "multi_row", False)
            if early:                     # rows sharing a slot read each other from the ring
                cache.write_window_tokens(pos, kv)
            o = decode_attention(*args, out_rope=None if q.dtype == torch.float32 else
                                 (r.inv_freq, r.rope_dim, q.dtype))
            if kv_ready is None and not early:                        # else stored beside
                cache.write_window_tokens(pos, kv)                    # after the kernel read it
        else:
            from backfit.runtime.kernels.attention import sparse_attention_prefill
            memo = batch.memo if PREFILL_MEMO else None
            img = batch.images                # image spans: bidirectional window (11.2)
            span = None if img is None else (img.span_lo, img.span_hi)
            if q.dtype == torch.float32:                              # post de-rotates
                o = sparse_attention_prefill(*args, seq=seq, start=start, memo=memo, span=span)
            else:              # stored in q.dtype, de-rotated in place (its last R lanes only)
                from backfit.runtime.kernels.rope_norm import rope
                o = rope(sparse_attention_prefill(*args, seq=seq, start=start, out_dtype=q.dtype,
                                                  memo=memo, span=span),
                         pos, self.rope.inv_freq, self.rope.rope_dim, inverse=True, inplace=True)
            if self._fused_prefill(q):
                cache.write_window_chunk(pos, kv)
            else:
                for s in batch.slices():
                    cache.write_window(s.index, pos[s.lo:s.hi], kv[s.lo:s.hi])
        return o

    @staticmethod
    def _fused_prefill(q: torch.Tensor) -> bool:
        """A prefill / mixed batch's cache updates as batched kernels (compressor.FUSED_PREFILL)."""
        return compressor_mod.FUSED_PREFILL and q.dtype in (torch.bfloat16, torch.float32)
