"""Platform conformance checks: the contract of ``hyper_parallel.platform.base.Platform``,
written once and run on every platform.

Design note
-----------
Each check is a function of a ``Ctx`` (the platform, this rank, the world, the meshes) that
returns nothing and raises AssertionError with a message naming what broke; ``Skip`` says
the check does not apply to this platform (``release_storage`` where it cannot free memory).
The checks only call ``hp.get_platform()`` methods, ``hp.init_device_mesh``/``hp.track_comms``
and numpy. What a check cannot express through the platform (building a small model, asking
the framework for gradients) goes through ``framework_side()``, the one place that imports a
framework: a new platform adds a ``_<Name>Side`` class there and nothing else.

``run_checks(names)`` is the rank-side entry of tests/platform/test_conformance.py: it runs
the named checks in order on every rank of one launch (so the suite pays the framework's
start-up once per backend and world size) and returns ``{name: {"status", "detail",
"seconds"}}`` as plain Python.

Two kinds of checks:
- ``LOCAL_CHECKS``: one process's tensor, module and autograd behaviour (no collective);
  they run in the 2-rank launch, on both ranks.
- ``COLLECTIVE_CHECKS``: collectives, groups, meshes, CommStats; they run at every world size
  listed for them. Each issues all its collectives before asserting on values, so a failed
  assertion on one rank never leaves a peer waiting in a collective.

[Note: what "right" means for CommStats]
``op`` is what was asked, ``nbytes`` the buffer that crossed the wire (all-gather: output,
reduce-scatter: input, all-reduce/broadcast: the tensor) and ``wire`` what the framework ran:
the op itself unless the platform composes it; ``COMPOSED_WIRE`` lists the known compositions.
"""

from __future__ import annotations

import functools
import itertools
import time
import traceback

import numpy as np

import hyper_parallel as hp
from hyper_parallel.platform.base import Handle
from tests.kit import get_kit

#: (platform name, device type) -> {op: wire op, or {group size: wire op, None: otherwise}}
#: for collectives a platform composes over the whole world (the group the checks use).
COMPOSED_WIRE = {
    # a reduce-scatter over two ranks is an exchange of the chunks each peer owns (one
    # all-gather, the world group's flat one); over more, an all-reduce. (A list all-gather,
    # wire "all_gather_list", stands in on other groups: tests/test_hsdp.py checks it.)
    ("mindspore", "cpu"): {"reduce_scatter": {2: "all_gather", None: "all_reduce"}},
}

#: name -> bytes per element; every platform must know these names.
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int32": 4, "int64": 8}
#: numpy dtypes that round-trip through from_numpy/to_numpy (numpy has no bfloat16).
NUMPY_ROUND_TRIP = ("float32", "float64", "float16", "int32", "int64")


class Skip(Exception):
    """The check does not apply to this platform; the test reports it as skipped."""


# ====================================================================== framework side
def framework_side():
    """The small framework-specific helper of the current platform (imports it lazily)."""
    name = hp.get_platform().name
    if name == "torch":
        return _TorchSide()
    if name == "mindspore":
        return _MindSporeSide()
    raise NotImplementedError(f"tests/platform/conformance.py has no framework side for platform "
                              f"{name!r}: add a _<Name>Side class next to _TorchSide")


def _model_values(seed: int = 7) -> dict:
    rng = np.random.default_rng(seed)
    return {"fc1.weight": rng.standard_normal((3, 4)).astype(np.float32),
            "fc1.bias": rng.standard_normal(3).astype(np.float32),
            "inner.fc2.weight": rng.standard_normal((2, 3)).astype(np.float32),
            "inner.fc2.bias": rng.standard_normal(2).astype(np.float32)}


def model_reference(x: np.ndarray, values: dict | None = None) -> np.ndarray:
    """numpy forward of the model ``framework_side().model()`` builds: fc2(relu(fc1(x)))."""
    v = values or _model_values()
    h = np.maximum(x @ v["fc1.weight"].T + v["fc1.bias"], 0.0)
    return h @ v["inner.fc2.weight"].T + v["inner.fc2.bias"]


class _TorchSide:
    def __init__(self):
        import torch

        self.torch = torch

    def optimizer(self, kind: str, params: list):
        return {"adamw": self.torch.optim.AdamW, "sgd": self.torch.optim.SGD}[kind](params, lr=0.1)

    def model(self):
        """Root with ``fc1`` Linear(4, 3) and ``inner.fc2`` Linear(3, 2); fc2(relu(fc1(x)))."""
        torch, nn = self.torch, self.torch.nn

        class Inner(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc2 = nn.Linear(3, 2)

            def forward(self, x):
                return self.fc2(x)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(4, 3)
                self.inner = Inner()

            def forward(self, x):
                return self.inner(torch.relu(self.fc1(x)))

        net = Net()
        with torch.no_grad():
            for name, param in net.named_parameters():
                param.copy_(torch.from_numpy(_model_values()[name]))
        return net

    def new_param(self, array: np.ndarray, name: str, requires_grad: bool = True):
        return self.torch.nn.Parameter(self.torch.from_numpy(array.copy()),
                                       requires_grad=requires_grad)

    def deferred_param(self, shape: tuple, name: str):
        """A parameter with a shape and no values: on the meta device."""
        return self.torch.nn.Parameter(self.torch.empty(shape, device="meta"))

    def set_requires_grad(self, param, flag: bool) -> None:
        param.requires_grad_(flag)

    def tensor_parallel_param(self, array: np.ndarray, native_mesh, mesh_dim: str, dim: int):
        """``array`` as a DTensor parameter sharded on ``dim`` over ``native_mesh[mesh_dim]``
        (tensor parallelism; only torch has it)."""
        from torch.distributed.tensor import DTensor, Shard

        sub = native_mesh[mesh_dim]
        part = np.array_split(array, sub.size(), axis=dim)[sub.get_local_rank()]
        tensor = DTensor.from_local(self.torch.from_numpy(part.copy()), sub, [Shard(dim)],
                                    run_check=False)
        return self.torch.nn.Parameter(tensor)

    def weighted_sum(self, tensor, weights: np.ndarray):
        """sum(tensor * weights) as a differentiable scalar."""
        return (tensor * self.torch.from_numpy(weights)).sum()

    def backward(self, fn, arrays: list, params: list = ()) -> tuple:
        """Run ``fn(list_of_input_tensors) -> scalar`` and its backward; return
        ``(loss, [input grads], [param grads])`` as numpy (None where no gradient arrived)."""
        torch = self.torch
        inputs = [torch.from_numpy(np.array(a, dtype=np.float32)).requires_grad_(True)
                  for a in arrays]
        for param in params:
            param.grad = None
        loss = fn(inputs)
        loss.backward()
        platform = hp.get_platform()

        def grad_of(t):
            return None if t.grad is None else platform.to_numpy(t.grad)
        return (float(loss.detach()), [grad_of(t) for t in inputs], [grad_of(p) for p in params])


class _MindSporeSide:
    def __init__(self):
        import mindspore

        self.ms = mindspore

    def optimizer(self, kind: str, params: list):
        from mindspore.experimental.optim import SGD, AdamW

        return {"adamw": AdamW, "sgd": SGD}[kind](params, lr=0.1)

    def model(self):
        ms, nn, ops = self.ms, self.ms.nn, self.ms.ops

        class Inner(nn.Cell):
            def __init__(self):
                super().__init__()
                self.fc2 = nn.Dense(3, 2)

            def construct(self, x):
                return self.fc2(x)

        class Net(nn.Cell):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Dense(4, 3)
                self.inner = Inner()

            def construct(self, x):
                return self.inner(ops.relu(self.fc1(x)))

        net = Net()
        values = _model_values()
        for name, param in net.parameters_and_names():
            param.set_data(ms.Tensor(values[name]))
        return net

    def new_param(self, array: np.ndarray, name: str, requires_grad: bool = True):
        return self.ms.Parameter(self.ms.Tensor(array.copy()), name=name,
                                 requires_grad=requires_grad)

    def deferred_param(self, shape: tuple, name: str):
        """A parameter with a shape and no values: built under no_init_parameters()."""
        from mindspore.common.initializer import One, initializer
        from mindspore.nn.utils import no_init_parameters

        with no_init_parameters():
            return self.ms.Parameter(initializer(One(), shape, self.ms.float32), name=name)

    def set_requires_grad(self, param, flag: bool) -> None:
        param.requires_grad = flag

    def weighted_sum(self, tensor, weights: np.ndarray):
        return (tensor * self.ms.Tensor(weights)).sum()

    def backward(self, fn, arrays: list, params: list = ()) -> tuple:
        ms = self.ms
        inputs = [ms.Tensor(np.array(a, dtype=np.float32)) for a in arrays]
        params = list(params)
        position = tuple(range(len(inputs))) if inputs else None
        grad_fn = ms.value_and_grad(lambda *xs: fn(list(xs)), grad_position=position,
                                    weights=params or None)
        loss, grads = grad_fn(*inputs)

        def as_tuple(g):  # one position or one weight comes back as a bare tensor
            return (g,) if isinstance(g, ms.Tensor) else tuple(g)
        if inputs and params:
            input_grads, param_grads = as_tuple(grads[0]), as_tuple(grads[1])
        elif inputs:
            input_grads, param_grads = as_tuple(grads), ()
        else:
            input_grads, param_grads = (), as_tuple(grads)
        platform = hp.get_platform()
        as_np = [None if g is None else platform.to_numpy(g) for g in (*input_grads, *param_grads)]
        return float(loss.asnumpy()), as_np[:len(inputs)], as_np[len(inputs):]


# ====================================================================== context and registry
class Ctx:
    """What a check sees: the platform, this rank, the world, lazily the framework side."""

    def __init__(self):
        self.p = hp.get_platform()
        self.rank = self.p.rank()
        self.world = self.p.world_size()
        self.mesh1 = None  # 1-D ("shard",) mesh over the world
        self.mesh2 = None  # (2, world // 2) ("replicate", "shard") mesh, world >= 4
        self._side = None

    @property
    def side(self):
        if self._side is None:
            self._side = framework_side()
        return self._side

    def make_meshes(self, need_2d: bool) -> None:
        """Create the meshes up front, before any check, so every rank creates them at the
        same point whatever fails later."""
        device = self.p.device_type()
        self.mesh1 = hp.init_device_mesh(device, (self.world,), mesh_dim_names=("shard",))
        if need_2d:
            self.mesh2 = hp.init_device_mesh(device, (2, self.world // 2),
                                             mesh_dim_names=("replicate", "shard"))

    def wire(self, op: str) -> str:
        """The wire op of ``op`` over the whole world (the checks' group for CommStats)."""
        wire = COMPOSED_WIRE.get((self.p.name, self.p.device_type()), {}).get(op, op)
        return wire.get(self.world, wire[None]) if isinstance(wire, dict) else wire


LOCAL_CHECKS: dict = {}
COLLECTIVE_CHECKS: dict = {}  # name -> (function, applies(world_size) -> bool)


def local_check(fn):
    LOCAL_CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


def collective_check(min_world: int = 2, even: bool = False):
    def register(fn):
        def applies(world):
            return world >= min_world and (not even or world % 2 == 0)
        COLLECTIVE_CHECKS[fn.__name__.removeprefix("check_")] = (fn, applies)
        return fn
    return register


def local_check_names() -> list:
    return list(LOCAL_CHECKS)


def collective_check_names(world_size: int) -> list:
    return [name for name, (_, applies) in COLLECTIVE_CHECKS.items() if applies(world_size)]


def run_checks(names: list) -> dict:
    """Rank-side entry: run the named checks in order; plain-Python results per check."""
    ctx = Ctx()
    collective = [n for n in names if n in COLLECTIVE_CHECKS]
    if collective:
        ctx.make_meshes(need_2d=any(n.startswith("mesh2d_") for n in collective))
    results = {}
    for name in names:
        fn = LOCAL_CHECKS[name] if name in LOCAL_CHECKS else COLLECTIVE_CHECKS[name][0]
        start = time.perf_counter()
        try:
            fn(ctx)
            status, detail = "ok", ""
        except Skip as skip:
            status, detail = "skip", str(skip)
        except Exception:  # noqa: BLE001 - every failure is reported under its check's name
            status, detail = "fail", traceback.format_exc()
        results[name] = {"status": status, "detail": detail,
                         "seconds": round(time.perf_counter() - start, 4)}
    return results


# ====================================================================== assertion helpers
def _same(actual, expected, what: str, tol: float = 0.0) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {actual.shape}, expected {expected.shape}")
    if tol:
        np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64),
                                   rtol=tol, atol=tol, err_msg=what)
    else:
        np.testing.assert_array_equal(actual, expected, err_msg=what)


def _check(condition, message: str) -> None:
    if not condition:
        raise AssertionError(message)


@functools.lru_cache(maxsize=None)
def _kit():
    return get_kit()


def _storage_bytes(tensor) -> int:
    """Bytes the tensor's storage holds now (a test-kit helper: the core never asks)."""
    return _kit().storage_bytes(tensor)


def _values(ctx, tensor):
    return ctx.p.to_numpy(tensor)


def _f32(ctx, array) -> object:
    return ctx.p.from_numpy(np.asarray(array, dtype=np.float32))


def _arange(*shape, start: float = 0.0) -> np.ndarray:
    return (np.arange(int(np.prod(shape)), dtype=np.float32) + start).reshape(shape)


