"""Rank-side scenarios of tests/test_low_precision_gather.py: parameters all-gathered in a
lower precision than they are kept in (fully_shard/gather_codec.py).

The model is the kits' small language model (embedding, pre-norm blocks of attention and an
MLP, final norm, untied head; sizes multiples of 16, as float8 matmuls need), each block
one unit and the root one more, trained with AdamW on this rank's slice of each batch.
Every scenario measures the all-gather bytes of its last step, which the test compares
with the count made from the parameters' shapes (``expected_gather_bytes``).

- ``cast``, both frameworks: ``hp.set_gather_codec(model, hp.CastGather("bfloat16"))``
  and ``hp.Int8RowGather()`` against the same run without a codec (a vocabulary of 61:
  uneven shards, padded on the wire).
- ``torchao_*``, torch: torchao 0.18's float8 training (tensorwise dynamic scaling, with
  FSDP2 float8 all-gather on; with and without ``precompute_float8_dynamic_scale_for_fsdp``;
  float32 and bfloat16 parameters) and int8 quantized training, against torch FSDP2 on the
  same model (float8 all-gather off there: gloo refuses FSDP2's float8 all-gather, and
  with global scales the math is the same); ``hsdp_torchao_*`` the same on a (replicate 2,
  shard 2) mesh of 4 ranks.
- ``bad_hooks``, torch: a subclass with one hook only, and hooks returning wrong shapes.
"""

from __future__ import annotations

import numpy as np

import hyper_parallel as hp
from tests.kit import get_kit

VOCAB, DIM, HIDDEN, BLOCKS, SEQ, BATCH = 64, 64, 128, 2, 8, 4
ODD_VOCAB = 61  # the cast scenario's: the embedding and head shard unevenly (padded rows)
STEPS = 3
SEED = 11


def _batches(world: int, vocab: int = VOCAB):
    rng = np.random.default_rng(SEED)
    shape = (BATCH * world, SEQ)
    return [(rng.integers(0, vocab, shape), rng.integers(0, vocab, shape)) for _ in range(STEPS)]


def _model(kit, vocab: int = VOCAB):
    model = kit.LM(vocab, DIM, HIDDEN, BLOCKS)
    kit.load(model, SEED)
    return model


def _shard(model, **options):
    for block in model.blocks:
        hp.fully_shard(block, **options)
    hp.fully_shard(model, **options)


def _train(kit, model, opt, rank: int, world: int, vocab: int = VOCAB) -> tuple:
    """(losses, all-gather bytes of the last step)."""
    losses, nbytes = [], 0
    for ids, targets in _batches(world, vocab):
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        with hp.track_comms() as stats:
            losses.append(kit.grad_step(model, opt, lambda: kit.lm_loss(
                model.head(model(kit.ids(ids[mine]))), kit.ids(targets[mine]))))
        nbytes = stats.nbytes("all_gather")
    return losses, nbytes


