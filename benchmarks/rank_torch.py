"""One torch rank of one benchmark launch: ``python benchmarks/rank_torch.py JOB.json``.

[Note: the phases]
Every phase builds its own copy of the same model (the MLP of workload.py, or the decoder
of examples/lm) from the same numpy values, trains it with SGD (momentum 0.9, so there is
optimizer state) on the rank's rows of the same batches, and is timed over forward +
backward + optimizer step + zero_grad:

* ``hp``: ``hyper_parallel.fully_shard`` on every block (decoder layer), then on the root,
  over an ``hp.init_device_mesh`` mesh (("shard",) or ("replicate", "shard"));
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` the same way, over a torch DeviceMesh
  of the same shape and names;
* ``ddp``: ``DistributedDataParallel`` with its defaults (25 MiB buckets);
* ``compute``: the plain model, no communication: the computation of one rank;
* ``floor``: the plain model with the minimal schedule issued from hooks
  (raw_collectives.py, "the interleaved floor"); ``raw``: that schedule back to back.

All of them live in the same processes (FSDP2 and hyper_parallel on separate model copies,
their hooks on their own modules), so measure.py alternates their steps round by round.

bf16 means bf16 parameters with fp32 gradient reduction: ``MixedPrecisionPolicy(
param_dtype=bfloat16, reduce_dtype=float32)`` for hp and FSDP2; for DDP and the plain
model, which have no such policy, ``torch.autocast("cpu", bfloat16)`` around the forward,
which computes the Linears in bf16 and leaves fp32 gradients (DDP then all-reduces fp32).

[Note: what is counted]
hp's and the floor's bytes come from ``hp.track_comms()`` around one step; FSDP2's from
counting wrappers around ``torch.distributed.all_gather_single`` / ``reduce_scatter_single``
/ ``all_reduce`` (what FSDP2 calls), installed for one step only.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import measure
import raw_collectives
import workload

LR = 1e-3


def _mlp(torch, dims: list):
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
        for block, (weight, bias) in zip(model.blocks, workload.init_arrays(dims, workload.SEED)):
            block.linear.weight.copy_(torch.from_numpy(weight))
            block.linear.bias.copy_(torch.from_numpy(bias))
    return model


def _workload(torch, cfg: dict, rank: int, world: int):
    """(build() -> model, units(model) -> the blocks to shard, data, loss(out, target))."""
    if cfg["lm_size"] is None:
        dims = cfg["dims"]
        data = [(torch.from_numpy(x), torch.from_numpy(y))
                for x, y in workload.local_mlp_batches(dims, cfg["local_batch"], rank, world)]
        return (lambda: _mlp(torch, dims), lambda m: list(m.blocks), data,
                lambda out, y: ((out.float() - y) ** 2).mean())
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/ at the repo root
    from examples.lm.config import SIZES, VOCAB
    from examples.lm.model_torch import build

    size = cfg["lm_size"]
    data = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in workload.local_token_batches(
        SIZES[size]["seq"], VOCAB, cfg["local_batch"], rank, world)]

    def loss(logits, target):
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), target.reshape(-1))

    return (lambda: build(size), lambda m: list(m.model.layers), data, loss)


def _tiny(cfg: dict) -> dict:
    """The same configuration on a tiny model of the same kind (measure.py's priming)."""
    return dict(cfg, dims=None, lm_size="tiny") if cfg["lm_size"] else dict(cfg, dims=[64] * 5)


def _step_fn(torch, model, data: list, loss_fn, autocast: bool, after_backward=None):
    """The timed step of every phase. ``after_backward()`` runs between backward and the
    optimizer (the interleaved floor's last collectives)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        loss = loss_fn(out, y)
        loss.backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


@contextlib.contextmanager
def _count_torch_collectives(dist, dim_of_group, out: list):
    """Count calls and bytes of the torch.distributed collectives FSDP2 issues."""
    ops = {"all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter",
           "all_reduce": "all_reduce"}
    originals = {name: getattr(dist, name) for name in ops}
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
            entry = counts.setdefault((ops[name], dim_of_group(kwargs.get("group"))), [0, 0])
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
    import torch.distributed as dist

    import hyper_parallel as hp

    torch.set_num_threads(1)
    hp.init_distributed(timeout_s=job["comm_timeout_s"])
    cfg, impls = job["config"], job["config"]["impls"]
    mesh_shape = tuple(cfg["mesh"])
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    raf, bf16 = cfg["reshard_after_forward"], cfg["precision"] == "bf16"
    hp_mesh = hp.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    groups = {n: (hp_mesh.get_group(n), hp_mesh.size(n)) for n in names}
    torch_mesh = None
    if "fsdp2" in impls:
        from torch.distributed.device_mesh import init_device_mesh

        torch_mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)

    def make(build_model, units, data, loss_fn):
        """The builders of every phase on one workload (``_workload``)."""

        def build_hp():
            model = build_model()
            mp = (hp.MixedPrecisionPolicy(param_dtype="bfloat16", reduce_dtype="float32") if bf16
                  else hp.MixedPrecisionPolicy())
            for unit in units(model) + [model]:
                hp.fully_shard(unit, mesh=hp_mesh, reshard_after_forward=raf, mp_policy=mp)
            return _step_fn(torch, model, data, loss_fn, False)

        def build_fsdp2():
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            model = build_model()
            mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
                  else MixedPrecisionPolicy())
            for unit in units(model) + [model]:
                fully_shard(unit, mesh=torch_mesh, reshard_after_forward=raf, mp_policy=mp)
            return _step_fn(torch, model, data, loss_fn, False)

        def build_ddp():
            from torch.nn.parallel import DistributedDataParallel

            return _step_fn(torch, DistributedDataParallel(build_model()), data, loss_fn, bf16)

        def build_floor():
            model = build_model()
            return raw_collectives.interleaved_step(
                hp, model, job["schedule"], groups,
                lambda after: _step_fn(torch, model, data, loss_fn, bf16, after_backward=after))

        def build_raw():
            one_round = raw_collectives.round_fn(hp, job["schedule"], groups)
            return lambda i: one_round() or 0.0

        return {"hp": build_hp, "fsdp2": build_fsdp2, "ddp": build_ddp,
                "compute": lambda: _step_fn(torch, build_model(), data, loss_fn, bf16),
                "floor": build_floor, "raw": build_raw}

    def count_fsdp2(rows):
        ranks_of = {tuple(dist.get_process_group_ranks(torch_mesh.get_group(n))): n for n in names}

        def dim_of_group(group):
            return "" if group is None else ranks_of.get(tuple(dist.get_process_group_ranks(group)), "?")

        return _count_torch_collectives(dist, dim_of_group, rows)

    counters = {"hp": lambda rows: measure.track_into(hp, rows), "fsdp2": count_fsdp2,
                "floor": lambda rows: measure.track_into(hp, rows)}
    builders = make(*_workload(torch, cfg, rank, world))
    tiny = make(*_workload(torch, _tiny(cfg), rank, world))
    result = measure.measure_phases(
        {i: builders[i] for i in impls}, cfg["warmup"], cfg["rounds"], dist.barrier,
        {i: c for i, c in counters.items() if i in impls},
        primers={i: tiny[i] for i in impls if i not in ("floor", "raw")})
    result["threads"] = torch.get_num_threads()
    hp.destroy_distributed()
    return result


if __name__ == "__main__":
    measure.rank_main(run)
