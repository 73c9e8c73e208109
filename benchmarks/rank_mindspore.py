"""One MindSpore rank of one benchmark launch: ``python benchmarks/rank_mindspore.py JOB.json``.

[Note: the three implementations]
All three build the same ``Stack`` (blocks of Dense + ReLU) from workload.py's arrays and
train it with ``mindspore.experimental.optim.SGD`` (momentum 0.9) on the rank's rows of the
same batches; a step is ``value_and_grad`` + the optimizer, the idiom MindSpore users write:

* ``hp``: ``hyper_parallel.fully_shard`` on every block, then on the root;
* ``dp``: the plain data-parallel baseline: ``value_and_grad`` on the unsharded model, all
  gradients concatenated into one flat buffer, one ``mint.distributed.all_reduce`` (SUM) of
  it, divided by the world size and split back, then the optimizer;
* ``compute``: the plain model in a process that joins no group (one per rank, started
  together, so the CPU is shared as in the distributed runs). Every distributed launch
  also times it once more at its end (``compute_paired``), and the hp launch then
  alternates its step with it, the interleaved floor and the raw collectives
  (``alternated``), as rank_torch.py says.

[Note: blocking or asynchronous execution]
By default (``--ms-pipeline blocking``) every implementation runs under
``ms.runtime.launch_blocking()``: on a CPU with about one core per rank, a wait on
PyNative's asynchronous queue spins a whole core (CPU time = 2x wall time in a plain
sync of queued matmuls), so each rank starves its own kernel threads, and every
mid-step wait costs the time of the whole queue. ``--ms-pipeline async`` measures
MindSpore's default instead.

[Note: asynchronous execution]
PyNative queues kernels and returns at once; collectives on CPU complete lazily too. A step
therefore ends with ``_pynative_executor.sync()`` (MindSpore's pipeline sync; a private API,
with ``loss.asnumpy()`` as fallback), so the time covers the work, not its dispatch. The raw
collectives end each round with the same sync.

[Note: the composed reduce-scatter]
MindSpore CPU has no reduce-scatter kernel; the platform composes one (over two ranks an
exchange of halves by one all-gather, over more an all-reduce of the whole buffer; see
README.md). The hp launch times, besides the minimal schedule, the schedule's
reduce-scatters alone and all-gathers of the same sizes: a native reduce-scatter moves the
same bytes per rank as an all-gather of its input size, so their time ratio is the measured
cost factor of the composition.
"""

from __future__ import annotations

import gc
import time

import measure
import raw_collectives
import workload

SEED, DATA_SEED, N_BATCHES = 1234, 4321, 4
LR = 1e-3


def _build_model(ms, dims: list):
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
    for block, (weight, bias) in zip(model.blocks, workload.init_arrays(dims, SEED)):
        block.linear.weight.set_data(ms.Tensor(weight))
        block.linear.bias.set_data(ms.Tensor(bias))
    return model


def _sync(tensor=None) -> None:
    """Wait for every queued kernel, collectives included (``tensor.asnumpy()`` waits for
    that tensor's producers only: the fallback if the private sync moves)."""
    try:
        from mindspore.common.api import _pynative_executor

        _pynative_executor.sync()
    except (ImportError, AttributeError):
        if tensor is not None:
            tensor.asnumpy()