def _param_sizes(model, shard_size: int = 2) -> dict:
    """``{name: (numel, unit, rows)}`` as gathered over ``shard_size`` ranks, dim 0 padded
    to a multiple of it (every rank sends as many rows); unit "block" (gathered twice a
    step: forward and the re-gather before backward) or "root" (gathered once: the root
    keeps its parameters); rows: the padded dim 0 of a matrix, None for a vector."""
    p = hp.get_platform()
    out = {}
    for prefix, sub in p.named_modules(model):
        for attr, param in p.direct_params(sub):
            name = f"{prefix}.{attr}" if prefix else attr
            shape = p.shape(param)
            rows = -(-shape[0] // shard_size) * shard_size
            out.setdefault(name, (rows * int(np.prod(shape[1:])),
                                  "block" if name.startswith("blocks") else "root",
                                  rows if len(shape) >= 2 else None))
    return out


def expected_gather_bytes(sizes: dict, wire_bytes) -> int:
    """All-gather bytes of one step: ``wire_bytes(name, numel, rows)`` of every full
    parameter, twice for a block's."""
    return int(sum(wire_bytes(name, numel, rows) * (2 if unit == "block" else 1)
                   for name, (numel, unit, rows) in sizes.items()))


# ------------------------------------------------------------------------ both frameworks
def cast() -> dict:
    kit, rank, world = get_kit(), hp.get_platform().rank(), hp.get_platform().world_size()
    runs = {}
    for label, codec in (("off", None), ("bfloat16", hp.CastGather("bfloat16")),
                         ("int8", hp.Int8RowGather())):
        model = _model(kit, ODD_VOCAB)
        sizes = _param_sizes(model)
        if codec is not None:
            hp.set_gather_codec(model, codec)
        _shard(model)
        opt = kit.optimizer(kit.params(model), lr=1e-2, kind="adamw")
        runs[label] = _train(kit, model, opt, rank, world, ODD_VOCAB)
    return {"losses": runs["bfloat16"][0], "ref_losses": runs["off"][0],
            "int8_losses": runs["int8"][0], "int8_bytes": runs["int8"][1],
            "bytes": runs["bfloat16"][1], "ref_bytes": runs["off"][1], "sizes": sizes,
            "bad_input": _bad_codec_input(kit, model)}


def _bad_codec_input(kit, sharded) -> dict:
    """``set_gather_codec`` and ``CastGather`` refusing bad input: ``{case: (error type,
    message, whether any parameter was marked)}``; ``sharded`` is a model after fully_shard."""
    from hyper_parallel.fully_shard.gather_codec import GATHER_CODEC_ATTR

    p = hp.get_platform()
    fresh = _model(kit)

    def marked(model):
        return any(hasattr(param, GATHER_CODEC_ATTR) for _, sub in p.named_modules(model)
                   for _, param in p.direct_params(sub))

    cases = {"after fully_shard": lambda: hp.set_gather_codec(sharded, hp.CastGather()),
             "not a codec": lambda: hp.set_gather_codec(fresh, "bfloat16"),
             "not a module": lambda: hp.set_gather_codec([fresh], hp.CastGather()),
             "bad predicate": lambda: hp.set_gather_codec(fresh, hp.CastGather(), predicate=3),
             "bad dtype": lambda: hp.CastGather("int8")}
    out = {}
    for case, call in cases.items():
        before = marked(sharded)
        try:
            call()
            out[case] = (None, "", False)
        except (TypeError, ValueError) as error:
            out[case] = (type(error).__name__, str(error),
                         marked(fresh) or marked(sharded) != before)
    return out


# ------------------------------------------------------------------------ torch: torchao
def _torchao_model(kit, recipe: str, all_gather: bool):
    model = _model(kit)
    if recipe == "int8":
        from torchao.prototype.quantized_training import int8_weight_only_quantized_training
        from torchao.quantization import quantize_

        for block in model.blocks:  # the blocks' linears: attention, MLP
            quantize_(block, int8_weight_only_quantized_training())
    else:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather)
        convert_to_float8_training(model, config=config)
    return model


def _their_fully_shard(model, bf16: bool, hsdp: bool):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    for block in model.blocks:
        fully_shard(block, mp_policy=policy, mesh=mesh)
    fully_shard(model, mp_policy=policy, mesh=mesh)


def _params_of(model) -> dict:
    import torch

    out = {}
    for name, param in model.named_parameters():
        # this rank's shard: both libraries cut dim 0 alike (int8 weights have no full_tensor)
        local = param.to_local()
        if hasattr(local, "dequantize"):  # int8 weights: their values
            local = local.dequantize()
        elif hasattr(local, "_tensor"):  # float8's wrapper of the high-precision weight
            local = local._tensor
        out[name] = torch.Tensor(local.detach().float()).numpy().copy()
    return out


def _torchao(recipe: str, precompute: bool = False, bf16: bool = False,
             hsdp: bool = False) -> dict:
    """``hsdp``: on a (replicate 2, shard 2) mesh of 4 ranks."""
    import torch

    kit, rank, world = get_kit(), hp.get_platform().rank(), hp.get_platform().world_size()
    ours = _torchao_model(kit, recipe, all_gather=True)
    sizes = _param_sizes(ours)
    policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None)
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) \
        if hsdp else None
    _shard(ours, mp_policy=policy, mesh=mesh)
    theirs = _torchao_model(kit, recipe, all_gather=recipe == "int8")
    _their_fully_shard(theirs, bf16, hsdp)
    out = {}
    for label, model in (("ours", ours), ("theirs", theirs)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)  # int8: no decay op
        torch.manual_seed(SEED + rank)  # int8 weights round their updates stochastically
        losses, nbytes = [], 0
        for ids, targets in _batches(world):
            mine = slice(rank * BATCH, (rank + 1) * BATCH)
            with hp.track_comms() as stats:
                loss = kit.lm_loss(model.head(model(kit.ids(ids[mine]))), kit.ids(targets[mine]))
                loss.backward()
                opt.step()
                opt.zero_grad()
                if precompute:
                    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

                    precompute_float8_dynamic_scale_for_fsdp(model)
            losses.append(float(loss.item()))
            nbytes = stats.nbytes("all_gather")
        out[label] = (losses, _params_of(model), nbytes)
    coded = sorted(n for n, p in ours.named_parameters()
                   if hp.get_platform().gather_codec_of(p.to_local()) is not None)
    return {"losses": out["ours"][0], "their_losses": out["theirs"][0],
            "param_diff": max(float(np.max(np.abs(out["ours"][1][n] - out["theirs"][1][n])))
                              for n in out["ours"][1]),
            "bytes": out["ours"][2], "sizes": sizes, "coded": coded,
            "weight_dtype": str(next(p for n, p in ours.named_parameters()
                                     if n in coded).to_local().dtype) if coded else None}


