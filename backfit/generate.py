"""`backfit generate`: raw-text prompts through the engine (no chat template), printed.

One prompt streams its text as it is produced. Several (`--prompts-file`, one per line) are all
in flight at once (continuous batching) and are printed in order as `[i] text` when done, with
a throughput line on stderr. BOS is prepended to every prompt; decoding stops at EOS.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

__all__ = ["generate"]


def generate(converted: str | Path, prompts: list[str], params=None, tp: int | None = None,
             dtype: str = "bfloat16", device: str = "cpu", out=None, **engine_kw) -> list[dict]:
    """-> [{text, token_ids, finish_reason, usage}] per prompt (printing as described above)."""
    from backfit.config import ModelConfig
    from backfit.engine.engine import EngineConfig, LLMEngine
    from backfit.engine.sampling_params import SamplingParams
    from backfit.formats import load_manifest

    out = out or sys.stdout
    params = params or SamplingParams(max_tokens=64, temperature=0)
    tp = tp or load_manifest(converted)["tp"]
    cfg = ModelConfig.from_file(Path(converted) / "config.json")
    engine_kw.setdefault("max_num_seqs", max(1, min(64, len(prompts))))
    engine = LLMEngine(EngineConfig(str(converted), tp=tp, dtype=dtype, device=device, **engine_kw))
    try:
        enc = [[cfg.bos_token_id] + engine.tokenizer.encode(p, add_special_tokens=False).ids
               for p in prompts]
        t0 = time.perf_counter()
        if len(prompts) == 1:
            rid = engine.add_request(enc[0], params)
            res = {"text": "", "token_ids": [], "finish_reason": None, "usage": None}
            while engine.has_unfinished():
                for o in engine.step():
                    assert o.request_id == rid
                    out.write(o.text)
                    out.flush()
                    res["text"] += o.text
                    res["token_ids"] += o.token_ids
                    if o.finished:
                        res["finish_reason"], res["usage"] = o.finish_reason, o.usage
            out.write("\n")
            results = [res]
        else:
            results = engine.generate(enc, params)
            for i, r in enumerate(results):
                out.write(f"[{i}] {r['text']}\n")
        dt = time.perf_counter() - t0
        n = sum(len(r["token_ids"]) for r in results)
        line = f"{len(prompts)} prompt(s), {n} tokens in {dt:.2f} s ({n / dt:.1f} tokens/s)"
        if engine.spec.num_drafts:                   # speculative decoding: the accepted length
            line += (f"; speculative: mean accepted length {engine.spec.mean_accepted_length:.2f}"
                     f" ({engine.spec.num_accepted_tokens} of {engine.spec.num_draft_tokens} "
                     f"drafted tokens accepted)")
        print(line, file=sys.stderr)
        return results
    finally:
        engine.close()
