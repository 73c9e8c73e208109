"""Rank side of tests/test_docs_examples.py: each doc block's surroundings, and what it claims.

Design note
-----------
A setup is a generator ``setup(backend, ctx)``: it yields the namespace the block runs in
(exactly what the doc says the block needs), the block's text runs in it verbatim
(``run_blocks``), then the generator resumes to check what the block did and returns a
picklable result for the test process (cross-rank comparisons happen there). A setup whose
block is documented to raise (``expects_error``) receives the exception. Besides the doc's
names a block gets only ``__name__ = "__main__"``, which every script has (MindSpore's
``value_and_grad`` fails on a function whose module has no name).

The models are small but real: a language model of an embedding, pre-norm blocks of
single-head attention and an MLP, a final norm and a head (``torch_lm_class``,
``ms_lm_class``: the same model on each framework), initialised from
numpy seeds so that a sharded model and its single-process reference start identical on
every rank. A reference is trained in the same process on the global batch (the
concatenation of the ranks' slices), so a block that trains is held against it.
"""

from __future__ import annotations

import os
import time
import traceback

import numpy as np

import hyper_parallel as hp
from tests.docs_blocks import all_blocks
from tests.kit import init_values

VOCAB, DIM, HIDDEN, SEQ, N_BLOCKS = 32, 16, 32, 8, 2
LR = 0.05


# ---------------------------------------------------------------------------- the runner
def run_blocks(entries: list, workdir: str) -> dict:
    """Run each ``(block_id, setup_name)`` in order: {block_id: the setup's result}, and
    under "seconds" {block_id: (the block's time, with its setup and checks)}. The block
    runs with ``workdir`` as the current directory (blocks write relative paths)."""
    backend = os.environ["HP_BACKEND"]
    blocks = all_blocks()
    out = {}
    for block_id, setup_name in entries:
        setup = globals()[setup_name]
        ctx = {"dir": workdir, "id": block_id}
        setup_started = time.perf_counter()
        gen = setup(backend, ctx)
        namespace = next(gen)
        namespace.setdefault("__name__", "__main__")  # as in a script (MindSpore reads it)
        started = time.perf_counter()
        raised = None
        cwd = os.getcwd()
        os.chdir(workdir)
        try:
            exec(blocks[block_id].compile(), namespace)  # noqa: S102 - the doc's block, as written
        except Exception as error:  # noqa: BLE001
            if not getattr(setup, "expects_error", False):
                raise
            raised = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
        finally:
            os.chdir(cwd)
        ran = time.perf_counter() - started
        try:
            gen.send(raised)
        except StopIteration as stop:
            out[block_id] = stop.value
        else:
            raise RuntimeError(f"setup {setup_name} yielded twice")
        out.setdefault("seconds", {})[block_id] = (round(ran, 2),
                                                   round(time.perf_counter() - setup_started, 2))
    return out


def _rank_world() -> tuple[int, int]:
    platform = hp.get_platform()
    return platform.rank(), platform.world_size()


def global_batches(steps: int, batch: int, seed: int = 7) -> list:
    """``steps`` (ids, targets) of ``batch`` sequences (targets: the next token)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        tokens = rng.integers(0, VOCAB, (batch, SEQ + 1))
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def rank_slice(batch, rank: int, world: int):
    """This rank's rows of a global (ids, targets) batch."""
    return tuple(np.array_split(a, world)[rank] for a in batch)


# ---------------------------------------------------------------------------- torch side
def torch_lm_class():
    import torch
    from torch import nn

    class Block(nn.Module):
        """Pre-norm residual block: single-head softmax attention, then an MLP."""

        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(DIM)
            self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
            self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

        def forward(self, x):
            h = self.norm(x)
            scores = torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2) / DIM ** 0.5, -1)
            x = x + self.o(scores @ self.v(h))
            return x + self.down(torch.relu(self.up(x)))

    class LM(nn.Module):
        def __init__(self, seed=0):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.blocks = nn.ModuleList([Block() for _ in range(N_BLOCKS)])
            self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)
            if not any(p.is_meta for p in self.parameters()):
                torch_load(self, seed)

        def forward(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    return LM


def torch_load(model, seed: int) -> None:
    import torch

    params = list(model.parameters())
    with torch.no_grad():
        for p, v in zip(params, init_values([tuple(p.shape) for p in params], seed)):
            p.copy_(torch.from_numpy(v))


def torch_loss(logits, targets):
    import torch

    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1))


def torch_tensors(batch):
    import torch

    return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in batch)


def torch_params(model) -> dict:
    return {name: p.detach().numpy().copy() for name, p in model.named_parameters()}


