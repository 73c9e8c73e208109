"""One rank of a context-parallel benchmark launch (context_parallel.py), 2 ranks, one
framework.

The example language model (examples/lm) is built twice in the same processes, from the
same values:

- ``one``: not sharded; each rank steps the whole global batch alone, as one process would
  (no collective);
- ``cp2``: fully_shard over the 2 ranks, each step inside ``hp.context_parallel`` (ring
  attention): each rank holds half of every sequence.

They are stepped (AdamW, the same batches) in alternated rounds, one step each, the order
reversed every round, after ``warmup`` rounds. Then each model's forward is run once more
under the framework's saved-tensor hooks, which count the memory autograd keeps for
backward (the activations, and the weights a matmul keeps): each memory once, however many
operations save it or views of it (torch: the tensor's storage; MindSpore: its data
pointer). One ``cp2`` step is counted by ``hp.comm_stats`` on the cp dim (the ring's
sends).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import hyper_parallel as hp  # noqa: E402
from benchmarks.measure import alternate, rank_main  # noqa: E402
from examples.lm.config import VOCAB  # noqa: E402
from examples.lm.data import ByteCorpus  # noqa: E402

KINDS = ("one", "cp2")


class TorchModels:
    def __init__(self, job, mesh):
        import torch

        from examples.lm.model_torch import build

        torch.set_num_threads(1)
        self.torch, self.mesh, self.models, self.opts = torch, mesh, {}, {}
        for kind in KINDS:
            model = build(job["size"])
            if kind == "cp2":
                for layer in model.model.layers:
                    hp.fully_shard(layer, mesh=mesh)
                hp.fully_shard(model, mesh=mesh)
            self.models[kind] = model
            self.opts[kind] = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def _context(self, kind, ids, targets):
        if kind == "one":
            return contextlib.nullcontext()
        body = self.models[kind].model
        return hp.context_parallel(self.mesh, buffers=[ids, targets, body.cos, body.sin],
                                   buffer_seq_dims=[1, 1, 0, 0], no_restore_buffers=[ids, targets])

    def _forward(self, kind, ids, targets):
        logits = self.models[kind](ids)
        return hp.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    def step(self, kind, ids, targets, count_saved=False) -> tuple:
        torch = self.torch
        ids, targets = torch.from_numpy(ids.copy()), torch.from_numpy(targets.copy())
        saved = {}

        def pack(t):
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if count_saved \
            else contextlib.nullcontext()
        with self._context(kind, ids, targets):
            with hooks:
                loss = self._forward(kind, ids, targets)
            loss.backward()
        self.opts[kind].step()
        self.opts[kind].zero_grad(set_to_none=False)
        return float(loss.detach()), sum(saved.values())


class MindSporeModels:
    def __init__(self, job, mesh):
        import mindspore as ms
        from mindspore.experimental.optim import AdamW

        from examples.lm.model_mindspore import build

        ms.set_context(mode=ms.PYNATIVE_MODE)
        ms.runtime.launch_blocking()  # as every MindSpore phase of run.py
        self.ms, self.mesh, self.models, self.opts, self.grad_fns = ms, mesh, {}, {}, {}
        self.saved, self.counting = {}, False
        for kind in KINDS:
            model = build(job["size"], hp.get_platform())
            if kind == "cp2":
                for layer in model.model.layers:
                    hp.fully_shard(layer, mesh=mesh)
                hp.fully_shard(model, mesh=mesh)
            params = model.trainable_params()
            self.models[kind], self.opts[kind] = model, AdamW(params, lr=1e-4)
            self.grad_fns[kind] = ms.value_and_grad(self._loss_fn(model), None, params)

    def _loss_fn(self, model):
        def pack(t):
            key = t.data_ptr()
            self.saved[key] = max(self.saved.get(key, 0), t.nbytes)
            return t

        def loss(ids, targets):
            hooks = self.ms.saved_tensors_hooks(pack, lambda t: t) if self.counting \
                else contextlib.nullcontext()
            with hooks:
                return hp.cross_entropy(model(ids).reshape(-1, VOCAB), targets.reshape(-1))
        return loss

    def step(self, kind, ids, targets, count_saved=False) -> tuple:
        ms = self.ms
        ids, targets = ms.Tensor(ids.astype(np.int32)), ms.Tensor(targets.astype(np.int32))
        self.saved.clear()
        self.counting = count_saved
        context = contextlib.nullcontext() if kind == "one" else hp.context_parallel(
            self.mesh, buffers=[ids, targets, self.models[kind].model.cos,
                                self.models[kind].model.sin],
            buffer_seq_dims=[1, 1, 0, 0], no_restore_buffers=[ids, targets])
        with context:
            loss, grads = self.grad_fns[kind](ids, targets)
        self.opts[kind](grads)
        self.counting = False
        return float(loss.asnumpy()), sum(self.saved.values())


def run(job: dict, rank: int, world: int) -> dict:
    hp.init_distributed()
    platform = hp.get_platform()
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    models = (TorchModels if platform.name == "torch" else MindSporeModels)(job, mesh)
    corpus = ByteCorpus()
    batches = [corpus.batch(k, job["batch"], job["seq"])
               for k in range(job["warmup"] + job["rounds"])]
    def stepper(kind):
        return lambda k: models.step(kind, *batches[k])[0]

    result = alternate({kind: stepper(kind) for kind in KINDS}, 0, job["warmup"], job["rounds"])
    ids, targets = batches[0]
    result["saved_bytes"] = {kind: models.step(kind, ids, targets, count_saved=True)[1]
                             for kind in KINDS}
    before = hp.comm_stats().snapshot()
    models.step("cp2", ids, targets)
    window = hp.comm_stats().snapshot().minus(before)
    result["cp_comm"] = {op: [rec.calls, rec.nbytes]
                         for (op, _wire, dim), rec in window.records.items() if dim == "cp"}
    hp.destroy_distributed()
    return result


if __name__ == "__main__":
    rank_main(run)