# ====================================================================== tensor primitives
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
    choice of delivery reads two of them, iteration.py; check_grad_placeholder_write_grad
    matches returns_grads_from_backward against grad_placeholder)."""
    import dataclasses

    from hyper_parallel.platform.capabilities import Capabilities

    caps = ctx.p.capabilities
    _check(isinstance(caps, Capabilities), f"capabilities is {type(caps).__name__}, "
           f"want a Capabilities")
    _check(ctx.p.capabilities == caps, "capabilities changed between two reads")
    try:
        setattr(caps, "can_release_storage", not caps.can_release_storage)
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("capabilities can be changed: want a frozen record")
    for field in dataclasses.fields(caps):
        value = getattr(caps, field.name)
        if field.name == "default_own_collective_bytes":
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
def check_optimizer_state(ctx):
    p = ctx.p
    params = [ctx.side.new_param(_arange(3, 2), "a"), ctx.side.new_param(_arange(4), "b")]
    opt = ctx.side.optimizer("adamw", params)
    undo = p.create_optimizer_state(opt)
    state = p.optimizer_state(opt)
    for param in params:
        moments = [t for name, owner, t in state if name == "exp_avg" and owner is param]
        _check(len(moments) == 1, f"optimizer_state lists {len(moments)} exp_avg of a parameter")
        _same(p.to_numpy(moments[0]), np.zeros(p.shape(param), np.float32),
              "a created exp_avg (zeros, shaped like its parameter)")
    if undo is not None:  # the optimizer had no state: undoing leaves it with none again
        undo()
        _check(not [s for s in p.optimizer_state(opt) if s[1] is not None],
               "create_optimizer_state's undo left per-parameter state behind")


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
def check_save_tensors_load_tensors(ctx):
    import os
    import tempfile

    p = ctx.p
    saved = {"a.weight": p.from_numpy(_arange(3, 2)), "step": p.from_numpy(np.array(3, np.int32)),
             "from_numpy": _arange(4)}
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, f"t.{p.checkpoint_extension}")
        p.save_tensors(saved, path)
        back = p.load_tensors(path)
    _check(sorted(back) == sorted(saved), f"load_tensors keys {sorted(back)}")
    for key, expected in (("a.weight", _arange(3, 2)), ("step", np.array(3, np.int32)),
                          ("from_numpy", _arange(4))):
        _same(p.to_numpy(back[key]), expected, f"save_tensors/load_tensors of {key}")


def check_adam_state(ctx):
    p = ctx.p
    params = [ctx.side.new_param(_arange(3, 2), "a"), ctx.side.new_param(_arange(4), "b")]
    opt = ctx.side.optimizer("adamw", params)
    _check([id(x) for x in p.adam_params(opt)] == [id(x) for x in params], "adam_params order")
    fresh = p.adam_state(opt, params[0])
    _check(fresh is None or fresh[0] == 0, f"state before any step: {fresh}")
    for param in params:
        moments = {"exp_avg": p.from_numpy(_arange(*p.shape(param), start=1.0)),
                   "exp_avg_sq": p.from_numpy(_arange(*p.shape(param), start=2.0))}
        p.set_adam_state(opt, param, 3, moments)
    for param in params:
        step, moments = p.adam_state(opt, param)
        _check(step == 3, f"step read back as {step}")
        _same(_values(ctx, moments["exp_avg_sq"]), _arange(*p.shape(param), start=2.0),
              "exp_avg_sq read back")
    try:
        p.adam_params(ctx.side.optimizer("sgd", params))
    except TypeError:
        return
    raise AssertionError("adam_params accepted SGD")


@local_check
def check_is_tensor(ctx):
    p = ctx.p
    _check(p.is_tensor(p.zeros((2,), p.dtype("float32"))), "is_tensor(zeros) is False")
    _check(p.is_tensor(p.from_numpy(_arange(2))), "is_tensor(from_numpy) is False")
    _check(p.is_tensor(ctx.side.new_param(_arange(2), "conf_is_tensor")),
           "is_tensor(Parameter) is False")
    for obj in (np.zeros(2, np.float32), [1.0, 2.0], 1.0, None, "tensor"):
        _check(not p.is_tensor(obj), f"is_tensor({type(obj).__name__}) is True")


@local_check
def check_cast(ctx):
    p = ctx.p
    f32 = p.dtype("float32")
    values = np.array([0.5, -1.25, 3.0, 1024.0, -0.0625], np.float32)  # exact in f16 and bf16
    t = p.from_numpy(values)
    for name in ("float64", "float16", "bfloat16"):
        out = p.cast(t, p.dtype(name))
        _check(p.dtype_of(out) == p.dtype(name), f"cast to {name} gave {p.dtype_of(out)}")
        _same(_values(ctx, p.cast(out, f32)), values, f"cast f32 -> {name} -> f32 values")
    _check(p.cast(t, f32) is t, "cast to the tensor's own dtype must return the same tensor")
    ints = p.cast(p.from_numpy(np.array([1, -2, 3], np.int64)), f32)
    _same(_values(ctx, ints), np.array([1, -2, 3], np.float32), "cast int64 -> f32")
    _same(_values(ctx, t), values, "cast changed its input")


@local_check
def check_reshape(ctx):
    p = ctx.p
    base = _arange(2, 3, 4)
    t = p.from_numpy(base)
    for shape in ((24,), (4, 6), [3, 8], (2, 12, 1)):
        out = p.reshape(t, shape)
        _check(p.shape(out) == tuple(shape), f"reshape to {shape}: shape {p.shape(out)}")
        _same(_values(ctx, out), base.reshape(shape), f"reshape to {shape} values")
    _same(_values(ctx, t), base, "reshape changed its input")


@local_check
def check_movedim(ctx):
    p = ctx.p
    base = _arange(2, 3, 4)
    t = p.from_numpy(base)
    for source, destination in ((0, 2), (2, 0), (1, 0), (0, 1), (1, 1)):
        out = p.movedim(t, source, destination)
        _same(_values(ctx, out), np.moveaxis(base, source, destination),
              f"movedim({source}, {destination}) values")
    flat = p.reshape(p.contiguous(p.movedim(t, 1, 0)), (24,))
    _same(_values(ctx, flat), np.moveaxis(base, 1, 0).reshape(24), "movedim+contiguous+reshape")
    flat = p.reshape(p.movedim(t, 1, 0), (24,))
    _same(_values(ctx, flat), np.moveaxis(base, 1, 0).reshape(24),
          "reshape of a movedim result (no contiguous in between)")


@local_check
def check_narrow(ctx):
    p = ctx.p
    base = _arange(5, 4)
    t = p.from_numpy(base)
    _same(_values(ctx, p.narrow(t, 0, 1, 3)), base[1:4], "narrow(dim 0, 1, 3)")
    _same(_values(ctx, p.narrow(t, 0, 0, 2)), base[0:2], "narrow(dim 0, 0, 2)")
    _same(_values(ctx, p.narrow(t, 1, 2, 2)), base[:, 2:4], "narrow(dim 1, 2, 2)")
    _same(_values(ctx, p.narrow(p.narrow(t, 0, 1, 3), 1, 1, 2)), base[1:4, 1:3],
          "narrow of a narrow")
    flat = p.reshape(t, (20,))
    _same(_values(ctx, p.narrow(flat, 0, 7, 6)), base.reshape(20)[7:13], "narrow of a reshape")
    _same(_values(ctx, p.reshape(p.narrow(flat, 0, 8, 8), (2, 4))), base.reshape(20)[8:16]
          .reshape(2, 4), "reshape of a narrow at an offset")
    _same(_values(ctx, t), base, "narrow changed its input")


@local_check
def check_narrow_empty(ctx):
    """Uneven sharding leaves some ranks an empty shard: narrow(.., start=rows, length=0)."""
    p = ctx.p
    base = _arange(3, 4)
    t = p.from_numpy(base)
    empty = p.narrow(t, 0, 3, 0)
    _check(p.shape(empty) == (0, 4), f"narrow(dim 0, 3, 0) shape {p.shape(empty)}")
    _same(_values(ctx, p.contiguous(empty)), np.zeros((0, 4), np.float32), "contiguous(empty)")
    _same(_values(ctx, p.cat([empty, p.zeros((2, 4), p.dtype("float32"))], 0)),
          np.zeros((2, 4), np.float32), "cat of an empty tensor and a (2, 4) one")
    _check(p.shape(p.movedim(p.narrow(p.movedim(t, 1, 0), 0, 4, 0), 0, 1)) == (3, 0),
           "narrow to 0 along a moved dim")


@local_check
def check_core_shard_pattern(ctx):
    """The core's sharding read: narrow(movedim(t, d, 0), 0, start, rows) moved back, made
    contiguous, flattened, padded with cat, and the full tensor rebuilt from that."""
    p = ctx.p
    base = _arange(5, 6, 3)
    t = p.from_numpy(base)
    for dim in (0, 1):
        moved = np.moveaxis(base, dim, 0)
        local = p.narrow(p.movedim(t, dim, 0), 0, 2, 2)
        local = p.contiguous(p.movedim(local, 0, dim))
        expected = np.moveaxis(moved[2:4], 0, dim)
        _same(_values(ctx, local), expected, f"shard rows 2:4 along dim {dim}")
        flat = p.reshape(p.movedim(local, dim, 0), (expected.size,))
        padded = p.cat([flat, p.zeros((5,), p.dtype("float32"))], 0)
        _same(_values(ctx, padded), np.concatenate([moved[2:4].reshape(-1), np.zeros(5)]),
              f"flat padded shard along dim {dim}")


@local_check
def check_cat(ctx):
    p = ctx.p
    a, b, c = _arange(2, 3), _arange(1, 3, start=100), _arange(2, 2, start=50)
    ta, tb, tc = p.from_numpy(a), p.from_numpy(b), p.from_numpy(c)
    _same(_values(ctx, p.cat([ta, tb], 0)), np.concatenate([a, b], 0), "cat dim 0")
    _same(_values(ctx, p.cat((ta, tc), 1)), np.concatenate([a, c], 1), "cat dim 1 (tuple)")
    _same(_values(ctx, p.cat([ta, tb, ta])), np.concatenate([a, b, a], 0), "cat of three, default dim")
    out = p.cat([ta, tb], 0)
    p.copy_into(out, p.from_numpy(np.full((3, 3), -1, np.float32)))
    _same(_values(ctx, ta), a, "writing the result of cat changed an input")
    single = p.cat([ta], 0)
    _check(p.is_tensor(single), "cat of a single-tensor list did not return a tensor")
    _same(_values(ctx, single), a, "cat of one tensor")
    p.copy_into(single, p.from_numpy(np.full((2, 3), -1, np.float32)))
    _same(_values(ctx, single), np.full((2, 3), -1, np.float32), "copy_into the cat result")
    _same(_values(ctx, ta), a, "cat([t]) must be a new tensor: writing it changed t")
    _same(_values(ctx, p.cat([p.narrow(ta, 1, 1, 2), p.narrow(tc, 1, 0, 2)], 1)),
          np.concatenate([a[:, 1:3], c[:, 0:2]], 1), "cat of narrowed inputs")


@local_check
def check_contiguous(ctx):
    p = ctx.p
    base = _arange(3, 4)
    t = p.from_numpy(base)
    strided = p.contiguous(p.movedim(t, 0, 1))
    _same(_values(ctx, strided), base.T, "contiguous(movedim) values")
    p.copy_into(strided, p.from_numpy(np.zeros((4, 3), np.float32)))
    _same(_values(ctx, t), base, "contiguous of a strided read must own its memory: writing it "
          "changed the base")
    _same(_values(ctx, p.contiguous(p.narrow(t, 0, 1, 2))), base[1:3],
          "contiguous(narrow along dim 0 at an offset) values")
    part = p.contiguous(p.narrow(t, 1, 1, 2))  # a strided read
    _same(_values(ctx, part), base[:, 1:3], "contiguous(narrow along dim 1) values")
    p.copy_into(part, p.from_numpy(np.zeros((3, 2), np.float32)))
    _same(_values(ctx, t), base, "contiguous(narrow along dim 1) must own its memory: writing "
          "it changed the base")
    _same(_values(ctx, p.contiguous(t)), base, "contiguous of a dense tensor")


@local_check
def check_clone(ctx):
    p = ctx.p
    base = _arange(3, 4)
    t = p.from_numpy(base)
    for how, source, expected in (("a dense tensor", t, base),
                                  ("narrow at offset 0", p.narrow(t, 0, 0, 2), base[0:2]),
                                  ("narrow at an offset", p.narrow(t, 0, 1, 2), base[1:3]),
                                  ("movedim", p.movedim(t, 0, 1), base.T)):
        copy = p.clone(source)
        _check(p.dtype_of(copy) == p.dtype_of(source), f"clone of {how}: dtype {p.dtype_of(copy)}")
        _same(_values(ctx, copy), expected, f"clone of {how}: values")
        p.copy_into(copy, p.from_numpy(np.full(expected.shape, -1, np.float32)))
        _same(_values(ctx, t), base, f"clone of {how} must own its memory: writing the clone "
              "changed the original")
    copy = p.clone(t)
    p.copy_into(t, p.from_numpy(np.zeros((3, 4), np.float32)))
    _same(_values(ctx, copy), base, "writing the original changed its clone")
    half = p.cast(p.from_numpy(base), p.dtype("float16"))
    _check(p.dtype_of(p.clone(half)) == p.dtype("float16"), "clone of float16 changed the dtype")


@local_check
def check_join_from_launcher_env(ctx):
    """Outside the framework's own launcher (hp-run set RANK etc.) it must not join."""
    p = ctx.p
    world = p.world_size()
    _check(p.join_from_launcher_env() is False, "join_from_launcher_env joined without its launcher")
    _check(p.is_initialized() and p.world_size() == world, "join_from_launcher_env changed the group")


