"""Cutting a whole model into pipeline stages by module names (torchtitan's
``pipeline_module_split`` and ``generate_llm_fqn_per_model_part``), written once over the
platform.

[Note: a model part is the whole model with holes]
Stage ``i``'s model part is a copy of the whole model's tree along the paths to the
modules named for stage ``i``; those modules (and all below them) are the whole model's
own objects, shared, not copied; every other module is removed: from a list or dict
container (``ModuleList``, ``CellList``, ...) without renumbering the entries kept (a
container none of whose entries is kept stays, empty, as torchtitan leaves it), and
elsewhere replaced by None. So a part's parameters keep the whole model's names (stage 1
of a four-layer model holds ``layers.2.*`` and ``layers.3.*``, as the checkpoint of the
whole model names them; torchtitan renumbers a kept ``ModuleList``), and the parts of one
rank never share registries (hooks, units). Nothing is copied or materialised: a whole
model built without values (torch's meta device, MindSpore's ``no_init_parameters``)
gives parts without values, and each rank materialises only its own parts.

The model's forward must run on a part: skip a None module (``h = self.embed(ids) if
self.embed is not None else ids``) and iterate a container rather than index it (the
entries kept keep their names: ``layers[0]`` of stage 1 does not exist).
"""

from __future__ import annotations

import copy
from typing import Any

from hyper_parallel.pipelining.schedules import (
    Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
)
from hyper_parallel.pipelining.stage import PipelineStage, _pp_mesh
from hyper_parallel.platform import get_platform

#: torch's schedule names (``get_schedule_class``, case-insensitive) -> (class, single stage)
SCHEDULES = {"gpipe": (ScheduleGPipe, True), "1f1b": (Schedule1F1B, True),
             "interleaved1f1b": (ScheduleInterleaved1F1B, False)}


def generate_llm_fqn_per_model_part(num_stages: int, num_layers: int, input_weight: int = 1,
                                    output_weight: int = 1, *,
                                    input_modules: tuple = ("tok_embeddings",),
                                    layers: str = "layers",
                                    output_modules: tuple = ("norm", "output")) -> list:
    """torchtitan's split of a language model: ``[[module names of stage 0], ...]``, the
    input modules on the first stage, the output modules on the last, the layers spread
    so that each stage holds about as many layers as the others, the input and output
    modules counting ``input_weight`` and ``output_weight`` layers. The keywords name the
    model's modules (torchtitan's names by default)."""
    layer_names = [f"{layers}.{i}" for i in range(num_layers)]
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    if num_stages == 1:
        return [list(input_modules) + layer_names + list(output_modules)]
    effective = num_layers + input_weight + output_weight
    per_stage, extra = divmod(effective, num_stages)
    if per_stage == 0:
        raise ValueError(f"{num_stages} stages are more than the {effective} layers they "
                         f"share ({num_layers} layers, input_weight {input_weight}, "
                         f"output_weight {output_weight}): use at most {effective} stages")
    for what, weight in (("input_weight", input_weight), ("output_weight", output_weight)):
        if weight > per_stage:
            raise ValueError(f"{what} {weight} is more than the {per_stage} layers a stage "
                             f"holds: lower it or use fewer stages")
    stages, next_layer = [], 0
    for i in range(num_stages):
        count = per_stage + (i < extra)
        count -= input_weight if i == 0 else output_weight if i == num_stages - 1 else 0
        names = list(input_modules) if i == 0 else []
        names += layer_names[next_layer:next_layer + count]
        next_layer = min(next_layer + count, num_layers)
        stages.append(names + (list(output_modules) if i == num_stages - 1 else []))
    return stages


