"""Rank side of the compiler suite: torch.compile and mindspore.jit on sharded blocks.

torch: the kit's small language model (embedding, attention blocks, norms, a 37-row head
that shards unevenly over 2 ranks), its blocks compiled in the four ways users write
(``block.compile()`` or ``torch.compile(block)``, before or after ``fully_shard``), trained
``STEPS`` SGD steps with hyper_parallel and, in the same process and on the same wrapping,
with torch's FSDP2 compiled the same way; plus hyper_parallel uncompiled and a
single-process reference. Each compiled run counts dynamo's graph breaks
(``counters["graph_break"]``) and the graphs handed to the backend, after
``torch._dynamo.reset()``. The backend is aot_eager behind a counter: graph breaks are a
dynamo property, and no C++ compiler runs.

MindSpore: a sharded cell whose ``construct`` is compiled with ``mindspore.jit`` (before
or after ``fully_shard``) must refuse its first call with an error saying what to do; the
supported form, a block whose construct calls a jitted function that takes the
parameters as arguments, trains with parity against the single-process reference.
"""

from __future__ import annotations

import numpy as np

import hyper_parallel as hp
from tests.kit import get_kit
from tests.scenarios import _named

VOCAB, DIM, HIDDEN, BLOCKS = 37, 16, 24, 2
SEQ, LOCAL_BATCH = 8, 2
STEPS = {"torch": 3, "mindspore": 2}
TORCH_VARIANTS = ("method_before", "method_after", "wrap_before", "wrap_after")
MS_REFUSED = ("jit_construct_before", "jit_construct_after")


def _batches(kit, slice_) -> list:
    rng = np.random.default_rng(11)
    world_batch = LOCAL_BATCH * hp.get_platform().world_size()
    out = []
    for _ in range(STEPS[kit.name]):
        ids = rng.integers(0, VOCAB, (world_batch, SEQ))[slice_]
        targets = rng.integers(0, VOCAB, (world_batch, SEQ))[slice_]
        out.append((kit.ids(ids), kit.ids(targets)))
    return out


def _train(kit, model, slice_) -> list:
    opt = kit.optimizer(kit.params(model), lr=0.1)
    return [kit.grad_step(model, opt, lambda: kit.lm_loss(model.head(model(ids)), targets))
            for ids, targets in _batches(kit, slice_)]


def _diff(full: dict, reference: dict) -> float:
    assert set(full) == set(reference), sorted(set(full) ^ set(reference))
    return max(float(np.abs(np.asarray(full[k]) - reference[k]).max()) for k in reference)


def _wrap(model, fully_shard) -> None:
    for block in model.blocks:
        fully_shard(block)
    fully_shard([model.norm, model.head])
    fully_shard(model)


# ------------------------------------------------------------------------------ torch
def _compile_blocks(torch, model, how: str, backend) -> None:
    for i, block in enumerate(model.blocks):
        if how == "method":
            block.compile(backend=backend)
        else:
            model.blocks[i] = torch.compile(block, backend=backend)


def _torch_run(kit, variant: str, fully_shard, slice_) -> dict:
    import torch
    from torch._dynamo.backends.debugging import aot_eager
    from torch._dynamo.utils import counters

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    how, when = variant.split("_")
    model = kit.LM(VOCAB, DIM, HIDDEN, BLOCKS)
    kit.load(model, seed=3)
    if when == "before":
        _compile_blocks(torch, model, how, counting_backend)
    _wrap(model, fully_shard)
    if when == "after":
        _compile_blocks(torch, model, how, counting_backend)
    losses = _train(kit, model, slice_)
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().numpy()
            for n, p in model.named_parameters()}
    full = {n.replace("._orig_mod", ""): v for n, v in full.items()}
    return {"losses": losses, "full": full, "graphs": len(graphs),
            "breaks": sum(counters["graph_break"].values()),
            "break_reasons": sorted(counters["graph_break"])}


