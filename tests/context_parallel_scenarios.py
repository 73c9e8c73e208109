"""Rank side of tests/test_context_parallel.py: context parallelism (hp.context_parallel,
hp.scaled_dot_product_attention) on real ranks, against one process on the same data.

- ``attention``: queries, keys and values of the whole sequence are buffers of the
  context; inside it each rank attends its share (on torch through
  ``torch.nn.functional.scaled_dot_product_attention``, which the context routes; on
  MindSpore through ``hp.scaled_dot_product_attention``) and differentiates a weighted sum
  of the output. Returned: this rank's output and gradients of q, k, v, its positions, the
  one-process reference (torch's own attention; on MindSpore a softmax written in
  MindSpore ops) and whether every buffer was restored.
- ``training``: the example's language model (examples/lm, size tiny) under
  ``hp.fully_shard`` over the joined (dp, cp) dims, trained with AdamW inside the context
  (inputs, targets and rotary tables as buffers); and the same model trained in one
  process on the whole batch. Returned: both loss curves (each rank's local mean) and the
  full parameters at the end.
- ``bad_attention``: what a rank's attention refuses under the context, and a model
  computing attention by hand.
Each returns plain numpy; the test compares.
"""

from __future__ import annotations

import numpy as np

import hyper_parallel as hp
from hyper_parallel.context_parallel.balance import positions

B, H, S, D = 2, 4, 16, 8
CASES = [(strategy, causal) for strategy in ("ring", "all_to_all") for causal in (False, True)]
STEPS, LR, SIZE = 5, 1e-2, "tiny"


def _data(seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, H, S, D)).astype(np.float32) for _ in range(4)]


def _cp_mesh(dp: int, cp: int):
    return hp.init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))


# ---------------------------------------------------------------- attention
def _torch_attention(cp_mesh, strategy: str, causal: bool) -> dict:
    import torch
    import torch.nn.functional as F

    arrays = _data()
    q, k, v = (torch.from_numpy(a).requires_grad_() for a in arrays[:3])
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    (out * torch.from_numpy(arrays[3])).sum().backward()
    reference = [t.detach().numpy().copy() for t in (out, q.grad, k.grad, v.grad)]
    buffers = [torch.from_numpy(a.copy()) for a in arrays]
    with hp.context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[2] * 4,
                             strategy=strategy):
        lq, lk, lv = (b.clone().requires_grad_() for b in buffers[:3])
        out = F.scaled_dot_product_attention(lq, lk, lv, is_causal=causal)
        (out * buffers[3]).sum().backward()
        local = [t.detach().numpy().copy() for t in (out, lq.grad, lk.grad, lv.grad)]
    restored = all(np.array_equal(b.numpy(), a) for b, a in zip(buffers, arrays))
    return {"reference": reference, "local": local, "restored": restored}


def _ms_attention(cp_mesh, strategy: str, causal: bool) -> dict:
    import mindspore as ms
    from mindspore import ops

    arrays = _data()
    weight = ms.Tensor(arrays[3])
    tril = ms.Tensor(np.tril(np.ones((S, S), np.bool_)))

    def by_hand(q, k, v):  # the one-process reference: MindSpore's own softmax
        scores = ops.matmul(q, k.swapaxes(-1, -2)) / float(np.sqrt(D))
        if causal:
            scores = ops.masked_fill(scores, ~tril, float("-inf"))
        out = ops.matmul(ops.softmax(scores, -1), v)
        return (out * weight).sum(), out

    (_, out), grads = ms.value_and_grad(by_hand, (0, 1, 2), has_aux=True)(
        *(ms.Tensor(a) for a in arrays[:3]))
    reference = [out.asnumpy()] + [g.asnumpy() for g in grads]
    buffers = [ms.Tensor(a.copy()) for a in arrays]
    with hp.context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[2] * 4,
                             strategy=strategy):
        def routed(q, k, v):
            out = hp.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return (out * buffers[3]).sum(), out

        # the buffers themselves are the network's inputs, then restored
        (_, out), grads = ms.value_and_grad(routed, (0, 1, 2), has_aux=True)(*buffers[:3])
        local = [out.asnumpy()] + [g.asnumpy() for g in grads]
    restored = all(np.array_equal(b.asnumpy(), a) for b, a in zip(buffers, arrays))
    return {"reference": reference, "local": local, "restored": restored}


