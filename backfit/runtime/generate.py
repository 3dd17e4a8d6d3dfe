"""Greedy generation with the runtime, printing text as it is produced (`backfit generate`)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from backfit.config import ModelConfig

__all__ = ["generate", "IncrementalDecoder"]


class IncrementalDecoder:
    """Turns a growing list of ids into text deltas; holds back an incomplete UTF-8 sequence."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.emitted = tokenizer, [], ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids, skip_special_tokens=False)
        if text.endswith("\ufffd"):                 # a multi-byte character is not complete yet
            return ""
        delta, self.emitted = text[len(self.emitted):], text
        return delta


def _generate_worker(converted: str, prompt: str, max_tokens: int, dtype: str, device: str) -> list[int]:
    from tokenizers import Tokenizer

    from backfit.runtime.batch import ForwardBatch
    from backfit.runtime.distributed import get_tp_info
    from backfit.runtime.loader import load_model
    from backfit.runtime.model.transformer import Transformer

    cfg = ModelConfig.from_file(Path(converted) / "config.json")
    model = Transformer(cfg, getattr(torch, dtype), mtp=False)
    load_model(model, converted, device)
    tok = Tokenizer.from_file(str(Path(converted) / "tokenizer.json"))
    ids = [cfg.bos_token_id] + tok.encode(prompt, add_special_tokens=False).ids
    talk = get_tp_info().rank == 0
    dec, out = IncrementalDecoder(tok), []
    state = model.new_state(device)
    logits = model(ForwardBatch.single(ids, device=device), state, last_only=True)
    for _ in range(max_tokens):
        nxt = int(logits[-1].argmax())
        if nxt == cfg.eos_token_id:
            break
        out.append(nxt)
        if talk:
            sys.stdout.write(dec.push(nxt))
            sys.stdout.flush()
        logits = model(ForwardBatch.single([nxt], start=len(ids) + len(out) - 1, device=device),
                       state, last_only=True)
    if talk:
        sys.stdout.write("\n")
    return out


def generate(converted: str | Path, prompt: str, max_tokens: int = 64, tp: int | None = None,
             dtype: str = "bfloat16", device: str = "cpu") -> list[int]:
    """Greedy-decode up to max_tokens after prompt; prints as it goes; returns the new ids."""
    from backfit.formats import load_manifest
    from backfit.runtime.launch import run_on_ranks
    tp = tp or load_manifest(converted)["tp"]
    return run_on_ranks(_generate_worker, tp, (str(converted), prompt, max_tokens, dtype, device), device)
