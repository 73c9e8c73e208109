"""Rank-side bad-input checks: each returns (error type, message, module untouched?)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import hyper_parallel as hp
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
    relu = kit.activation()
    returned = hp.fully_shard(relu)
    x = np.array([[-1.0, 2.0]], dtype=np.float32)
    out["no_params"] = (returned is relu and isinstance(relu, hp.FSDPModule),
                        kit.to_numpy(relu(kit.tensor(x))).tolist())
    return out
