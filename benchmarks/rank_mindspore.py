"""One MindSpore rank of one benchmark launch: ``python benchmarks/rank_mindspore.py JOB.json``.

[Note: the phases]
Every phase builds its own copy of the same model (the MLP of workload.py, or the decoder
of examples/lm) from the same numpy values and trains it with
``mindspore.experimental.optim.SGD`` (momentum 0.9) on the rank's rows of the same batches;
a step is ``value_and_grad`` + the optimizer, the idiom MindSpore users write:

* ``hp``: ``hyper_parallel.fully_shard`` on every block (decoder layer), then on the root;
* ``dp``: the plain data-parallel baseline: ``value_and_grad`` on the unsharded model, all
  gradients concatenated into one flat buffer, one ``mint.distributed.all_reduce`` (SUM) of
  it, divided by the world size and split back, then the optimizer;
* ``compute``: the plain model, no communication;
* ``floor``: the plain model with the minimal schedule issued from hooks
  (raw_collectives.py, "the interleaved floor"); ``raw``: that schedule back to back.

[Note: blocking execution]
By default (``--ms-pipeline blocking``) every phase runs under
``ms.runtime.launch_blocking()``: on a CPU with about one core per rank, a wait on
PyNative's asynchronous queue spins a whole core, so each rank would starve its own kernel
threads (docs/platforms.md, "Performance on CPU (MindSpore)"); ``--ms-pipeline async``
measures MindSpore's default instead. A step still
ends with ``_pynative_executor.sync()`` (MindSpore's pipeline sync; a private API, with
``loss.asnumpy()`` as fallback), so its time covers the work, not its dispatch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import measure
import raw_collectives
import workload

LR = 1e-3


def _mlp(ms, dims: list):
    from mindspore import nn, ops

    class Block(nn.Cell):
        def __init__(self, d_in, d_out):
            super().__init__()
            self.linear = nn.Dense(d_in, d_out)

        def construct(self, x):
            return ops.relu(self.linear(x))

    class Stack(nn.Cell):
        def __init__(self):
            super().__init__()
            self.blocks = nn.CellList([Block(dims[i], dims[i + 1]) for i in range(len(dims) - 1)])

        def construct(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    model = Stack()
    for block, (weight, bias) in zip(model.blocks, workload.init_arrays(dims, workload.SEED)):
        block.linear.weight.set_data(ms.Tensor(weight))
        block.linear.bias.set_data(ms.Tensor(bias))
    return model


def _sync(tensor=None) -> None:
    """Wait for every queued kernel, collectives included (``tensor.asnumpy()`` waits for
    that tensor's producers only: the fallback if the private sync moves)."""
    try:
        from mindspore.graph.api import _pynative_executor

        _pynative_executor.sync()
    except (ImportError, AttributeError):
        if tensor is not None:
            tensor.asnumpy()


def _workload(ms, hp, cfg: dict, rank: int, world: int):
    """(build() -> model, units(model) -> the blocks to shard, data, loss(out, target))."""
    from mindspore import ops

    if cfg["lm_size"] is None:
        dims = cfg["dims"]
        data = [(ms.Tensor(x), ms.Tensor(y))
                for x, y in workload.local_mlp_batches(dims, cfg["local_batch"], rank, world)]
        return (lambda: _mlp(ms, dims), lambda m: list(m.blocks), data,
                lambda out, y: ((out.astype(ms.float32) - y) ** 2).mean())
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/ at the repo root
    from examples.lm.config import SIZES, VOCAB
    from examples.lm.model_mindspore import build

    size = cfg["lm_size"]
    data = [(ms.Tensor(x.astype("int32")), ms.Tensor(y.astype("int32")))
            for x, y in workload.local_token_batches(SIZES[size]["seq"], VOCAB,
                                                     cfg["local_batch"], rank, world)]

    def loss(logits, target):
        return ops.cross_entropy(logits.astype(ms.float32).reshape(-1, VOCAB), target.reshape(-1))

    return (lambda: build(size, hp.get_platform()), lambda m: list(m.model.layers), data, loss)


def _tiny(cfg: dict) -> dict:
    """The same configuration on a tiny model of the same kind (measure.py's priming)."""
    return dict(cfg, dims=None, lm_size="tiny") if cfg["lm_size"] else dict(cfg, dims=[64] * 5)


def _step_fn(ms, model, data: list, loss_fn, reduce_grads=None):
    """The timed step of every phase: ``value_and_grad`` of the loss, the gradients through
    ``reduce_grads`` (the DP baseline's all-reduce; the interleaved floor's last
    collectives), the optimizer, then a pipeline sync so the time covers the work."""
    from mindspore.experimental.optim import SGD

    params = [p for p in model.trainable_params() if p.requires_grad]
    opt = SGD(params, lr=LR, momentum=0.9)

    def forward(x, y):
        return loss_fn(model(x), y)

    grad_fn = ms.value_and_grad(forward, None, opt.parameters)

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        loss, grads = grad_fn(x, y)
        if reduce_grads is not None:
            grads = reduce_grads(grads)
        opt(grads)
        _sync(loss)
        return float(loss.asnumpy())

    return step


def run(job: dict, rank: int, world: int) -> dict:
    import mindspore as ms
    from mindspore import ops
    from mindspore.mint import distributed as msdist

    import hyper_parallel as hp

    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE, runtime_num_threads=1)
    if job["ms_pipeline"] == "blocking":  # every phase alike (the note on blocking execution)
        ms.runtime.launch_blocking()
    hp.init_distributed(timeout_s=job["comm_timeout_s"])
    cfg = job["config"]
    hp_mesh = hp.init_device_mesh("cpu", tuple(cfg["mesh"]), mesh_dim_names=("shard",))
    groups = {"shard": (hp_mesh.get_group("shard"), hp_mesh.size("shard"))}

    def make(build_model, units, data, loss_fn):
        """The builders of every phase on one workload (``_workload``)."""

        def build_hp():
            model = build_model()
            for unit in units(model) + [model]:
                hp.fully_shard(unit, mesh=hp_mesh, reshard_after_forward=cfg["reshard_after_forward"])
            return _step_fn(ms, model, data, loss_fn)

        def build_dp():
            model = build_model()
            params = [p for p in model.trainable_params() if p.requires_grad]
            shapes, sizes = [tuple(p.shape) for p in params], [int(p.size) for p in params]

            def all_reduce_mean(grads):
                flat = ops.cat([g.reshape(-1) for g in grads])
                msdist.all_reduce(flat, op="sum")
                flat = flat / world
                out, offset = [], 0
                for shape, size in zip(shapes, sizes):
                    out.append(flat[offset:offset + size].reshape(shape))
                    offset += size
                return tuple(out)

            return _step_fn(ms, model, data, loss_fn, all_reduce_mean)

        def build_floor():
            model = build_model()

            def make_step(after_backward):
                def last_collectives(grads):  # between value_and_grad and the optimizer
                    after_backward()
                    return grads
                return _step_fn(ms, model, data, loss_fn, last_collectives)

            return raw_collectives.interleaved_step(hp, model, job["schedule"], groups, make_step)

        def build_raw():
            one_round = raw_collectives.round_fn(hp, job["schedule"], groups, finish=_sync)
            return lambda i: one_round() or 0.0

        return {"hp": build_hp, "dp": build_dp,
                "compute": lambda: _step_fn(ms, build_model(), data, loss_fn),
                "floor": build_floor, "raw": build_raw}

    counters = {name: (lambda rows: measure.track_into(hp, rows)) for name in ("hp", "floor")}
    impls = cfg["impls"]
    builders = make(*_workload(ms, hp, cfg, rank, world))
    tiny = make(*_workload(ms, hp, _tiny(cfg), rank, world))
    result = measure.measure_phases(
        {i: builders[i] for i in impls}, cfg["warmup"], cfg["rounds"], hp.get_platform().barrier,
        {i: c for i, c in counters.items() if i in impls},
        primers={i: tiny[i] for i in impls if i not in ("floor", "raw")})
    hp.destroy_distributed()
    return result


if __name__ == "__main__":
    measure.rank_main(run)
