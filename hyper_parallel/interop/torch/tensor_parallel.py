"""Tensor-parallel parameters under fully_shard on torch: a DTensor parameter that torch's
own tensor parallelism (``torch.distributed.tensor.parallel``) already split is sharded over
data parallel on top, as FSDP2 does.

[Note: two meshes, one shard]
fully_shard shards this rank's tensor-parallel part (``param_local_values``) over the
data-parallel mesh; the sharded parameter is a DTensor over both meshes joined (the
data-parallel dims first), with ``_StridedShard`` where both shard the same tensor dim.
The full tensors the unit gathers are this rank's tensor-parallel part, which the module
reads as the tensor-parallel DTensor (``as_tensor_parallel``).
"""

from __future__ import annotations

import torch.distributed as dist
import torch
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Partial

# on a sharded parameter made from a tensor-parallel DTensor: (its tensor-parallel mesh,
# placements, global shape, global stride), to present the full tensors as such DTensors
TP_SPEC = "_hp_tp_spec"
# on a unit's module: {attribute: (full tensor, its tensor-parallel DTensor)}
TP_VIEWS = "_hp_tensor_parallel_views"


def _strided_shard(dim: int, split_factor: int):
    """FSDP2's placement for sharding a dim over data parallel that tensor parallelism,
    on a mesh dim to its right, already splits ``split_factor`` ways."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def as_tensor_parallel(module, attr_name: str, sharded_param, tensor):
    """``tensor`` (this rank's tensor-parallel part of ``sharded_param``'s full values, to
    be ``module.<attr_name>``) as the tensor-parallel DTensor the layers compute with (its
    gradient comes back to ``tensor`` as a local tensor); ``tensor`` itself for any other
    parameter.

    The DTensor made for a full tensor is kept on the module (``TP_VIEWS``) and given
    again when the same full tensor is attached again: a unit resharded after forward is
    gathered again for backward into the same full tensors, in a hook that runs without
    grad mode, and activation checkpointing's recomputation must compute with the
    forward's DTensor (which requires grad, so the recomputation saves what the forward
    saved)."""
    tp = getattr(sharded_param, TP_SPEC, None)
    if tp is None:
        return tensor
    views = module.__dict__.setdefault(TP_VIEWS, {})
    made = views.get(attr_name)
    if made is not None and made[0] is tensor:
        return made[1]
    mesh, placements, shape, stride = tp
    view = DTensor.from_local(tensor, mesh, placements, run_check=False, shape=shape,
                              stride=stride)
    views[attr_name] = (tensor, view)
    return view


class TorchTensorParallel:
    """Mixed into the torch platform (platform.py): its ``make_sharded_param`` and
    ``attach_tensor`` for a parameter torch's tensor parallelism split, and the reads of
    such a parameter the core asks for (``param_local_values``, ``tensor_parallel_block``,
    ``full_over_tensor_parallel``)."""

    def __init__(self) -> None:
        super().__init__()
        self._spmd_meshes = {}  # see _spmd_mesh

    def make_sharded_param(self, orig_param, local_shard, native_mesh, shard_mesh_dim,
                           shard_dim, full_shape, backing=None):
        if not isinstance(orig_param, DTensor):
            return super().make_sharded_param(orig_param, local_shard, native_mesh,
                                              shard_mesh_dim, shard_dim, full_shape, backing)
        mesh, placements, shape, tp = self._tensor_parallel_layout(
            orig_param, native_mesh, shard_mesh_dim, shard_dim)
        param = self._dtensor_param(orig_param, local_shard, mesh, placements, shape, backing)
        setattr(param, TP_SPEC, tp)
        return param

    def attach_tensor(self, module, attr_name, tensor) -> None:
        super().attach_tensor(module, attr_name, as_tensor_parallel(
            module, attr_name, self._sharded_param(module, attr_name), tensor))

    def param_local_values(self, param):
        if not isinstance(param, DTensor):
            return param
        if any(isinstance(pl, Partial) for pl in param.placements):
            raise ValueError(f"fully_shard takes DTensor parameters that are sharded or "
                             f"replicated over their mesh (tensor parallelism); this one has "
                             f"placements {param.placements}: redistribute it first")
        return param.to_local().detach()

    def _spmd_mesh(self, dp_mesh, tp_mesh):
        """The mesh (data-parallel dims, then tensor-parallel dims) a tensor-parallel
        parameter's shard lives on: the two concatenated where they come from one torch
        mesh (FSDP2's), else one made from their groups, with the rank grid gathered once
        from every rank (all ranks shard the same parameters in the same order)."""
        key = (id(dp_mesh), id(tp_mesh))
        if key in self._spmd_meshes:
            return self._spmd_meshes[key][2]
        dp_ranks, tp_ranks = dp_mesh.mesh.flatten().tolist(), tp_mesh.mesh.flatten().tolist()
        if set(dp_ranks) & set(tp_ranks) != {self.rank()}:
            raise ValueError(f"a tensor-parallel parameter's mesh {tp_mesh} shares ranks other "
                             f"than this one with the data-parallel mesh {dp_mesh}; tensor "
                             f"parallelism must use the mesh dims that fully_shard does not")
        names = tuple(dp_mesh.mesh_dim_names or ()) + tuple(tp_mesh.mesh_dim_names or ())
        mesh = None
        concatenate = getattr(TorchDeviceMesh, "_concatenate", None)
        if concatenate is not None and len(set(names)) == dp_mesh.ndim + tp_mesh.ndim:
            try:
                mesh = concatenate([dp_mesh, tp_mesh])
            except (RuntimeError, AttributeError):
                mesh = None  # not slices of one torch mesh
        if mesh is None:
            everyone = [None] * self.world_size()
            dist.all_gather_object(everyone, (self.rank(), tp_ranks))
            tp_of = dict(everyone)
            grid = torch.tensor([tp_of[r] for r in dp_ranks]).reshape(
                *dp_mesh.mesh.shape, *tp_mesh.mesh.shape)
            groups = [dp_mesh.get_group(i) for i in range(dp_mesh.ndim)] + \
                     [tp_mesh.get_group(i) for i in range(tp_mesh.ndim)]
            if len(set(names)) != len(groups):
                names = tuple(f"dp{i}" for i in range(dp_mesh.ndim)) + \
                    tuple(f"tp{i}" for i in range(tp_mesh.ndim))
            mesh = TorchDeviceMesh.from_group(groups, dp_mesh.device_type, mesh=grid,
                                              mesh_dim_names=names)
        self._spmd_meshes[key] = (dp_mesh, tp_mesh, mesh)  # keeps the ids valid
        return mesh

    def _tensor_parallel_layout(self, orig_param, native_mesh, shard_mesh_dim, shard_dim):
        """``(mesh, placements, global shape, tensor-parallel spec)`` of the sharded parameter
        made from the tensor-parallel ``orig_param``: the shard spans both meshes."""
        spec = orig_param._spec
        tp = (orig_param.device_mesh, tuple(orig_param.placements), orig_param.shape,
              orig_param.stride())
        placements = [Replicate()] * native_mesh.ndim
        if shard_dim is not None:
            split = spec.num_shards_map[shard_dim]
            placements[shard_mesh_dim] = (_strided_shard(shard_dim, split) if split > 1
                                          else Shard(shard_dim))
        placements += list(orig_param.placements)
        mesh = self._spmd_mesh(native_mesh, orig_param.device_mesh)
        return mesh, placements, tuple(orig_param.shape), tp

    def tensor_parallel_block(self, sharded_param):
        mesh, placements, shape, _ = getattr(sharded_param, TP_SPEC)
        offsets, sizes = [0] * len(shape), list(shape)
        coordinate = mesh.get_coordinate()
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, Replicate):
                continue
            if type(placement) is not Shard:  # _StridedShard: the part is no block
                return None
            # DTensor's uneven split (torch.chunk's): ceil-sized chunks, trailing ones short
            dim, count = placement.dim, mesh.size(mesh_dim)
            chunk = -(-sizes[dim] // count)
            start = min(coordinate[mesh_dim] * chunk, sizes[dim])
            offsets[dim] += start
            sizes[dim] = min(chunk, sizes[dim] - start)
        return tuple(shape), tuple(offsets)

    def full_over_tensor_parallel(self, sharded_param, local_full):
        tp = getattr(sharded_param, TP_SPEC, None)
        if tp is None:
            return local_full
        mesh, placements, shape, stride = tp
        return DTensor.from_local(local_full, mesh, placements, run_check=False, shape=shape,
                                  stride=stride).full_tensor()
