"""Context parallelism, written once in the core: ``context_parallel`` (the sequence
buffers split over the context-parallel ranks) and ``scaled_dot_product_attention`` (ring
or all-to-all attention over the whole sequence inside it) (docs/context-parallel.md)."""

from hyper_parallel.context_parallel.api import context_parallel, scaled_dot_product_attention

__all__ = ["context_parallel", "scaled_dot_product_attention"]
