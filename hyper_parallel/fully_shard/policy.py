"""User-facing policies: mixed precision and offload.

Dtypes may be given as framework dtypes or as names ("bfloat16"); the core resolves names
through the platform so a policy can be written once for both frameworks. The classes carry
torch FSDP2's names and fields with the same meaning, so torch's own policy objects are
accepted too (``as_policy``).

[Note: checked before use]
A policy's bools and dtype names are checked when it is made; its framework dtypes by
``policy_dtypes`` when ``fully_shard`` reads it, before anything changes. Only floating-point
dtypes are accepted: a unit computes and reduces gradients in them, and an integer or
complex dtype would fail later, in forward or backward, with the module already sharded.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable

#: the dtypes a policy accepts, by name; given as a name or as the framework's dtype
FLOATING_DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")
_DTYPE_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype")


def _check_fields(policy) -> None:
    """The checks that need no framework ([Note: checked before use])."""
    kind = type(policy).__name__
    for field in fields(policy):
        value = getattr(policy, field.name)
        if field.type in (bool, "bool") and not isinstance(value, bool):
            raise TypeError(f"{kind}.{field.name} must be True or False, got {value!r}")
        if field.name in _DTYPE_FIELDS and isinstance(value, str) \
                and value not in FLOATING_DTYPE_NAMES:
            raise ValueError(f"{kind}.{field.name}: unknown dtype name {value!r}; valid: "
                             f"{', '.join(FLOATING_DTYPE_NAMES)} (floating-point dtypes only)")


def policy_dtypes(platform, policy) -> tuple:
    """``(param_dtype, reduce_dtype, output_dtype)`` of ``policy`` as the platform's dtypes
    (None where unset); anything but a floating-point dtype of this framework, or its name,
    is a TypeError naming the accepted spellings."""
    resolved = []
    for name in _DTYPE_FIELDS:
        value = getattr(policy, name)
        if value is None or isinstance(value, str):
            resolved.append(None if value is None else platform.dtype(value))
            continue
        if not any(type(value) is type(platform.dtype(known)) and value == platform.dtype(known)
                   for known in FLOATING_DTYPE_NAMES):
            accepted = ", ".join(f"{platform.name}.{known}" for known in FLOATING_DTYPE_NAMES)
            raise TypeError(f"MixedPrecisionPolicy.{name} must be a floating-point dtype of "
                            f"{platform.name} ({accepted}), its name as a string (e.g. "
                            f"'bfloat16') or None; got {value!r}")
        resolved.append(value)
    return tuple(resolved)


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

    def __post_init__(self):
        _check_fields(self)


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

    def __post_init__(self):
        _check_fields(self)


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