# ---------------------------------------------------------------------------- MindSpore side
def ms_lm_class():
    import mindspore as ms
    from mindspore import nn, ops

    class Block(nn.Cell):
        """See the torch Block."""

        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm((DIM,), epsilon=1e-5)
            self.q, self.k, self.v, self.o = (nn.Dense(DIM, DIM) for _ in range(4))
            self.up, self.down = nn.Dense(DIM, HIDDEN), nn.Dense(HIDDEN, DIM)

        def construct(self, x):
            h = self.norm(x)
            scores = ops.softmax(ops.matmul(self.q(h), self.k(h).swapaxes(-1, -2))
                                 / DIM ** 0.5, -1)
            x = x + self.o(ops.matmul(scores, self.v(h)))
            return x + self.down(ops.relu(self.up(x)))

    class LM(nn.Cell):
        def __init__(self, seed=0, load=True):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.blocks = nn.CellList([Block() for _ in range(N_BLOCKS)])
            self.norm = nn.LayerNorm((DIM,), epsilon=1e-5)
            self.head = nn.Dense(DIM, VOCAB, has_bias=False)
            if load:
                ms_load(self, seed)

        def construct(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    del ms
    LM.Block = Block
    return LM


def ms_load(net, seed: int) -> None:
    import mindspore as ms

    params = list(net.trainable_params())
    for p, v in zip(params, init_values([tuple(p.shape) for p in params], seed)):
        p.set_data(ms.Tensor(v))


def ms_loss(logits, targets):
    from mindspore import ops

    return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def ms_tensors(batch):
    import mindspore as ms

    ids, targets = batch
    return ms.Tensor(ids.astype(np.int32)), ms.Tensor(targets.astype(np.int32))


def ms_params(net) -> dict:
    return {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}


# ---------------------------------------------------------------------------- references
def reference_params(backend: str, batches: list, seed: int = 0, opt: str = "sgd",
                     clip: float | None = None) -> dict:
    """Parameters of the unsharded model after one optimizer step per global batch (SGD
    with momentum, or AdamW with its defaults), gradients clipped to ``clip`` if given."""
    return _reference(backend, batches, seed, opt, clip)["params"]


def reference_losses(backend: str, batches: list, seed: int = 0, opt: str = "sgd") -> list:
    return _reference(backend, batches, seed, opt, None)["losses"]


def _reference(backend, batches, seed, opt, clip, loss_scale=1.0):
    losses, norms = [], []
    if backend == "torch":
        import torch

        model = torch_lm_class()(seed)
        optim = (torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9) if opt == "sgd"
                 else torch.optim.AdamW(model.parameters()))
        for batch in batches:
            x, y = torch_tensors(batch)
            loss = torch_loss(model(x), y) * loss_scale
            loss.backward()
            if clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            optim.step()
            optim.zero_grad()
            losses.append(float(loss))
        return {"params": torch_params(model), "losses": losses, "norm": norms[:1]}
    import mindspore as ms
    from mindspore.experimental.optim import SGD, AdamW

    net = ms_lm_class()(seed)
    params = net.trainable_params()
    optim = SGD(params, lr=LR, momentum=0.9) if opt == "sgd" else AdamW(params)
    grad_fn = ms.value_and_grad(lambda x, y: ms_loss(net(x), y) * loss_scale, None, params)
    for batch in batches:
        loss, grads = grad_fn(*ms_tensors(batch))
        if clip is not None:  # torch's rule, as hp.clip_grad_norm_'s
            norms.append(float(np.sqrt(sum(float((g.astype(ms.float32) ** 2).sum().asnumpy())
                                           for g in grads))))
            coef = min(1.0, clip / (norms[-1] + 1e-6))
            grads = tuple(g * coef for g in grads)
        optim(grads)
        losses.append(float(loss.asnumpy()))
    return {"params": ms_params(net), "losses": losses, "norm": norms[:1]}


def gathered(model) -> dict:
    """The sharded model's full parameters (every rank)."""
    return {k: np.asarray(v) for k, v in hp.gather_full_state_dict(model).items()}


def _sharded_lm(backend: str, mesh=None, seed: int = 0):
    """The LM with ``fully_shard`` on its blocks and root (as the quick start does)."""
    model = torch_lm_class()(seed) if backend == "torch" else ms_lm_class()(seed)
    for block in model.blocks:
        hp.fully_shard(block, mesh=mesh)
    hp.fully_shard(model, mesh=mesh)
    return model


def _sgd(backend, model):
    if backend == "torch":
        import torch

        return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    from mindspore.experimental.optim import SGD

    return SGD(model.trainable_params(), lr=LR, momentum=0.9)


