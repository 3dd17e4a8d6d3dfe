"""backfit.runtime.cache: the paged DeepSeek-V4 cache pools (docs/ENGINE.md).

  layout   pure-Python byte layout: ring rows for rollback, entry widths, bytes per slot, per
           block and per token; the pools are allocated from it and `backfit plan` sizes them
           with it (one source of these numbers)

The slot pool (window ring, compressor rolling rows) and the paged block pools (CSA entries,
indexer keys, HCA entries) are added beside `layout`. Importing this package imports no torch.
"""
