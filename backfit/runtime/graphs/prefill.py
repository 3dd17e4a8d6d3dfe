"""Piecewise CUDA graphs of prefill and mixed steps (docs/ENGINE.md §4): the cache-free parts of
the forward captured per padded token count, the attention core between them run eagerly.

A prefill chunk or a mixed step (decode rows beside a chunk) runs the Block as
attn_in -> attn.core -> attn_out (model/transformer.py). attn_in / attn_out and the embedding
touch no cache and take their shapes from the token count alone, so for a padded count P in
`sizes` the forward is L + 1 graphs ("pieces") with the L attention cores between them:

  piece 0        embed(tokens) -> X; layer 0's attn_in(X) -> (post, M), pre
  piece i        layer i-1's attn_out(X, o, post, M) -> X; layer i's attn_in(X) -> ...
  piece L        layer L-1's attn_out -> the streams X [P, S, d] (the head runs eagerly after)
  core i         eager, on the real T rows: attn.core(pre[:T], batch, cache) -> o [T, Hl, D],
                 copied into the static o rows the next piece reads

The core keeps the work whose shapes depend on the step's sequences (compressor updates, batched
over the sequences by kernels.cache.prefill; the indexer's top-k, the prefill attention kernel,
the ring stores); the pieces hold the projections, mHC, the MoE and the all-reduces.

  static input   tokens and positions int64 [2, Pmax], one copy from a pinned twin a step;
                 rows T..P-1 are padding (token 0 at position 0): their rows of every piece
                 compute on what is there and are never read (every op of a piece is row-wise)
  static o       [Pmax, Hl, D], written by each core (rows < T), read by the next piece
  static pre     each piece copies its `pre` tensors into buffers shared by all layers (one per
                 tuple position, shape and dtype), so a piece's own outputs die with the next
                 piece's capture and the pool stays one layer deep
  memory         every piece of every size draws on one pool, sizes captured largest first

Replay order is capture order on one stream (piece 0, core 0, piece 1, ...), which is what
lets a later piece reuse an earlier piece's freed blocks. At tp > 1 the pieces hold the NCCL
all-reduces: every rank captures the same sizes and replays the same pieces for a step (the
step is broadcast). graphs=False runs the same pieces eagerly on the padded buffers (the CPU
test of the split and the padding, and the reference `check` replays against).
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch

from backfit.runtime.batch import ForwardBatch, fill_placeholders_
from backfit.runtime.cache.budget import PREFILL_GRAPH_MIN, prefill_sizes
from backfit.runtime.graphs.decode import capture_graph, mismatch, warm_up

__all__ = ["PrefillGraphs"]


def _rows(t, T: int):
    """pre's tensors (nested tuples, None) -> the same with each tensor's first T rows."""
    if t is None:
        return None
    if isinstance(t, tuple):
        return tuple(_rows(x, T) for x in t)
    return t[:T]


class PrefillGraphs:
    """The pieces of `model`'s prefill forward for padded counts prefill_sizes(max_tokens)."""

    def __init__(self, model, max_tokens: int, device: torch.device, graphs: bool = True,
                 keep_streams: bool = False):
        """keep_streams (backfit verify): every piece's streams stay addressable, each step's
        per-layer outputs land in self.streams (L tensors [T, S, d]); costs a pool L + 1
        streams deep instead of one."""
        self.model, self.device, self.use_graphs = model, torch.device(device), graphs
        self.keep_streams, self.streams = keep_streams, None
        self.sizes = prefill_sizes(max_tokens)
        if not self.sizes:
            raise ValueError(f"prefill graphs need a token budget of at least "
                             f"{PREFILL_GRAPH_MIN}, got {max_tokens}")
        Pm, a, cuda = self.sizes[-1], model.layers[0].attn, self.device.type == "cuda"
        self.host = torch.zeros((2, Pm), dtype=torch.int64, pin_memory=cuda)
        self.stage = self.host.to(self.device)                 # tokens, positions
        self.copied = torch.cuda.Event() if cuda else None     # the last copy out of self.host
        from backfit.runtime.kernels import get_kernel_backend
        # attn.core's o: the activation dtype on the triton path (de-rotated), else FP32
        o_dtype = model.dtype if get_kernel_backend() == "triton" else torch.float32
        self.o = torch.zeros((Pm, a.local_heads, model.cfg.head_dim), dtype=o_dtype,
                             device=self.device)
        self._pre_bufs: dict[tuple, torch.Tensor] = {}
        # DSpark's taps (model.tap_layers): each piece after a tapped layer writes the mean over
        # its streams into its columns, inside the graph -> [Pmax, n·d] (model.hidden's taps)
        n_taps = len(model.tap_layers)
        self.taps = torch.zeros((Pm, n_taps * model.cfg.hidden_size), dtype=model.dtype,
                                device=self.device) if n_taps else None
        # size -> per piece (graph, its pre views (the last piece: its streams), its streams
        # where keep_streams else None)
        self.pieces: dict[int, list[tuple]] = {}
        self.capture_s, self.pool_bytes, self.steps = 0.0, 0, 0

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def size_for(self, T: int) -> int | None:
        """The smallest size >= T (None: the step runs the plain eager forward)."""
        return next((P for P in self.sizes if P >= T), None)

    # -- one piece -------------------------------------------------------------------------
    def _static_pre(self, pre: tuple, P: int) -> tuple:
        """pre's tensors copied into the shared buffers (one per tuple position, trailing shape
        and dtype; Pmax rows) -> views of their first P rows."""
        def keep(t, key):
            if t is None:
                return None
            if isinstance(t, tuple):
                return tuple(keep(x, key + (j,)) for j, x in enumerate(t))
            k = key + (tuple(t.shape[1:]), t.dtype)
            if k not in self._pre_bufs:
                self._pre_bufs[k] = torch.zeros((self.max_tokens, *t.shape[1:]), dtype=t.dtype,
                                                device=t.device)
            return self._pre_bufs[k][:P].copy_(t)
        return tuple(keep(t, (j,)) for j, t in enumerate(pre))

    def _piece(self, i: int, P: int, X, carry) -> tuple:
        """Piece i at padded count P: (X, carry = (post, M) of the previous piece) -> (X, carry,
        pre in the static buffers)."""
        tokens, pos = self.stage[0, :P], self.stage[1, :P]
        X, carry, pre = self.model.piece(i, X, self.o[:P], carry, tokens, pos)
        taps = self.model.tap_layers
        if i > 0 and i - 1 in taps:                   # layer i-1's output: as hidden() keeps it
            d, j = X.shape[-1], sorted(taps).index(i - 1)
            self.taps[:P, j * d:(j + 1) * d].copy_(X.float().mean(1))
        return X, carry, None if pre is None else self._static_pre(pre, P)

    def _eager_pieces(self, P: int):
        """Every piece in order on the staged rows and the static o, no cores -> the last X."""
        X = carry = None
        for i in range(len(self.model.layers) + 1):
            X, carry, _ = self._piece(i, P, X, carry)
        return X

    # -- capture ---------------------------------------------------------------------------
    @torch.no_grad()
    def capture(self, log=None) -> None:
        """Warm every size up eagerly on padding (Triton compiles there), then capture its
        pieces into one pool, largest size first."""
        t, dev = time.perf_counter(), self.device
        torch.cuda.empty_cache()                               # the pool's bytes: reserved
        before = torch.cuda.memory_reserved(dev)               # after less before, both
        #                                                        without cached free blocks
        pool = None
        for P in reversed(self.sizes):
            warm_up(lambda: self._eager_pieces(P), dev)
            pieces, X, carry = [], None, None
            for i in range(len(self.model.layers) + 1):
                g, out = capture_graph(lambda: self._piece(i, P, X, carry), pool,
                                       f"prefill piece {i} ({P} tokens)",
                                       "--prefill-graph-tokens 0 runs prefill eagerly")
                pool = g.pool()
                X, carry = out[0], out[1]        # the previous piece's outputs: free to reuse
                pieces.append((g, out[2] if i < len(self.model.layers) else X,
                               X if self.keep_streams else None))
                del out
            self.pieces[P] = pieces
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        self.pool_bytes = torch.cuda.memory_reserved(dev) - before
        self.capture_s = time.perf_counter() - t
        if log:
            log(f"captured CUDA graphs for prefill steps of {self.sizes} tokens "
                f"({len(self.model.layers) + 1} pieces each) in {self.capture_s:.1f} s, "
                f"{self.pool_bytes / 2 ** 30:.2f} GiB")

    @torch.no_grad()
    def check(self, rel_max: float = 1e-2) -> str | None:
        """The smallest size's pieces replayed on padding against the same pieces run eagerly
        (o as it stands; no cores): None if ||graph - eager|| / ||eager|| < rel_max (bit-equal
        at tp 1 by GPU test), else what differs. Every rank computes the same verdict (the
        streams are replicated across ranks)."""
        P = self.sizes[0]
        self.host.zero_()
        self.stage.copy_(self.host)
        want = self._eager_pieces(P).clone()
        for g, *_ in self.pieces[P]:
            g.replay()
        return mismatch(self.pieces[P][-1][1], want, rel_max,
                        f"the {P}-token prefill graphs' streams", "the eager pieces'")

    # -- a step ----------------------------------------------------------------------------
    @torch.no_grad()
    def hidden(self, seqs, cache, prev: torch.Tensor | None = None) -> torch.Tensor | None:
        """seqs: [(seq_id, tokens, start, slot, block table)] of a prefill or mixed step ->
        the streams [T, S, d] after the last block (model.hidden's result), or None when T is
        above the largest size. prev: the overlapped step's sampled ids for placeholder tokens
        (-1 - r), filled on the device."""
        T = sum(len(s[1]) for s in seqs)
        P = self.size_for(T)
        if P is None:
            return None
        if self.copied is not None:
            self.copied.synchronize()                      # the last copy has left self.host
        rows = self.host.numpy()
        lens = np.fromiter((len(s[1]) for s in seqs), dtype=np.int64, count=len(seqs))
        rows[0, :T] = np.fromiter(itertools.chain.from_iterable(s[1] for s in seqs),
                                  dtype=np.int64, count=T)
        rows[:, T:P] = 0           # padding: token 0 at position 0. Never what an earlier step
        #                            left (a verify step's placeholders -1 - r are negative ids:
        #                            the hash layers' tid2eid gather reads out of bounds)
        starts = np.fromiter((s[2] for s in seqs), dtype=np.int64, count=len(seqs))
        rows[1, :T] = np.arange(T) - np.repeat(np.cumsum(lens) - lens - starts, lens)
        self.stage[:, :P].copy_(self.host[:, :P], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        if prev is not None:
            fill_placeholders_(self.stage[0, :T], prev)
        batch = ForwardBatch(self.stage[0, :T], self.stage[1, :T], tuple(s[0] for s in seqs),
                             tuple(len(s[1]) for s in seqs), tuple(s[2] for s in seqs),
                             tuple(s[3] for s in seqs), tuple(tuple(s[4]) for s in seqs))
        bound = cache.bind(batch)
        model, X, carry = self.model, None, None
        L = len(model.layers)
        self.streams = [] if self.keep_streams else None
        for i in range(L + 1):
            if self.use_graphs:
                g, out, X = self.pieces[P][i]
                g.replay()
                X, pre = (out, None) if i == L else (X, out)
            else:
                X, carry, pre = self._piece(i, P, X, carry)
            if i > 0 and self.streams is not None:        # layer i-1's output
                self.streams.append(X[:T].clone())
            if i < L:
                o = model.layers[i].attn.core(_rows(pre, T), batch, bound.layer(i))
                if o.dtype != self.o.dtype:
                    raise RuntimeError(f"attn.core returned {o.dtype}, the static o is "
                                       f"{self.o.dtype}")
                self.o[:T].copy_(o)
        bound.commit()
        model.taps = None if self.taps is None else self.taps[:T]   # until the next step
        model._head_part = None                            # logits(X) gathers no partials
        self.steps += 1
        return X[:T]