def run_torch() -> dict:
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    kit = get_kit()
    rank = hp.get_platform().rank()
    mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    ref = kit.LM(VOCAB, DIM, HIDDEN, BLOCKS)
    kit.load(ref, seed=3)
    ref_losses = _train(kit, ref, slice(None))
    ref_full = {k: kit.to_numpy(v) for k, v in _named(kit, ref).items()}
    eager = kit.LM(VOCAB, DIM, HIDDEN, BLOCKS)
    kit.load(eager, seed=3)
    _wrap(eager, hp.fully_shard)
    eager_losses = _train(kit, eager, mine)
    eager_full = hp.gather_full_state_dict(eager)
    out = {"ref_losses": ref_losses, "eager_losses": eager_losses,
           "eager_ref_diff": _diff(eager_full, ref_full)}
    for variant in TORCH_VARIANTS:
        ours = _torch_run(kit, variant, hp.fully_shard, mine)
        theirs = _torch_run(kit, variant, fsdp2_fully_shard, mine)
        out[variant] = {
            "losses": ours["losses"], "fsdp2_losses": theirs["losses"],
            "eager_diff": _diff(ours["full"], eager_full),
            "fsdp2_diff": _diff(ours["full"], theirs["full"]),
            "breaks": ours["breaks"], "fsdp2_breaks": theirs["breaks"],
            "graphs": ours["graphs"], "fsdp2_graphs": theirs["graphs"],
            "break_reasons": ours["break_reasons"]}
    return out


# ------------------------------------------------------------------------------ MindSpore
def _jitted_mlp_lm(kit):
    """The kit's LM with each block's MLP computed by a jitted function of the block's
    input and parameters (parameters passed in, never read from the cell by the graph)."""
    ms, nn, ops = kit.ms, kit.nn, kit.ops

    @ms.jit
    def mlp(h, w_up, b_up, w_down, b_down):
        hidden = ops.relu(ops.matmul(h, w_up.swapaxes(0, 1)) + b_up)
        return ops.matmul(hidden, w_down.swapaxes(0, 1)) + b_down

    class JitMLPBlock(nn.Cell):
        def __init__(self, dim, hidden):
            super().__init__()
            self.norm = nn.LayerNorm((dim,))
            self.up, self.down = nn.Dense(dim, hidden), nn.Dense(hidden, dim)

        def construct(self, x):
            h = self.norm(x)
            return x + mlp(h, self.up.weight, self.up.bias, self.down.weight, self.down.bias)

    model = kit.LM(VOCAB, DIM, HIDDEN, BLOCKS)
    model.blocks = nn.CellList([JitMLPBlock(DIM, HIDDEN) for _ in range(BLOCKS)])
    kit.load(model, seed=3)
    return model


def _refused(kit, variant: str, mine) -> dict:
    model = kit.LM(VOCAB, DIM, HIDDEN, BLOCKS)
    kit.load(model, seed=3)
    jit_blocks = lambda: [setattr(b, "construct", kit.ms.jit(b.construct))  # noqa: E731
                          for b in model.blocks]
    if variant.endswith("before"):
        jit_blocks()
    _wrap(model, hp.fully_shard)
    if variant.endswith("after"):
        jit_blocks()
    before = hp.gather_full_state_dict(model)
    try:
        _train(kit, model, mine)
    except RuntimeError as error:
        after = hp.gather_full_state_dict(model)
        return {"error": str(error), "unchanged": _diff(after, before) == 0.0}
    return {"error": None}


def run_mindspore() -> dict:
    kit = get_kit()
    rank = hp.get_platform().rank()
    mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    out = {}
    ref = _jitted_mlp_lm(kit)
    out["ref_losses"] = _train(kit, ref, slice(None))
    ref_full = {k: kit.to_numpy(v) for k, v in _named(kit, ref).items()}
    model = _jitted_mlp_lm(kit)
    _wrap(model, hp.fully_shard)
    out["losses"] = _train(kit, model, mine)
    full = hp.gather_full_state_dict(model)
    out["ref_diff"] = _diff(full, ref_full)
    # last: an error raised inside value_and_grad's forward leaves MindSpore's PyNative
    # grad state unusable for a later backward in the same process
    out.update({variant: _refused(kit, variant, mine) for variant in MS_REFUSED})
    return out
