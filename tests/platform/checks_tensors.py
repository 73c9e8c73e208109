"""Conformance checks of the platform contract: tensors made, their dtypes and shapes
(functional ops: checks_tensor_ops.py).

The harness (context, registry, assertion helpers) is conformance.py."""

from __future__ import annotations

import numpy as np

from hyper_parallel.platform.storage_release import StorageRelease
from tests.platform.conformance import (
    DTYPE_SIZES, NUMPY_ROUND_TRIP, _arange, _check, _f32, _same, _values, local_check)


@local_check
def check_dtype_names(ctx):
    p = ctx.p
    dtypes = {}
    for name, size in DTYPE_SIZES.items():
        dtype = p.dtype(name)
        dtypes[name] = dtype
        _check(p.element_size(dtype) == size,
               f"element_size(dtype({name!r})) = {p.element_size(dtype)}, expected {size}")
        _check(p.dtype_of(p.zeros((2,), dtype)) == dtype,
               f"dtype_of(zeros(.., dtype({name!r}))) = {p.dtype_of(p.zeros((2,), dtype))}")
    names = list(dtypes)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            _check(dtypes[a] != dtypes[b], f"dtype({a!r}) == dtype({b!r})")
    for bad in ("float8_nonexistent", "Float32", ""):
        try:
            p.dtype(bad)
        except ValueError as error:
            _check(repr(bad) in str(error) or bad in str(error),
                   f"ValueError for dtype({bad!r}) does not name it: {error}")
        else:
            raise AssertionError(f"dtype({bad!r}) did not raise ValueError")


@local_check
def check_shape_dtype_of_element_size(ctx):
    p = ctx.p
    for name in NUMPY_ROUND_TRIP:
        array = np.zeros((2, 3, 4), dtype=name)
        t = p.from_numpy(array)
        shape = p.shape(t)
        _check(shape == (2, 3, 4) and isinstance(shape, tuple)
               and all(type(s) is int for s in shape),
               f"shape of a {name} (2, 3, 4) tensor is {shape!r} (want a tuple of ints)")
        _check(p.dtype_of(t) == p.dtype(name), f"dtype_of(from_numpy({name})) = {p.dtype_of(t)}")
        _check(p.element_size(p.dtype_of(t)) == array.itemsize,
               f"element_size of {name} = {p.element_size(p.dtype_of(t))}")
    _check(p.shape(p.zeros([3, 1, 2], p.dtype("float32"))) == (3, 1, 2),
           "zeros with a list shape has the wrong shape")
    _check(p.shape(p.from_numpy(np.zeros((0, 5), np.float32))) == (0, 5), "empty tensor shape")


@local_check
def check_zeros(ctx):
    p = ctx.p
    for name in ("float32", "float16", "bfloat16", "int64"):
        t = p.zeros((3, 2), p.dtype(name))
        _check(p.shape(t) == (3, 2), f"zeros({name}) shape {p.shape(t)}")
        _check(p.dtype_of(t) == p.dtype(name), f"zeros({name}) dtype {p.dtype_of(t)}")
        _same(_values(ctx, p.cast(t, p.dtype("float32"))), np.zeros((3, 2), np.float32),
              f"zeros({name}) values")
    a, b = p.zeros((4,), p.dtype("float32")), p.zeros((4,), p.dtype("float32"))
    p.copy_into(a, _f32(ctx, [1, 2, 3, 4]))
    _same(_values(ctx, b), np.zeros(4, np.float32), "two zeros() share memory: writing one "
          "changed the other")