def _recording_loader(backend: str, namespace: dict, batches: list, losses: list):
    """This rank's slices of ``batches``; after each step it records the step's ``loss``
    (the name the block assigns), as a training script would print it."""
    rank, world = _rank_world()
    to_tensors = torch_tensors if backend == "torch" else ms_tensors
    for batch in batches:
        yield to_tensors(rank_slice(batch, rank, world))
        loss = namespace["loss"]
        losses.append(float(loss.detach()) if backend == "torch" else float(loss.asnumpy()))


# ---------------------------------------------------------------------------- README.md
def readme_quick_start(backend, ctx):
    """The quick start of either framework: ``MyModel``/``MyNet`` (layers in ``.blocks``),
    ``loader`` (this rank's batches) and ``loss_fn``. Result: each step's loss on this rank
    and the reference's losses on the global batch (AdamW, the block's defaults)."""
    batches = global_batches(3, 4)
    losses: list = []
    namespace: dict = {}
    if backend == "torch":
        namespace.update(MyModel=torch_lm_class(), loss_fn=torch_loss)
    else:
        namespace.update(MyNet=ms_lm_class(), loss_fn=ms_loss)
    namespace["loader"] = _recording_loader(backend, namespace, batches, losses)
    yield namespace
    model = namespace["model" if backend == "torch" else "net"]
    if backend == "torch":
        from torch.distributed.tensor import DTensor

        assert all(isinstance(p, DTensor) for p in model.parameters())
    return {"losses": losses, "ref_losses": reference_losses(backend, batches, opt="adamw")}


