"""CUDA graphs of a step (docs/ENGINE.md §4), what keeps the fixed cost per launch off the GPU.

  decode   one graph per padded decode batch size (the whole step: embedding -> head)
  prefill  a prefill or mixed step as pieces captured per padded token count, the attention
           cores run eagerly between them
  spec     a speculative decode step: draft, verify (the rows of a sequence share its slot)
           and the drafter's context in one graph per batch size
"""

from backfit.runtime.graphs.decode import DecodeGraphs
from backfit.runtime.graphs.prefill import PrefillGraphs
from backfit.runtime.graphs.spec import SpecGraphs

__all__ = ["DecodeGraphs", "PrefillGraphs", "SpecGraphs"]
