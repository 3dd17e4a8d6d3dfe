"""backfit.runtime: DeepSeek-V4 on a converted directory (docs/FORMAT.md), plain-torch path.

  distributed  TPInfo (set once per process), gloo/nccl init, all_reduce / all_gather
  layers       quantized Linear (int8_g128, int8_mx32, bf16, copy), TP linears, embedding, head,
               RMSNorm, interleaved RoPE with YaRN
  batch        ForwardBatch (tokens, positions, per-sequence ids / new-token counts / starts)
  state        DecodeState: per-sequence window ring, compressed entries, compressor rows, indexer keys
  model/       attention, compressor (+ indexer), moe, hyper (mHC), transformer, mtp
  loader       manifest-driven, rank-local loading with completeness checks

Typical use (one process, tp=1):
  set_tp_info(0, 1); model = Transformer(ModelConfig.from_file(dir / "config.json"), torch.bfloat16)
  load_model(model, dir, device="cuda"); state = model.new_state()
  logits = model(ForwardBatch.single(prompt_ids, device="cuda"), state, last_only=True)
Importing this package imports nothing heavy.
"""
