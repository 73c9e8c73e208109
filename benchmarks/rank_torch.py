"""One torch rank of one benchmark launch: ``python benchmarks/rank_torch.py JOB.json``.

[Note: the four implementations]
All four build the same ``Stack`` (blocks of Linear + ReLU) from workload.py's arrays, train
it with SGD (momentum 0.9, so there is optimizer state) on the rank's rows of the same
batches, and time forward + backward + optimizer step + zero_grad:

* ``hp``: ``hyper_parallel.fully_shard`` on every block, then on the root, over an
  ``hp.init_device_mesh`` mesh (("shard",) or ("replicate", "shard"));
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` the same way, over a torch DeviceMesh
  of the same shape and names;
* ``ddp``: ``DistributedDataParallel`` with its defaults (25 MiB buckets);
* ``compute``: the plain model in a process that joins no group: the computation of one
  rank on its local batch, with no communication. run.py starts one per rank at the same
  time, so the CPU is shared exactly as in the distributed runs.

Every distributed launch also times compute-only once more at its end (``compute_paired``):
the plain model, built after the implementation's model is dropped (hp's is kept for the
alternation below), stepped by the same
code on every rank, so the overhead can subtract a compute time measured in the same
processes as the step (analysis.py, "overhead"). The hp launch then alternates, step by
step (``alternated``): its own step, that plain model's, the interleaved floor's (a second
plain model stepped the same way with the minimal schedule issued from hooks where the step
needs it; raw_collectives.py, "the interleaved floor") and a round of raw collectives.

bf16 means bf16 parameters with fp32 gradient reduction: ``MixedPrecisionPolicy(
param_dtype=bfloat16, reduce_dtype=float32)`` for hp and FSDP2; for DDP and compute-only,
which have no such policy, ``torch.autocast("cpu", bfloat16)`` around the forward, which
computes the Linears in bf16 and leaves fp32 gradients (DDP then all-reduces fp32).

[Note: what is counted]
hp's bytes come from ``hp.track_comms()`` around the measured steps. FSDP2's come from
counting wrappers around ``torch.distributed.all_gather_single`` / ``reduce_scatter_single``
/ ``all_reduce`` (what FSDP2 calls), installed for the measured steps only. DDP's are the
bucket sizes DDP reports (its C++ reducer cannot be wrapped from Python). After the measured
steps the hp launch times the raw collectives of the minimal schedule and the DDP launch
those of DDP's buckets (raw_collectives.py); peak memory is read before that.
"""

from __future__ import annotations

import contextlib
import gc
import time

import measure
import raw_collectives
import workload

SEED, DATA_SEED, N_BATCHES = 1234, 4321, 4
LR = 1e-3


def _build_model(torch, dims: list):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, d_in, d_out):
            super().__init__()
            self.linear = nn.Linear(d_in, d_out)

        def forward(self, x):
            return torch.relu(self.linear(x))

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block(dims[i], dims[i + 1]) for i in range(len(dims) - 1))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    model = Stack()
    with torch.no_grad():
        for block, (weight, bias) in zip(model.blocks, workload.init_arrays(dims, SEED)):
            block.linear.weight.copy_(torch.from_numpy(weight))
            block.linear.bias.copy_(torch.from_numpy(bias))
    return model


