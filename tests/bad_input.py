"""Rank-side bad-input checks: each returns (error type, message, module untouched?)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

import hyper_parallel as hp
from hyper_parallel.launch import find_free_port
from tests.kit import get_kit


@dataclass(frozen=True)
class LookalikePolicy:
    """MixedPrecisionPolicy's fields on a class that is not a policy of hyper_parallel's or
    of the framework's."""

    param_dtype: Any = None
    reduce_dtype: Any = None
    output_dtype: Any = None
    cast_forward_inputs: bool = True


def _snapshot(kit, platform, model):
    return (type(model), [id(p) for _, sub in platform.named_modules(model)
                          for _, p in platform.direct_params(sub)])


def _attempt(kit, platform, model, action):
    before = _snapshot(kit, platform, model)
    try:
        action()
    except Exception as error:  # noqa: BLE001 - the error itself is what is checked
        untouched = _snapshot(kit, platform, model) == before and "_hp_state" not in model.__dict__
        return type(error).__name__, str(error), untouched
    return None, "", _snapshot(kit, platform, model) == before


def _bad_arguments(platform, framework, module) -> dict:
    """``{check: fully_shard keyword arguments}`` for ``module``, one wrong argument each."""
    mixed = hp.MixedPrecisionPolicy
    return {
        "param_dtype_numpy": dict(mp_policy=mixed(param_dtype=np.float16)),
        "param_dtype_python_float": dict(mp_policy=mixed(param_dtype=float)),
        "param_dtype_number": dict(mp_policy=mixed(param_dtype=5)),
        "param_dtype_integer": dict(mp_policy=mixed(param_dtype=framework.int8)),
        "param_dtype_complex": dict(mp_policy=mixed(param_dtype=framework.complex64)),
        "reduce_dtype_integer": dict(mp_policy=mixed(reduce_dtype=platform.dtype("int32"))),
        "output_dtype_integer": dict(mp_policy=mixed(output_dtype=framework.int64)),
        "reshard_after_forward_text": dict(reshard_after_forward="yes"),
        "reshard_after_forward_fraction": dict(reshard_after_forward=0.5),
        "reshard_after_forward_not_a_factor": dict(reshard_after_forward=3),
        "mesh_name": dict(mesh="cpu"),
        "placement_fn_not_callable": dict(shard_placement_fn=0),
        "dp_mesh_dims_name": dict(dp_mesh_dims="dp"),
        "ignored_single_param": dict(ignored_params=platform.direct_params(module.fc1)[0][1]),
        "threshold_fraction": dict(shard_threshold_bytes=1.5),
        "own_collective_bytes_negative": dict(own_collective_bytes=-1),
        "offload_policy_is_mp_policy": dict(offload_policy=mixed()),
    }


def _policy_errors() -> dict:
    """Policies whose fields are wrong fail when made: ``{check: a maker}``."""
    return {
        "cast_forward_inputs_text": lambda: hp.MixedPrecisionPolicy(cast_forward_inputs="no"),
        "main_grad_number": lambda: hp.MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=1),
        "pin_memory_text": lambda: hp.CPUOffloadPolicy(pin_memory="no"),
        "dtype_name_integer": lambda: hp.MixedPrecisionPolicy(param_dtype="int8"),
    }


def _argument_checks(kit, platform, block) -> dict:
    """Every argument of fully_shard and its policies checked before anything changes; the
    module given a good call after a bad one shards and computes (nothing half-changed)."""
    framework = getattr(kit, "torch", None) or kit.ms
    out = {}
    for check in _bad_arguments(platform, framework, block()):
        m = block()
        kwargs = _bad_arguments(platform, framework, m)[check]
        out[check] = _attempt(kit, platform, m, lambda: hp.fully_shard(m, **kwargs))
    for check, make in _policy_errors().items():
        m = block()
        out[check] = _attempt(kit, platform, m, lambda: hp.fully_shard(m, mp_policy=make()))
    m = block()
    out["not_a_module_tensor"] = _attempt(kit, platform, m, lambda: hp.fully_shard(
        platform.direct_params(m.fc1)[0][1]))
    out["not_a_module_none"] = _attempt(kit, platform, m, lambda: hp.fully_shard(None))
    out["not_a_module_name"] = _attempt(kit, platform, m, lambda: hp.fully_shard("model"))
    out["list_with_a_tensor"] = _attempt(kit, platform, m, lambda: hp.fully_shard(
        [m, kit.tensor(np.ones(2, np.float32))]))
    absent = "npu" if platform.device_type() == "cuda" else "cuda"  # a device this rank lacks
    for check, name in (("gpu", "gpu"), ("Ascend", "Ascend"), ("0", 0), ("absent", absent)):
        out[f"mesh_device_{check}"] = _attempt(kit, platform, m, lambda: hp.init_device_mesh(
            name, (platform.world_size(),)))
    m = block()
    failed = _attempt(kit, platform, m, lambda: hp.fully_shard(
        m, mp_policy=hp.MixedPrecisionPolicy(param_dtype=framework.int8)))
    hp.fully_shard(m, mp_policy=hp.MixedPrecisionPolicy(param_dtype="float32"))
    out["retry_after_bad_dtype"] = (failed[2], isinstance(m, hp.FSDPModule), kit.to_numpy(
        m(kit.tensor(np.ones((2, 8), np.float32)))).shape)
    return out