def attention(backend: str) -> dict:
    """Every (strategy, causal) case at this world's cp, against one process."""
    mesh = _cp_mesh(1, hp.get_platform().world_size())["cp"]
    run = _torch_attention if backend == "torch" else _ms_attention
    rank, cp = mesh.get_local_rank(0), mesh.size()
    results = {f"{s}-{'causal' if c else 'full'}": run(mesh, s, c) for s, c in CASES}
    return {"positions": positions(rank, cp, S // (2 * cp)), "cases": results}


# ---------------------------------------------------------------- training
def _lm_batches() -> list:
    """``STEPS`` (ids, targets) of the global batch: 2 rows of the tiny model's sequence."""
    from examples.lm.config import SIZES, VOCAB

    rng = np.random.default_rng(7)
    tokens = rng.integers(0, VOCAB, (STEPS, 2, SIZES[SIZE]["seq"] + 1))
    return [(t[:, :-1].astype(np.int32), t[:, 1:].astype(np.int32)) for t in tokens]


class _TorchSide:
    def __init__(self):
        import torch

        from examples.lm.model_torch import build

        self.torch, self.model = torch, build(SIZE)

    def rope(self):
        return [self.model.model.cos, self.model.model.sin]

    def recompute_attention(self):
        """Each layer's attention recomputed in backward (non-reentrant checkpoint)."""
        from torch.utils.checkpoint import checkpoint

        for layer in self.model.model.layers:
            attention = layer.self_attn
            attention.forward = lambda x, cos, sin, f=attention.forward: checkpoint(
                f, x, cos, sin, use_reentrant=False)

    def tensor(self, array):
        return self.torch.from_numpy(array.astype(np.int64))

    def optimizer(self):
        return self.torch.optim.AdamW(self.model.parameters(), lr=LR, foreach=False)

    def step(self, optimizer, ids, targets, context) -> float:
        from examples.lm.config import VOCAB

        with context:
            logits = self.model(ids).float()  # mixed precision: the loss in float32
            loss = hp.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
            loss.backward()
        hp.clip_grad_norm_(self.model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return float(loss.detach())


class _MindSporeSide:
    def __init__(self):
        import mindspore as ms

        from examples.lm.model_mindspore import build

        ms.set_context(mode=ms.PYNATIVE_MODE)
        self.ms, self.model = ms, build(SIZE, hp.get_platform())

    def rope(self):
        return [self.model.model.cos, self.model.model.sin]

    def tensor(self, array):
        return self.ms.Tensor(array.astype(np.int32))

    def optimizer(self):
        from mindspore.experimental.optim import AdamW

        self.params = list(self.model.trainable_params())
        self.grad_fn = self.ms.value_and_grad(self._loss, None, self.params)
        return AdamW(self.params, lr=LR)

    def _loss(self, ids, targets):
        from examples.lm.config import VOCAB

        logits = self.model(ids).astype(self.ms.float32)  # mixed precision: loss in float32
        return hp.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    def step(self, optimizer, ids, targets, context) -> float:
        with context:
            loss, grads = self.grad_fn(ids, targets)
        grads, _ = hp.clip_grad_norm_(self.params, 1.0, grads=grads)
        optimizer(grads)
        return float(loss.asnumpy())


def _side(backend: str):
    return _TorchSide() if backend == "torch" else _MindSporeSide()


def training(backend: str, dp: int, strategies=("ring",), param_dtype: str | None = None,
             recompute: bool = False) -> dict:
    """The tiny LM at (dp, cp = world / dp) per strategy, and in one process in float32
    (every rank computes the reference alike); ``param_dtype``: fully_shard's mixed
    precision (gradients reduced in float32); ``recompute``: the attention recomputed in
    backward (inside the context)."""
    import contextlib

    batches = _lm_batches()
    reference = _side(backend)
    optimizer = reference.optimizer()
    ref_losses = [reference.step(optimizer, reference.tensor(ids), reference.tensor(targets),
                                 contextlib.nullcontext()) for ids, targets in batches]
    result = {"reference": {"losses": ref_losses,
                            "params": hp.get_full_state_dict(reference.model)}}
    mesh = _cp_mesh(dp, hp.get_platform().world_size() // dp)
    rows = 2 // dp
    first = mesh.get_local_rank("dp") * rows
    for strategy in strategies:
        side = _side(backend)
        if recompute:
            side.recompute_attention()
        dims = hp.DataParallelMeshDims(shard=("dp", "cp"))
        policy = hp.MixedPrecisionPolicy(param_dtype=param_dtype,
                                         reduce_dtype=param_dtype and "float32")
        for layer in side.model.model.layers:
            hp.fully_shard(layer, mesh=mesh, dp_mesh_dims=dims, mp_policy=policy)
        hp.fully_shard(side.model, mesh=mesh, dp_mesh_dims=dims, mp_policy=policy)
        optimizer = side.optimizer()
        losses = []
        for ids, targets in batches:
            ids_t, targets_t = (side.tensor(a[first:first + rows].copy()) for a in (ids, targets))
            context = hp.context_parallel(
                mesh["cp"], buffers=[ids_t, targets_t] + side.rope(),
                buffer_seq_dims=[1, 1, 0, 0], no_restore_buffers=[ids_t, targets_t],
                strategy=strategy)
            losses.append(side.step(optimizer, ids_t, targets_t, context))
        result[strategy] = {"losses": losses, "params": hp.get_full_state_dict(side.model)}
    return result


# ---------------------------------------------------------------- bad input
def _by_hand(q, k, v):
    """Attention as a model might write it itself, not through scaled_dot_product_attention."""
    p = hp.get_platform()
    weights = p.exp(p.matmul(q, k.swapaxes(-1, -2)) / float(np.sqrt(D)))
    return p.matmul(p.divide(weights, p.sum_dim(weights, -1)), v)


def _refusal(mesh, arrays, call) -> dict:
    """``call(buffers)`` inside a context over ``arrays``: its error, and whether the
    buffers were whole again after the context closed."""
    p = hp.get_platform()
    buffers = [p.from_numpy(a.copy()) for a in arrays]
    error = None
    try:
        with hp.context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * len(buffers)):
            call(buffers)
    except (ValueError, NotImplementedError, RuntimeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    restored = all(np.array_equal(p.to_numpy(b), a) for b, a in zip(buffers, arrays))
    return {"error": error, "restored": restored}


def bad_attention(backend: str) -> dict:
    """Attention calls the context refuses, and attention computed by hand under it."""
    p = hp.get_platform()
    mesh = _cp_mesh(1, p.world_size())["cp"]
    arrays = _data()[:3]
    whole = [p.from_numpy(a) for a in arrays]
    sdpa = hp.scaled_dot_product_attention
    rng = np.random.default_rng(3)
    three_heads = [rng.standard_normal((B, 3, S, D)).astype(np.float32) for _ in range(3)]
    result = {
        "unsplit": _refusal(mesh, arrays, lambda b: sdpa(*whole, is_causal=True)),
        "attn_mask": _refusal(mesh, arrays, lambda b: sdpa(*b, attn_mask=b[0])),
        "by_hand": _refusal(mesh, arrays, lambda b: _by_hand(*b)),
    }
    buffers = [p.from_numpy(a.copy()) for a in three_heads]
    try:
        with hp.context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * 3,
                                 strategy="all_to_all"):
            sdpa(*buffers)
        result["heads"] = None
    except ValueError as exc:
        result["heads"] = f"ValueError: {exc}"
    # one call routed, one by hand: no error, and the by-hand rows see the local keys only
    buffers = [p.from_numpy(a.copy()) for a in arrays]
    with hp.context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * 3):
        routed = p.to_numpy(sdpa(*buffers))
        by_hand = p.to_numpy(_by_hand(*buffers))
    rank, cp = mesh.get_local_rank(0), mesh.size()
    result["mixed"] = {"routed": routed, "by_hand": by_hand,
                       "reference": p.to_numpy(_by_hand(*whole)),
                       "positions": positions(rank, cp, S // (2 * cp))}
    return result


def torch_own_context_parallel(backend: str) -> str | None:
    """torch's own ``context_parallel`` around its own attention on CPU: the error it
    raises (None: it ran)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    q, k, v = (torch.from_numpy(a) for a in _data()[:3])
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except NotImplementedError as exc:
        return str(exc)
    return None
