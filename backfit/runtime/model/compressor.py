"""KV compressors (HCA and CSA forms) and the lightning indexer, dsv4-model.md 5.4.5-5.4.7.

Compressor: learned gated pooling of m = ratio consecutive tokens into one entry.
  c_t = wkv·x_t,  z_t = wgate·x_t + ape[t mod m]     (FP32, weights upcast)
  HCA (ratio >= 8, coff 1): E_j = Σ_{t in block j} softmax_t(z_t) ⊙ c_t          (per channel)
  CSA (ratio 4,  coff 2):   rows are 2·D wide; entry j pools 8 slots: the first halves of
                            block j-1 and the second halves of block j (block -1 = weight 0)
  then E_j = norm(E_j), RoPE of its last dims at position j·m (the block's first token).
The QAT fake-quant epilogues (FP8 on the attention entries, Hadamard + FP4 on the indexer keys)
are not simulated (allowed by 5.10; without FP4 the Hadamard cancels in q·k).
Streaming: the cache keeps the unpooled rows (runtime/state.py), so any chunking gives the same
entries.
"""

from __future__ import annotations

import torch
from torch import nn

from backfit.config import ModelConfig
from backfit.runtime.distributed import all_reduce, get_tp_info
from backfit.runtime.kernels import kernel_path
from backfit.runtime.layers import ColumnParallelLinear, Linear, RMSNorm, Rotary

__all__ = ["Compressor", "Indexer", "ProjectedRows", "HeadWeights", "FUSED_DECODE",
           "FUSED_PREFILL", "ROWS_KERNEL"]

# The decode kernel path of Compressor.decode_update: True = one launch per compressor
# (kernels.cache.decode.compress_decode_fused: ape add, rows, pooling, cast, norm, RoPE, entry
# store); False = the previous chain (torch ape add, compress_decode, cast, rms_norm, rope,
# store_decode; ~10 launches). Same entries bit for bit either way.
FUSED_DECODE = True
# The kernel path of a prefill / mixed batch's compressor update: True = every sequence's chunk at
# once (Compressor.prefill_update: kernels.cache.prefill, two launches a compressor); False =
# `update` per sequence (torch ops). The same entries as FUSED_DECODE's kernel, token by token;
# the torch update's to FP32 rounding. H200, 43-layer TP-4 slice, a 512-token step through the
# prefill pieces: 136.0 -> 81.7 ms (profile_step.py, 2026-12-03).
FUSED_PREFILL = True
# A multi-row decode batch (a speculative verify: rows sharing a slot) stores its compressor rows
# before pooling: True = one kernels.cache.store_rows launch a compressor (ape added inside);
# False = PagedCache.write_rows_tokens' torch ops (~6 launches: modulo, gather, add, cast, two
# index-puts). The same bits either way.
ROWS_KERNEL = True


class ProjectedRows:
    """(c, z) of Attention's fused projection for the decode step (FUSED_DECODE): c and the raw
    z [B, width] FP32, ape[pos mod m] still to add; Compressor.decode_update(ape_added=False)
    adds it inside its kernel. A marker, not (c, z): z_raw is not the z that `update` takes."""

    def __init__(self, c: torch.Tensor, z_raw: torch.Tensor):
        self.c, self.z_raw = c, z_raw


class HeadWeights:
    """Indexer head weights w·weight_scale [T, Hl] FP32 from the fused projection's FP32
    weights_proj output, not yet rounded to the act dtype (FUSED_DECODE, the decode step): the
    indexer compressor's kernel forms them with no launch of their own (pending -> the kernel ->
    formed, in Compressor.decode_update(head_w=...)); where no kernel did, w[i] forms them on
    first use (torch: round, upcast, scale). Either way the same bits."""

    def __init__(self, raw: torch.Tensor, dtype: torch.dtype, scale: float):
        self.raw, self.dtype, self.scale, self._w = raw, dtype, scale, None

    def pending(self, dtype: torch.dtype) -> tuple[torch.Tensor, float] | None:
        """(raw [T, Hl] FP32, scale) for a kernel that rounds to `dtype` to form the weights;
        None where that kernel may not: formed already, or `dtype` is not theirs."""
        return None if self._w is not None or dtype != self.dtype else (self.raw, self.scale)

    def formed(self, w: torch.Tensor) -> None:
        """The kernel's result for pending()'s arguments: w [T, Hl] FP32, used from now on."""
        self._w = w

    def tensor(self) -> torch.Tensor:
        if self._w is None:
            self._w = self.raw.to(self.dtype).float() * self.scale
        return self._w

    def __getitem__(self, i) -> torch.Tensor:
        return self.tensor()[i]


