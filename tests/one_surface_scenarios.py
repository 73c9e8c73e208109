"""Rank side of tests/test_one_surface.py: torch's own styles and meshes through
``hp.parallelize_module`` (2 ranks, torch)."""

from __future__ import annotations


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))


def _error_name(call) -> str:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the kind is what is reported
        return type(error).__name__
    return "nothing"


def torch_styles() -> dict:
    """What each way of calling ``hp.parallelize_module`` on torch makes or raises."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    import hyper_parallel as hp
    from hyper_parallel.tensor_parallel import tensor_parallel_layout

    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    out = {}
    # torch's styles on hp's mesh: torch's parallelize_module over the mesh it wraps
    model = hp.parallelize_module(_model(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    out["dtensor_weight"] = str(tuple(model[0].weight.placements))
    # torch warns and skips a key that matches nothing; hp's check refuses it, for torch's
    # styles too, before anything changes
    out["unmatched_key"] = _error_name(lambda: hp.parallelize_module(
        _model(), mesh, {"0": ColwiseParallel(), "9": RowwiseParallel()}))
    out["mixed_plan"] = _error_name(lambda: hp.parallelize_module(
        _model(), mesh, {"0": ColwiseParallel(), "2": hp.RowwiseParallel()}))
    # hp's styles on torch's own mesh, and on a slice of hp's mesh
    torch_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = hp.parallelize_module(_model(), torch_mesh, {"0": hp.ColwiseParallel()})
    out["torch_mesh_hp_styles"] = type(tensor_parallel_layout(model[0].weight)).__name__
    grid = hp.init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model = hp.parallelize_module(_model(), grid["tp"], {"0": hp.ColwiseParallel()})
    out["slice_of_hp_mesh"] = type(tensor_parallel_layout(model[0].weight)).__name__
    # torch's own function given hp's mesh: the error says to pass mesh.native
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    try:
        torch_parallelize(_model(), grid["tp"], {"0": ColwiseParallel()})
        out["torch_function_hp_mesh"] = "nothing raised"
    except AttributeError as error:
        out["torch_function_hp_mesh"] = "names mesh.native" if "mesh.native" in str(error) \
            else str(error)
    torch_parallelize(_model(), grid["tp"].native, {"0": ColwiseParallel()})  # as it says
    return out