def run(job: dict, rank: int, world: int) -> dict:
    import mindspore as ms
    from mindspore import ops

    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE, runtime_num_threads=1)
    if job.get("ms_pipeline", "blocking") == "blocking":
        ms.runtime.launch_blocking()  # every implementation alike (README: "MindSpore pipeline")
    cfg, impl = job["config"], job["impl"]
    dims, mesh_shape = cfg["dims"], tuple(cfg["mesh"])
    started = time.perf_counter()
    hp = msdist = None
    if impl != "compute":
        from mindspore.mint import distributed as msdist

        import hyper_parallel as hp

        hp.init_distributed(timeout_s=job["comm_timeout_s"])
    model = _build_model(ms, dims)
    hp_mesh = None
    if impl == "hp":
        hp_mesh = hp.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("shard",))
        mp = (hp.MixedPrecisionPolicy(param_dtype=cfg["param_dtype"], reduce_dtype="float32")
              if cfg["precision"] != "fp32" else hp.MixedPrecisionPolicy())
        for block in model.blocks:
            hp.fully_shard(block, mesh=hp_mesh, reshard_after_forward=cfg["reshard_after_forward"],
                           mp_policy=mp)
        hp.fully_shard(model, mesh=hp_mesh, reshard_after_forward=cfg["reshard_after_forward"],
                       mp_policy=mp)
    params = [p for p in model.trainable_params() if p.requires_grad]
    shapes = [tuple(p.shape) for p in params]
    sizes = [int(p.size) for p in params]
    data = [(ms.Tensor(workload.local_rows(x, rank, world)), ms.Tensor(workload.local_rows(y, rank, world)))
            for x, y in workload.batches(N_BATCHES, cfg["local_batch"] * world, dims[0], dims[-1],
                                         DATA_SEED)]

    def all_reduce_mean(grads):
        flat = ops.cat([g.reshape(-1) for g in grads])
        msdist.all_reduce(flat, op="sum")
        flat = flat / world
        out, offset = [], 0
        for shape, size in zip(shapes, sizes):
            out.append(flat[offset:offset + size].reshape(shape))
            offset += size
        return tuple(out)

    step = _step_fn(ms, model, data, all_reduce_mean if impl == "dp" else None)
    gc.collect()
    setup_s = time.perf_counter() - started

    barrier = hp.get_platform().barrier if hp is not None else None
    result = {"impl": impl, "setup_s": setup_s}
    counted: list = []
    context = None
    if impl == "hp":
        context = measure.track_into(hp, counted)
        result["comm_source"] = "hp.track_comms"
    result["timing"] = measure.timed_steps(step, cfg["warmup"], cfg["steps"], barrier,
                                           measured_context=context)
    result["comm_steps"] = cfg["steps"]
    if impl == "hp":
        result["comm"] = counted
    if impl == "dp":
        result["comm"] = [{"op": "all_reduce", "wire": "all_reduce", "dim": "",
                           "calls": cfg["steps"], "bytes": sum(sizes) * 4 * cfg["steps"]}]
        result["comm_source"] = "one all_reduce of the flat fp32 gradients per step"
        result["raw"] = raw_collectives.time_schedule(hp, job["schedule"], {"": (None, world)}, 1,
                                                      cfg["steps"], barrier, finish=_sync)
    elif impl == "hp":
        groups = {"shard": (hp_mesh.get_group("shard"), hp_mesh.size("shard"))}
        result["raw"] = raw_collectives.time_schedule(hp, job["schedule"], groups, 1, cfg["steps"],
                                                      barrier, finish=_sync)
        scatters = [e for e in job["schedule"] if e["op"] == "reduce_scatter"]
        same_size_gathers = [dict(e, op="all_gather") for e in scatters]
        result["raw_reduce_scatters"] = raw_collectives.time_schedule(
            hp, scatters, groups, 1, cfg["steps"], barrier, finish=_sync)
        result["raw_same_size_all_gathers"] = raw_collectives.time_schedule(
            hp, same_size_gathers, groups, 1, cfg["steps"], barrier, finish=_sync)
    if impl != "compute":
        # the implementation's model, all of it, goes before the plain one; hp's lives on in
        # its step for the alternation
        library_step = step if impl == "hp" else None
        step = model = params = None
        gc.collect()
        compute_step = _step_fn(ms, _build_model(ms, dims), data)
        result["compute_paired"] = measure.timed_steps(compute_step, cfg["warmup"], cfg["steps"],
                                                       barrier)
        if impl == "hp":
            floor = _build_model(ms, dims)

            def make_floor_step(after_backward):
                def last_collectives(grads):  # between value_and_grad and the optimizer
                    after_backward()
                    return grads
                return _step_fn(ms, floor, data, last_collectives)

            result.update(raw_collectives.alternate_with_floor(
                hp, job["schedule"], groups, library_step, compute_step, floor, make_floor_step,
                cfg["steps"], barrier, finish=_sync))
        hp.destroy_distributed()
    return result


def _step_fn(ms, model, data: list, reduce_grads=None):
    """The timed step of every implementation: ``value_and_grad`` of the loss, the
    gradients through ``reduce_grads`` (the DP baseline's all-reduce; the interleaved
    floor's last collectives), the optimizer, then a pipeline sync so the time covers the
    work."""
    from mindspore.experimental.optim import SGD

    params = [p for p in model.trainable_params() if p.requires_grad]
    opt = SGD(params, lr=LR, momentum=0.9)

    def forward(x, y):
        out = model(x)
        return ((out.astype(ms.float32) - y) ** 2).mean()

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


if __name__ == "__main__":
    measure.rank_main(run)
