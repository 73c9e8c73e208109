"""The example model's mixture of experts (``--moe``) and its expert parallelism (``--ep N``),
written once for both frameworks.

[Note: the plan]
With ``--moe`` every decoder layer's MLP is a mixture of ``EXPERTS`` SwiGLU experts (top-
``TOP_K`` softmax routing, no token dropped, experts held grouped: one ``(EXPERTS, ...)``
parameter per projection) balanced by router bias (``hp.update_expert_bias`` after each
step, the counts summed over every rank). With ``--ep N`` the experts are split over N
ranks, torchtitan's mesh: every rank is a data-parallel rank with its own rows, the
expert dim is carved out of them (``(nproc / N, N)``, dims ``efsdp`` x ``ep``), each
layer's experts are a ``fully_shard`` unit over ``efsdp`` whose gradients are divided by
the whole data-parallel size (they sum every rank's tokens), and the rest is sharded
over every rank as without experts.

[Note: the export]
``--export`` with ``--moe`` writes the weights in Hugging Face Llama's names, each layer's
router as ``mlp.gate.weight`` and each expert as a checkpoint of a mixture-of-experts
family stores it, one linear weight per expert and projection
(``model.layers.0.mlp.experts.3.gate_proj.weight``, ``(out, in)``: the grouped
``(in, out)`` blocks transposed; ``per_expert_names``). It writes no config.json: no
transformers family routes as this model does (softmax over every expert, the top 2 not
renormalised, a router bias), so ``from_pretrained`` would build another model.

[Note: the router bias in a checkpoint]
The router's bias is no parameter (outside autograd, no optimizer state): it travels in
the checkpoint's extra data (``router_biases``), one list per layer, and a resumed run
sets it back (``restore_router_biases``) before its first step, so it routes as the
uninterrupted run would at any expert degree and on either framework.
"""

from __future__ import annotations

import numpy as np

EXPERTS, TOP_K = 4, 2


def check_degree(nproc: int, ep: int, tp: int, mesh: str | None, cp: int = 1) -> str | None:
    """Why ``--ep ep`` cannot run (None if it can): the expert dim is carved out of the
    sharding ranks of each tensor-parallel position (``--mesh RxS``: of the S)."""
    shards = nproc // tp
    if mesh:
        try:
            shards = int(mesh.lower().split("x")[1])
        except (IndexError, ValueError):
            return None  # the mesh's own check names it
    if ep < 1 or shards % ep:
        where = f"the {shards} sharding ranks of --mesh {mesh}" if mesh else \
            f"--nproc {nproc} / --tp {tp}"
        return f"--ep {ep} must divide {where}"
    if EXPERTS % ep:
        return f"--ep {ep} must divide the {EXPERTS} experts"
    if ep > 1 and cp > 1:
        return "--ep runs with FSDP, HSDP (--mesh) and --tp: leave out --cp"
    return None


def expert_meshes(hp, device_type: str, nproc: int, ep: int, tp: int = 1,
                  replicas: int = 1) -> tuple:
    """(None without expert parallelism, else (the ``ep`` mesh, the experts' fully_shard
    mesh, the data-parallel size); a 1-D mesh of every rank, over which the router's counts
    are summed). The ranks are laid out as the dense mesh's ``(replicate, shard, tp)``,
    the shard dim cut into ``(efsdp, ep)``."""
    every = hp.init_device_mesh(device_type, (nproc,), mesh_dim_names=("dp",))
    if ep == 1:
        return None, every
    data = nproc // tp
    shape = (replicas, data // replicas // ep, ep, tp)
    names = ("replicate", "efsdp", "ep", "tp")
    keep = [i for i, n in enumerate(shape) if n > 1 or names[i] in ("efsdp", "ep")]
    mesh = hp.init_device_mesh(device_type, tuple(shape[i] for i in keep),
                               mesh_dim_names=tuple(names[i] for i in keep))
    experts = mesh["replicate", "efsdp"] if replicas > 1 else mesh["efsdp"]
    return (mesh["ep"], experts, data), every


def shard_experts(hp, model, meshes: tuple, mp_policy) -> None:
    """Split each layer's experts over the ``ep`` mesh and make them a unit over the
    experts' fully_shard mesh (``expert_meshes``; before the layers' units, which then
    leave them out), their gradients divided by the data-parallel size."""
    ep_mesh, experts_mesh, data = meshes
    for layer in model.model.layers:
        hp.parallelize_module(layer.mlp.experts, ep_mesh, hp.ExpertParallel())
        hp.fully_shard(layer.mlp.experts, mesh=experts_mesh, mp_policy=mp_policy)
        layer.mlp.experts.set_gradient_divide_factor(data)


def balance(hp, model, every) -> None:
    """After an optimizer step: each layer's router bias against the step's counts."""
    for layer in model.model.layers:
        hp.update_expert_bias(layer.mlp.expert_bias, layer.mlp.tokens_per_expert, every)


def forget_counts(hp, model) -> None:
    """Zero the counts a forward outside training (validation) added."""
    platform = hp.get_platform()
    for layer in model.model.layers:
        counts = layer.mlp.tokens_per_expert
        platform.copy_into(counts, platform.zeros(platform.shape(counts), platform.dtype_of(counts)))


def router_biases(hp, model) -> list:
    """Each layer's router bias, as JSON-serialisable lists (for a checkpoint's extra)."""
    platform = hp.get_platform()
    return [[float(v) for v in platform.to_numpy(layer.mlp.expert_bias)]
            for layer in model.model.layers]


def restore_router_biases(hp, model, biases: list) -> None:
    """Set each layer's router bias to ``biases`` (``router_biases``' lists)."""
    platform = hp.get_platform()
    for layer, bias in zip(model.model.layers, biases):
        platform.copy_into(layer.mlp.expert_bias, platform.from_numpy(np.asarray(bias, np.float32)))


def per_expert_names(hp):
    """The export's ``key_map``: each grouped expert parameter as one linear weight per
    expert; every other name as the model has it."""
    def key(name: str):
        prefix, _, attr = name.rpartition(".")
        if not prefix.endswith("mlp.experts"):
            return name
        return hp.per_expert_keys(f"{prefix}.{{expert}}.{attr}.weight", EXPERTS, transpose=True)
    return key