@local_check
def check_alias(ctx):
    """alias: same values and memory under a new object, usable as a new node's output."""
    p = ctx.p
    base = _arange(3, 4)
    t = p.from_numpy(base)
    alias = p.alias(t)
    _same(_values(ctx, alias), base, "alias: values")
    _check(p.shape(alias) == (3, 4), f"alias: shape {p.shape(alias)}")
    p.copy_into(t, p.from_numpy(np.zeros((3, 4), np.float32)))
    _same(_values(ctx, alias), np.zeros((3, 4), np.float32), "alias must share the original's memory")


@local_check
def check_scale(ctx):
    p = ctx.p
    base = np.array([1.0, -2.0, 0.5, 4.0], np.float32)
    for name in ("float32", "float16"):
        t = p.cast(p.from_numpy(base), p.dtype(name))
        for factor in (0.25, 3.0, 1.0):
            out = p.scale(t, factor)
            _check(p.dtype_of(out) == p.dtype(name), f"scale of {name} by {factor} gave "
                   f"{p.dtype_of(out)}")
            _same(_values(ctx, p.cast(out, p.dtype("float32"))), base * factor,
                  f"scale({name}, {factor}) values")
            p.copy_into(out, p.cast(p.from_numpy(np.zeros(4, np.float32)), p.dtype(name)))
            _same(_values(ctx, p.cast(t, p.dtype("float32"))), base,
                  f"scale({name}, {factor}) must return a new tensor: writing it changed the input")
    view = p.narrow(p.from_numpy(_arange(8)), 0, 3, 4)
    _same(_values(ctx, p.scale(view, 2.0)), _arange(8)[3:7] * 2, "scale of a narrow")
    # may_overwrite: the value is the same whether or not the platform scales in place
    for name in ("float32", "float16"):
        own = p.cast(p.from_numpy(base), p.dtype(name))
        out = p.scale(own, 0.5, may_overwrite=True)
        _check(p.dtype_of(out) == p.dtype(name), f"scale(may_overwrite) of {name} gave "
               f"{p.dtype_of(out)}")
        _same(_values(ctx, p.cast(out, p.dtype("float32"))), base * 0.5,
              f"scale({name}, 0.5, may_overwrite=True) values")


@local_check
def check_vector_norm(ctx):
    p = ctx.p
    base = np.array([[3.0, -4.0, 0.5], [0.0, 2.0, -1.5]], np.float32)
    for name in ("float32", "float16", "bfloat16"):
        t = p.cast(p.from_numpy(base), p.dtype(name))
        for norm_type in (2.0, 1.0, 3.0, float("inf")):
            out = p.vector_norm(t, norm_type)
            _check(p.dtype_of(out) == p.dtype("float32") and p.shape(out) == (),
                   f"vector_norm of {name} gave {p.dtype_of(out)} {p.shape(out)}: want a 0-d float32")
            expected = np.linalg.norm(base.reshape(-1).astype(np.float64), norm_type)
            _same(_values(ctx, out), np.float32(expected), f"vector_norm({name}, {norm_type})",
                  tol=1e-6)
    _same(_values(ctx, p.vector_norm(p.narrow(p.from_numpy(base), 1, 1, 1), 2.0)),
          np.float32(np.sqrt(20.0)), "vector_norm of a narrow", tol=1e-6)


@local_check
def check_param_grad(ctx):
    p = ctx.p
    if p.capabilities.returns_grads_from_backward:
        raise Skip("gradients are returned by backward, not attached to the parameters")
    param = ctx.side.new_param(np.ones(3, np.float32), "w")
    _check(p.param_grad(param) is None, "param_grad of a parameter without a gradient: want None")
    weights = np.array([1.0, -2.0, 3.0], np.float32)
    ctx.side.backward(lambda _: ctx.side.weighted_sum(param, weights), [], [param])
    grad = p.param_grad(param)
    _same(_values(ctx, grad), weights, "param_grad after backward")
    p.copy_into(grad, p.scale(grad, 0.5))  # the clipping's in-place write reaches the gradient
    _same(_values(ctx, p.param_grad(param)), weights * 0.5, "copy_into the gradient param_grad gave")


@local_check
def check_add(ctx):
    p = ctx.p
    a, b = _arange(2, 3), _arange(2, 3, start=10) * -1
    ta, tb = p.from_numpy(a), p.from_numpy(b)
    out = p.add(ta, tb)
    _same(_values(ctx, out), a + b, "add values")
    _same(_values(ctx, ta), a, "add changed a")
    _same(_values(ctx, tb), b, "add changed b")
    _check(p.dtype_of(out) == p.dtype("float32"), f"add of f32 gave {p.dtype_of(out)}")
    p.copy_into(out, p.from_numpy(np.zeros((2, 3), np.float32)))
    _same(_values(ctx, ta), a, "add's result aliases a")
    _same(_values(ctx, tb), b, "add's result aliases b")
    zero = p.zeros((2, 3), p.dtype("float32"))
    out = p.add(zero, ta)
    p.copy_into(out, p.from_numpy(np.ones((2, 3), np.float32)))
    _same(_values(ctx, zero), np.zeros((2, 3)), "add(zeros, t) aliases its first input")
    _same(_values(ctx, ta), a, "add(zeros, t) aliases its second input")
    halves = p.add(p.narrow(ta, 1, 0, 1), p.narrow(tb, 1, 2, 1))
    _same(_values(ctx, halves), a[:, 0:1] + b[:, 2:3], "add of narrowed inputs")


@local_check
def check_copy_into(ctx):
    p = ctx.p
    for shape, name in (((6,), "float32"), ((2, 3), "float32"), ((4,), "float16"),
                        ((3,), "int64")):
        src_np = (np.arange(int(np.prod(shape))) + 1).reshape(shape).astype(name)
        dst, src = p.zeros(shape, p.dtype(name)), p.from_numpy(src_np)
        p.copy_into(dst, src)
        _same(p.to_numpy(dst), src_np, f"copy_into {name}{shape}: dst read back")
        _same(p.to_numpy(src), src_np, f"copy_into {name}{shape} changed src")
        p.copy_into(src, p.from_numpy(np.zeros(shape, name)))
        _same(p.to_numpy(dst), src_np, f"copy_into {name}{shape} made dst alias src")
    param = ctx.side.new_param(np.zeros(3, np.float32), "conf_copy_into")
    p.copy_into(param, _f32(ctx, [7, 8, 9]))
    _same(_values(ctx, param), np.array([7, 8, 9], np.float32), "copy_into a Parameter")


@local_check
def check_copy_into_from_view(ctx):
    """``src`` may be any read: a narrow (at offset 0 or not), a movedim, their contiguous()."""
    p = ctx.p
    base = _arange(10)
    src = p.from_numpy(base)
    failures = []
    for start in (4, 0):
        for how, make in (("narrow", lambda: p.narrow(src, 0, start, 4)),
                          ("contiguous(narrow)", lambda: p.contiguous(p.narrow(src, 0, start, 4)))):
            dst = p.zeros((4,), p.dtype("float32"))
            try:
                p.copy_into(dst, make())
                _same(_values(ctx, dst), base[start:start + 4], "")
            except Exception as error:  # noqa: BLE001 - collect every failing form
                failures.append(f"copy_into(dst, {how}(src of 10, dim 0, start {start}, "
                                f"length 4)): {type(error).__name__}: "
                                f"{str(error).strip().splitlines()[0]}")
    for how, make in (("movedim", lambda m: p.movedim(m, 0, 1)),
                      ("contiguous(movedim)", lambda m: p.contiguous(p.movedim(m, 0, 1)))):
        dst = p.zeros((3, 2), p.dtype("float32"))
        try:
            p.copy_into(dst, make(p.from_numpy(_arange(2, 3))))
            _same(_values(ctx, dst), _arange(2, 3).T, "")
        except Exception as error:  # noqa: BLE001
            failures.append(f"copy_into(dst, {how}): {type(error).__name__}: "
                            f"{str(error).strip().splitlines()[0]}")
    _check(not failures, "copy_into from a read of another tensor failed:\n  "
           + "\n  ".join(failures))


@local_check
def check_copy_into_slice(ctx):
    """Every dim, at the start, the middle and the end, from a contiguous or strided read;
    the rest of ``dst`` keeps its values and ``src`` is not aliased."""
    p = ctx.p
    base = _arange(4, 6)
    for dim, start, length in ((0, 0, 2), (0, 1, 2), (0, 3, 1), (1, 0, 6), (1, 2, 3), (1, 5, 1)):
        shape = list(base.shape)
        shape[dim] = length
        src_np = -1 - _arange(*shape)
        for how, src in (("dense", p.from_numpy(src_np)),
                         ("movedim", p.movedim(p.from_numpy(np.ascontiguousarray(
                             np.moveaxis(src_np, 1, 0))), 0, 1))):
            dst = p.from_numpy(base)
            p.copy_into_slice(dst, dim, start, src)
            expected = base.copy()
            index = [slice(None)] * 2
            index[dim] = slice(start, start + length)
            expected[tuple(index)] = src_np
            _same(_values(ctx, dst), expected,
                  f"copy_into_slice(dim {dim}, start {start}, length {length}, {how} src)")
            p.copy_into(src, p.from_numpy(np.zeros(shape, np.float32)))
            _same(_values(ctx, dst), expected,
                  f"copy_into_slice(dim {dim}, start {start}) made dst alias src")
    param = ctx.side.new_param(np.zeros((3, 2), np.float32), "conf_copy_into_slice")
    p.copy_into_slice(param, 0, 1, _f32(ctx, [[7, 8]]))
    _same(_values(ctx, param), np.array([[0, 0], [7, 8], [0, 0]], np.float32),
          "copy_into_slice of a Parameter")


@local_check
def check_storage_bytes(ctx):
    p = ctx.p
    for name in ("float32", "float16", "int64"):
        t = p.zeros((3, 5), p.dtype(name))
        expected = 15 * DTYPE_SIZES[name]
        _check(_storage_bytes(t) == expected,
               f"storage_bytes of zeros((3, 5), {name}) = {_storage_bytes(t)}, want {expected}")


@local_check
def check_release_restore_storage(ctx):
    p = ctx.p
    if not p.capabilities.can_release_storage:
        raise Skip(f"{p.name}: can_release_storage is False")
    for how, t in (("zeros", p.zeros((3, 4), p.dtype("float32"))),
                   ("add", p.add(p.zeros((3, 4), p.dtype("float32")), p.zeros((3, 4), p.dtype("float32")))),
                   ("cat", p.cat([p.zeros((1, 4), p.dtype("float32")), p.zeros((2, 4), p.dtype("float32"))]))):
        p.release_storage(t)
        _check(_storage_bytes(t) == 0, f"{how}: after release_storage, storage_bytes "
               f"{_storage_bytes(t)}")
        _check(p.shape(t) == (3, 4), f"{how}: release_storage changed the shape to {p.shape(t)}")
        p.release_storage(t)  # releasing twice is harmless
        p.restore_storage(t)
        _check(_storage_bytes(t) == 48, f"{how}: after restore_storage, storage_bytes "
               f"{_storage_bytes(t)}")
        p.restore_storage(t)  # restoring twice is harmless
        _check(_storage_bytes(t) == 48, f"{how}: after a second restore, storage_bytes "
               f"{_storage_bytes(t)}")
        p.copy_into(t, p.from_numpy(_arange(3, 4, start=5)))
        _same(_values(ctx, t), _arange(3, 4, start=5), f"{how}: values after restore + copy_into")


@local_check
def check_release_restore_shared_buffer(ctx):
    """Full parameters may be reads of one gathered buffer at different offsets: releasing
    and restoring each, then refilling each, gives every one its values."""
    p = ctx.p
    if not p.capabilities.can_release_storage:
        raise Skip(f"{p.name}: can_release_storage is False")
    buffer = p.zeros((10,), p.dtype("float32"))
    first = p.contiguous(p.narrow(buffer, 0, 0, 4))
    second = p.contiguous(p.reshape(p.narrow(buffer, 0, 4, 6), (2, 3)))
    for t in (first, second):
        p.release_storage(t)
    _check(_storage_bytes(first) == 0 and _storage_bytes(second) == 0,
           "release_storage of reads of one buffer did not free it")
    for t in (first, second):
        p.restore_storage(t)
    p.copy_into(first, p.from_numpy(_arange(4, start=1)))
    p.copy_into(second, p.from_numpy(_arange(2, 3, start=-6)))
    _same(_values(ctx, first), _arange(4, start=1), "first read after restore + copy_into")
    _same(_values(ctx, second), _arange(2, 3, start=-6), "second read (at offset 4) after "
          "restore + copy_into")


