"""The optional part of the contract that the core's context parallelism needs
(hyper_parallel/context_parallel): a batched matrix product, a tensor's values and shape
replaced in place, and the framework's own attention function routed through the core's.

[Note: what stays in the core]
The sequence split, the ring and all-to-all attention, the online-softmax merge and the
masks are written once in the core over the tensor operations of tensors.py and
tp_support.py (``exp``, ``log``, ``amax``, ``sum_dim``, ``where``). A platform answers only
what its framework does its own way: replacing a buffer in place (torch: ``set_`` to new
memory; MindSpore CPU, whose in-place kernels are unreliable: ``assign_value``), and
where the framework has an attention function models call (torch's
``F.scaled_dot_product_attention``), sending its calls to the core while a context is open.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable


class ContextParallelSupport(abc.ABC):
    """Tensor operations and the attention route for hyper_parallel.context_parallel."""

    def matmul(self, a: Any, b: Any) -> Any:
        """The matrix product over the last two dims, batched over the others."""
        return a @ b

    @abc.abstractmethod
    def replace_values(self, tensor: Any, new: Any) -> None:
        """Make ``tensor`` (not a parameter, no autograd history) hold ``new``'s values and
        shape, in place: every reference to ``tensor`` sees them. Other tensors that shared
        ``tensor``'s memory keep their values (the tensor is given memory of its own)."""

    def route_framework_attention(self, attention: Callable) -> Any:
        """A context manager in which the framework's own attention function (torch:
        ``torch.nn.functional.scaled_dot_product_attention``) calls ``attention`` with the
        same arguments; nothing where the framework has none that models call."""
        return contextlib.nullcontext()