@contextlib.contextmanager
def _count_torch_collectives(dist, dim_of_group, out: list):
    """Count calls and bytes of the torch.distributed collectives FSDP2 issues."""
    originals = {name: getattr(dist, name) for name in
                 ("all_gather_single", "reduce_scatter_single", "all_reduce")}
    ops = {"all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter",
           "all_reduce": "all_reduce"}
    counts: dict = {}

    def wrap(name):
        original = originals[name]

        def counted(*args, **kwargs):
            # all-gather: the output (first argument); reduce-scatter: the input; all-reduce:
            # the tensor -- the same convention as hp.track_comms.
            if name == "reduce_scatter_single":
                tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
            else:
                tensor = kwargs.get("output_tensor", kwargs.get("tensor", args[0] if args else None))
            key = (ops[name], dim_of_group(kwargs.get("group")))
            entry = counts.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] += tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)

        return counted

    for name in originals:
        setattr(dist, name, wrap(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        out.extend({"op": op, "wire": op, "dim": dim, "calls": c, "bytes": b}
                   for (op, dim), (c, b) in sorted(counts.items()))


def run(job: dict, rank: int, world: int) -> dict:
    import torch

    torch.set_num_threads(1)
    cfg, impl = job["config"], job["impl"]
    dims, mesh_shape = cfg["dims"], tuple(cfg["mesh"])
    hsdp = len(mesh_shape) == 2
    names = ("replicate", "shard") if hsdp else ("shard",)
    bf16 = cfg["precision"] == "bf16"
    started = time.perf_counter()
    hp = dist = None
    if impl != "compute":
        import torch.distributed as dist

        import hyper_parallel as hp

        hp.init_distributed(timeout_s=job["comm_timeout_s"])
    model = _build_model(torch, dims)
    autocast = False
    hp_mesh = torch_mesh = None
    if impl == "hp":
        hp_mesh = hp.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        mp = (hp.MixedPrecisionPolicy(param_dtype="bfloat16", reduce_dtype="float32") if bf16
              else hp.MixedPrecisionPolicy())
        for block in model.blocks:
            hp.fully_shard(block, mesh=hp_mesh, reshard_after_forward=cfg["reshard_after_forward"],
                           mp_policy=mp)
        hp.fully_shard(model, mesh=hp_mesh, reshard_after_forward=cfg["reshard_after_forward"],
                       mp_policy=mp)
    elif impl == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        torch_mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
              else MixedPrecisionPolicy())
        for block in model.blocks:
            fully_shard(block, mesh=torch_mesh, reshard_after_forward=cfg["reshard_after_forward"],
                        mp_policy=mp)
        fully_shard(model, mesh=torch_mesh, reshard_after_forward=cfg["reshard_after_forward"],
                    mp_policy=mp)
    elif impl == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        autocast = bf16
    else:
        autocast = bf16
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    data = [(torch.from_numpy(workload.local_rows(x, rank, world)),
             torch.from_numpy(workload.local_rows(y, rank, world)))
            for x, y in workload.batches(N_BATCHES, cfg["local_batch"] * world, dims[0], dims[-1],
                                         DATA_SEED)]
    gc.collect()
    setup_s = time.perf_counter() - started

    step = _step_fn(torch, model, opt, data, autocast)
    barrier = dist.barrier if dist is not None else None
    result = {"impl": impl, "setup_s": setup_s, "threads": torch.get_num_threads()}
    counted: list = []
    context = None
    if impl == "hp":
        context = measure.track_into(hp, counted)
        result["comm_source"] = "hp.track_comms"
    elif impl == "fsdp2":
        groups = {tuple(dist.get_process_group_ranks(torch_mesh.get_group(n))): n for n in names}

        def dim_of_group(group):
            return "" if group is None else groups.get(tuple(dist.get_process_group_ranks(group)), "?")

        context = _count_torch_collectives(dist, dim_of_group, counted)
        result["comm_source"] = "wrapped torch.distributed calls"
    result["timing"] = measure.timed_steps(step, cfg["warmup"], cfg["steps"], barrier,
                                           measured_context=context)
    if context is not None:
        result["comm"] = counted
    result["comm_steps"] = cfg["steps"]

    if impl == "ddp":
        buckets = _ddp_bucket_bytes(model)
        result["ddp_bucket_bytes"] = buckets
        schedule = workload.ddp_schedule(dims, buckets)
        result["comm"] = [{"op": "all_reduce", "wire": "all_reduce", "dim": "",
                           "calls": len(schedule) * cfg["steps"],
                           "bytes": sum(e["numel"] * 4 for e in schedule) * cfg["steps"]}]
        result["comm_source"] = "DDP bucket sizes (DDP logging data)" if buckets else "DDP default bucketing rule"
        result["raw"] = raw_collectives.time_schedule(
            hp, schedule, {"": (None, world)}, 1, cfg["steps"], barrier)
    elif impl == "hp":
        groups = {n: (hp_mesh.get_group(n), hp_mesh.size(n)) for n in names}
        result["raw"] = raw_collectives.time_schedule(hp, job["schedule"], groups, 1, cfg["steps"],
                                                      barrier)
    if impl != "compute":
        library_step = step if impl == "hp" else None  # hp's model lives on for the alternation
        step = opt = model = None
        gc.collect()
        plain = _build_model(torch, dims)
        plain_opt = torch.optim.SGD(plain.parameters(), lr=LR, momentum=0.9)
        compute_step = _step_fn(torch, plain, plain_opt, data, autocast=bf16)
        result["compute_paired"] = measure.timed_steps(compute_step, cfg["warmup"], cfg["steps"],
                                                       barrier)
        if impl == "hp":
            floor = _build_model(torch, dims)
            floor_opt = torch.optim.SGD(floor.parameters(), lr=LR, momentum=0.9)
            result.update(raw_collectives.alternate_with_floor(
                hp, job["schedule"], groups, library_step, compute_step, floor,
                lambda after: _step_fn(torch, floor, floor_opt, data, bf16, after_backward=after),
                cfg["steps"], barrier))
        hp.destroy_distributed()
    return result


def _step_fn(torch, model, opt, data: list, autocast: bool, after_backward=None):
    """The timed step of every implementation: forward (under bf16 autocast for DDP and
    compute-only in bf16 configurations), loss, backward, optimizer step, zero_grad.
    ``after_backward()`` runs between backward and the optimizer (the interleaved floor's
    last collectives)."""

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        loss = ((out.float() - y) ** 2).mean()
        loss.backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def _ddp_bucket_bytes(ddp) -> list[int] | None:
    """DDP's bucket sizes in bytes from its logging data (a private API: None if it moved).

    On CPU, DDP starts with all gradients in one bucket and rebuilds its buckets after the
    first backward (``rebuilt_bucket_sizes``, 25 MiB cap); the measured steps use those.
    """
    try:
        data = ddp._get_ddp_logging_data()
        text = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
        sizes = [int(s) for s in str(text).replace(" ", "").split(",") if s]
        return sizes or None
    except Exception:  # noqa: BLE001 - fall back to the documented default rule
        return None


if __name__ == "__main__":
    measure.rank_main(run)