@local_check
def check_release_storage_of_from_numpy(ctx):
    """Every tensor the platform makes can be released, from_numpy's too."""
    p = ctx.p
    if not p.capabilities.can_release_storage:
        raise Skip(f"{p.name}: can_release_storage is False")
    t = p.from_numpy(_arange(3, 4))
    p.release_storage(t)
    _check(_storage_bytes(t) == 0, f"after release_storage: storage_bytes {_storage_bytes(t)}")
    p.restore_storage(t)
    p.copy_into(t, p.from_numpy(_arange(3, 4, start=5)))
    _same(_values(ctx, t), _arange(3, 4, start=5), "values after restore + copy_into")


@local_check
def check_kept_released_memory_is_never_shared(ctx):
    """Memory ``keep_released_memory`` lets a platform keep goes to one tensor at a time:
    released tensors restored and new ``empty`` tensors of the same size (which a pool
    would serve from kept blocks) each hold their own values, and a view of a released
    tensor reads what the restored tensor is refilled with."""
    p = ctx.p
    if not p.capabilities.can_release_storage:
        raise Skip(f"{p.name}: can_release_storage is False")
    f32 = p.dtype("float32")
    p.keep_released_memory(1 << 20)
    first, second = p.zeros((8, 16), f32), p.zeros((8, 16), f32)
    view = p.narrow(second, 0, 2, 3)
    p.release_storage(first)
    p.release_storage(second)
    fresh = [p.empty((8, 16), f32), p.empty((128,), f32)]  # same bytes as the released two
    p.restore_storage(second)
    p.restore_storage(first)
    later = p.empty((8, 16), f32)
    tensors = [first, second, *fresh, later]
    for k, t in enumerate(tensors):
        p.copy_into(t, p.from_numpy(_arange(*p.shape(t), start=1000.0 * k)))
    for k, t in enumerate(tensors):
        _same(_values(ctx, t), _arange(*p.shape(t), start=1000.0 * k),
              f"tensor {k} of {len(tensors)} (released+restored or new) lost its values: "
              "two tensors share memory")
    _same(_values(ctx, view), _arange(8, 16, start=1000.0)[2:5],
          "a view of a released tensor does not read it after restore + refill")


@local_check
def check_release_restore_under_autograd(ctx):
    """FSDP2's reshard-after-forward: a tensor autograd saved is released after forward,
    restored and refilled (in a grad hook) before backward uses it; the gradient sees the
    refilled values and autograd does not complain."""
    p = ctx.p
    if not p.capabilities.can_release_storage:
        raise Skip(f"{p.name}: can_release_storage is False")
    weights = _arange(2, 3, start=1)
    refill = _arange(2, 3, start=-4) * 0.5
    coef = _arange(2, 3) * 0.1 + 1
    refilled = []

    def loss_fn(inputs):
        full = p.zeros((2, 3), p.dtype("float32"))
        with p.no_grad():
            p.copy_into(full, p.from_numpy(weights))
        product = inputs[0] * full  # autograd saves ``full`` for the gradient of inputs[0]

        def before_backward():
            p.restore_storage(full)
            p.copy_into(full, p.from_numpy(refill))
            refilled.append(True)
        p.register_grad_hook(product, before_backward)
        p.release_storage(full)
        _check(_storage_bytes(full) == 0, "release_storage under autograd did not free")
        return ctx.side.weighted_sum(product, coef)

    _, (grad,), _ = ctx.side.backward(loss_fn, [np.ones((2, 3), np.float32)])
    _check(refilled == [True], f"grad hook ran {len(refilled)} times, expected once")
    _same(grad, refill * coef, "gradient after release/restore/copy_into", tol=1e-6)


@local_check
def check_no_grad_and_is_grad_enabled(ctx):
    p = ctx.p
    enabled = p.is_grad_enabled()
    _check(isinstance(enabled, bool), f"is_grad_enabled returned {type(enabled).__name__}")
    with p.no_grad():
        inside = p.is_grad_enabled()
        out = p.scale(p.from_numpy(_arange(3)), 2.0)
    _check(isinstance(inside, bool), f"is_grad_enabled in no_grad returned {type(inside).__name__}")
    _same(_values(ctx, out), _arange(3) * 2, "computing inside no_grad")
    _check(p.is_grad_enabled() == enabled, "no_grad did not restore is_grad_enabled on exit")
    try:
        with p.no_grad():
            raise KeyError("inside")
    except KeyError:
        pass
    _check(p.is_grad_enabled() == enabled, "no_grad did not restore grad mode after an exception")


@local_check
def check_is_grad_enabled_reflects_no_grad(ctx):
    """Outside no_grad operations are recorded (True), inside they are not (False)."""
    p = ctx.p
    _check(p.is_grad_enabled() is True, "is_grad_enabled() is not True outside no_grad")
    with p.no_grad():
        inside = p.is_grad_enabled()
    _check(inside is False, f"is_grad_enabled() is {inside!r} inside platform.no_grad()")


@local_check
def check_no_grad_stops_gradient(ctx):
    """An operation run inside ``no_grad`` is not recorded: no gradient flows through it."""
    p = ctx.p

    def loss_fn(inputs):
        x = inputs[0]
        with p.no_grad():
            frozen = p.scale(x, 3.0)
        return ctx.side.weighted_sum(p.add(p.scale(x, 2.0), frozen), np.ones(3, np.float32))

    _, (grad,), _ = ctx.side.backward(loss_fn, [np.ones(3, np.float32)])
    _same(grad, np.full(3, 2.0, np.float32),
          "gradient of sum(2x + no_grad(3x)) (3x must not contribute)", tol=1e-6)


# ====================================================================== modules and parameters
@local_check
def check_named_modules(ctx):
    p = ctx.p
    model = ctx.side.model()
    named = p.named_modules(model)
    names = [n for n, _ in named]
    _check(named and named[0][0] == "" and named[0][1] is model,
           f"named_modules must start with ('', root); got {names}")
    _check(sorted(names) == ["", "fc1", "inner", "inner.fc2"],
           f"named_modules names {names}, expected '', 'fc1', 'inner', 'inner.fc2'")
    by_name = dict(named)
    _check(by_name["fc1"] is model.fc1 and by_name["inner.fc2"] is model.inner.fc2,
           "named_modules returned other objects than the submodules")


@local_check
def check_direct_params(ctx):
    p = ctx.p
    model = ctx.side.model()
    _check(p.direct_params(model) == [], f"root has no direct params, got {p.direct_params(model)}")
    fc1 = dict(p.direct_params(model.fc1))
    _check(sorted(fc1) == ["bias", "weight"], f"direct_params(fc1) names {sorted(fc1)}")
    _check(fc1["weight"] is model.fc1.weight and fc1["bias"] is model.fc1.bias,
           "direct_params(fc1) did not return the registered parameter objects")
    _same(_values(ctx, fc1["weight"]), _model_values()["fc1.weight"], "fc1.weight values")
    _check(p.is_tensor(fc1["weight"]), "a direct param is not a tensor")


@local_check
def check_param_requires_grad(ctx):
    p = ctx.p
    model = ctx.side.model()
    _check(p.param_requires_grad(model.fc1.weight) is True, "param_requires_grad of a fresh param")
    ctx.side.set_requires_grad(model.fc1.bias, False)
    _check(p.param_requires_grad(model.fc1.bias) is False, "param_requires_grad of a frozen param")
    frozen = ctx.side.new_param(_arange(2), "conf_frozen", requires_grad=False)
    _check(p.param_requires_grad(frozen) is False, "param_requires_grad(requires_grad=False)")


@local_check
def check_register_param(ctx):
    p = ctx.p
    model = ctx.side.model()
    x = _arange(2, 4) * 0.1
    new_weight = np.full((3, 4), 0.5, np.float32)
    replacement = ctx.side.new_param(new_weight, "fc1.weight")
    p.register_param(model.fc1, "weight", replacement)
    params = dict(p.direct_params(model.fc1))
    _check(params["weight"] is replacement, "direct_params does not return the registered param")
    _check(sorted(params) == ["bias", "weight"], f"names after register_param: {sorted(params)}")
    _check(model.fc1.weight is replacement, "module.weight does not read the registered param")
    values = dict(_model_values(), **{"fc1.weight": new_weight})
    _same(_values(ctx, model(_f32(ctx, x))), model_reference(x, values),
          "forward after register_param", tol=1e-5)
    extra = ctx.side.new_param(_arange(3), "fc1.extra")
    p.register_param(model.fc1, "extra", extra)
    params = dict(p.direct_params(model.fc1))
    _check(params.get("extra") is extra, f"register_param did not add a new name: {sorted(params)}")


@local_check
def check_attach_detach_tensor(ctx):
    p = ctx.p
    model = ctx.side.model()
    param = model.fc1.weight
    x = _arange(2, 4) * 0.1
    full_np = np.full((3, 4), -0.25, np.float32)
    full = p.from_numpy(full_np)
    p.register_param(model.fc1, "weight", param)  # as fully_shard registers the sharded one
    p.attach_tensor(model.fc1, "weight", full)
    _check(model.fc1.weight is full, "after attach_tensor, module.weight is not the tensor")
    registered = dict(p.direct_params(model.fc1))["weight"]
    expected = full if p.capabilities.registers_full_tensors else param
    _check(registered is expected, f"after attach_tensor, direct_params returns {registered!r}; "
           f"registers_full_tensors={p.capabilities.registers_full_tensors}")
    values = dict(_model_values(), **{"fc1.weight": full_np})
    _same(_values(ctx, model(_f32(ctx, x))), model_reference(x, values),
          "forward with the attached tensor", tol=1e-5)
    p.detach_tensor(model.fc1, "weight")
    _check(model.fc1.weight is param, "after detach_tensor, module.weight is not the param")
    _check(dict(p.direct_params(model.fc1))["weight"] is param,
           "after detach_tensor, direct_params does not return the registered param")
    _same(_values(ctx, model(_f32(ctx, x))), model_reference(x), "forward after detach", tol=1e-5)
    p.detach_tensor(model.fc1, "weight")  # detaching twice is harmless
    _check(model.fc1.weight is param, "a second detach_tensor lost the param")


@local_check
def check_forward_hooks(ctx):
    p = ctx.p
    model = ctx.side.model()
    x = _arange(2, 4) * 0.1
    seen = []

    def pre(module, args, kwargs):
        seen.append(("pre", module, tuple(_values(ctx, a) for a in args), dict(kwargs)))
        return (p.scale(args[0], 2.0), *args[1:]), kwargs

    def post(module, args, kwargs, output):
        seen.append(("post", module, tuple(_values(ctx, a) for a in args), _values(ctx, output)))
        return p.scale(output, 3.0)

    handles = p.register_forward_hooks(model, pre, post)
    _check(isinstance(handles, list), f"register_forward_hooks returned {type(handles).__name__}")
    out = _values(ctx, model(_f32(ctx, x)))
    _check([s[0] for s in seen] == ["pre", "post"], f"hook calls {[s[0] for s in seen]}")
    _check(seen[0][1] is model and seen[1][1] is model, "hooks did not receive the module")
    _check(len(seen[0][2]) == 1, f"pre-hook saw {len(seen[0][2])} args, expected 1")
    _same(seen[0][2][0], x, "pre-hook args", tol=1e-6)
    _check(seen[0][3] == {}, f"pre-hook kwargs {seen[0][3]}")
    _same(seen[1][3], model_reference(2 * x), "post-hook output (forward of the replaced args)",
          tol=1e-5)
    _same(out, 3 * model_reference(2 * x), "output replaced by the post-hook", tol=1e-5)
    for handle in handles:
        handle.remove()
    seen.clear()
    _same(_values(ctx, model(_f32(ctx, x))), model_reference(x), "forward after remove()",
          tol=1e-5)
    _check(seen == [], f"hooks still ran after remove(): {[s[0] for s in seen]}")

    def pre_none(module, args, kwargs):
        seen.append(("pre", module))

    def post_none(module, args, kwargs, output):
        seen.append(("post", module))
    handles = p.register_forward_hooks(model.inner, pre_none, post_none)
    _same(_values(ctx, model(_f32(ctx, x))), model_reference(x),
          "hooks returning None must leave args and output unchanged", tol=1e-5)
    _check([(s[0], s[1] is model.inner) for s in seen] == [("pre", True), ("post", True)],
           f"hooks on a submodule: {[(s[0], type(s[1]).__name__) for s in seen]}")
    for handle in handles:
        handle.remove()


@local_check
def check_forward_hooks_under_autograd(ctx):
    """A pre-hook's replaced args take part in the gradient (the core gathers in hooks)."""
    p = ctx.p
    model = ctx.side.model()
    x = _arange(2, 4) * 0.1 - 0.3
    weights = _arange(2, 2) + 1
    calls = []

    def pre(module, args, kwargs):
        calls.append("pre")
        return (p.scale(args[0], 2.0),), kwargs

    def post(module, args, kwargs, output):
        calls.append("post")
    handles = p.register_forward_hooks(model, pre, post)
    _, (hooked,), _ = ctx.side.backward(
        lambda xs: ctx.side.weighted_sum(model(xs[0]), weights), [x])
    for handle in handles:
        handle.remove()
    _, (plain,), _ = ctx.side.backward(
        lambda xs: ctx.side.weighted_sum(model(p.scale(xs[0], 2.0)), weights), [x])
    _check(calls == ["pre", "post"], f"hooks under autograd ran {calls}")
    _same(hooked, plain, "gradient through the pre-hook's replaced input", tol=1e-5)


