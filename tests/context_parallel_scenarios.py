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

        (_, out), grads = ms.value_and_grad(routed, (0, 1, 2), has_aux=True)(
            *(b + 0 for b in buffers[:3]))
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
