"""What a platform can and cannot do, in one record the core reads instead of probing.

[Note: capabilities instead of stubs]
A method a platform cannot offer is not part of its required contract: the core asks
``platform.capabilities`` first and only then calls the method (``release_storage`` only
where ``can_release_storage``). Each field is fixed for the life of the process; a platform
whose answer depends on the device computes the record on first use, after the process
joined its group (MindSpore reads its device only then).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """One platform's answers; every field is documented where the core reads it."""

    #: the device this process computes on: "cpu", "cuda" or "npu"
    device_type: str = "cpu"
    #: ``release_storage`` really frees memory that autograd still references, and
    #: ``restore_storage`` gives it back: full parameters are freed between forward and
    #: backward and gathered again before backward.
    can_release_storage: bool = False
    #: an operation reads a view of another tensor's memory in place. Where it does not
    #: (MindSpore copies a view into new memory for each kernel, and autograd keeps that
    #: copy for backward), full parameters are copied out of the gather output instead of
    #: being read as views of it (layout.py, "views").
    kernels_read_views: bool = True
    #: a sharded parameter keeps its padding rows, so it is never empty (MindSpore's
    #: optimizers cannot make state for an empty parameter).
    pads_local_shards: bool = False
    #: ``attach_tensor`` registers the full tensor as the module's parameter, so
    #: ``parameters()`` yields it while the unit is unsharded (FSDP2's behaviour on torch).
    registers_full_tensors: bool = False
    #: backward's return value is the gradient the user receives (MindSpore
    #: ``value_and_grad``); False where gradients accumulate on the parameters (torch).
    returns_grads_from_backward: bool = False
    #: an async collective progresses while the host issues more work. Where it does not,
    #: the core reduces each unit's gradients inside its own backward (iteration.py).
    collectives_overlap_compute: bool = True
    #: default of ``fully_shard(own_collective_bytes=...)``: from which size a sharded
    #: parameter gets its own all-gather and reduce-scatter instead of sharing the unit's
    #: fused one (None: always share), weighing a collective call against the copies into
    #: and out of the fused buffer it saves (param_group.py).
    default_own_collective_bytes: int | None = None
    #: backward gives no gradient (None) for a full parameter that nothing used, as torch's
    #: autograd does; False where every output's gradient arrives as a tensor (MindSpore's
    #: bprop receives zeros). Where True, a unit's ranks agree on which parameters some
    #: rank used, and the others get no gradient (gradients.py, "unused parameters").
    reports_unused_grads: bool = False
    #: a unit's backward frees its full parameters after its gradient reduction started,
    #: not before (FSDP2's order, which lets the reduction's buffers take the memory).
    #: Where the allocator keeps every block it once held and carves smaller requests out of
    #: free ones (MindSpore's CPU pool), a block freed first is split by the reduction's
    #: half-size buffers, the gradient shard kept until the optimizer stays in it, and the
    #: next unit's re-gather, as large as the block, takes new memory: 3.6 MiB more per
    #: 16 MiB block in a step (docs/platforms.md, "Memory").
    release_after_reduction: bool = False
    #: of the forwards whose backward is pending (``forward_for_later_backward``), only the
    #: latest one's may run (MindSpore PyNative keeps them as a stack); a pipeline runs an
    #: older one's by recomputing its forward (docs/platforms.md, "Pipelines on MindSpore").
    backward_of_latest_forward_only: bool = False
