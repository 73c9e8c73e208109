"""Rank-side scenarios of the HSDP gradient-pipeline suite (test_hsdp.py), for both frameworks.

A config is a dict; every key is optional:
    mesh:        (R, S) replicate x shard, default (1, world)
    reduce_op:   "avg" | "sum"            divide: custom divide factor
    scale:       gradient scaling factor (float, or ("tensor", value) for a 1-element tensor)
    optimizer:   "sgd" (momentum, default) | "adamw"
    mp:          None | "bfloat16" | "float16"   (param_dtype; reduce_dtype float32)
    main_grad:   apply_grad_on_fp32_main_grad
    accum:       None | "no_sync" | "no_all_reduce" | "not_last"   (K = 3 micro-batches)
    threshold:   shard_threshold_bytes
    own:         own_collective_bytes (default None: every sharded parameter fused)
The reference trains an unwrapped copy on the whole global batch; its gradients are scaled by
the factor the config implies (e.g. "sum" gives data-parallel-size times the mean gradient).
"""

from __future__ import annotations

import numpy as np

import hyper_parallel as hp
from tests.clip_grad_scenarios import run_layout
from tests.kit import get_kit, make_batches
from tests.scenarios import D_IN, D_OUT, GLOBAL_BATCH, STEPS, _build, _named

MICRO_BATCHES = 3
GLOBAL_BATCH_ACCUM = 12  # divisible by 4 ranks x 3 micro-batches


def _expected_grad_factor(config: dict, dp: int) -> float:
    scale = config.get("scale", 1.0)
    scale = scale[1] if isinstance(scale, tuple) else scale
    if config.get("divide") is not None:
        return scale * dp / config["divide"]
    return scale * (dp if config.get("reduce_op", "avg").lower() == "sum" else 1.0)


def run_config(config: dict) -> dict:
    kit = get_kit()
    platform = hp.get_platform()
    rank, world = platform.rank(), platform.world_size()
    mesh_shape = tuple(config.get("mesh", (1, world)))
    mesh = hp.init_device_mesh(platform.device_type(), mesh_shape, mesh_dim_names=("replicate", "shard"))
    accum = config.get("accum")
    micro = MICRO_BATCHES if accum else 1
    batch = GLOBAL_BATCH_ACCUM if accum else GLOBAL_BATCH
    model, ref = _build(kit, "nested"), _build(kit, "nested")
    kit.load(model, 0)
    kit.load(ref, 0)
    mp = hp.MixedPrecisionPolicy(param_dtype=config.get("mp"),
                                 reduce_dtype="float32" if config.get("mp") else None,
                                 apply_grad_on_fp32_main_grad=config.get("main_grad", False))
    options = dict(mesh=mesh, mp_policy=mp, shard_threshold_bytes=config.get("threshold", 0),
                   own_collective_bytes=config.get("own"))
    for block in model.blocks:
        hp.fully_shard(block, **options)
    hp.fully_shard(model, **options)
    if "reduce_op" in config:
        model.set_reduce_op_type(config["reduce_op"])
    if config.get("divide") is not None:
        model.set_gradient_divide_factor(config["divide"])
    if "scale" in config:
        scale = config["scale"]
        model.set_gradient_scaling_factor(
            kit.tensor(np.array([scale[1]], np.float32)) if isinstance(scale, tuple) else scale)
    kind = config.get("optimizer", "sgd")
    opt = kit.optimizer([p for p in kit.params(model) if p.requires_grad], kind=kind)
    ref_opt = kit.optimizer(kit.params(ref), kind=kind)
    factor = _expected_grad_factor(config, world)

    per_micro = []
    pending_after_non_last = []

    def before_micro(index, is_last):
        if per_micro:
            per_micro[-1] = hp.comm_stats().snapshot().minus(per_micro[-1])
        if index > 0 and accum == "not_last":
            pending_after_non_last.append(model.__dict__["_hp_state"].iteration.has_pending())
        per_micro.append(hp.comm_stats().snapshot())
        if accum == "no_sync":
            model.set_requires_gradient_sync(is_last)
        elif accum == "no_all_reduce":
            model.set_requires_all_reduce(is_last)
        elif accum == "not_last":
            model.set_is_last_backward(is_last)

    losses, ref_losses, comms = [], [], []
    local = slice(rank * batch // world, (rank + 1) * batch // world)
    for x, y in make_batches(STEPS, batch, D_IN, D_OUT, seed=11):
        per_micro.clear()
        losses.append(kit.train_step(model, opt, x[local], y[local], micro_batches=micro,
                                     sync_fn=before_micro, use_main_grad=config.get("main_grad", False)))
        per_micro[-1] = hp.comm_stats().snapshot().minus(per_micro[-1])
        comms = [{(op, dim): rec.calls for (op, _wire, dim), rec in window.records.items()}
                 for window in per_micro]
        shard_wires = sorted({f"{op}:{wire}" for window in per_micro
                              for (op, wire, dim) in window.records if dim == "shard"})
        ref_losses.append(kit.train_step(ref, ref_opt, x, y, grad_scale=factor))
    training_gather_bytes = hp.comm_stats().nbytes("all_gather")
    full = hp.gather_full_state_dict(model)
    ref_full = {k: kit.to_numpy(v) for k, v in _named(kit, ref).items()}
    return {
        "losses": losses, "ref_losses": ref_losses,
        "param_diff": max(float(np.abs(full[k] - ref_full[k]).max()) for k in ref_full),
        "worst": max(ref_full, key=lambda k: float(np.abs(full[k] - ref_full[k]).max())),
        "full": full,
        "last_step_comms": comms,
        "last_step_shard_wires": shard_wires,
        "pending_after_non_last": pending_after_non_last,
        "all_gather_bytes": training_gather_bytes,
        "param_dtypes": sorted({str(platform.dtype_of(p)).split(".")[-1].lower() for p in kit.params(model)}),
        "replicated_params": sorted(fp.fqn for _, sub in platform.named_modules(model)
                                    if "_hp_state" in sub.__dict__
                                    for fp in sub.__dict__["_hp_state"].params if not fp.is_sharded),
    }


def run_configs(configs: list) -> list:
    results = []
    for config in configs:
        hp.comm_stats().reset()
        # the clipping suite's HSDP layout (tests/clip_grad_scenarios.py) shares this launch
        results.append(run_layout("hsdp", {}) if config.get("clip") else run_config(config))
    return results

