"""The capacity tables of docs/DEPLOY.md (§4, "Capacity"), printed as Markdown rows.

  python scripts/capacity_table.py [CONFIG]
                                    (default: shared/tools/configs/deepseek-v4-flash.json)

Every row is `backfit plan CONFIG --tp T --experts E --kv-cache-dtype K
--gpu-memory-utilization U` on 80 GiB cards (backfit.capacity.plan, the engine's defaults:
64 sequences + 64 snapshot slots, the default token budget and prefill graphs), then the same
with --max-model-len 524288 / 1048576 for the last two columns (max concurrency at that length).
The second table: the levers at TP 4 with INT8 experts.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backfit.capacity import GiB, plan  # noqa: E402


def _at(cfg, length, **kw) -> str:
    try:
        p = plan(cfg, max_model_len=length, **kw)
    except ValueError:
        return "no"
    return f"yes ({p.max_concurrency_at_max_model_len} seq)"


def main_table(cfg) -> None:
    print("| TP | experts | KV | util | weights / rank (GiB) | chunk (tokens) | prefill graphs "
          "(tokens) | KV pool (GiB) | capacity (tokens) | longest context | 524,288? | "
          "1,048,576? |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for tp in (4, 8):
        for experts in ("int8", "bf16", "mx4"):
            for kv in ("bf16", "int8"):
                for util in (0.90, 0.95):
                    kw = dict(tp=tp, gpu_mem=80 * GiB, utilization=util, experts=experts,
                              kv_cache_dtype=kv)
                    try:
                        p = plan(cfg, **kw)
                    except ValueError:
                        from backfit.capacity import weight_bytes
                        w = weight_bytes(cfg, tp, experts).per_rank / GiB
                        print(f"| {tp} | {experts} | {kv} | {util:.2f} | {w:.2f} | — | — | "
                              "— | does not fit | — | no | no |")
                        continue
                    print(f"| {tp} | {experts} | {kv} | {util:.2f} | "
                          f"{p.weight_bytes_per_rank / GiB:.2f} | {p.max_num_batched_tokens} | "
                          f"{p.prefill_graph_tokens or 'off'} | {p.kv_pool_bytes / GiB:.2f} | "
                          f"{p.kv_capacity_tokens:,} | {p.longest_context:,} | "
                          f"{_at(cfg, 524288, **kw)} | {_at(cfg, 1048576, **kw)} |")


def levers(cfg) -> None:
    print("\n| flags | KV | util 0.90 | util 0.95 |\n|---|---|---|---|")
    rows = [("(defaults: 64 seqs + 64 snapshots)", "bf16", {}), ("(defaults)", "int8", {}),
            ("`--mtp` (count the MTP block)", "int8", dict(mtp=True)),
            ("`--max-num-seqs 8`", "bf16", dict(max_num_seqs=8)),
            ("`--max-num-seqs 8`", "int8", dict(max_num_seqs=8)),
            ("`--max-num-seqs 8 --num-snapshot-slots 0`", "int8",
             dict(max_num_seqs=8, num_snapshot_slots=0)),
            ("`--max-num-seqs 1 --num-snapshot-slots 0`", "int8",
             dict(max_num_seqs=1, num_snapshot_slots=0))]
    for name, kv, extra in rows:
        cells = []
        for util in (0.90, 0.95):
            kw = dict(tp=4, gpu_mem=80 * GiB, utilization=util, experts="int8",
                      kv_cache_dtype=kv, **extra)
            try:
                p = plan(cfg, **kw)
            except ValueError:
                cells.append("does not fit")
                continue
            c = f"{p.kv_capacity_tokens:,}"
            try:
                q = plan(cfg, max_model_len=524288, **kw)
                c += f" ({q.max_concurrency_at_max_model_len} × 512K)"
            except ValueError:
                pass
            cells.append(c + ("" if p.prefill_graph_tokens else ", no prefill graphs"))
        print(f"| {name} | {kv} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    from backfit.capacity import read_model
    root = Path(__file__).resolve().parents[1]
    cfg_path = sys.argv[1] if len(sys.argv) > 1 else \
        root.parent / "shared" / "tools" / "configs" / "deepseek-v4-flash.json"
    cfg = read_model(cfg_path)[0]
    main_table(cfg)
    levers(cfg)