@local_check
def check_capabilities(ctx):
    """One frozen record, the same every time; its flags are plain booleans (the core's
    choice of delivery reads two of them, iteration.py); the device is one the core knows
    and ``device_type()`` reads it from here."""
    import dataclasses

    from hyper_parallel.platform.capabilities import Capabilities

    caps = ctx.p.capabilities
    _check(isinstance(caps, Capabilities), f"capabilities is {type(caps).__name__}, "
           f"want a Capabilities")
    _check(caps.can_release_storage == isinstance(ctx.p, StorageRelease),
           f"can_release_storage is {caps.can_release_storage}, but the platform "
           f"{'does not implement' if caps.can_release_storage else 'implements'} "
           f"StorageRelease: the core calls release_storage exactly where it is True")
    _check(ctx.p.capabilities == caps, "capabilities changed between two reads")
    _check(ctx.p.device_type() == caps.device_type,
           f"device_type() = {ctx.p.device_type()!r}, capabilities.device_type = "
           f"{caps.device_type!r}")
    try:
        setattr(caps, "can_release_storage", not caps.can_release_storage)
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("capabilities can be changed: want a frozen record")
    for field in dataclasses.fields(caps):
        value = getattr(caps, field.name)
        if field.name == "device_type":
            _check(value in ("cpu", "cuda", "npu"), f"capabilities.device_type = {value!r}")
        elif field.name == "default_own_collective_bytes":
            _check(value is None or (isinstance(value, int) and not isinstance(value, bool)
                                     and value >= 0),
                   f"default_own_collective_bytes = {value!r}: want None or an int >= 0")
        else:
            _check(isinstance(value, bool), f"capabilities.{field.name} = {value!r}: want a bool")


@local_check
def check_empty(ctx):
    p = ctx.p
    for name in ("float32", "bfloat16", "int64"):
        t = p.empty((3, 2), p.dtype(name))
        _check(p.shape(t) == (3, 2), f"empty({name}) shape {p.shape(t)}")
        _check(p.dtype_of(t) == p.dtype(name), f"empty({name}) dtype {p.dtype_of(t)}")
    a, b = p.empty((4,), p.dtype("float32")), p.empty((4,), p.dtype("float32"))
    p.copy_into(a, _f32(ctx, [1, 2, 3, 4]))
    p.copy_into(b, _f32(ctx, [5, 6, 7, 8]))
    _same(_values(ctx, a), np.array([1, 2, 3, 4], np.float32),
          "two empty() share memory: writing one changed the other")


@local_check
def check_from_numpy_to_numpy(ctx):
    p = ctx.p
    for name in NUMPY_ROUND_TRIP:
        array = (np.arange(24).reshape(2, 3, 4) - 7).astype(name)
        t = p.from_numpy(array)
        back = p.to_numpy(t)
        _check(isinstance(back, np.ndarray), f"to_numpy returned {type(back).__name__}")
        _check(back.dtype == array.dtype, f"{name} round trip gave numpy dtype {back.dtype}")
        _same(back, array, f"{name} round trip values")
    source = _arange(5)
    t = p.from_numpy(source)
    source[:] = -1
    _same(_values(ctx, t), _arange(5), "from_numpy must copy: changing the array changed the tensor")
    out = p.to_numpy(t)
    out[:] = -2
    _same(_values(ctx, t), _arange(5), "to_numpy must copy: changing its result changed the tensor")
    strided = _arange(3, 4).T  # a non-contiguous numpy array
    _same(_values(ctx, p.from_numpy(strided)), strided, "from_numpy of a transposed array")
    _same(_values(ctx, p.from_numpy(np.zeros((0, 3), np.float32))), np.zeros((0, 3), np.float32),
          "from_numpy/to_numpy of an empty array")


@local_check
def check_refresh_converted_param(ctx):
    p = ctx.p
    param = ctx.side.new_param(_arange(3, 2), "w")
    param.hp_conformance_tag = 7
    p.refresh_converted_param(param)
    _same(p.to_numpy(param), _arange(3, 2), "values after refresh_converted_param")
    _check(getattr(param, "hp_conformance_tag", None) == 7,
           "refresh_converted_param dropped an attribute of the parameter")
    _check(p.param_requires_grad(param), "refresh_converted_param changed requires_grad")


@local_check
def check_is_tensor(ctx):
    p = ctx.p
    _check(p.is_tensor(p.zeros((2,), p.dtype("float32"))), "is_tensor(zeros) is False")
    _check(p.is_tensor(p.from_numpy(_arange(2))), "is_tensor(from_numpy) is False")
    _check(p.is_tensor(ctx.side.new_param(_arange(2), "conf_is_tensor")),
           "is_tensor(Parameter) is False")
    for obj in (np.zeros(2, np.float32), [1.0, 2.0], 1.0, None, "tensor"):
        _check(not p.is_tensor(obj), f"is_tensor({type(obj).__name__}) is True")