def pipeline_module_split(whole_model: Any, pp_mesh: Any, pp_schedule: Any, device: Any,
                          module_names_per_stage: list) -> tuple:
    """``(stages, model_parts)`` of this pp rank: stage ``i`` holds the modules
    ``module_names_per_stage[i]`` names, and sits on pp rank ``i % size`` (torch's loop
    order: an interleaved schedule gets several per rank). ``pp_schedule``: a schedule
    class or torch's name of one ("GPipe", "1F1B", "Interleaved1F1B"). Every name is
    checked before anything is built (the note above for what a part is)."""
    mesh = _pp_mesh(pp_mesh)
    size, pp_rank = mesh.size(), mesh.get_local_rank(0)
    single = _single_stage(pp_schedule)
    num_stages = len(module_names_per_stage)
    if single and num_stages != size:
        raise ValueError(f"{num_stages} lists of module names for a schedule of one stage "
                         f"per rank over a pp mesh of {size} ranks: give {size} lists")
    if not single and (num_stages % size or num_stages < 2 * size):
        raise ValueError(f"{num_stages} lists of module names for an interleaved schedule "
                         f"over a pp mesh of {size} ranks: give a multiple of {size}, at "
                         f"least {2 * size} (two or more stages per rank)")
    _check_names(whole_model, module_names_per_stage)
    stages, parts = [], []
    for i in range(pp_rank, num_stages, size):
        part = _part(whole_model, "", set(module_names_per_stage[i]))
        stages.append(PipelineStage(part, i, num_stages, device, group=mesh))
        parts.append(part)
    return stages, parts


def _single_stage(pp_schedule: Any) -> bool:
    for cls, single in SCHEDULES.values():
        if pp_schedule is cls:
            return single
    key = pp_schedule.lower() if isinstance(pp_schedule, str) else None
    if key not in SCHEDULES:
        raise ValueError(f"pp_schedule {pp_schedule!r} is not offered: pass GPipe, 1F1B or "
                         f"Interleaved1F1B (torch's names) or the schedule class")
    return SCHEDULES[key][1]


def _check_names(whole_model: Any, names_per_stage: list) -> None:
    """Every name a module of the model, named for one stage only, and every parameter
    in a named module: else a ValueError that says which."""
    p = get_platform()
    modules = dict(p.named_modules(whole_model))
    owner: dict = {}
    for i, names in enumerate(names_per_stage):
        for name in names:
            if not name or name not in modules:
                raise ValueError(f"stage {i} names {name!r}, which is not a module of the "
                                 f"model: name submodules as the model's named_modules do "
                                 f"(e.g. 'layers.0')")
            clash = [o for o in owner if o == name or o.startswith(name + ".")
                     or name.startswith(o + ".")]
            if clash:
                raise ValueError(f"{name!r} (stage {i}) and {clash[0]!r} (stage "
                                 f"{owner[clash[0]]}) name the same module or one inside "
                                 f"the other: name each module for one stage only")
            owner[name] = i
    unplaced = [f"{m}.{a}" if m else a for m, sub in p.named_modules(whole_model)
                for a, _ in p.direct_params(sub)
                if not any(m == o or m.startswith(o + ".") for o in owner)]
    if unplaced:
        raise ValueError(f"parameters in no stage's modules: {unplaced[:4]}: name the "
                         f"modules that hold them for a stage")


def _part(module: Any, prefix: str, kept: set) -> Any:
    """``module`` (at ``prefix`` in the whole model) cut down to the ``kept`` names."""
    if prefix in kept:
        return module
    p = get_platform()
    children = {}
    for name, child in p.named_modules(module):
        full = f"{prefix}.{name}" if prefix else name
        if not name or "." in name:
            continue
        if full in kept or any(k.startswith(full + ".") for k in kept):
            children[name] = _part(child, full, kept)
        elif p.children_of(child)[1]:  # a list or dict of layers none of which is kept
            children[name] = module_shell(p, child, {})
    return module_shell(p, module, children)


def module_shell(p: Any, module: Any, children: dict) -> Any:
    """A copy of ``module`` that shares its parameters, buffers and attributes but has its
    own registries (hooks and units added to the copy stay on it), whose children are
    ``children`` (``{name: module}``, a subset of its own): a child left out is dropped from
    a list or dict container without renumbering the others, and is None elsewhere."""
    shell = copy.copy(module)
    shell.__dict__ = {k: copy.copy(v) if isinstance(v, (dict, list, set)) else v
                      for k, v in vars(module).items()}
    registry, container = p.children_of(shell)
    for name in list(registry):
        if name in children:
            registry[name] = children[name]
        elif container:
            del registry[name]
        else:
            registry[name] = None
    p.children_changed(shell)
    return shell
