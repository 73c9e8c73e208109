"""A two-stage pipeline written by hand with point-to-point send/recv, fully_shard inside
each stage: the rank side of tests/test_p2p_pipeline.py, and an example to copy.

[Note: the pipeline]
Four ranks form a (pp 2, dp 2) mesh. Ranks 0 and 1 hold stage 0 (two blocks and a linear
layer), ranks 2 and 3 stage 1 (a block and the output layer); inside a stage the two
ranks shard its parameters with ``fully_shard`` over ``mesh["dp"]`` and each reads its own
half of the global batch. Rank r of stage 0 talks to rank r + 2 of stage 1 only:

    stage 0 (rank r)                         stage 1 (rank r + 2)
    forward micro-batch i, send its output   receive it, forward to the loss
    ... for every micro-batch (GPipe) ...
    receive d(loss)/d(output) of i           backward of i, send d(loss)/d(input)
    backward of i                            ... micro-batches in reverse order ...

Each forward keeps its graph for a backward issued later (``torch`` keeps the output;
MindSpore's ``mindspore.vjp`` returns a function that runs that backward). MindSpore's
PyNative executor keeps such pending graphs as a stack: a backward must be of the latest
pending forward, so the backwards run in reverse micro-batch order (one-forward-one-backward
schedules would need a backward of an older forward: "Can not find top cell for backward").

Gradient sync: every backward but the last of a step runs with
``set_requires_gradient_sync(False)`` and ``set_is_last_backward(False)`` on the stage's
root: its unsharded gradients accumulate on the units, and the last backward reduce-scatters
the sum once per unit. On MindSpore the backwards of the other micro-batches return zeros
and the last one the whole reduced gradient: the returned gradients are summed (as for any
accumulation, docs/gradient-pipeline.md), then the optimizer steps once.

The pipeline is ``pipeline_step`` with the framework's pieces (``MindSporeLink``,
``TorchLink``); ``run`` sets up the mesh and the stages and trains the reference beside it:
the same model (stage 0 then stage 1) trained in one process on the whole global batch. ``accumulate=False`` syncs every micro-batch instead: the same parameters,
one reduce-scatter per unit per micro-batch.
"""

from __future__ import annotations

import numpy as np

import hyper_parallel as hp
from tests.kit import get_kit, make_batches
from tests.scenarios import _named

STEPS = 3
MICRO_BATCHES = 4
GLOBAL_BATCH = 16          # dp 2 x 4 micro-batches x 2 rows
D_IN, WIDTH, D_OUT = 37, 16, 5
PP, DP = 2, 2
CONFIGS = {"accumulate": True, "sync_every": False}  # name -> run's ``accumulate``


def _stages(kit) -> list:
    """The model, cut in two stages (initialised from the same seed on every rank)."""
    first = kit.Stack([kit.Block(D_IN, 24, WIDTH), kit.Block(WIDTH, 16, WIDTH)],
                      kit.linear(WIDTH, WIDTH))
    last = kit.Stack([kit.Block(WIDTH, 20, WIDTH)], kit.linear(WIDTH, D_OUT))
    kit.load(first, 0)
    kit.load(last, 1)
    return [first, last]


def pipeline_step(kit, link, stage, params, opt, micro_batches: list, peer: int,
                  is_last: bool, accumulate: bool) -> float:
    """One optimizer step of this rank's stage over ``micro_batches`` [(x, y)], exchanging
    activations and their gradients with ``peer``; the summed loss on the last stage."""
    # forward of every micro-batch, each graph kept for its backward
    pending, loss = [], 0.0
    for x, y in micro_batches:
        if is_last:
            inputs = link.recv((x.shape[0], WIDTH), peer)  # stage 0's output
            target = kit.tensor(y)

            def fn(hidden, target=target):
                return ((stage(hidden) - target) ** 2).mean() / len(micro_batches)
        else:
            inputs, fn = kit.tensor(x), stage
        out, backward = link.forward(fn, inputs, params)
        if is_last:
            loss += float(kit.to_numpy(out))
        else:
            link.send(out, peer)
        pending.append((out, backward))
    # backward of every micro-batch, latest first; only the step's last backward syncs
    returned = []
    for i in reversed(range(len(micro_batches))):
        out, backward = pending.pop()
        sync = i == 0 or not accumulate
        stage.set_requires_gradient_sync(sync)  # off: gradients accumulate on the units
        stage.set_is_last_backward(sync)        # off: no end-of-step drain of reductions
        grad_out = link.ones_like(out) if is_last else link.recv(tuple(out.shape), peer)
        grad_in, grads = backward(grad_out)
        if is_last:
            link.send(grad_in, peer)  # d(loss)/d(stage 0's output)
        returned.append(grads)
    # complete only now: a backward with is_last_backward off may leave its reductions in
    # flight, finished by the last one
    link.step(opt, returned)
    return loss


