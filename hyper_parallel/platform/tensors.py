"""Tensor primitives of the Platform contract: what the core does to a tensor.

[Note: defaults]
Where PyTorch and MindSpore tensors spell a primitive alike (``tensor.reshape(shape)``,
``a + b``) it is implemented here once, as a default a platform overrides where its
framework spells it differently or does it faster. A default is never a stub: it is
correct for any framework whose tensors have that method. The few primitives no generic
spelling covers (``zeros``, ``cat``, ``copy_into``, numpy in and out) are abstract.
"""

from __future__ import annotations

import abc
import math
from typing import Any, Sequence

#: bytes per element, by dtype name (``dtype_names``' keys)
_ITEM_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8,
               "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


class TensorPrimitives(abc.ABC):
    """The tensor half of ``Platform`` (base.py); ``dtype_names`` is the platform's."""

    dtype_names: dict

    @abc.abstractmethod
    def is_tensor(self, obj: Any) -> bool:
        """Whether ``obj`` is a framework tensor (Parameters included)."""

    @abc.abstractmethod
    def zeros(self, shape: Sequence[int], dtype: Any) -> Any:
        """A new zero-filled tensor on the compute device."""

    @abc.abstractmethod
    def from_numpy(self, array: Any) -> Any:
        """A new tensor on the compute device holding a copy of a numpy array."""

    @abc.abstractmethod
    def to_numpy(self, tensor: Any) -> Any:
        """A numpy copy of a tensor's values (sharded parameters: the local shard)."""

    @abc.abstractmethod
    def cat(self, tensors: Sequence[Any], dim: int = 0) -> Any:
        """A new tensor concatenating ``tensors`` along ``dim`` (a copy, also of one)."""

    @abc.abstractmethod
    def copy_into(self, dst: Any, src: Any) -> None:
        """Write ``src`` (same shape and dtype) into ``dst`` in place, without disturbing
        autograd's bookkeeping of ``dst``."""

    def dtype(self, name: str) -> Any:
        """The framework dtype named ``name`` (a key of ``dtype_names``)."""
        try:
            return self.dtype_names[name]
        except KeyError:
            raise ValueError(f"unknown dtype name {name!r}; valid: {sorted(self.dtype_names)}"
                             ) from None

    def element_size(self, dtype: Any) -> int:
        """Bytes per element of ``dtype``."""
        for name, value in self.dtype_names.items():
            if value == dtype:
                return _ITEM_BYTES[name]
        raise ValueError(f"dtype {dtype} is not one of {sorted(self.dtype_names)}")

    def shape(self, tensor: Any) -> tuple:
        return tuple(tensor.shape)

    def dtype_of(self, tensor: Any) -> Any:
        return tensor.dtype

    def empty(self, shape: Sequence[int], dtype: Any) -> Any:
        """A new tensor whose values are undefined, for a buffer that is then overwritten
        whole. The default fills it with zeros."""
        return self.zeros(shape, dtype)

    def cast(self, tensor: Any, dtype: Any) -> Any:
        """``tensor`` in ``dtype`` (the same tensor when it already is)."""
        return tensor if self.dtype_of(tensor) == dtype else tensor.to(dtype)

    def reshape(self, tensor: Any, shape: Sequence[int]) -> Any:
        """A reshaped tensor, valid for reading."""
        return tensor.reshape(tuple(shape))

    def movedim(self, tensor: Any, source: int, destination: int) -> Any:
        """``tensor`` with dimension ``source`` moved to ``destination``, valid for reading."""
        return tensor if source == destination else tensor.movedim(source, destination)

    def narrow(self, tensor: Any, dim: int, start: int, length: int) -> Any:
        """Elements ``[start, start+length)`` of ``dim``, valid for reading."""
        return tensor.narrow(dim, start, length)

    def contiguous(self, tensor: Any) -> Any:
        """A tensor with its own dense memory (a copy when ``tensor`` is a strided read)."""
        return tensor.contiguous()

    def alias(self, tensor: Any) -> Any:
        """The same values under a new tensor object (the same memory where views exist),
        so that a new autograd node can output it."""
        return tensor.reshape(tuple(tensor.shape))

    def as_bytes(self, tensor: Any) -> Any:
        """A contiguous ``tensor``'s memory as a 1-D uint8 tensor (a view where views exist),
        whatever its dtype: how a gather codec's tensors of any dtype share one collective."""
        return self.reshape(tensor, (-1,)).view(self.dtype("uint8"))

    def from_bytes(self, data: Any, dtype: Any, shape: Sequence[int]) -> Any:
        """1-D uint8 ``data`` (starting at a multiple of ``dtype``'s size) read as a tensor
        of ``dtype`` and ``shape``: the reverse of ``as_bytes``."""
        return self.reshape(data.view(dtype), shape)

    def int8_rows(self, tensor: Any) -> tuple:
        """``(values, scales)``: each dim-0 row of ``tensor`` scaled by its largest magnitude
        over 127 and rounded to int8 (``values``, ``tensor``'s shape), and the float32
        scales, one per row (``from_int8_rows`` multiplies them back)."""
        shape = self.shape(tensor)
        rows = self.reshape(self.cast(tensor, self.dtype("float32")),
                            (shape[0], math.prod(shape[1:])))
        scales = rows.abs().amax(1, True).clamp(min=1e-12) / 127.0
        values = self.cast((rows / scales).round().clamp(-127, 127), self.dtype("int8"))
        return self.reshape(values, shape), self.reshape(scales, (shape[0],))

    def from_int8_rows(self, values: Any, scales: Any, dtype: Any) -> Any:
        """``int8_rows``' reverse: ``values`` times their row's scale, in ``dtype``."""
        shape = self.shape(values)
        rows = self.reshape(self.cast(values, self.dtype("float32")),
                            (shape[0], math.prod(shape[1:])))
        return self.cast(self.reshape(rows * self.reshape(scales, (shape[0], 1)), shape), dtype)

    def clone(self, tensor: Any) -> Any:
        """A new tensor with the same values and its own memory."""
        return tensor + 0

    def add(self, a: Any, b: Any) -> Any:
        return a + b

    def scale(self, tensor: Any, factor: float, may_overwrite: bool = False) -> Any:
        """``tensor * factor``. ``may_overwrite``: nobody else reads ``tensor`` (a buffer the
        core owns), so a platform whose in-place arithmetic writes through may scale it in
        place and save an allocation (the default never does)."""
        return tensor * factor

    def vector_norm(self, tensor: Any, norm_type: float) -> Any:
        """A new 0-d float32 tensor: the ``norm_type``-norm (> 0) of all of a non-empty
        ``tensor``'s elements, computed in float32; ``inf``: the largest absolute value."""
        values = self.cast(tensor, self.dtype("float32"))
        if norm_type == float("inf"):
            return values.abs().max()
        if norm_type == 2.0:
            return (values * values).sum().sqrt()
        return (values.abs() ** norm_type).sum() ** (1.0 / norm_type)
