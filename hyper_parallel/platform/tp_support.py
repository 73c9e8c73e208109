"""The optional part of the contract that the core's tensor parallelism needs
(hyper_parallel/tensor_parallel): which layers a style can split, a plain parameter
holding a block, and the few elementwise and reduction operations of the vocabulary mask
and the parallel loss.

[Note: what stays in the core]
The styles, the plan, the redistributions and their gradients, and the loss's arithmetic
are written once in the core; the differentiable collectives are the core's too, each one
autograd node (``differentiable_call``) around the counted collectives of
collectives.py. A platform only answers what its framework spells its own way: a layer's
kind and parameter names, and ``amax``/``sum_dim``/``take_along_dim``/``where``, whose
signatures differ between frameworks. The rest are defaults over the tensor operators both
frameworks share.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from typing import Any

#: on a module: ``{attr_name: (what its instance attribute was, the tensor read instead)}``
#: while ``read_in_forward`` shadows it (``_NOTHING``: no instance attribute)
_SHADOWED = "_hp_read_in_forward"
_NOTHING = object()


@dataclass(frozen=True)
class ParallelLayer:
    """A layer a linear style can split: ``kind`` "linear" (weight ``(out, in)``, an
    optional bias ``(out,)``) or "embedding" (weight ``(vocabulary, dim)``, no bias), the
    names its parameters are registered under, and the weight dims its forward still
    computes with when they hold only a block (a forward that reshapes by a size it
    stored at construction cannot)."""

    kind: str
    weight: str
    bias: str | None = None
    split_dims: tuple = (0, 1)


class TensorParallelSupport(abc.ABC):
    """Layers, parameters and tensor math for hyper_parallel.tensor_parallel."""

    @abc.abstractmethod
    def parallel_layer(self, module: Any) -> ParallelLayer | None:
        """``module`` as a layer ``ColwiseParallel``/``RowwiseParallel`` can split (torch:
        ``nn.Linear``, ``nn.Embedding``; MindSpore: ``nn.Dense`` without activation,
        ``mint.nn.Linear``, ``nn.Embedding``, ``mint.nn.Embedding``); None for any other."""

    def unsplittable_reason(self, module: Any) -> str | None:
        """Why ``module``, which looks like a linear or embedding layer, is no layer a style
        can split (``parallel_layer`` None for it), and what to do instead; None where
        there is nothing particular to say."""
        return None

    def is_framework_style(self, style: Any) -> bool:
        """Whether ``style`` is the framework's own tensor-parallel style object (torch's
        ``ParallelStyle``), which ``framework_parallelize`` applies."""
        return False

    def framework_parallelize(self, module: Any, native_mesh: Any, plan: dict,
                              src_data_rank: int | None) -> Any:
        """Apply ``plan`` of the framework's own styles with the framework's own
        ``parallelize_module`` over ``native_mesh``, for a script written against it."""
        raise NotImplementedError("this framework has no tensor-parallel styles of its own")

    @abc.abstractmethod
    def framework_cross_entropy(self, logits: Any, target: Any, ignore_index: int,
                                reduction: str, label_smoothing: float = 0.0) -> Any:
        """The framework's own cross entropy of ``(N, C)`` logits and ``(N,)`` class ids
        (torch: ``F.cross_entropy``, which inside ``framework_loss_parallel`` also takes
        DTensor logits)."""

    def framework_loss_parallel(self) -> Any:
        """A context manager in which the framework's own losses take logits its own tensor
        parallelism split (torch's ``loss_parallel()``); a no-op where there is none."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def new_local_param(self, orig_param: Any, local: Any) -> Any:
        """A plain parameter with its own copy of ``local`` that replaces ``orig_param``
        (same name, same ``requires_grad``)."""

    @abc.abstractmethod
    def set_local_param(self, module: Any, attr_name: str, param: Any) -> None:
        """Register ``param`` (from ``new_local_param``) on ``module`` as ``attr_name``, in
        place of the parameter there."""

    def read_in_forward(self, module: Any, attr_name: str, tensor: Any) -> None:
        """Make ``module.<attr_name>`` read ``tensor`` (a parameter as one forward uses it:
        through a differentiable op) until ``end_read_in_forward``; the registered parameter
        stays what ``parameters()`` yields, and what the module read before (a full
        parameter fully_shard attached) is read again after. An instance attribute shadows
        a registered parameter in both frameworks' attribute lookup."""
        self.end_read_in_forward(module, attr_name)
        saved = module.__dict__.setdefault(_SHADOWED, {})
        saved[attr_name] = (module.__dict__.get(attr_name, _NOTHING), tensor)
        object.__setattr__(module, attr_name, tensor)

    def end_read_in_forward(self, module: Any, attr_name: str) -> None:
        """Undo ``read_in_forward``; ending twice is harmless, and so is a read left
        behind by a forward cut short (torch's non-reentrant checkpoint stops recomputing
        once it has what backward needs, before the module's post-hooks): if something
        else replaced the attribute since (fully_shard resharding), that stays."""
        before, tensor = module.__dict__.get(_SHADOWED, {}).pop(attr_name, (None, None))
        if before is None or module.__dict__.get(attr_name, _NOTHING) is not tensor:
            return
        if before is _NOTHING:
            module.__dict__.pop(attr_name, None)
        else:
            object.__setattr__(module, attr_name, before)

    @abc.abstractmethod
    def amax(self, tensor: Any, dim: int) -> Any:
        """The largest element along ``dim``, the dim kept (size 1)."""

    @abc.abstractmethod
    def sum_dim(self, tensor: Any, dim: int) -> Any:
        """The sum along ``dim``, the dim kept (size 1)."""

    @abc.abstractmethod
    def take_along_dim(self, tensor: Any, index: Any, dim: int) -> Any:
        """``tensor``'s elements at ``index`` along ``dim`` (torch.gather)."""

    @abc.abstractmethod
    def where(self, condition: Any, tensor: Any, other: float) -> Any:
        """``tensor`` where ``condition`` holds, the number ``other`` elsewhere."""

    def exp(self, tensor: Any) -> Any:
        return tensor.exp()

    def log(self, tensor: Any) -> Any:
        return tensor.log()

    def total(self, tensor: Any) -> Any:
        """The sum of all elements, a 0-d tensor."""
        return tensor.sum()

    def subtract(self, a: Any, b: Any) -> Any:
        """``a - b`` (``b`` a tensor or a number)."""
        return a - b

    def multiply(self, a: Any, b: Any) -> Any:
        """``a * b`` (``b`` a tensor or a number), broadcast."""
        return a * b

    def divide(self, tensor: Any, divisor: Any) -> Any:
        """``tensor / divisor``: a true division, as torch divides a replicated value into
        partial summands (not a multiplication by the reciprocal)."""
        return tensor / divisor

    def in_range(self, tensor: Any, low: int, high: int) -> Any:
        """A boolean tensor: ``low <= tensor < high`` elementwise."""
        return (tensor >= low) & (tensor < high)

    def not_equal(self, tensor: Any, value: Any) -> Any:
        """A boolean tensor: ``tensor != value`` elementwise (broadcast)."""
        return tensor != value

    def equal(self, tensor: Any, value: Any) -> Any:
        """A boolean tensor: ``tensor == value`` elementwise (broadcast)."""
        return tensor == value