# ====================================================================== autograd
def _differentiable_pair(ctx, log):
    """forward: [2x, x + y]; backward: the exact chain rule, logging every call."""
    p = ctx.p

    def forward_fn(inputs):
        log.append(("forward", len(inputs)))
        x, y = inputs
        return [p.scale(x, 2.0), p.add(x, y)]

    def backward_fn(grads):
        log.append(("backward", [None if g is None else _values(ctx, g) for g in grads]))
        g0, g1 = grads
        return [p.add(p.scale(g0, 2.0), g1), p.scale(g1, 1.0)]
    return forward_fn, backward_fn


@local_check
def check_differentiable_call(ctx):
    p = ctx.p
    x, y = _arange(3) + 1, _arange(3) * -0.5
    a, b, c = _arange(3) + 0.5, np.array([1, -1, 2], np.float32), np.array([3, 0, -2], np.float32)
    log, outputs = [], []
    forward_fn, backward_fn = _differentiable_pair(ctx, log)

    def loss_fn(inputs):
        out = p.differentiable_call(inputs, forward_fn, backward_fn)
        outputs.append([_values(ctx, o) for o in out])
        _check(isinstance(out, list) and len(out) == 2, f"differentiable_call returned {out!r}")
        # the first output is used twice: its two gradients must arrive summed, in one call
        return (ctx.side.weighted_sum(out[0], a) + ctx.side.weighted_sum(out[0], b)
                + ctx.side.weighted_sum(out[1], c))

    loss, (gx, gy), _ = ctx.side.backward(loss_fn, [x, y])
    _same(outputs[0][0], 2 * x, "forward output 0")
    _same(outputs[0][1], x + y, "forward output 1")
    _same(loss, float(np.sum(2 * x * (a + b)) + np.sum((x + y) * c)), "loss", tol=1e-5)
    kinds = [entry[0] for entry in log]
    _check(kinds == ["forward", "backward"],
           f"forward_fn/backward_fn calls: {kinds} (backward must run exactly once)")
    grads = log[1][1]
    _check(len(grads) == 2 and all(g is not None for g in grads),
           f"backward_fn got {grads!r}, expected two gradients")
    _same(grads[0], a + b, "backward_fn's gradient of the output used twice (summed)", tol=1e-6)
    _same(grads[1], c, "backward_fn's gradient of output 1", tol=1e-6)
    _same(gx, 2 * (a + b) + c, "input gradient x", tol=1e-6)
    _same(gy, c, "input gradient y", tol=1e-6)


@local_check
def check_differentiable_call_detached(ctx):
    """grads_to_inputs=False: backward_fn still runs once with the summed gradients, but
    the inputs receive nothing from it (None or zeros)."""
    p = ctx.p
    x, y = _arange(3) + 1, _arange(3) * -0.5
    a, c = _arange(3) + 0.5, np.array([3, 0, -2], np.float32)
    log = []
    forward_fn, backward_fn = _differentiable_pair(ctx, log)

    def loss_fn(inputs):
        out = p.differentiable_call(inputs, forward_fn, backward_fn, grads_to_inputs=False)
        return ctx.side.weighted_sum(out[0], a) + ctx.side.weighted_sum(out[1], c)

    loss, grads, _ = ctx.side.backward(loss_fn, [x, y])
    _same(loss, float(np.sum(2 * x * a) + np.sum((x + y) * c)), "loss", tol=1e-5)
    kinds = [entry[0] for entry in log]
    _check(kinds == ["forward", "backward"], f"forward_fn/backward_fn calls: {kinds}")
    _same(log[1][1][0], a, "backward_fn's gradient of output 0", tol=1e-6)
    for name, grad in zip("xy", grads):
        _check(grad is None or not np.any(grad), f"input {name} received {grad!r}")


@local_check
def check_differentiable_call_single(ctx):
    """One input, one output, the output used three times."""
    p = ctx.p
    calls = []

    def forward_fn(inputs):
        return [p.scale(inputs[0], -1.0)]

    def backward_fn(grads):
        calls.append(_values(ctx, grads[0]))
        return [p.scale(grads[0], -1.0)]

    w = np.array([1, 2, 3], np.float32)

    def loss_fn(inputs):
        (out,) = p.differentiable_call(inputs, forward_fn, backward_fn)
        return ctx.side.weighted_sum(out, w) + ctx.side.weighted_sum(out, w) + \
            ctx.side.weighted_sum(out, w)

    _, (grad,), _ = ctx.side.backward(loss_fn, [np.ones(3, np.float32)])
    _check(len(calls) == 1, f"backward_fn ran {len(calls)} times, expected once")
    _same(calls[0], 3 * w, "summed output gradient", tol=1e-6)
    _same(grad, -3 * w, "input gradient", tol=1e-6)


@local_check
def check_differentiable_call_params(ctx):
    """Parameters as inputs (the core passes the local shards): their gradients are what
    backward_fn returned for them."""
    p = ctx.p
    a = ctx.side.new_param(_arange(2, 2), "conf.dc.a")
    b = ctx.side.new_param(_arange(3, start=1), "conf.dc.b")
    seen = []

    def forward_fn(inputs):
        return [p.scale(inputs[0], 1.0), p.scale(inputs[1], 1.0)]

    def backward_fn(grads):
        seen.append([_values(ctx, g) for g in grads])
        return [p.scale(grads[0], 10.0), p.scale(grads[1], -1.0)]

    wa, wb = _arange(2, 2, start=1), np.array([2, 0, -1], np.float32)

    def loss_fn(_):
        out_a, out_b = p.differentiable_call([a, b], forward_fn, backward_fn)
        return ctx.side.weighted_sum(out_a, wa) + ctx.side.weighted_sum(out_b, wb)

    _, _, (ga, gb) = ctx.side.backward(loss_fn, [], [a, b])
    _check(len(seen) == 1, f"backward_fn ran {len(seen)} times")
    _same(ga, 10 * wa, "gradient of parameter input a", tol=1e-6)
    _same(gb, -wb, "gradient of parameter input b", tol=1e-6)


@local_check
def check_differentiable_call_none_grad(ctx):
    """backward_fn may return None for an input (the core's no-sync micro-batches): that
    input then gets no gradient (None or zeros), the others theirs."""
    p = ctx.p

    def forward_fn(inputs):
        return [p.add(inputs[0], inputs[1])]

    def backward_fn(grads):
        return [None, p.scale(grads[0], 1.0)]

    w = np.array([2, 3], np.float32)
    _, (gx, gy), _ = ctx.side.backward(
        lambda xs: ctx.side.weighted_sum(p.differentiable_call(xs, forward_fn, backward_fn)[0], w),
        [np.ones(2, np.float32), np.ones(2, np.float32)])
    _check(gx is None or not np.any(gx), f"input whose gradient backward_fn gave as None got {gx}")
    _same(gy, w, "the other input's gradient", tol=1e-6)


@local_check
def check_queue_backward_final_callback(ctx):
    p = ctx.p
    events = []

    def forward_fn(inputs):
        return [p.scale(inputs[0], 1.0)]

    def backward_fn(grads):
        events.append("backward")
        p.queue_backward_final_callback(lambda: events.append("final"))
        return [p.scale(grads[0], 1.0)]

    def loss_fn(inputs):
        out = p.differentiable_call(inputs, forward_fn, backward_fn)[0]
        return ctx.side.weighted_sum(out, np.ones(2, np.float32))

    ctx.side.backward(loss_fn, [np.ones(2, np.float32)])
    _check(events == ["backward", "final"],
           f"events after the first backward: {events}, expected ['backward', 'final']")
    ctx.side.backward(loss_fn, [np.ones(2, np.float32)])
    _check(events == ["backward", "final"] * 2,
           f"events after a second backward: {events} (queued again, it runs again, once)")


@local_check
def check_register_grad_hook(ctx):
    p = ctx.p
    fired = []

    def loss_fn(inputs):
        hidden = p.scale(inputs[0], 3.0)
        p.register_grad_hook(hidden, lambda: fired.append("hidden"))
        return ctx.side.weighted_sum(hidden, np.ones(2, np.float32))

    _, (grad,), _ = ctx.side.backward(loss_fn, [np.ones(2, np.float32)])
    _check(fired == ["hidden"], f"grad hook on an activation fired {fired}")
    _same(grad, np.full(2, 3.0, np.float32), "gradient with a grad hook", tol=1e-6)

    model = ctx.side.model()
    fired.clear()
    p.register_grad_hook(model.fc1.weight, lambda: fired.append("param"))
    params = [model.fc1.weight]
    _, _, (gw,) = ctx.side.backward(
        lambda xs: ctx.side.weighted_sum(model(xs[0]), np.ones((2, 2), np.float32)),
        [_arange(2, 4) * 0.1], params)
    _check(fired == ["param"], f"grad hook on a parameter fired {fired}")
    _check(gw is not None and gw.shape == (3, 4), f"parameter gradient {gw!r}")


@local_check
def check_in_backward(ctx):
    """False outside backward, True in a hook that backward runs: fully_shard tells a
    recomputed forward (activation checkpointing) from a new iteration's by it."""
    p = ctx.p
    _check(p.in_backward() is False, f"in_backward() outside backward is {p.in_backward()!r}")
    seen = []

    def loss_fn(inputs):
        hidden = p.scale(inputs[0], 3.0)
        p.register_grad_hook(hidden, lambda: seen.append(p.in_backward()))
        return ctx.side.weighted_sum(hidden, np.ones(2, np.float32))

    ctx.side.backward(loss_fn, [np.ones(2, np.float32)])
    _check(seen == [True], f"in_backward() in a grad hook during backward gave {seen}")
    _check(p.in_backward() is False, "in_backward() is still True after backward returned")


# ====================================================================== process groups, collectives
def _only(window, op, wire, dim, nbytes, what):
    """The CommStats window holds exactly one call of (op, wire, dim) with nbytes."""
    records = {key: (rec.calls, rec.nbytes) for key, rec in window.records.items()}
    expected = {(op, wire, dim): (1, nbytes)}
    _check(records == expected, f"{what}: CommStats recorded {records}, expected {expected}")


@collective_check()
def check_process_group(ctx):
    p = ctx.p
    ranks = p.zeros((ctx.world,), p.dtype("float32"))
    p.all_gather_into(ranks, _f32(ctx, [ctx.rank]), ctx.mesh1.get_group(0))
    _check(p.is_initialized() is True, "is_initialized() is not True inside a launch")
    _check(0 <= ctx.rank < ctx.world, f"rank() {ctx.rank} outside world_size() {ctx.world}")
    _same(_values(ctx, ranks), np.arange(ctx.world, dtype=np.float32),
          "every rank reports a distinct rank()")
    _check(p.device_type() in ("cpu", "cuda", "npu"), f"device_type() = {p.device_type()!r}")


@collective_check()
def check_mesh_1d_groups(ctx):
    p = ctx.p
    group = ctx.mesh1.get_group(0)
    _check(p.group_size(group) == ctx.world, f"group_size(world mesh group) {p.group_size(group)}")
    _check(p.group_rank(group) == ctx.rank, f"group_rank(world mesh group) {p.group_rank(group)}")
    _check(ctx.mesh1.get_local_rank(0) == ctx.rank, "mesh.get_local_rank(0)")
    native = ctx.mesh1.native
    _check(p.mesh_from_native(object()) is None, "mesh_from_native(not a mesh) is not None")
    if native is not None:
        described = p.mesh_from_native(native)
        _check(described is not None, "mesh_from_native(the mesh's own native mesh) is None")
        shape, names, groups = described.shape, described.dim_names, described.groups
        device, grid = described.device_type, described.rank_grid
        _check(tuple(shape) == (ctx.world,) and tuple(names) == ("shard",),
               f"mesh_from_native: shape {shape}, names {names}")
        _check(device == p.device_type(), f"mesh_from_native device {device}")
        _check(list(grid) == list(range(ctx.world)), f"mesh_from_native rank grid {grid}")
        _check(p.group_size(groups[0]) == ctx.world, "mesh_from_native group size")


@collective_check()
def check_new_mesh_groups(ctx):
    """Direct call (hp.init_device_mesh wraps it): one group per dim; a size-1 dim too."""
    p, w = ctx.p, ctx.world
    device = p.device_type()
    made = {shape: p.new_mesh_groups(device, shape, names)
            for shape, names in (((w,), ("a",)), ((1, w), ("one", "all")))}
    probe = _f32(ctx, [1.0])
    p.all_reduce(probe, made[(1, w)][0][1])  # the size-w dim of the (1, w) mesh
    for shape, (groups, native) in made.items():
        _check(len(groups) == len(shape), f"new_mesh_groups{shape}: {len(groups)} groups")
        sizes = [p.group_size(g) for g in groups]
        _check(sizes == list(shape), f"new_mesh_groups{shape}: group sizes {sizes}")
        if native is not None:
            described = p.mesh_from_native(native)
            _check(described is not None and tuple(described.shape) == shape,
                   f"mesh_from_native(new_mesh_groups{shape} native) = {described}")
    _check(p.group_rank(made[(w,)][0][0]) == ctx.rank, "group_rank in the 1-D mesh group")
    _check(p.group_rank(made[(1, w)][0][0]) == 0, "group_rank in a size-1 dim group")
    _same(_values(ctx, probe), [float(w)], "all_reduce on the size-w dim of a (1, w) mesh")