def run_checks() -> dict:
    kit = get_kit()
    platform = hp.get_platform()
    device = platform.device_type()
    block = lambda: kit.Block(8, 12, 6)  # noqa: E731
    out = {}
    out["mesh_size"] = _attempt(kit, platform, block(), lambda: hp.init_device_mesh(device, (3,)))
    out["mesh_dup_names"] = _attempt(kit, platform, block(), lambda: hp.init_device_mesh(
        device, (1, 2), mesh_dim_names=("dp", "dp")))
    mesh3 = hp.init_device_mesh(device, (1, 1, 2))
    m = block()
    out["mesh_3d"] = _attempt(kit, platform, m, lambda: hp.fully_shard(m, mesh=mesh3))
    m = block()
    out["shard_dim_out_of_range"] = _attempt(kit, platform, m, lambda: hp.fully_shard(
        m, shard_placement_fn=lambda p: 5))
    m = block()
    out["ignored_not_a_parameter"] = _attempt(kit, platform, m, lambda: hp.fully_shard(
        m, ignored_params=["fc1.bias"]))
    m = block()
    hp.fully_shard(m)
    error = _attempt(kit, platform, m, lambda: hp.fully_shard(m))
    out["twice"] = (error[0], error[1], True)
    model = kit.Stack([block()], kit.linear(6, 3))
    hp.fully_shard(model)
    inner = model.blocks[0]
    out["top_down"] = _attempt(kit, platform, inner, lambda: hp.fully_shard(inner))
    a, b = kit.Block(8, 8, 8), kit.Block(8, 8, 8)
    kit.tie(a.fc1, b.fc1)
    hp.fully_shard(a)
    out["tied_across_units"] = _attempt(kit, platform, b, lambda: hp.fully_shard(b))
    unit = block()
    hp.fully_shard(unit)
    state = unit.__dict__["_hp_state"]
    settings = lambda: (state.reduce_op, state.scaling_factor)  # noqa: E731
    before = settings()
    out["unknown_reduce_op"] = _attempt(kit, platform, unit, lambda: unit.set_reduce_op_type("max"))[:2] + (
        settings() == before,)
    two = kit.tensor(np.array([1.0, 2.0], np.float32))
    out["non_scalar_scaling"] = _attempt(kit, platform, unit, lambda: unit.set_gradient_scaling_factor(two))[:2] + (
        settings() == before,)
    m = block()
    out["negative_threshold"] = _attempt(kit, platform, m, lambda: hp.fully_shard(m, shard_threshold_bytes=-1))
    out["bad_own_collective_bytes"] = _attempt(
        kit, platform, m, lambda: hp.fully_shard(m, own_collective_bytes="big"))
    m = block()
    out["unknown_dtype_name"] = _attempt(kit, platform, m, lambda: hp.fully_shard(
        m, mp_policy=hp.MixedPrecisionPolicy(param_dtype="bf16")))
    m = block()
    out["policy_none"] = _attempt(kit, platform, m, lambda: hp.fully_shard(m, mp_policy=None))
    m = block()
    out["policy_lookalike"] = _attempt(kit, platform, m, lambda: hp.fully_shard(
        m, mp_policy=LookalikePolicy(param_dtype="float32")))
    out.update(_argument_checks(kit, platform, block))
    relu = kit.activation()
    returned = hp.fully_shard(relu)
    x = np.array([[-1.0, 2.0]], dtype=np.float32)
    out["no_params"] = (returned is relu and isinstance(relu, hp.FSDPModule),
                        kit.to_numpy(relu(kit.tensor(x))).tolist())
    return out


# msrun's environment for a worker of a 2-rank job (mindspore/parallel/cluster/process_entity)
_MSRUN_WORKER_ENV = {"MS_WORKER_NUM": "2", "MS_ROLE": "MS_WORKER", "RANK_SIZE": "2"}
_HP_RUN_ONLY = ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE")


def _unjoined_attempts(kit, platform) -> dict:
    m = kit.Block(8, 12, 6)
    return {"fully_shard": _attempt(kit, platform, m, lambda: hp.fully_shard(m)),
            "init_device_mesh": _attempt(kit, platform, m, lambda: hp.init_device_mesh(
                platform.device_type(), (2,))),
            "joined_after": platform.is_initialized()}


def unjoined_launch_checks() -> dict:
    """On a rank of a 2-rank launch that never called hp.init_distributed (run with
    HP_TEST_NO_DIST=1: tests/_rank_entry.py joins nothing): fully_shard and init_device_mesh
    refuse, naming it, and change nothing, under hp-run's variables and then under msrun's
    in their place; then, back under hp-run's, the same on a group of one rank joined by
    hand."""
    kit = get_kit()
    platform = hp.get_platform()
    out = {"hp-run": _unjoined_attempts(kit, platform)}
    hp_run = {name: os.environ.pop(name) for name in _HP_RUN_ONLY}
    os.environ.update(_MSRUN_WORKER_ENV, MS_NODE_ID=os.environ["LOCAL_RANK"],
                      RANK_ID=os.environ["LOCAL_RANK"])
    out["msrun"] = _unjoined_attempts(kit, platform)
    for name in (*_MSRUN_WORKER_ENV, "MS_NODE_ID", "RANK_ID"):
        del os.environ[name]
    os.environ.update(hp_run)
    platform.init_process_group(0, 1, "127.0.0.1", find_free_port(), 60.0)
    m = kit.Block(8, 12, 6)
    out["world_of_one"] = _attempt(kit, platform, m, lambda: hp.fully_shard(m))
    platform.destroy_process_group()
    return out