def run(accumulate: bool = True) -> dict:
    """Train the pipeline STEPS steps; per-rank losses (last stage), reduce-scatter counts
    per step, and the stage's gathered parameters beside the reference's."""
    kit = get_kit()
    link = _point_to_point(kit.name)
    platform = hp.get_platform()
    rank = platform.rank()
    mesh = hp.init_device_mesh(platform.device_type(), (PP, DP), mesh_dim_names=("pp", "dp"))
    stage_index, dp_rank = rank // DP, rank % DP
    is_last = stage_index == PP - 1
    peer = rank - DP if is_last else rank + DP

    stage = _stages(kit)[stage_index]
    for block in stage.blocks:
        hp.fully_shard(block, mesh=mesh["dp"])
    hp.fully_shard(stage, mesh=mesh["dp"])
    units = sum(isinstance(m, hp.FSDPModule) for _, m in platform.named_modules(stage))
    params = [p for p in kit.params(stage) if p.requires_grad]
    opt = kit.optimizer(params)

    reference = _stages(kit)
    ref_model = kit.Stack([reference[0]], reference[1])  # stage 0, then stage 1
    ref_opt = kit.optimizer(kit.params(ref_model))

    losses, ref_losses, reduce_scatters = [], [], []
    rows = GLOBAL_BATCH // DP
    for x, y in make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=5):
        mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
        micro_batches = list(zip(np.array_split(x[mine], MICRO_BATCHES),
                                 np.array_split(y[mine], MICRO_BATCHES)))
        with hp.track_comms() as comms:
            losses.append(pipeline_step(kit, link, stage, params, opt, micro_batches, peer,
                                        is_last, accumulate))
        reduce_scatters.append(comms.calls("reduce_scatter"))
        ref_losses.append(kit.train_step(ref_model, ref_opt, x, y))

    full = hp.gather_full_state_dict(stage)
    ref_full = {k: kit.to_numpy(v) for k, v in _named(kit, reference[stage_index]).items()}
    platform.barrier()  # no rank leaves while a peer's last receive is in flight
    return {
        "stage": stage_index, "losses": losses if is_last else None, "ref_losses": ref_losses,
        "units": units, "reduce_scatters": reduce_scatters,
        "names_match": sorted(full) == sorted(ref_full),
        "param_diff": max(float(np.abs(full[k] - ref_full[k]).max()) for k in ref_full),
    }


def run_configs(names: list) -> dict:
    """``{name: run(...)}`` for "accumulate" (sync on the last backward only) and
    "sync_every" (sync on every backward), in one launch."""
    return {name: run(accumulate=CONFIGS[name]) for name in names}


def _point_to_point(backend: str):
    return TorchLink() if backend == "torch" else MindSporeLink()


class MindSporeLink:
    """What a MindSpore PyNative stage needs: send/recv, a forward whose backward runs later,
    and summing the gradients that backwards return."""

    def __init__(self):
        import mindspore as ms
        import mindspore.mint.distributed as dist
        from mindspore.communication import GlobalComm
        from mindspore.mint.distributed import distributed as dist_impl

        self.ms, self.dist, self.group = ms, dist, GlobalComm.WORLD_COMM_GROUP
        # MindSpore 2.10 on CPU: send/isend look this rank up in "hccl_world_group" (a
        # default argument fixed at import), which mccl does not create, and raise "The
        # group hccl_world_group does not exist" (docs/platforms.md). Tell them the rank.
        dist_impl._GROUP_RANK_CACHE.setdefault("hccl_world_group", dist.get_rank())

    def send(self, tensor, dst: int) -> None:
        self.dist.send(tensor, dst=dst, group=self.group)

    def recv(self, shape: tuple, src: int):
        buffer = self.ms.Tensor(np.zeros(shape, np.float32))
        self.dist.recv(buffer, src=src, group=self.group)  # filled when first read
        return buffer

    def forward(self, fn, inputs, params):
        """``fn(inputs)`` now; ``backward(grad_out)`` later gives (grad of inputs, grads of
        params)."""
        out, vjp_fn = self.ms.vjp(fn, inputs, weights=params)

        def backward(grad_out):
            (grad_in,), grads = vjp_fn(grad_out)  # a gradient per input, per weight
            return grad_in, grads

        return out, backward

    def ones_like(self, tensor):
        return self.ms.ops.ones_like(tensor)

    def step(self, opt, returned: list) -> None:
        """One update with the sum of the gradients the step's backwards returned."""
        opt(tuple(sum(per_param[1:], per_param[0]) for per_param in zip(*returned)))


class TorchLink:
    """The same pieces on torch: backward accumulates into ``.grad``."""

    def __init__(self):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist

    def send(self, tensor, dst: int) -> None:
        self.dist.send(tensor.detach().contiguous(), dst)

    def recv(self, shape: tuple, src: int):
        buffer = self.torch.empty(shape)
        self.dist.recv(buffer, src)
        return buffer

    def forward(self, fn, inputs, params):
        inputs = inputs.detach().requires_grad_()
        out = fn(inputs)

        def backward(grad_out):
            out.backward(grad_out)
            return inputs.grad, None

        return out, backward

    def ones_like(self, tensor):
        return self.torch.ones_like(tensor)

    def step(self, opt, returned: list) -> None:
        opt.step()
        opt.zero_grad()
