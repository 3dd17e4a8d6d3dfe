"""backfit.runtime: DeepSeek-V4 on a converted directory (docs/FORMAT.md); how a step runs.

  distributed  TPInfo (set once per process), gloo/nccl init, all_reduce / all_gather
  layers       quantized Linear (int8_g128, int8_mx32, mx4_e2m1, bf16, copy), TP linears,
               embedding, head, RMSNorm, interleaved RoPE with YaRN
  batch        ForwardBatch (tokens, positions, per-sequence ids / lengths / starts, slots,
               block tables)
  state        the layer-cache interface the model computes against, and DecodeState (its
               plain per-sequence form, the reference layout)
  cache/       layout (bytes per slot / block), budget (the planner's fit), paged (the pools)
  model/       attention, compressor (+ indexer), moe, hyper (mHC), transformer, mtp
  kernels/     Triton kernels behind set_kernel_backend("triton"), torch references in ref.py
  loader       manifest-driven, rank-local loading with completeness checks
  runner       one rank: build, load, size pools, run a StepInput as one forward
  workers      tensor-parallel rank processes driven by rank 0
  sampling     batched on-device sampling and logprobs

Typical use (one process, tp=1, no engine):
  set_tp_info(0, 1); model = Transformer(ModelConfig.from_file(dir / "config.json"), torch.bfloat16)
  load_model(model, dir, device="cuda"); state = model.new_state()
  logits = model(ForwardBatch.single(prompt_ids, device="cuda"), state, last_only=True)
The engine (backfit.engine) drives runner/workers instead. Importing this package imports
nothing heavy.
"""
