"""backfit: DeepSeek-V4 FP8/FP4 checkpoints on BF16/INT8 (SM80) GPUs. Importing it imports no torch."""

__version__ = "0.1.0"
__all__ = ["__version__"]
