"""User-facing policies: mixed precision and offload.

Dtypes may be given as framework dtypes or as names ("bfloat16"); the core resolves names
through the platform so a policy can be written once for both frameworks. The classes carry
torch FSDP2's names and fields with the same meaning, so torch's own policy objects are
accepted too (``as_policy``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of one unit's all-gather/compute, gradient reduction and outputs.

    param_dtype: dtype the shards are cast to before the all-gather; the unit computes in it.
    reduce_dtype: dtype gradients are reduced in; None means param_dtype (or, without
        param_dtype, the gradient's own dtype). Reduced gradients are cast back to the
        sharded parameter's dtype.
    output_dtype: dtype floating-point outputs of the unit are cast to (None: unchanged).
    cast_forward_inputs: cast floating-point inputs of the unit to param_dtype.
    apply_grad_on_fp32_main_grad: deliver reduced gradients by accumulating them, in
        float32, into a ``main_grad`` attribute of each sharded parameter instead of its
        gradient (Megatron-style optimizers read ``main_grad``; the user zeroes it by
        setting it to None, or to zeros, after the optimizer step).
    """

    param_dtype: Any = None
    reduce_dtype: Any = None
    output_dtype: Any = None
    cast_forward_inputs: bool = True
    apply_grad_on_fp32_main_grad: bool = False


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: shards, gradients and optimizer state stay on the compute device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep shards (and so gradients and optimizer state) in host memory.

    Only meaningful when computing on an accelerator. On a CPU device the shards already
    live in host memory and this policy changes nothing; on an accelerator hyper_parallel
    does not implement it yet and ``fully_shard`` raises rather than ignore it.
    """

    pin_memory: bool = True


_CLASSES = {cls.__name__: cls for cls in (MixedPrecisionPolicy, OffloadPolicy, CPUOffloadPolicy)}


def as_policy(value: Any, kind: type, argument: str, describe_native: Callable[[Any], Any]):
    """``value`` as our ``kind``: ours as it is; a framework's own policy, which
    ``describe_native`` (``Platform.option_from_native``) gives as (class name, fields),
    rebuilt as our class of that name. Each of torch 2.13's fields (param_dtype,
    reduce_dtype, output_dtype, cast_forward_inputs; pin_memory) means the same here; a
    field we lack is an error rather than dropped."""
    if isinstance(value, kind):
        return value
    native = describe_native(value)
    ours = _CLASSES.get(native[0]) if native is not None else None
    if ours is None or not issubclass(ours, kind):
        raise TypeError(f"fully_shard: {argument} must be a hp.{kind.__name__}, got {value!r}; "
                        f"leave it out for the default ({kind.__name__}()). On torch, "
                        f"torch.distributed.fsdp.{kind.__name__} is accepted too")
    unknown = sorted(set(native[1]) - {f.name for f in fields(ours)})
    if unknown:
        raise TypeError(f"fully_shard: {argument} {value!r} has fields {unknown} that "
                        f"hp.{ours.__name__} does not have; pass a hp.{ours.__name__}")
    return ours(**native[1])