@collective_check(even=True)
def check_new_group(ctx):
    """Groups over explicit rank lists (evens, odds), made by every rank in the same order:
    each rank's own group has the right size, rank and members; a framework mesh over it
    (where the platform makes one) lists the same ranks."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    evens, odds = list(range(0, w, 2)), list(range(1, w, 2))
    groups = {0: p.new_group(evens), 1: p.new_group(odds)}
    peers, mine = (evens, odds)[r % 2], groups[r % 2]
    _check(p.group_size(mine) == len(peers), f"new_group({peers}): size {p.group_size(mine)}")
    _check(p.group_rank(mine) == peers.index(r), f"new_group({peers}): rank {p.group_rank(mine)}")
    probe = _f32(ctx, [float(r)])
    p.all_reduce(probe, mine)
    _same(_values(ctx, probe), [float(sum(peers))], f"all_reduce over new_group({peers})")
    native = p.mesh_from_groups(p.device_type(), [mine], peers, ("dp",))
    if native is not None:
        described = p.mesh_from_native(native)
        _check(described is not None and list(described.rank_grid) == peers,
               f"mesh_from_groups over {peers}: described as {described}")


@collective_check()
def check_all_gather_into(ctx):
    p, w, r, n = ctx.p, ctx.world, ctx.rank, 3
    mine = (np.arange(n, dtype=np.float32) + 1) * (r + 1) + 10 * r  # different on every rank
    out = p.zeros((w * n,), p.dtype("float32"))
    handle = p.all_gather_into(out, _f32(ctx, mine), ctx.mesh1.get_group(0))
    _check(isinstance(handle, Handle), f"all_gather_into returned {type(handle).__name__}")
    handle.wait()
    expected = np.concatenate([(np.arange(n) + 1) * (k + 1) + 10 * k for k in range(w)])
    _same(_values(ctx, out), expected.astype(np.float32), "all_gather_into output (rank-major)")


@collective_check()
def check_all_gather_into_async(ctx):
    p, w, r = ctx.p, ctx.world, ctx.rank
    out = p.zeros((w * 2,), p.dtype("float32"))
    src = _f32(ctx, [r, -r])
    handle = p.all_gather_into(out, src, ctx.mesh1.get_group(0), async_op=True)
    _check(isinstance(handle, Handle), f"async all_gather_into returned {type(handle).__name__}")
    handle.wait()
    handle.wait()  # a second wait is harmless
    expected = np.array([v for k in range(w) for v in (k, -k)], np.float32)
    _same(_values(ctx, out), expected, "async all_gather_into output after wait()")


@collective_check()
def check_all_gather_into_view_input(ctx):
    """The input may be a narrowed/reshaped read of a bigger tensor."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    big = p.from_numpy(_arange(3, 4, start=100 * r))
    outs = {row: p.zeros((w * 4,), p.dtype("float32")) for row in (1, 0)}
    for row, out in outs.items():
        p.all_gather_into(out, p.reshape(p.narrow(big, 0, row, 1), (4,)), ctx.mesh1.get_group(0))
    for row, out in outs.items():
        expected = np.concatenate([_arange(3, 4, start=100 * k)[row] for k in range(w)])
        _same(_values(ctx, out), expected, f"all_gather_into of row {row} (a narrow) of a "
              "(3, 4) tensor")


def _chunk_sizes(world: int) -> tuple:
    """Per-rank chunk lengths whose fp32 inputs fall on both sides of 1 MiB, where a
    platform may switch collective algorithms by size (torch on gloo does)."""
    return 3, (1 << 18) // world + 5


@collective_check()
def check_reduce_scatter(ctx):
    p, w, r = ctx.p, ctx.world, ctx.rank
    for n in _chunk_sizes(w):
        k = np.arange(w * n, dtype=np.float32)
        mine = k * (r + 1) + r
        out = p.zeros((n,), p.dtype("float32"))
        handle = p.reduce_scatter(out, _f32(ctx, mine), ctx.mesh1.get_group(0))
        _check(isinstance(handle, Handle), f"reduce_scatter returned {type(handle).__name__}")
        handle.wait()
        total = k * (w * (w + 1) / 2) + w * (w - 1) / 2
        _same(_values(ctx, out), total[r * n:(r + 1) * n], f"reduce_scatter chunk of rank {r} (n={n})")


@collective_check()
def check_reduce_scatter_async(ctx):
    p, w, r = ctx.p, ctx.world, ctx.rank
    k = np.arange(w * 2, dtype=np.float32)
    out = p.zeros((2,), p.dtype("float32"))
    handle = p.reduce_scatter(out, _f32(ctx, k + r), ctx.mesh1.get_group(0), async_op=True)
    _check(isinstance(handle, Handle), f"async reduce_scatter returned {type(handle).__name__}")
    handle.wait()
    handle.wait()
    total = k * w + w * (w - 1) / 2
    _same(_values(ctx, out), total[2 * r:2 * r + 2], "async reduce_scatter chunk after wait()")


