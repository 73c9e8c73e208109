"""How the example lays out its model over the ranks, written once for both frameworks:
the whole model, or under ``--pp`` each of this rank's model parts (examples/lm/pipeline.py)
as if it were the whole model.

In torchtitan's order: the tensor-parallel plan (examples/lm/tensor_parallel.py) with the
keys that name the part's own modules, then the experts (examples/lm/expert_parallel.py),
then each decoder layer and the part ``fully_shard`` units. With ``recompute`` each
decoder layer, a unit, runs its forward again in backward (model_torch.py's
``Body._layer``).
"""

from __future__ import annotations

import fnmatch

from examples.lm.expert_parallel import shard_experts
from examples.lm.tensor_parallel import lm_plan


def lay_out(hp, part, mesh, mp_policy, dp_mesh_dims, tp_mesh, ep_meshes, moe: bool,
            recompute: bool) -> None:
    """``mesh``/``dp_mesh_dims``: fully_shard's; ``tp_mesh``: None for no tensor
    parallelism; ``ep_meshes``: ``shard_experts``'s, None for no expert parallelism;
    ``moe``: the model has experts."""
    part.model.recompute_layers = recompute
    if tp_mesh is not None:
        plan = lm_plan(hp, attention_inputs=3, moe=moe)
        hp.parallelize_module(part, tp_mesh, plan_for(hp, part, plan))
    if ep_meshes is not None:
        shard_experts(hp, part, ep_meshes, mp_policy)
    for layer in decoder_layers(part):
        hp.fully_shard(layer, mesh=mesh, mp_policy=mp_policy, dp_mesh_dims=dp_mesh_dims)
    hp.fully_shard(part, mesh=mesh, mp_policy=mp_policy, dp_mesh_dims=dp_mesh_dims)


def plan_for(hp, part, plan: dict) -> dict:
    """The keys of ``plan`` that name modules ``part`` holds."""
    names = [n for n, _ in hp.get_platform().named_modules(part) if n]
    return {key: style for key, style in plan.items() if fnmatch.filter(names, key)}


def decoder_layers(part) -> list:
    """The decoder layers a model part holds (a part's list keeps the whole model's
    indices: iterate it, never index it)."""
    return list(part.model.layers)