class Compressor(nn.Module):
    """Pools `ratio` tokens into one head_dim entry; overlap=True is the CSA (coff=2) form."""

    def __init__(self, dim: int, head_dim: int, ratio: int, overlap: bool, eps: float, rope: Rotary):
        super().__init__()
        self.ratio, self.overlap, self.head_dim = ratio, overlap, head_dim
        width = (2 if overlap else 1) * head_dim
        self.wkv = Linear(dim, width)          # replicated: every rank pools the full entry
        self.wgate = Linear(dim, width)
        self.register_buffer("ape", torch.empty(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, eps)
        self.rope = rope                       # shared with the owning layer (not a checkpoint name)

    def project(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, dim] -> c, z [T, width] FP32 (z includes the absolute-position ape row)."""
        return self.with_ape(self.wkv.forward_f32(x), self.wgate.forward_f32(x), pos)

    def with_ape(self, c: torch.Tensor, z: torch.Tensor, pos: torch.Tensor):
        """(c, z) of the projections -> (c, z + ape[pos mod m])."""
        return c, z + self.ape[pos % self.ratio]

    def update(self, cache, i: int, kind: str, c: torch.Tensor, z: torch.Tensor, start: int,
               dtype: torch.dtype, read: bool = True) -> torch.Tensor | None:
        """Add sequence i's new rows c, z [n, width] (positions start..); -> entries [j1, D].

        Emits entry j for every block j that completes inside this chunk, reading the rows it
        needs from before the chunk (block j-1 for CSA, the incomplete block) from the cache.
        Returns all entries 0 .. j1-1 with j1 = (start+n) // ratio: what the chunk's queries see
        (read=False: None; the decode kernels read the pools in place).
        """
        m, D = self.ratio, self.head_dim
        back = 1 if self.overlap else 0                                # CSA also reads block j-1
        lo = max(0, (start // m - back) * m)                           # first row entry j0 needs
        old_c, old_z = cache.rows(i, kind, lo, start)
        rows_c, rows_z = torch.cat((old_c, c)), torch.cat((old_z, z))  # positions lo .. end-1
        end = start + c.shape[0]
        j0, j1 = start // m, end // m                                  # entries to emit: j0..j1-1
        if j1 > j0:
            b0 = lo // m                                               # block index of row 0
            nfull = (end - lo) // m
            bc = rows_c[:nfull * m].view(nfull, m, -1)                 # [blocks, m, width]
            bz = rows_z[:nfull * m].view(nfull, m, -1)
            if self.overlap:
                pad = 1 if b0 == 0 else 0                              # virtual block -1: weight 0
                if pad:
                    bc = torch.cat((bc.new_zeros(1, m, 2 * D), bc))
                    bz = torch.cat((bz.new_full((1, m, 2 * D), float("-inf")), bz))
                cur = slice(j0 - b0 + pad, j1 - b0 + pad)
                prev = slice(j0 - 1 - b0 + pad, j1 - 1 - b0 + pad)
                sc = torch.cat((bc[prev, :, :D], bc[cur, :, D:]), dim=1)   # [k, 2m, D]
                sz = torch.cat((bz[prev, :, :D], bz[cur, :, D:]), dim=1)
            else:
                sc, sz = bc[j0 - b0:j1 - b0], bz[j0 - b0:j1 - b0]          # [k, m, D]
            E = (torch.softmax(sz, dim=1) * sc).sum(dim=1)                 # softmax over slots
            E = self.norm(E.to(dtype))                                     # act dtype, as stored
            jpos = torch.arange(j0, j1, device=E.device) * m
            cache.write_entries(i, kind, j0, self.rope(E, jpos))           # at the block's first token
        keep_from = max(0, (end // m - back) * m)                      # what the next chunk reads
        cache.write_rows(i, kind, torch.arange(start, end, device=c.device), c, z, keep_from)
        return cache.entries(i, kind, j1) if read else None

    def prefill_update(self, cache, kind: str, c: torch.Tensor, z: torch.Tensor,
                       pos: torch.Tensor, seq: torch.Tensor, start: torch.Tensor,
                       dtype: torch.dtype) -> None:
        """`update(read=False)` for every sequence of a prefill or mixed batch at once, on the
        kernel path (FUSED_PREFILL, paged pools): c, z [T, width] FP32 (z with its ape row),
        pos / seq / start [T] (each row's position, sequence and chunk start) on the device.
        The entries the chunks complete, from the chunks' rows and the rings' older ones, then
        each sequence's last ring rows (kernels.cache.prefill: two launches, no host sync)."""
        from backfit.runtime.kernels.cache import compress_prefill, store_rows
        data, scale = cache.entry_pool(kind)
        ring_c, ring_z = cache.rows_pool(kind)
        compress_prefill(c, z, cache.entry_rows(kind), pos, seq, start, cache.slot_ids(), ring_c,
                         ring_z, self.norm.weight, self.norm.eps, self.rope.inv_freq,
                         self.rope.rope_dim, data, scale, cache.block_table(),
                         cache.scratch_block, self.ratio, self.overlap, self.head_dim, dtype)
        store_rows(c, z, *cache.chunk_rows(ring_c.shape[1]), ring_c, ring_z)

    def decode_update(self, cache, kind: str, c: torch.Tensor, z: torch.Tensor, pos: torch.Tensor,
                      dtype: torch.dtype, ape_added: bool = True,
                      head_w: HeadWeights | None = None) -> None:
        """Decode, one token per sequence (c, z [B, width] at positions pos [B] on the device):
        `update` for the whole batch without a host sync or a branch (CUDA-graph safe).
        ape_added=False: z is the raw projection, ape[pos mod m] is added here. head_w (the
        indexer's compressor): its weights are formed too, in the same launch when fused.

        Every row pools the m (CSA: 2m) rows ending at its position, as if it completed a block;
        entry j = pos // m is written only where (pos+1) % m == 0, the others go to the cache's
        scratch block. Same operations in the same order as `update`, so the same entries. On
        the triton backend it is one kernel (FUSED_DECODE; kernels.cache.decode, Triton's exp, so
        FP32 rounding away from the torch path), else rows + pooling, then cast, norm, RoPE and
        the entry store as separate launches (bit for bit the fused kernel's entries).
        """
        m, D = self.ratio, self.head_dim
        if getattr(cache, "multi_row", False) and kernel_path(c):   # rows sharing a slot: all
            self._store_rows(cache, kind, pos, c, z, ape_added)        # stored first, so no
        #                            pooling program reads a row before its store (each
        #                            program's own store then rewrites equal bits)
        if kernel_path(c) and FUSED_DECODE and dtype in (torch.bfloat16, torch.float32):
            from backfit.runtime.kernels.cache import compress_decode_fused
            data, scale = cache.entry_pool(kind)
            wI = compress_decode_fused(
                c, z, None if ape_added else self.ape, pos, cache.slot_ids(),
                *cache.rows_pool(kind), self.norm.weight, self.norm.eps, self.rope.inv_freq,
                self.rope.rope_dim, data, scale, cache.block_table(),
                cache.scratch_block, m, self.overlap, D, dtype,
                None if head_w is None else head_w.pending(dtype))
            if wI is not None:
                head_w.formed(wI)
            return
        if not ape_added:
            z = z + self.ape[pos % m]
        j = pos // m
        if kernel_path(c):          # 1 launch for rows + pooling
            from backfit.runtime.kernels.cache import compress_decode
            E = compress_decode(c, z, pos, cache.slot_ids(), *cache.rows_pool(kind), m,
                                self.overlap, D)
            cache.write_entries_tokens(kind, pos, self.rope(self.norm(E.to(dtype)), j * m))
            return
        cache.write_rows_tokens(kind, pos, c, z)
        sc, sz = cache.rows_tokens(kind, pos, 2 * m if self.overlap else m)   # [B, n, width]
        if self.overlap:                   # block j-1's first halves, then block j's second
            sc = torch.cat((sc[:, :m, :D], sc[:, m:, D:]), dim=1)             # [B, 2m, D]
            sz = torch.cat((sz[:, :m, :D], sz[:, m:, D:]), dim=1)
            virtual = (pos < m)[:, None] & (torch.arange(2 * m, device=pos.device) < m)[None]
            sc = sc.masked_fill(virtual[..., None], 0.0)                       # block -1: weight 0
            sz = sz.masked_fill(virtual[..., None], float("-inf"))
        E = (torch.softmax(sz, dim=1) * sc).sum(dim=1)                          # [B, D]
        E = self.rope(self.norm(E.to(dtype)), j * m)
        cache.write_entries_tokens(kind, pos, E)

    def _store_rows(self, cache, kind: str, pos: torch.Tensor, c: torch.Tensor, z: torch.Tensor,
                    ape_added: bool) -> None:
        """A multi-row decode batch's rows c, z [B, width] FP32 (z + ape[pos mod m] unless
        ape_added) into the slots' compressor rings: one kernels.cache.store_rows launch
        (ROWS_KERNEL) or the torch ops of PagedCache.write_rows_tokens (the same bits)."""
        if ROWS_KERNEL:
            from backfit.runtime.kernels.cache import store_rows
            store_rows(c, z, None, pos, cache.slot_ids(), *cache.rows_pool(kind),
                       ape=None if ape_added else self.ape)
            return
        cache.write_rows_tokens(kind, pos, c, z if ape_added else z + self.ape[pos % self.ratio])


class Indexer(nn.Module):
    """Lightning indexer: score_j = Σ_h w_h · ReLU(qI_h · K_j), top-k compressed entries per query.

    Heads are split across ranks (wq_b, weights_proj by head), so partial scores are all-reduced
    before the top-k; the indexer's own CSA compressor is replicated.
    """

    def __init__(self, cfg: ModelConfig, rope: Rotary):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.local_heads = get_tp_info().shard(self.n_heads, "index_n_heads")
        self.wq_b = ColumnParallelLinear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = ColumnParallelLinear(cfg.hidden_size, self.n_heads)
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, 4, True, cfg.rms_norm_eps, rope)
        self.rope = rope
        # 128^-0.5 (q·k scale) · 64^-0.5 (average over the GLOBAL head count)
        self.weight_scale = self.head_dim ** -0.5 * self.n_heads ** -0.5

    def queries(self, qr: torch.Tensor, w: torch.Tensor, pos: torch.Tensor, rotate: bool = True):
        """qr [T, q_lora], w = weights_proj(x) [T, Hl] -> qI [T, Hl, 128] (rotated; FP32, on the
        kernel path the act dtype: kernels.attention.indexer reads it so, no cast launches), head
        weights [T, Hl] FP32 (w a HeadWeights: itself, formed on use). rotate False (kernel
        path): qI as wq_b made it, for indexer_scores(q_rope=) to rotate."""
        qI = self.wq_b(qr).view(qr.shape[0], self.local_heads, self.head_dim)
        if rotate or not kernel_path(qI):
            qI = self.rope(qI, pos)
        if not kernel_path(qI):
            qI = qI.float()
        if isinstance(w, HeadWeights):                  # formed later (decode: in a kernel)
            return qI, w
        return qI, w.float() * self.weight_scale

    def select(self, qI: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor):
        """qI [n, Hl, 128], w [n, Hl], keys [E, 128], valid [n, E] -> (sel [n, k], ok [n, k]).

        k = min(index_topk, E); a selected slot is usable only where ok (fewer valid than k).
        """
        dots = torch.einsum("nhd,ed->nhe", qI.float(), keys.float()).relu()          # [n, Hl, E]
        score = all_reduce(torch.einsum("nh,nhe->ne", w, dots))            # sum over ALL heads
        score = score.masked_fill(~valid, float("-inf"))
        k = min(self.topk, keys.shape[0])
        sel = score.topk(k, dim=-1).indices                                # [n, k]
        return sel, valid.gather(1, sel)
