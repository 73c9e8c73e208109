"""Platform conformance harness: the contract of ``hyper_parallel.platform`` (``Platform``
and its optional parts ``StorageRelease`` and ``StateIO``), checked once for every platform.
The checks live in one module per group of the contract (``CHECK_MODULES``,
tests/platform/checks_*.py); this module holds what they share.

Design note
-----------
Each check is a function of a ``Ctx`` (the platform, this rank, the world, the meshes) that
returns nothing and raises AssertionError with a message naming what broke; ``Skip`` says
the check does not apply to this platform (``release_storage`` where it cannot free memory).
The checks only call ``hp.get_platform()`` methods, ``hp.init_device_mesh``/``hp.track_comms``
and numpy. What a check cannot express through the platform (building a small model, asking
the framework for gradients) goes through ``framework_side()`` (framework_sides.py), the one
place that imports a framework: a new platform adds a ``_<Name>Side`` class there and nothing else.

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
reduce-scatter: input, all-reduce: the tensor) and ``wire`` what the framework ran (the
handle's ``wire``): the op itself unless the platform composes it. ``COMPOSED_WIRE`` names,
per platform and device, the wire op of every composition the platform makes.
"""

from __future__ import annotations

import functools
import importlib
import time
import traceback

import numpy as np

import hyper_parallel as hp
from hyper_parallel.platform import Gathered
from tests.kit import get_kit
from tests.platform.framework_sides import framework_side

def _mindspore_cpu_wire(op: str, dtype: str, group_size: int, world_group: bool) -> str:
    """MindSpore CPU (platform/mindspore/platform.py): mccl's flat all-gather serves only
    the world group and float32/float16/int32, a list all-gather stands in elsewhere; a
    reduce-scatter over two ranks is one all-gather of the chunk each peer owns, over more
    an all-reduce; an all-to-all is send/recv pairs."""
    gather = "all_gather" if world_group and dtype in ("float32", "float16", "int32") \
        else "all_gather_list"
    if op == "all_gather":
        return gather
    if op == "reduce_scatter":
        return gather if group_size == 2 else "all_reduce"
    if op == "all_to_all":
        return "send_recv"
    return op


#: (platform name, device type) -> wire(op, dtype name, group size, world group?) for the
#: platforms that compose collectives; every other one runs each op as itself.
COMPOSED_WIRE = {("mindspore", "cpu"): _mindspore_cpu_wire}

#: name -> bytes per element; every platform must know these names.
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int32": 4, "int64": 8}
#: numpy dtypes that round-trip through from_numpy/to_numpy (numpy has no bfloat16).
NUMPY_ROUND_TRIP = ("float32", "float64", "float16", "int32", "int64")


class Skip(Exception):
    """The check does not apply to this platform; the test reports it as skipped."""


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
        device = self.p.capabilities.device_type
        self.mesh1 = hp.init_device_mesh(device, (self.world,), mesh_dim_names=("shard",))
        if need_2d:
            self.mesh2 = hp.init_device_mesh(device, (2, self.world // 2),
                                             mesh_dim_names=("replicate", "shard"))

    def wire(self, op: str, dtype: str = "float32", group=None) -> str:
        """The wire op of ``op`` on ``dtype`` over ``group`` (None: the whole world)."""
        size = self.world if group is None else self.p.group_size(group)
        composed = COMPOSED_WIRE.get((self.p.name, self.p.capabilities.device_type))
        return op if composed is None else composed(op, dtype, size, size == self.world)


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
    if tol:  # relative, and absolute on the scale of the values (tests/tolerance.py)
        expected = expected.astype(np.float64)
        np.testing.assert_allclose(actual.astype(np.float64), expected, rtol=tol,
                                   atol=tol * float(np.abs(expected).max(initial=0.0)),
                                   err_msg=what)
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


def _check_gathered(ctx, gathered, expected: list, what: str) -> None:
    """``pieces[k]`` is rank k's input; ``flat`` is None or the rank-major buffer."""
    _check(isinstance(gathered, Gathered), f"{what}: wait() returned "
           f"{type(gathered).__name__}, want a Gathered")
    _check(len(gathered.pieces) == len(expected),
           f"{what}: {len(gathered.pieces)} pieces for {len(expected)} ranks")
    for k, piece in enumerate(gathered.pieces):
        _same(_values(ctx, piece), expected[k], f"{what}: piece of rank {k}")
    if gathered.flat is not None:
        _same(_values(ctx, gathered.flat), np.concatenate(expected), f"{what}: flat (rank-major)")


def _values(ctx, tensor):
    return ctx.p.to_numpy(tensor)


def _f32(ctx, array) -> object:
    return ctx.p.from_numpy(np.asarray(array, dtype=np.float32))


def _arange(*shape, start: float = 0.0) -> np.ndarray:
    return (np.arange(int(np.prod(shape)), dtype=np.float32) + start).reshape(shape)


# ====================================================================== the checks
# One module per group of the contract; importing them registers their checks, in this order.
CHECK_MODULES = ("checks_tensors", "checks_tensor_ops", "checks_memory", "checks_parameters", "checks_gradients",
                 "checks_autograd",
                 "checks_state_io", "checks_process_groups", "checks_collectives",
                 "checks_autograd_collectives", "checks_tp_support", "checks_cp_support", "checks_units")
for _module in CHECK_MODULES:
    importlib.import_module(f"tests.platform.{_module}")