def torchao_float8() -> dict:
    return _torchao("float8")


def torchao_float8_precompute() -> dict:
    return _torchao("float8", precompute=True)


def torchao_float8_bf16() -> dict:
    return _torchao("float8", bf16=True)


def torchao_int8() -> dict:
    return _torchao("int8")


def hsdp_torchao_float8() -> dict:
    return _torchao("float8", hsdp=True)


def hsdp_torchao_float8_bf16() -> dict:
    return _torchao("float8", bf16=True, hsdp=True)


def hsdp_torchao_int8() -> dict:
    return _torchao("int8", hsdp=True)


# ------------------------------------------------------------------------ torch: bad hooks
def _wrapper_class():
    """A minimal torch wrapper subclass (as torchao's weights are: DTensor keeps those as
    local tensors, a plain subclass it does not); the bad subclasses add hooks to it."""
    import torch
    from torch.utils._pytree import tree_map

    class Wrapped(torch.Tensor):
        @staticmethod
        def __new__(cls, data):
            return torch.Tensor._make_wrapper_subclass(
                cls, data.shape, strides=data.stride(), dtype=data.dtype, device=data.device,
                requires_grad=data.requires_grad)

        def __init__(self, data):
            self._data = data

        def __tensor_flatten__(self):
            return ["_data"], None

        @classmethod
        def __tensor_unflatten__(cls, inner, meta, size, stride):
            return cls(inner["_data"])

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            def unwrap(t):
                return t._data if isinstance(t, Wrapped) else t

            out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
            return tree_map(lambda t: cls(t) if isinstance(t, torch.Tensor) else t, out)

    return Wrapped


def bad_hooks() -> dict:
    """Each bad subclass's error at the first forward (the first all-gather), by case."""
    import torch

    wrapped = _wrapper_class()

    class OnlyPre(wrapped):
        def fsdp_pre_all_gather(self, mesh):
            return (self._data,), None

    class WrongInputRows(wrapped):
        def fsdp_pre_all_gather(self, mesh):
            return (self._data.reshape(-1)[:3],), None

        def fsdp_post_all_gather(self, outputs, metadata, dtype, *, out=None):
            return outputs[0], outputs

    class WrongFullShape(wrapped):
        def fsdp_pre_all_gather(self, mesh):
            return (self._data,), None

        def fsdp_post_all_gather(self, outputs, metadata, dtype, *, out=None):
            return outputs[0][:, :3], outputs

    errors = {}
    for cls in (OnlyPre, WrongInputRows, WrongFullShape):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        model[0].weight = torch.nn.Parameter(cls(model[0].weight.detach()))
        hp.fully_shard(model)
        try:
            model(torch.ones(2, 8)).sum().backward()
            errors[cls.__name__] = None
        except (TypeError, ValueError) as error:
            errors[cls.__name__] = f"{type(error).__name__}: {error}"
    return errors


SCENARIOS = {"cast": cast, "torchao_float8": torchao_float8,
             "torchao_float8_precompute": torchao_float8_precompute,
             "torchao_float8_bf16": torchao_float8_bf16, "torchao_int8": torchao_int8,
             "bad_hooks": bad_hooks, "hsdp_torchao_float8": hsdp_torchao_float8,
             "hsdp_torchao_float8_bf16": hsdp_torchao_float8_bf16,
             "hsdp_torchao_int8": hsdp_torchao_int8}


def run_all(names: list) -> dict:
    return {name: SCENARIOS[name]() for name in names}
