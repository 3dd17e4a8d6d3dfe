"""DeepSeek-V4 model modules (plain torch): attention, MoE, mHC, transformer, MTP."""