# ---------------------------------------------------------------------------- docs/api.md
def api_expert_mesh(backend, ctx):
    """A unit ``block`` holding a mixture of experts ``moe`` (experts in ``moe.experts``).
    Checks: the experts' shards span the expert mesh's shard dim, the rest the whole
    world; the unit's forward equals the unsharded one's."""
    import torch
    from torch import nn

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(DIM, 4)
            self.experts = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(4)])

        def forward(self, x):
            weights = torch.softmax(self.router(x), -1)
            return sum(weights[..., i:i + 1] * e(x) for i, e in enumerate(self.experts))

    class Unit(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.moe = nn.LayerNorm(DIM), MoE()

        def forward(self, x):
            return x + self.moe(self.norm(x))

    def build():
        unit = Unit()
        torch_load(unit, 3)
        return unit

    block, reference = build(), build()
    namespace = {"hp": hp, "block": block, "moe": block.moe}
    yield namespace
    _, world = _rank_world()
    expert_shards = namespace["expert_mesh"].size(1)
    experts = {id(p) for p in block.moe.experts.parameters()}
    for name, p in block.named_parameters():
        mesh_dims = 2 if id(p) in experts else 1
        shards = expert_shards if id(p) in experts else world
        assert p.device_mesh.ndim == mesh_dims, (name, p.device_mesh)
        assert p.to_local().shape[0] == -(-p.shape[0] // shards), (name, p.to_local().shape)
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((2, SEQ, DIM)).astype(np.float32))
    torch.testing.assert_close(block(x).detach(), reference(x).detach())
    return None


def api_deferred_torch(backend, ctx):
    """torch's deferred init: ``Transformer(cfg)`` a model with ``.blocks`` whose modules
    have ``reset_parameters``. Checks: every parameter is a shard on the CPU, and a step
    trains."""
    import torch
    from torch.distributed.tensor import DTensor

    namespace = {"torch": torch, "hp": hp, "Transformer": torch_lm_class(), "cfg": 0}
    yield namespace
    model, world = namespace["model"], _rank_world()[1]
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.device.type == "cpu", name
        assert p.to_local().shape[0] == -(-p.shape[0] // world), name
        assert torch.isfinite(p.to_local()).all(), name
    _one_step(backend, model, namespace["optim"], global_batches(1, 2 * world)[0])
    return None


def api_deferred_mindspore(backend, ctx):
    """MindSpore's deferred init: ``Transformer(cfg)`` a net with ``.blocks``, its
    parameters initializers only under ``no_init_parameters``. Checks: every parameter
    holds values at its shard's shape, and a step trains."""
    base = ms_lm_class()

    class Transformer(base):
        def __init__(self, cfg):
            super().__init__(cfg, load=False)  # the initializers, not seeded values

    namespace = {"hp": hp, "Transformer": Transformer, "cfg": 0}
    yield namespace
    net, world = namespace["net"], _rank_world()[1]
    for name, p in net.parameters_and_names():
        assert not p.has_init, f"{name} was never given values"
    for key, value in hp.get_state_dict(net).items():
        local = value.local.asnumpy()
        assert value.shard_dim == 0, (key, value.shard_dim)
        assert local.shape[0] <= -(-value.global_shape[0] // world), (key, local.shape)
        assert np.isfinite(local).all(), key
    _one_step(backend, net, _sgd(backend, net), global_batches(1, 2 * world)[0])
    return None


def _one_step(backend, model, optim, batch) -> float:
    """One optimizer step on this rank's slice of ``batch``; its loss, which must be finite."""
    rank, world = _rank_world()
    if backend == "torch":
        x, y = torch_tensors(rank_slice(batch, rank, world))
        loss = torch_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        value = float(loss.detach())
    else:
        import mindspore as ms

        params = model.trainable_params()
        grad_fn = ms.value_and_grad(lambda a, b: ms_loss(model(a), b), None, params)
        loss, grads = grad_fn(*ms_tensors(rank_slice(batch, rank, world)))
        optim(grads)
        value = float(loss.asnumpy())
    assert np.isfinite(value), value
    return value


def api_clip_mindspore(backend, ctx):
    """MindSpore's clipping: ``params`` of a sharded net, ``loss_fn(x, y)`` its loss on this
    rank's batch ``(x, y)``, an ``optimizer`` over ``params``. Result: the norm, gathered
    parameters after the step, and the reference's (global batch, clipped the same)."""
    import mindspore

    rank, world = _rank_world()
    batch = global_batches(1, 2 * world)[0]
    net = _sharded_lm(backend)
    params = net.trainable_params()
    x, y = ms_tensors(rank_slice(batch, rank, world))
    tokens = x.size  # a summed loss: a gradient norm above max_norm, so the block clips

    def loss_fn(a, b):
        return ms_loss(net(a), b) * tokens

    namespace = {"mindspore": mindspore, "hp": hp, "params": params, "x": x, "y": y,
                 "loss_fn": loss_fn, "optimizer": _sgd(backend, net)}
    yield namespace
    ref = _reference(backend, [batch], 0, "sgd", 1.0, loss_scale=tokens)
    return {"norm": float(namespace["norm"].asnumpy()), "ref_norm": ref["norm"][0],
            "params": gathered(net), "ref": ref["params"]}


# ---------------------------------------------------------------------------- gradient-pipeline.md
def gp_meshes(backend, ctx):
    """``block`` (here a whole model) sharded on an ``(R, S)`` mesh of all ranks. Result:
    gathered parameters after one step, and the reference's."""
    rank, world = _rank_world()
    r, s = (2, world // 2)
    batch = global_batches(1, 2 * world)[0]
    model = torch_lm_class()() if backend == "torch" else ms_lm_class()()
    yield {"hp": hp, "block": model, "R": r, "S": s}
    _one_step(backend, model, _sgd(backend, model), batch)
    return {"params": gathered(model), "ref": reference_params(backend, [batch])}


def gp_optimizer_in_backward(backend, ctx):
    """torch: ``model`` sharded, ``loss_fn`` and this rank's batch ``x``, ``y``. Result:
    gathered parameters after the backward, and the reference's after one step."""
    import torch

    rank, world = _rank_world()
    batch = global_batches(1, 2 * world)[0]
    model = _sharded_lm(backend)
    x, y = torch_tensors(rank_slice(batch, rank, world))
    yield {"torch": torch, "model": model, "loss_fn": torch_loss, "x": x, "y": y}
    return {"params": gathered(model), "ref": reference_params(backend, [batch])}


def gp_accumulation(backend, ctx):
    """The accumulation loop of either framework: the model sharded (``model`` / ``net``),
    ``K`` micro-batches of this rank's batch, ``loss_fn`` and ``opt`` (torch), ``grad_fn``
    of a ``forward_fn`` returning loss / K and ``optimizer`` (MindSpore). Result: gathered
    parameters after the step, and the reference's after one step on the global batch."""
    rank, world = _rank_world()
    k = 2
    batch = global_batches(1, 2 * k * world)[0]
    model = _sharded_lm(backend)
    opt = _sgd(backend, model)
    if backend == "torch":
        x, y = torch_tensors(rank_slice(batch, rank, world))
        namespace = {"model": model, "loss_fn": torch_loss, "opt": opt, "K": k,
                     "micro_batches": list(zip(x.chunk(k), y.chunk(k)))}
    else:
        import mindspore

        x, y = rank_slice(batch, rank, world)
        namespace = {"net": model, "optimizer": opt, "K": k,
                     "micro_batches": [ms_tensors(b) for b in zip(np.array_split(x, k),
                                                                  np.array_split(y, k))],
                     "grad_fn": mindspore.value_and_grad(
                         lambda a, b: ms_loss(model(a), b) / k, None, opt.parameters)}
    yield namespace
    return {"params": gathered(model), "ref": reference_params(backend, [batch])}


def gp_track_comms(backend, ctx):
    """torch: ``loss`` of a model sharded on a 2-D mesh with R > 1. Checks the block's
    comment: one all-reduce over the replicate dim per unit."""
    _, world = _rank_world()
    mesh = hp.init_device_mesh(hp.get_platform().device_type(), (2, world // 2),
                               mesh_dim_names=("replicate", "shard"))
    model = _sharded_lm(backend, mesh)
    rank = _rank_world()[0]
    x, y = torch_tensors(rank_slice(global_batches(1, 2 * world)[0], rank, world))
    namespace = {"hp": hp, "loss": torch_loss(model(x), y)}
    yield namespace
    units = N_BLOCKS + 1  # the blocks and the root
    calls = namespace["window"].calls("all_reduce", dim="replicate")
    assert calls == units, f"{calls} all-reduces over the replicate dim, {units} units"
    assert "all_reduce" in namespace["window"].summary()
    return None


def gp_debug_log(backend, ctx):
    """The debug-log block needs nothing. Checks: a step then logs through the logger (and
    nothing did before the block); the logger and the root's handlers are restored after."""
    import logging

    logger = logging.getLogger("hyper_parallel.fully_shard")
    root_handlers = list(logging.getLogger().handlers)
    records: list = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    keep = Keep(logging.DEBUG)
    logger.addHandler(keep)
    _, world = _rank_world()
    model = _sharded_lm(backend)
    _one_step(backend, model, _sgd(backend, model), global_batches(1, 2 * world)[0])
    silent = len(records)
    yield {}
    try:
        _one_step(backend, model, _sgd(backend, model), global_batches(1, 2 * world)[0])
        assert silent == 0, f"{silent} records before the block set the level"
        assert records and all(r.levelno == logging.DEBUG for r in records)
    finally:
        logger.removeHandler(keep)
        logger.setLevel(logging.NOTSET)
        for handler in list(logging.getLogger().handlers):
            if handler not in root_handlers:
                logging.getLogger().removeHandler(handler)
    return len(records)


# ---------------------------------------------------------------------------- checkpoints.md
def _key_map_model(backend):
    """The same model on either framework: embedding, BatchNorm1d, LayerNorm, linear head,
    built with the layer settings checkpoints.md gives for crossing."""
    if backend == "torch":
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed, self.bn = nn.Embedding(VOCAB, DIM), nn.BatchNorm1d(DIM)
                self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

            def forward(self, ids):
                return self.head(self.norm(self.bn(self.embed(ids).reshape(-1, DIM))))

        return Net()
    from mindspore import nn

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.embed, self.bn = nn.Embedding(VOCAB, DIM), nn.BatchNorm1d(DIM, momentum=0.9)
            self.norm = nn.LayerNorm((DIM,), begin_norm_axis=-1, begin_params_axis=-1,
                                     epsilon=1e-5)
            self.head = nn.Dense(DIM, VOCAB)

        def construct(self, ids):
            return self.head(self.norm(self.bn(self.embed(ids).reshape(-1, DIM))))

    net = Net()
    ms_load(net, 11)
    return net


def _state(model, optimizer, to_torch_names: bool) -> dict:
    """Full model and optimizer state, keys in torch's names."""
    out = {}
    for key, value in hp.get_full_state_dict(model, optimizer, rank0_only=False).items():
        prefix, name = "", key
        if key.startswith("optim.") and key.count(".") > 1:  # optim.<state>.<parameter>
            head, _, name = key[len("optim."):].partition(".")
            prefix = f"optim.{head}."
        if to_torch_names and name:
            name = hp.torch_nn_names(name) or name
        out[prefix + name] = np.asarray(value)
    return out


def ckpt_key_map_mindspore(backend, ctx):
    """The MindSpore half: ``net`` (sharded, trained a step so BatchNorm's statistics and
    AdamW's moments are not their initial values) and its ``optimizer``. Result: its state
    in torch's names."""
    from mindspore.experimental.optim import AdamW

    net = _key_map_model(backend)
    hp.fully_shard(net)
    optimizer = AdamW(net.trainable_params())
    _, world = _rank_world()
    _one_step(backend, net, optimizer, global_batches(1, 2 * world)[0])
    yield {"hp": hp, "net": net, "optimizer": optimizer}
    return _state(net, optimizer, to_torch_names=True)


def ckpt_key_map_torch(backend, ctx):
    """The torch half, after the MindSpore half saved ``ckpt``: ``model`` (sharded) and its
    ``optimizer``. Result: its state after the load."""
    import torch

    model = _key_map_model(backend)
    hp.fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    yield {"hp": hp, "model": model, "optimizer": optimizer}
    state = _state(model, optimizer, to_torch_names=False)
    state.update({f"buffer.{k}": v.numpy().copy() for k, v in model.named_buffers()})
    return state


# ---------------------------------------------------------------------------- single processes
def _rss_bytes() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def faults_cat_memory(backend, ctx):
    """The growth reproducer needs nothing (a fresh process). Result: resident memory it
    added, in bytes."""
    before = _rss_bytes()
    yield {}
    return _rss_bytes() - before


def platforms_layernorm_after_error(backend, ctx):
    """The reproducer needs nothing (a fresh process); as written its last line raises.
    Result: that error."""
    raised = yield {}
    return raised


platforms_layernorm_after_error.expects_error = True


def titan_swap(backend, ctx):
    """torchtitan's FSDP module, with ``hp`` imported. Checks the claim that the one name
    ``apply_fsdp_to_decoder`` calls is the module's ``fully_shard``."""
    yield {"hp": hp}
    import torchtitan.distributed.fsdp as titan_fsdp

    assert titan_fsdp.fully_shard is hp.fully_shard
    assert "fully_shard" in titan_fsdp.apply_fsdp_to_decoder.__code__.co_names
    return None


def lm_stage_names(count: int = 2) -> list:
    """examples/one_script's transformer in ``count`` stages by module names: the
    embedding on the first, the norm and the head on the last, the blocks between."""
    from examples.one_script import train as script

    return hp.pipelining.generate_llm_fqn_per_model_part(
        count, script.SIZES["layers"], input_modules=("embed",), layers="blocks",
        output_modules=("norm", "head"))


def of_stage(full: dict, names: list) -> dict:
    """The entries of ``full`` (a whole model's state) under the modules ``names``."""
    return {k: v for k, v in full.items() if any(k.startswith(n + ".") for n in names)}


def pipelining_usage(backend, ctx):
    """pipelining.md's usage block, 2 ranks (pp 2, dp 1): ``model`` (examples/one_script's
    transformer, whole), ``vocab``, ``device_type``, ``batches``, ``make_optimizer``
    (the framework's AdamW) and ``optimizer_step``. Result: the last stage's mean loss per
    step, the stage's gathered parameters, and the same of the whole model trained in this
    process on the whole batch."""
    script, framework = _one_script(backend)
    platform = hp.get_platform()
    vocab = script.SIZES["vocab"]
    batches = [(platform.from_numpy(t[:, :-1]), platform.from_numpy(t[:, 1:]))
               for t in script.batches(3)]

    def optimizer_step(optimizer, stage):
        if backend == "torch":
            optimizer.step()
            optimizer.zero_grad()
        else:
            optimizer(tuple(stage.gradients()))

    model = framework.build(script.initial_values(), **script.SIZES)
    namespace = {"model": model, "vocab": vocab, "device_type": "cpu",
                 "batches": batches, "optimizer_step": optimizer_step,
                 "make_optimizer": lambda module: framework.optimizer(module, 1e-2)}
    yield namespace
    per_step = len(namespace["losses"]) // len(batches)  # each micro-batch's loss, in order
    rank = platform.rank()
    reference = framework.build(script.initial_values(), **script.SIZES)

    def reference_loss(ids, targets):
        return hp.cross_entropy(reference(ids).reshape(-1, vocab), targets.reshape(-1))

    reference_opt = framework.optimizer(reference, 1e-2)
    ref_losses = [framework.train_step(reference, reference_opt, reference_loss, ids, targets,
                                       1e9, hp.clip_grad_norm_)  # clips nothing
                  for ids, targets in batches]
    losses = [float(platform.to_numpy(v)) for v in namespace["losses"]]
    return {"stage": rank, "params": gathered(namespace["module"]),
            "ref": of_stage(gathered(reference), namespace["names"][rank]),
            "losses": [float(np.mean(losses[i:i + per_step]))
                       for i in range(0, len(losses), per_step)] if rank == 1 else None,
            "ref_losses": ref_losses}


# ---------------------------------------------------------------------------- tensor parallelism
def _one_script(backend: str):
    """examples/one_script's train module and the framework's model module: the
    transformer the tensor-parallel page's blocks name."""
    import importlib

    from examples.one_script import train as script

    return script, importlib.import_module(f"examples.one_script.model_{backend}")


def _train_against_reference(backend, model, loss_fn, rows) -> dict:
    """Three AdamW steps with clipping of ``loss_fn`` on this rank's ``rows`` of each
    global batch, beside the unsplit model trained in this process on the whole batch."""
    script, framework = _one_script(backend)
    platform = hp.get_platform()
    vocab = script.SIZES["vocab"]
    reference = framework.build(script.initial_values(), **script.SIZES)

    def reference_loss(ids, targets):
        return hp.cross_entropy(reference(ids).reshape(-1, vocab), targets.reshape(-1))

    opt, reference_opt = framework.optimizer(model, 1e-2), framework.optimizer(reference, 1e-2)
    losses, ref_losses = [], []
    for tokens in script.batches(3):
        mine = tokens[rows]
        losses.append(framework.train_step(
            model, opt, loss_fn, platform.from_numpy(mine[:, :-1]),
            platform.from_numpy(mine[:, 1:]), 1.0, hp.clip_grad_norm_))
        ref_losses.append(framework.train_step(
            reference, reference_opt, reference_loss, platform.from_numpy(tokens[:, :-1]),
            platform.from_numpy(tokens[:, 1:]), 1.0, hp.clip_grad_norm_))
    return {"losses": losses, "ref_losses": ref_losses}


def tp_usage(backend, ctx):
    """tensor-parallel.md's usage block: ``model`` (examples/one_script's transformer, on
    ``backend``), ``vocab``, ``device_type``. Its ``loss_fn`` trains, with the framework's
    own step, as the unsplit model in one process (every rank the same batch)."""
    script, framework = _one_script(backend)
    namespace = {"model": framework.build(script.initial_values(), **script.SIZES),
                 "vocab": script.SIZES["vocab"], "device_type": "cpu"}
    yield namespace
    return _train_against_reference(backend, namespace["model"], namespace["loss_fn"],
                                    slice(None))


def tp_with_fully_shard(backend, ctx):
    """tensor-parallel.md's block under fully_shard, 4 ranks: ``hp``, ``model``,
    ``device_type``, the usage plan as ``plan`` and ``mp``. Each data-parallel rank trains
    on its half of the batch; the ranks' mean loss is the one-process loss."""
    script, framework = _one_script(backend)
    model = framework.build(script.initial_values(), **script.SIZES)
    namespace = {"hp": hp, "model": model, "device_type": "cpu",
                 "plan": script.tensor_parallel_plan(), "mp": hp.MixedPrecisionPolicy()}
    yield namespace
    dp_rank = namespace["mesh"]["dp"].get_local_rank()
    vocab = script.SIZES["vocab"]

    def loss_fn(ids, targets):
        with hp.loss_parallel():
            return hp.cross_entropy(model(ids).reshape(-1, vocab), targets.reshape(-1))

    half = script.BATCH // 2
    return _train_against_reference(backend, model, loss_fn,
                                    slice(dp_rank * half, (dp_rank + 1) * half))


def tp_deferred_load(backend, ctx):
    """tensor-parallel.md's deferred block (MindSpore): ``Transformer``, ``sizes``, a (dp 1,
    tp 2) ``mesh``, the usage ``plan``, ``AdamW`` and ``path``, a checkpoint the whole
    model saved after one step. After the load, the model's whole parameters are the
    saved ones, bitwise."""
    import mindspore
    from mindspore.experimental.optim import AdamW

    script, framework = _one_script(backend)
    saved = framework.build(script.initial_values(), **script.SIZES)
    opt = framework.optimizer(saved, 1e-2)
    tokens = script.batches(1)[0]
    platform = hp.get_platform()

    def loss_fn(ids, targets):
        logits = saved(ids).reshape(-1, script.SIZES["vocab"])
        return hp.cross_entropy(logits, targets.reshape(-1))

    framework.train_step(saved, opt, loss_fn, platform.from_numpy(tokens[:, :-1]),
                         platform.from_numpy(tokens[:, 1:]), 1.0, hp.clip_grad_norm_)
    path = os.path.join(ctx["dir"], "tp-deferred-checkpoint")
    hp.save_checkpoint(path, saved, opt, key_map=hp.torch_nn_names)
    namespace = {"hp": hp, "mindspore": mindspore, "Transformer": framework.Transformer,
                 "sizes": script.SIZES, "AdamW": AdamW, "path": path,
                 "mesh": hp.init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp")),
                 "plan": script.tensor_parallel_plan()}
    yield namespace
    whole = hp.get_full_state_dict(namespace["model"], rank0_only=False)
    for name, param in saved.parameters_and_names():
        np.testing.assert_array_equal(whole[name], param.asnumpy(), err_msg=name)
    return {"compared": len(whole)}


def tp_torch_own(backend, ctx):
    """api.md's block of torch's own tensor parallelism under hp.fully_shard, 4 ranks:
    torch's ``init_device_mesh`` and ``parallelize_module``, a ``plan`` of torch's styles
    (q/k/v and w1 column-wise, o and w2 row-wise), ``device_type``, ``dp``, ``tp`` and
    ``model`` with ``.blocks``. Parameters become DTensors over both dims; three AdamW
    steps on each data-parallel half equal the one-process run."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module)

    script, framework = _one_script(backend)
    model = framework.build(script.initial_values(), **script.SIZES)
    plan = {"blocks.*.attn.w[qkv]": ColwiseParallel(), "blocks.*.attn.wo": RowwiseParallel(),
            "blocks.*.ffn.w1": ColwiseParallel(), "blocks.*.ffn.w2": RowwiseParallel()}
    namespace = {"hp": hp, "init_device_mesh": init_device_mesh,
                 "parallelize_module": parallelize_module, "plan": plan,
                 "device_type": "cpu", "dp": 2, "tp": 2, "model": model}
    yield namespace
    assert all(isinstance(p, DTensor) for p in model.parameters())
    platform = hp.get_platform()
    dp_rank = platform.rank() // 2
    reference = framework.build(script.initial_values(), **script.SIZES)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    vocab = script.SIZES["vocab"]
    losses, ref_losses = [], []
    for tokens in script.batches(3):
        for net, optimizer, rows, out in ((model, opt, tokens[dp_rank * 2:dp_rank * 2 + 2], losses),
                                          (reference, reference_opt, tokens, ref_losses)):
            ids, targets = torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])
            loss = torch.nn.functional.cross_entropy(net(ids).reshape(-1, vocab),
                                                     targets.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(float(loss.detach()))
    return {"losses": losses, "ref_losses": ref_losses}


def api_fsdp2_rebind(backend, ctx):
    """api.md's rebinding of ``torch.distributed.fsdp.fully_shard`` around code written for
    FSDP2 (``...`` in the block; tests/test_fsdp2_rebound.py trains such code): ``hp``.
    After the block, torch's own function is back under its public name."""
    import torch.distributed.fsdp as fsdp

    original = fsdp.fully_shard
    yield {"hp": hp}
    assert fsdp.fully_shard is original, "the block left torch's name rebound"
    return {"restored": True}


# ------------------------------------------------------------------ docs/expert-parallel.md
def ep_plan(backend, ctx):
    """expert-parallel.md's plan: ``hp``, ``device_type`` and ``model`` (tests/ep_models.py's
    MoE model on ``backend``). Each rank then trains its own sequences for 3 AdamW steps
    (clipping, bias balancing over the block's ``dp`` mesh) beside the model trained whole
    in this process: the ranks' mean loss and every whole parameter match (the check)."""
    from tests.ep_models import SEQS, batches
    from tests.ep_scenarios import Run, _model

    namespace = {"hp": hp, "device_type": "cpu", "model": _model(backend, "softmax")}
    yield namespace
    world, rank = hp.get_platform().world_size(), hp.get_platform().rank()
    rows = slice(rank * SEQS // world, (rank + 1) * SEQS // world)
    steps = batches()[:3]
    trained = Run(backend, namespace["model"], rows, bias_mesh=namespace["dp"]).train(steps)
    reference = Run(backend, _model(backend, "softmax"), slice(None)).train(steps)
    return {"losses": trained["losses"], "ref_losses": reference["losses"],
            "params": trained["params"][-1], "ref": reference["params"][-1]}


# ---------------------------------------------------------------------------- docs/context-parallel.md
def cp_usage(backend, ctx):
    """context-parallel.md's plan on 2 ranks: ``hp``, ``model`` (examples/lm, tiny),
    ``rope``, ``batches`` (3 steps of the whole batch, framework tensors) and
    ``train_step`` (the framework's own AdamW step). Result: this rank's losses and the
    one-process run's on the same batches."""
    import contextlib

    from tests.context_parallel_scenarios import _lm_batches, _side

    side, batches = _side(backend), _lm_batches()[:3]
    state = {}

    def train_step(ids, targets):
        if "optimizer" not in state:  # after fully_shard: over the sharded parameters
            state["optimizer"] = side.optimizer()
        return side.step(state["optimizer"], ids, targets, contextlib.nullcontext())

    namespace = {"hp": hp, "model": side.model, "rope": side.rope(), "train_step": train_step,
                 "batches": [(side.tensor(i), side.tensor(t)) for i, t in batches]}
    yield namespace
    reference = _side(backend)
    optimizer = reference.optimizer()
    ref_losses = [reference.step(optimizer, reference.tensor(i), reference.tensor(t),
                                 contextlib.nullcontext()) for i, t in batches]
    return {"losses": namespace["losses"], "ref_losses": ref_losses}