@collective_check()
def check_reduce_scatter_view_input(ctx):
    """The core passes reshape(cat(..)) as input; a narrowed read must work as well."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    k = _arange(w, 2)
    group = ctx.mesh1.get_group(0)
    outs = [p.zeros((2,), p.dtype("float32")) for _ in range(3)]
    p.reduce_scatter(outs[0], p.reshape(p.from_numpy(k + r), (2 * w,)), group)
    padded = np.concatenate([np.full(3, 99, np.float32), (k + r).reshape(-1),
                             np.full(3, 99, np.float32)])
    p.reduce_scatter(outs[1], p.narrow(p.from_numpy(padded), 0, 3, 2 * w), group)
    p.reduce_scatter(outs[2], p.narrow(p.from_numpy(padded[3:]), 0, 0, 2 * w), group)
    total = (k * w + w * (w - 1) / 2).reshape(-1)[2 * r:2 * r + 2]
    failures = [what for what, out in zip(
        ("a reshaped input", "narrow(buffer of 2W+6, 0, 3, 2W)", "narrow(buffer of 2W+3, 0, 0, 2W)"),
        outs) if not np.array_equal(_values(ctx, out), total)]
    _check(not failures, f"reduce_scatter is wrong for: {failures} (rank {r} expected {total}, "
           f"got {[_values(ctx, o).tolist() for o in outs]})")


@collective_check()
def check_all_gather_pieces(ctx):
    p, w, r, n = ctx.p, ctx.world, ctx.rank, 3
    mine = (np.arange(n, dtype=np.float32) + 1) * (r + 1) + 10 * r
    expected = [(np.arange(n) + 1) * (k + 1) + 10 * k for k in range(w)]
    for async_op in (False, True):
        source = _f32(ctx, mine)
        pieces, whole, handle = p.all_gather_pieces(source, ctx.mesh1.get_group(0), w,
                                                    async_op=async_op)
        _check(isinstance(handle, Handle), f"all_gather_pieces returned {type(handle).__name__}")
        handle.wait()
        _check(len(pieces) == w, f"all_gather_pieces gave {len(pieces)} pieces for {w} ranks")
        for k, piece in enumerate(pieces):
            _same(_values(ctx, piece), expected[k],
                  f"all_gather_pieces piece {k} (async_op={async_op})")
        if whole is not None:
            _same(_values(ctx, whole), np.concatenate(expected),
                  f"all_gather_pieces whole buffer (async_op={async_op})")
        p.copy_into(source, _f32(ctx, np.zeros(n)))
        _same(_values(ctx, pieces[r]), expected[r], "all_gather_pieces: a piece aliases the input")


@collective_check()
def check_all_gather_into_released(ctx):
    """The re-gather before backward: a full tensor autograd saved is released, then
    gathered into in place (sync and async); backward sees the gathered values and
    autograd does not complain about the write. Padded: the full tensor is a prefix of
    the gathered rows (the last rank's row is padding). With ``start``: the full tensor
    begins one row into the gathered buffer (another tensor's row before it), and
    ``handle.result`` is the whole buffer."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    if not p.capabilities.can_release_storage:
        raise Skip(f"{p.name}: can_release_storage is False")
    rows = np.stack([_arange(3, start=10 * k) for k in range(w)])   # rank k's row
    cases = [(async_op, kept, 0) for async_op in (False, True) for kept in (w, w - 1)]
    cases += [(async_op, w - 1, 1) for async_op in (False, True)]
    for async_op, kept, first in cases:
        gathered = []
        coef = _arange(kept, 3) * 0.1 + 1

        def loss_fn(inputs):
            buffer = p.zeros((w, 3), p.dtype("float32"))
            full = p.narrow(buffer, 0, first, kept)
            product = inputs[0] * full  # autograd saves ``full`` for the gradient of inputs[0]

            def before_backward():
                handle = p.all_gather_into_released(full, _f32(ctx, rows[r]),
                                                    ctx.mesh1.get_group(0), w, async_op=async_op,
                                                    start=3 * first)
                _check(isinstance(handle, Handle),
                       f"all_gather_into_released returned {type(handle).__name__}")
                handle.wait()
                gathered.append((_values(ctx, full), _values(ctx, handle.result)))
            p.register_grad_hook(product, before_backward)
            p.release_storage(full)
            return ctx.side.weighted_sum(product, coef)

        _, (grad,), _ = ctx.side.backward(loss_fn, [np.ones((kept, 3), np.float32)])
        how = f"(async_op={async_op}, {kept} of {w} rows from row {first})"
        _check(len(gathered) == 1, f"grad hook ran {len(gathered)} times {how}")
        _same(gathered[0][0], rows[first:first + kept], f"all_gather_into_released values {how}")
        _same(gathered[0][1], rows.reshape(-1), f"all_gather_into_released handle.result {how}")
        _same(grad, rows[first:first + kept] * coef,
              f"gradient through a tensor gathered in place {how}", tol=1e-6)


@collective_check()
def check_reduce_scatter_pieces(ctx):
    """Each rank's part of the input given as views of one gradient, as one tensor, or as
    several parts (a view plus zeros, the padded case); the parts stay as they were and
    the result, multiplied by ``scale``, is memory of its own."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    # both sizes (both sides of a size switch, see above) in both modes; each mode is
    # scaled on one size and not on the other
    small, large = _chunk_sizes(w)
    for n, async_op, scale in ((small, False, 1.0), (small, True, 0.25),
                               (large, False, 0.25), (large, True, 1.0)):
        k = np.arange(w * n, dtype=np.float32)
        mine = k * (r + 1) + r
        mine[-1] = 0.0  # the last rank's last element is padding: zero on every rank
        total = sum(k * (q + 1) + q for q in range(w))
        total[-1] = 0.0
        total = total * np.float32(scale)  # a power of two: exact
        whole = _f32(ctx, mine)
        layouts = {
            "views": [[p.narrow(whole, 0, q * n, n)] for q in range(w)],
            "tensors": [[_f32(ctx, mine[q * n:(q + 1) * n])] for q in range(w)],
            "parts": [[p.narrow(whole, 0, q * n, n - 1), _f32(ctx, mine[(q + 1) * n - 1:(q + 1) * n])]
                      for q in range(w - 1)] + [[p.narrow(whole, 0, (w - 1) * n, n - 1),
                                                 p.zeros((1,), p.dtype("float32"))]],
        }
        for how, pieces in layouts.items():
            before = [[_values(ctx, t) for t in parts] for parts in pieces]
            handle = p.reduce_scatter_pieces(pieces, ctx.mesh1.get_group(0), async_op=async_op)
            _check(isinstance(handle, Handle),
                   f"reduce_scatter_pieces returned {type(handle).__name__}")
            handle.wait()
            # scaled as the core scales it: in place where the platform can (its own memory)
            result = p.scale(handle.result, scale, may_overwrite=True)
            what = f"({how}, n={n}, async_op={async_op}, scale={scale})"
            _same(_values(ctx, result), total[r * n:(r + 1) * n],
                  f"reduce_scatter_pieces chunk {what}")
            for q, parts in enumerate(pieces):
                for t, old in zip(parts, before[q]):
                    _same(_values(ctx, t), old, f"reduce_scatter_pieces changed a part of rank {q} {what}")
            p.all_reduce(result, ctx.mesh1.get_group(0))  # its own memory
            _same(_values(ctx, result), total.reshape(w, n).sum(0),
                  f"all_reduce of the reduce_scatter_pieces result {what}")
            _same(_values(ctx, whole), mine, f"reduce_scatter_pieces changed the gradient {what}")


@collective_check()
def check_reduce_scatter_new(ctx):
    p, w, r, n = ctx.p, ctx.world, ctx.rank, 3
    k = np.arange(w * n, dtype=np.float32)
    mine = k * (r + 1) + r
    total = sum(k * (q + 1) + q for q in range(w))
    for (async_op, overwrite), scale in zip(((False, False), (True, False), (False, True), (True, True)),
                                            (1.0, 0.5, 0.25, 1.0)):
        source = p.cat([_f32(ctx, mine)], 0)  # a tensor of the caller's own
        handle = p.reduce_scatter_new(source, ctx.mesh1.get_group(0), w, async_op=async_op,
                                      may_overwrite_input=overwrite)
        _check(isinstance(handle, Handle), f"reduce_scatter_new returned {type(handle).__name__}")
        handle.wait()
        out = p.scale(handle.result, scale, may_overwrite=True)  # as the core scales it
        how = f"(async_op={async_op}, may_overwrite_input={overwrite}, scale={scale})"
        expected = total * np.float32(scale)  # a power of two: exact
        _same(_values(ctx, out), expected[r * n:(r + 1) * n], f"reduce_scatter_new chunk {how}")
        if not overwrite:
            _same(_values(ctx, source), mine, f"reduce_scatter_new changed its input {how}")
        p.all_reduce(out, ctx.mesh1.get_group(0))  # its own memory: an in-place write lands
        _same(_values(ctx, out), expected.reshape(w, n).sum(0),
              f"all_reduce of the reduce_scatter_new result {how}")


@collective_check()
def check_reduce_scatter_leaves_input(ctx):
    """Only the output buffer is written (Platform's note: the collectives' output buffers
    are the only writes besides copy_into and release/restore)."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    mine = _arange(2 * w, start=r)
    source = p.from_numpy(mine)
    p.reduce_scatter(p.zeros((2,), p.dtype("float32")), source, ctx.mesh1.get_group(0))
    _same(_values(ctx, source), mine, "reduce_scatter changed its input")


@collective_check()
def check_all_reduce_ops(ctx):
    p, w, r = ctx.p, ctx.world, ctx.rank
    group = ctx.mesh1.get_group(0)

    def values(k):
        return np.array([k + 1, -(k + 1), (7 * k) % 5, 0.5 * k, 3.0], np.float32)
    every = np.stack([values(k) for k in range(w)])
    expected = {"sum": every.sum(0), "avg": every.sum(0) / w, "max": every.max(0),
                "min": every.min(0)}
    got = {}
    for op in expected:
        t = _f32(ctx, values(r))
        handle = p.all_reduce(t, group, op=op)
        _check(isinstance(handle, Handle), f"all_reduce returned {type(handle).__name__}")
        handle.wait()
        got[op] = _values(ctx, t)
    default = _f32(ctx, values(r))
    p.all_reduce(default, group)
    for op, value in expected.items():
        _same(got[op], value, f"all_reduce op={op!r}", tol=1e-6)
    _same(_values(ctx, default), expected["sum"], "all_reduce default op is sum", tol=1e-6)


@collective_check()
def check_all_reduce_async(ctx):
    p, w, r = ctx.p, ctx.world, ctx.rank
    t = _f32(ctx, [r, 1.0, 2.0 * r])
    handle = p.all_reduce(t, ctx.mesh1.get_group(0), op="sum", async_op=True)
    _check(isinstance(handle, Handle), f"async all_reduce returned {type(handle).__name__}")
    handle.wait()
    handle.wait()
    s = w * (w - 1) / 2
    _same(_values(ctx, t), np.array([s, w, 2 * s], np.float32), "async all_reduce after wait()")


@collective_check()
def check_async_overlap(ctx):
    """Two collectives in flight at once (prefetch), waited in the reverse order."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    group = ctx.mesh1.get_group(0)
    gathered = p.zeros((w,), p.dtype("float32"))
    first = p.all_gather_into(gathered, _f32(ctx, [r + 1]), group, async_op=True)
    reduced = _f32(ctx, [1.0, r])
    second = p.all_reduce(reduced, group, op="max", async_op=True)
    second.wait()
    first.wait()
    _same(_values(ctx, gathered), np.arange(1, w + 1, dtype=np.float32), "overlapped all_gather")
    _same(_values(ctx, reduced), np.array([1.0, w - 1], np.float32), "overlapped all_reduce")


@collective_check()
def check_barrier(ctx):
    """barrier() blocks until the last rank arrives (the last rank comes 0.6 s late)."""
    p = ctx.p
    p.barrier()
    if ctx.rank == ctx.world - 1:
        time.sleep(0.6)
    start = time.perf_counter()
    p.barrier(ctx.mesh1.get_group(0))
    waited = time.perf_counter() - start
    p.barrier()
    if ctx.rank != ctx.world - 1:
        _check(waited > 0.3, f"barrier returned after {waited:.3f} s although the last rank "
               "arrived 0.6 s later: it does not block")


@collective_check()
def check_comm_stats(ctx):
    p, w = ctx.p, ctx.world
    group = ctx.mesh1.get_group(0)
    _check(hp.comm_stats() is p.comm_stats, "hp.comm_stats() is not platform.comm_stats")
    windows = {}
    n = 5
    with hp.track_comms() as windows["all_gather"]:
        p.all_gather_into(p.zeros((w * n,), p.dtype("float32")), p.zeros((n,), p.dtype("float32")),
                          group, dim="shard")
    with hp.track_comms() as windows["reduce_scatter"]:
        p.reduce_scatter(p.zeros((n,), p.dtype("float32")), p.zeros((w * n,), p.dtype("float32")),
                         group, dim="shard")
    with hp.track_comms() as windows["all_reduce"]:
        p.all_reduce(p.zeros((n,), p.dtype("float32")), group, op="avg", dim="replicate")
    with hp.track_comms() as windows["async"]:
        h = p.all_reduce(p.zeros((3,), p.dtype("float32")), group, async_op=True)
        h.wait()
    before = p.comm_stats.snapshot()
    with hp.track_comms() as windows["mixed"]:
        p.all_reduce(p.zeros((n,), p.dtype("float32")), group)
        p.all_reduce(p.zeros((2 * n,), p.dtype("float32")), group)
        p.all_gather_into(p.zeros((w,), p.dtype("float32")), p.zeros((1,), p.dtype("float32")),
                          group)
    live_delta = p.comm_stats.minus(before)
    _only(windows["all_gather"], "all_gather", ctx.wire("all_gather"), "shard", 4 * w * n,
          "all_gather (bytes = output)")
    _only(windows["reduce_scatter"], "reduce_scatter", ctx.wire("reduce_scatter"), "shard",
          4 * w * n, "reduce_scatter (bytes = input)")
    _only(windows["all_reduce"], "all_reduce", "all_reduce", "replicate", 4 * n, "all_reduce")
    _only(windows["async"], "all_reduce", "all_reduce", "", 12, "async all_reduce")
    mixed = windows["mixed"]
    _check(mixed.calls("all_reduce") == 2 and mixed.nbytes("all_reduce") == 12 * n,
           f"track_comms window: all_reduce {mixed.calls('all_reduce')} calls, "
           f"{mixed.nbytes('all_reduce')} bytes; expected 2 and {12 * n}")
    _check(mixed.calls("all_gather", wire=ctx.wire("all_gather")) == 1
           and mixed.nbytes("all_gather") == 4 * w,
           f"track_comms window all_gather: {mixed.summary()}")
    _check(mixed.calls() == 3, f"track_comms window counts {mixed.calls()} calls, expected 3")
    _check(live_delta.summary() == mixed.summary(),
           f"live comm_stats delta {live_delta.summary()} != window {mixed.summary()}")


@collective_check()
def check_deferred_and_replaced_params(ctx):
    """A deferred parameter's part is made without the whole (MindSpore: materialised by its
    initializer); a replacement is told from the sharded parameter it replaces."""
    p, w = ctx.p, ctx.world
    deferred = ctx.side.deferred_param((3, 2 * w), "conf.deferred")
    _check(p.is_deferred(deferred), "is_deferred(a parameter without values) is False")
    _check(not p.is_deferred(p.from_numpy(_arange(2, 2))), "is_deferred(a tensor) is True")
    part = p.deferred_part(deferred, 1, 2, 2)
    _check(tuple(p.shape(part)) == (3, 2), f"deferred_part shape {p.shape(part)}, expected (3, 2)")
    if not p.is_deferred(part):  # materialised: the One initializer's values
        _same(p.to_numpy(part), np.ones((3, 2), np.float32), "deferred_part values")
    module = next(m for _, m in p.named_modules(ctx.side.model()) if p.direct_params(m))
    attr, param = p.direct_params(module)[0]
    _check(p.registered_param(module, attr) is param, "registered_param is not the registered one")
    _check(p.registered_param(module, "conf_missing") is None, "registered_param of no parameter")
    full = _arange(2 * w, 3)
    orig = ctx.side.new_param(full, "conf.replaced")
    sharded = p.make_sharded_param(orig, p.from_numpy(full[:2]), ctx.mesh1.native, 0, 0,
                                   (2 * w, 3))
    _check(p.is_shard_like(sharded, sharded), "is_shard_like(a sharded parameter, itself) is False")
    _check(not p.is_shard_like(orig, sharded), "is_shard_like(the full parameter, its shard) is True")
    _check(p.replace_local(orig, p.from_numpy(full[:2])) is False,
           "replace_local turned a plain full parameter into a shard")
    if p.replace_local(sharded, p.from_numpy(full[2:4] if w > 1 else full[:2])):
        _same(p.to_numpy(sharded), full[2:4] if w > 1 else full[:2], "replace_local values")


@collective_check()
def check_make_sharded_param(ctx):
    p, w, r = ctx.p, ctx.world, ctx.rank
    mesh = ctx.mesh1
    full = _arange(2 * w, 3)
    for shard_dim, local_np in ((0, full[2 * r:2 * r + 2]),
                                (1, full.T.copy()[:, 2 * r:2 * r + 2])):
        full_shape = (2 * w, 3) if shard_dim == 0 else (3, 2 * w)
        for requires_grad in (True, False):
            orig = ctx.side.new_param(np.zeros(full_shape, np.float32), f"conf.sharded{shard_dim}",
                                      requires_grad=requires_grad)
            param = p.make_sharded_param(orig, p.from_numpy(local_np), mesh.native, 0,
                                         shard_dim, full_shape)
            _check(p.is_tensor(param), "make_sharded_param did not return a tensor")
            _check(p.param_requires_grad(param) is requires_grad,
                   f"sharded param requires_grad {p.param_requires_grad(param)}, "
                   f"orig {requires_grad}")
            local = p.local_tensor(param)
            _check(p.shape(local) == local_np.shape,
                   f"local_tensor shape {p.shape(local)}, expected {local_np.shape}")
            _same(_values(ctx, local), local_np, f"local_tensor values (shard_dim {shard_dim})")
            _same(p.to_numpy(param), local_np, f"to_numpy(sharded param) is the local shard "
                  f"(shard_dim {shard_dim})")
    big = p.from_numpy(_arange(4, 3))
    owned = p.make_sharded_param(ctx.side.new_param(np.zeros((4, 3), np.float32), "conf.own"),
                                 p.narrow(big, 0, 0, 2), mesh.native, 0, 0, (4, 3))
    _check(_storage_bytes(p.local_tensor(owned)) == 2 * 3 * 4,
           f"a shard made from a narrow keeps {_storage_bytes(p.local_tensor(owned))} bytes: it "
           "must own only its 24 bytes, not the whole parameter's memory")
    p.copy_into(big, p.from_numpy(np.zeros((4, 3), np.float32)))
    _same(p.to_numpy(owned), _arange(4, 3)[:2], "a sharded param must not alias its source")
    replicated = p.make_sharded_param(ctx.side.new_param(np.zeros((2, 3), np.float32), "conf.rep"),
                                      p.from_numpy(_arange(2, 3)), mesh.native, 0, None, (2, 3))
    _check(p.shape(p.local_tensor(replicated)) == (2, 3),
           f"shard_dim=None: local_tensor shape {p.shape(p.local_tensor(replicated))}")
    _same(p.to_numpy(replicated), _arange(2, 3), "shard_dim=None (replicated): to_numpy")
    # backing: the shard (2 rows) at the start of a padded piece of 3 rows the caller owns
    backing = p.cat([p.from_numpy(full[2 * r:2 * r + 2]), p.zeros((1, 3), p.dtype("float32"))], 0)
    backed = p.make_sharded_param(ctx.side.new_param(np.zeros((2 * w, 3), np.float32), "conf.b"),
                                  p.narrow(backing, 0, 0, 2), mesh.native, 0, 0, (2 * w, 3),
                                  backing=backing)
    local = p.local_tensor(backed)
    _check(p.shape(local) == (2, 3), f"backed shard shape {p.shape(local)}")
    _same(_values(ctx, local), full[2 * r:2 * r + 2], "backed shard values")
    _check(p.starts_with(backing, local) is _views_write_through(ctx),
           "make_sharded_param(backing=...) must keep the shard as a view of its backing "
           "exactly where views write through")
    if p.starts_with(backing, local):  # kept as a view: updates reach the padded piece
        with p.no_grad():
            p.copy_into(local, p.from_numpy(-full[2 * r:2 * r + 2]))
        _same(_values(ctx, backing), np.concatenate([-full[2 * r:2 * r + 2], np.zeros((1, 3))]),
              "an update of a backed shard must reach its backing, padding untouched")
    param = p.make_sharded_param(ctx.side.new_param(np.zeros((2 * w, 3), np.float32), "conf.g"),
                                 p.from_numpy(full[2 * r:2 * r + 2]), mesh.native, 0, 0,
                                 (2 * w, 3))
    weights = _arange(2, 3, start=r)
    _, _, (grad,) = ctx.side.backward(
        lambda _: ctx.side.weighted_sum(p.local_tensor(param), weights), [], [param])
    _same(grad, weights, "gradient of the sharded param through local_tensor", tol=1e-6)


@collective_check(min_world=4, even=True)
def check_mesh2d_tensor_parallel_param(ctx):
    """param_local_values, make_sharded_param and attach_tensor for a parameter that
    tensor parallelism split over the "shard" dim of the 2-D mesh, sharded further over its
    "replicate" dim (standing in for data parallel)."""
    p = ctx.p
    plain = ctx.side.new_param(_arange(3, 4), "conf.plain")
    _check(p.param_local_values(plain) is plain,
           "param_local_values of a parameter no parallelism split must be the parameter")
    _check(p.full_over_tensor_parallel(plain, plain) is plain,
           "full_over_tensor_parallel of a parameter no parallelism split must return it")
    make = getattr(ctx.side, "tensor_parallel_param", None)
    if make is None:
        raise Skip(f"{p.name} has no tensor-parallel parameters")
    mesh = ctx.mesh2.native
    dp, tp = mesh.get_local_rank("replicate"), mesh.get_local_rank("shard")
    tp_size = mesh.size(1)
    full = _arange(3, 2 * tp_size * 2)  # split on dim 1: tp_size parts, each over 2 dp ranks
    param = make(full, mesh, "shard", 1)
    local = p.param_local_values(param)
    part = full[:, 4 * tp:4 * tp + 4]
    _check(p.shape(local) == (3, 4), f"param_local_values shape {p.shape(local)}, expected (3, 4)")
    _same(_values(ctx, local), part, "param_local_values: this rank's tensor-parallel part")
    sharded = p.make_sharded_param(param, p.narrow(local, 1, 2 * dp, 2), mesh["replicate"], 0, 1,
                                   (3, 4))
    _check(p.shape(sharded) == (3, 4 * tp_size), f"the sharded parameter's shape "
           f"{p.shape(sharded)} must be the tensor-parallel parameter's, (3, {4 * tp_size})")
    _same(_values(ctx, p.local_tensor(sharded)), part[:, 2 * dp:2 * dp + 2],
          "local_tensor of a tensor-parallel sharded parameter")
    _same(_values(ctx, p.full_over_tensor_parallel(sharded, p.from_numpy(part))), full,
          "full_over_tensor_parallel: every rank's tensor-parallel part, whole")
    model = ctx.side.model()
    p.register_param(model.fc1, "weight", sharded)
    p.attach_tensor(model.fc1, "weight", p.from_numpy(part))
    attached = model.fc1.weight
    _check(p.shape(attached) == (3, 4 * tp_size), f"attach_tensor of a tensor-parallel part "
           f"must present the tensor-parallel parameter (shape (3, {4 * tp_size})), got "
           f"{p.shape(attached)}")
    _same(_values(ctx, attached), part, "attached tensor-parallel parameter's local values")
    p.detach_tensor(model.fc1, "weight")
    _check(model.fc1.weight is sharded, "after detach_tensor, module.weight is not the param")


def _views_write_through(ctx) -> bool:
    """Whether a write into a leading narrow of a tensor reaches the tensor (torch: yes;
    MindSpore CPU: no, platform-facts: its copy into a narrow even fails)."""
    p = ctx.p
    whole = p.from_numpy(_arange(4, 3))
    try:
        p.copy_into(p.narrow(whole, 0, 0, 2), p.from_numpy(np.full((2, 3), -1.0, np.float32)))
        return bool((_values(ctx, whole)[:2] == -1.0).all())
    except RuntimeError:
        return False


@local_check
def check_starts_with(ctx):
    """True exactly for a leading view whose writes reach the whole; never for a copy or a
    view that starts later."""
    p = ctx.p
    whole = p.from_numpy(_arange(4, 3))
    prefix = p.narrow(whole, 0, 0, 2)
    writes_through = _views_write_through(ctx)
    _check(p.starts_with(whole, prefix) is writes_through,
           f"starts_with(whole, leading narrow) = {p.starts_with(whole, prefix)} but writes to "
           f"the narrow {'do' if writes_through else 'do not'} reach the whole")
    _check(p.starts_with(whole, p.narrow(whole, 0, 1, 2)) is False,
           "starts_with(whole, a narrow from row 1) must be False")
    _check(p.starts_with(whole, p.clone(prefix)) is False, "starts_with(whole, a clone) must be False")


def _sharded(ctx, name, requires_grad=True):
    """A (2W, 3) parameter sharded on dim 0 over the 1-D mesh; this rank holds 2 rows."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    orig = ctx.side.new_param(np.zeros((2 * w, 3), np.float32), name, requires_grad=requires_grad)
    return p.make_sharded_param(orig, p.from_numpy(_arange(2 * w, 3)[2 * r:2 * r + 2]),
                                ctx.mesh1.native, 0, 0, (2 * w, 3))


def _delivered(ctx, param, placeholder):
    """The gradient the user sees after write_grad: the placeholder where the platform
    returns one (MindSpore value_and_grad), else the parameter's accumulated ``.grad``."""
    if placeholder is not None:
        return _values(ctx, placeholder)
    return None if param.grad is None else ctx.p.to_numpy(param.grad)


@collective_check()
def check_grad_placeholder_write_grad(ctx):
    p = ctx.p
    g1, g2 = _arange(2, 3, start=1), _arange(2, 3, start=-3) * 0.5
    param = _sharded(ctx, "conf.wg")
    placeholder = p.grad_placeholder(param)
    _check((placeholder is not None) == p.capabilities.returns_grads_from_backward,
           f"returns_grads_from_backward is {p.capabilities.returns_grads_from_backward}, "
           f"but grad_placeholder "
           f"gave {placeholder!r}: a platform whose backward returns the user's gradients "
           f"needs a tensor placeholder, one that accumulates them on the parameter None")
    if placeholder is not None:
        _check(p.shape(placeholder) == (2, 3) and p.dtype_of(placeholder) == p.dtype_of(param),
               f"grad_placeholder: shape {p.shape(placeholder)} dtype {p.dtype_of(placeholder)}, "
               "expected the local shard's")
        _same(_values(ctx, placeholder), np.zeros((2, 3), np.float32), "grad_placeholder is zero")
    p.write_grad(param, placeholder, p.from_numpy(g1), False)
    _same(_delivered(ctx, param, placeholder), g1, "gradient after one write_grad")
    if placeholder is None:
        p.write_grad(param, placeholder, p.from_numpy(g2), False)
        _same(_delivered(ctx, param, placeholder), g1 + g2, "a second write_grad accumulates "
              "into .grad", tol=1e-6)
        expected_grad = g1 + g2
    else:
        expected_grad = g1
    main = _sharded(ctx, "conf.main")
    main_placeholder = p.grad_placeholder(main)
    low = p.cast(p.from_numpy(g1), p.dtype("float16"))
    p.write_grad(main, main_placeholder, low, True)
    p.write_grad(main, main_placeholder, p.cast(p.from_numpy(g2), p.dtype("float16")), True)
    main_grad = getattr(main, "main_grad", None)
    _check(main_grad is not None, "write_grad(to_main_grad=True) set no param.main_grad")
    _check(p.to_numpy(main_grad).dtype == np.float32,
           f"main_grad holds {p.to_numpy(main_grad).dtype}, expected float32")
    _same(p.to_numpy(main_grad), g1 + g2, "main_grad accumulates both writes in float32",
          tol=1e-6)
    untouched = _delivered(ctx, main, main_placeholder)
    _check(untouched is None or not np.any(untouched),
           f"write_grad(to_main_grad=True) touched the gradient: {untouched}")
    _same(_delivered(ctx, param, placeholder), expected_grad, "the first param is unaffected",
          tol=1e-6)


@collective_check()
def check_write_grad_after_backward(ctx):
    """The core's late fill: backward returns grad_placeholder(param) for the shard and a
    final callback write_grad()s the reduced gradient; the user then sees that gradient."""
    p = ctx.p
    param = _sharded(ctx, "conf.late")
    reduced = _arange(2, 3, start=10 * ctx.rank) * 0.25

    def forward_fn(inputs):
        return [p.scale(inputs[0], 2.0)]

    def backward_fn(grads):
        placeholder = p.grad_placeholder(param)
        p.queue_backward_final_callback(
            lambda: p.write_grad(param, placeholder, p.from_numpy(reduced), False))
        return [placeholder]

    def loss_fn(_):
        out = p.differentiable_call([p.local_tensor(param)], forward_fn, backward_fn)[0]
        return ctx.side.weighted_sum(out, np.ones((2, 3), np.float32))

    _, _, (grad,) = ctx.side.backward(loss_fn, [], [param])
    _same(grad, reduced, "gradient the framework reports after the late write_grad")


@collective_check()
def check_low_precision_collectives(ctx):
    """Mixed precision gathers in float16/bfloat16 and may reduce in them."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    group = ctx.mesh1.get_group(0)
    f32 = p.dtype("float32")
    results = {}
    for name in ("float16", "bfloat16"):
        dtype = p.dtype(name)
        out = p.zeros((2 * w,), dtype)
        p.all_gather_into(out, p.cast(_f32(ctx, [r, 0.5 * r]), dtype), group)
        chunk = p.zeros((2,), dtype)
        p.reduce_scatter(chunk, p.cast(_f32(ctx, np.arange(2 * w) + r), dtype), group)
        t = p.cast(_f32(ctx, [r, 1.0]), dtype)
        p.all_reduce(t, group)
        results[name] = [_values(ctx, p.cast(x, f32)) for x in (out, chunk, t)]
    s = w * (w - 1) / 2
    for name, (gathered, chunk, reduced) in results.items():
        _same(gathered, np.array([v for k in range(w) for v in (k, 0.5 * k)], np.float32),
              f"all_gather_into {name}")
        _same(chunk, (np.arange(2 * w) * w + s)[2 * r:2 * r + 2].astype(np.float32),
              f"reduce_scatter {name}")
        _same(reduced, np.array([s, w], np.float32), f"all_reduce {name}")


# ---------------------------------------------------------------------- 2-D mesh (world >= 4)
def _coords(ctx):
    s_size = ctx.world // 2
    return ctx.rank // s_size, ctx.rank % s_size, s_size


@collective_check(min_world=4, even=True)
def check_mesh2d_groups(ctx):
    p = ctx.p
    r_idx, s_idx, s_size = _coords(ctx)
    mesh = ctx.mesh2
    rep, shard = mesh.get_group("replicate"), mesh.get_group("shard")
    got = {"replicate": (p.group_rank(rep), p.group_size(rep)),
           "shard": (p.group_rank(shard), p.group_size(shard))}
    expected = {"replicate": (r_idx, 2), "shard": (s_idx, s_size)}
    _check(got == expected, f"rank {ctx.rank}: (group_rank, group_size) {got}, expected {expected}")
    _check((mesh.get_local_rank(0), mesh.get_local_rank(1)) == (r_idx, s_idx),
           "mesh.get_local_rank")
    if mesh.native is not None:
        described = p.mesh_from_native(mesh.native)
        shape, names, grid = described.shape, described.dim_names, described.rank_grid
        _check(tuple(shape) == (2, s_size) and tuple(names) == ("replicate", "shard"),
               f"mesh_from_native shape {shape} names {names}")
        expected_grid = np.arange(ctx.world).reshape(2, s_size).tolist()
        _check([list(row) for row in grid] == expected_grid, f"rank grid {grid}")


@collective_check(min_world=4, even=True)
def check_mesh2d_all_reduce(ctx):
    p = ctx.p
    r_idx, s_idx, s_size = _coords(ctx)
    mine = float(10 ** ctx.rank)
    along_rep, along_shard = _f32(ctx, [mine]), _f32(ctx, [mine])
    with hp.track_comms() as window:
        p.all_reduce(along_rep, ctx.mesh2.get_group("replicate"), dim="replicate")
        p.all_reduce(along_shard, ctx.mesh2.get_group("shard"), dim="shard")
    rep_ranks = [k * s_size + s_idx for k in range(2)]
    shard_ranks = [r_idx * s_size + j for j in range(s_size)]
    _same(_values(ctx, along_rep), [sum(10.0 ** k for k in rep_ranks)],
          f"all_reduce along 'replicate' (ranks {rep_ranks})")
    _same(_values(ctx, along_shard), [sum(10.0 ** k for k in shard_ranks)],
          f"all_reduce along 'shard' (ranks {shard_ranks})")
    _check(window.calls("all_reduce", dim="replicate") == 1
           and window.calls("all_reduce", dim="shard") == 1,
           f"CommStats dims: {window.summary()}")


@collective_check(min_world=4, even=True)
def check_mesh2d_gather_scatter(ctx):
    p = ctx.p
    r_idx, s_idx, s_size = _coords(ctx)
    shard, rep = ctx.mesh2.get_group("shard"), ctx.mesh2.get_group("replicate")
    gathered = p.zeros((s_size * 2,), p.dtype("float32"))
    p.all_gather_into(gathered, _f32(ctx, [ctx.rank, -ctx.rank]), shard)
    chunk = p.zeros((2,), p.dtype("float32"))
    p.reduce_scatter(chunk, _f32(ctx, np.arange(4) * (ctx.rank + 1)), rep)
    members = [r_idx * s_size + j for j in range(s_size)]
    _same(_values(ctx, gathered), np.array([v for k in members for v in (k, -k)], np.float32),
          f"all_gather_into on the shard group {members}")
    rep_members = [k * s_size + s_idx for k in range(2)]
    total = np.arange(4) * sum(k + 1 for k in rep_members)
    _same(_values(ctx, chunk), total[2 * r_idx:2 * r_idx + 2].astype(np.float32),
          f"reduce_scatter on the replicate group {rep_members}")
