"""One rank of a tensor-parallel benchmark launch (tensor_parallel.py), 4 ranks, one framework.

The example language model (examples/lm, the same shapes on both frameworks) is built
three ways in the same processes, from the same values, with the example's own plan
(examples/lm/tensor_parallel.py):

- ``fsdp4``: fully_shard over the 4 ranks (every layer and the root);
- ``tp2``: ``hp.parallelize_module`` over the tp dim of a (shard 2, tp 2) mesh, then
  fully_shard over the shard dim (hyper_parallel's tensor parallelism on both);
- ``tp1``: fully_shard over the same shard dim of 2 ranks without tensor parallelism:
  the same data-parallel degree as ``tp2``, for the memory comparison.

``fsdp4`` and ``tp2`` are stepped (AdamW, the same global batch) in alternated rounds, one
step each, order reversed every round, after ``warmup`` rounds. After one step of each
model the rank reports the bytes of its parameters, gradients and optimizer state, split
into the layers tensor parallelism splits and the rest. The bytes the tensor-parallel
collectives move in one step are counted by ``hp.comm_stats`` on the tp dim.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import hyper_parallel as hp  # noqa: E402
from benchmarks.measure import alternate, rank_main  # noqa: E402
from examples.lm.config import VOCAB  # noqa: E402
from examples.lm.data import ByteCorpus, rank_rows  # noqa: E402
from examples.lm.tensor_parallel import lm_plan  # noqa: E402


def _is_split(name: str) -> bool:
    """A parameter the plan splits (every one but the norms')."""
    return not name.endswith("norm.weight")


def _nbytes_torch(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


class TorchModels:
    def __init__(self, job):
        import torch

        from examples.lm.model_torch import build

        torch.set_num_threads(1)
        self.torch, self.job = torch, job
        self.mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "tp"))
        self.models, self.opts = {}, {}
        for kind in ("fsdp4", "tp2", "tp1"):
            model = build(job["size"])
            if kind == "tp2":
                hp.parallelize_module(model, self.mesh["tp"], lm_plan(hp, attention_inputs=3))
            mesh = None if kind == "fsdp4" else self.mesh["shard"]
            for layer in model.model.layers:
                hp.fully_shard(layer, mesh=mesh)
            hp.fully_shard(model, mesh=mesh)
            self.models[kind] = model
            self.opts[kind] = torch.optim.AdamW(model.parameters(), lr=1e-4)
    def step(self, kind, ids, targets) -> float:
        torch, model = self.torch, self.models[kind]
        with hp.loss_parallel():
            logits = model(torch.from_numpy(ids))
            loss = hp.cross_entropy(logits.reshape(-1, VOCAB),
                                    torch.from_numpy(targets).reshape(-1))
        loss.backward()
        self.opts[kind].step()
        self.opts[kind].zero_grad(set_to_none=False)
        return float(loss.detach())

    def state_bytes(self, kind) -> dict:
        out = {"split": [0, 0, 0], "rest": [0, 0, 0]}  # parameters, gradients, optimizer
        opt = self.opts[kind]
        for name, p in self.models[kind].named_parameters():
            row = out["split" if _is_split(name) else "rest"]
            row[0] += _nbytes_torch(p)
            row[1] += _nbytes_torch(p.grad) if p.grad is not None else 0
            row[2] += sum(_nbytes_torch(v) for v in opt.state[p].values()
                          if hasattr(v, "numel") and v.dim() > 0)
        return out


class MindSporeModels:
    def __init__(self, job):
        import mindspore as ms
        from mindspore.experimental.optim import AdamW

        from examples.lm.model_mindspore import build

        ms.set_context(mode=ms.PYNATIVE_MODE)
        ms.runtime.launch_blocking()  # as every MindSpore phase of run.py
        self.ms = ms
        mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "tp"))
        self.models, self.opts, self.grad_fns, self.grads = {}, {}, {}, {}
        for kind in ("fsdp4", "tp2", "tp1"):
            model = build(job["size"], hp.get_platform())
            if kind == "tp2":
                hp.parallelize_module(model, mesh["tp"], lm_plan(hp, attention_inputs=3))
            dp_mesh = None if kind == "fsdp4" else mesh["shard"]
            for layer in model.model.layers:
                hp.fully_shard(layer, mesh=dp_mesh)
            hp.fully_shard(model, mesh=dp_mesh)
            params = model.trainable_params()
            self.models[kind], self.opts[kind] = model, AdamW(params, lr=1e-4)
            self.grad_fns[kind] = ms.value_and_grad(self._loss_fn(model), None, params)

    @staticmethod
    def _loss_fn(model):
        def loss(ids, targets):
            with hp.loss_parallel():
                return hp.cross_entropy(model(ids).reshape(-1, VOCAB), targets.reshape(-1))
        return loss

    def step(self, kind, ids, targets) -> float:
        ms = self.ms
        loss, grads = self.grad_fns[kind](ms.Tensor(ids.astype(np.int32)),
                                          ms.Tensor(targets.astype(np.int32)))
        self.opts[kind](grads)
        self.grads[kind] = grads
        return float(loss.asnumpy())

    def state_bytes(self, kind) -> dict:
        out = {"split": [0, 0, 0], "rest": [0, 0, 0]}
        opt = self.opts[kind]
        # MindSpore's AdamW also allocates max_exp_avg_sq (amsgrad's), used or not
        states = zip(opt.exp_avg, opt.exp_avg_sq, opt.max_exp_avg_sq)
        for (p, grad), buffers in zip(zip(opt.parameters, self.grads[kind]), states):
            row = out["split" if _is_split(p.name) else "rest"]
            row[0] += p.nbytes
            row[1] += grad.nbytes
            row[2] += sum(b.nbytes for b in buffers)
        return out


def run(job: dict, rank: int, world: int) -> dict:
    hp.init_distributed()
    platform = hp.get_platform()
    models = (TorchModels if platform.name == "torch" else MindSporeModels)(job)
    corpus = ByteCorpus()
    batches = [corpus.batch(k, job["batch"], job["seq"])
               for k in range(job["warmup"] + job["rounds"])]

    def rows(kind, array):  # fsdp4: 4 data-parallel ranks; the others: 2, tp pairs alike
        return rank_rows(array, rank, 4) if kind == "fsdp4" else rank_rows(array, rank // 2, 2)

    def stepper(kind):
        return lambda k: models.step(kind, rows(kind, batches[k][0]), rows(kind, batches[k][1]))

    result = alternate({kind: stepper(kind) for kind in ("fsdp4", "tp2")}, 0, job["warmup"],
                       job["rounds"])
    ids, targets = batches[0]
    models.step("tp1", rows("tp1", ids), rows("tp1", targets))
    result["state_bytes"] = {kind: models.state_bytes(kind) for kind in ("fsdp4", "tp2", "tp1")}
    before = hp.comm_stats().snapshot()
    models.step("tp2", rows("tp2", ids), rows("tp2", targets))
    window = hp.comm_stats().snapshot().minus(before)
    result["tp_comm"] = {f"{op}:{dim}": [rec.calls, rec.nbytes]
                         for (op, _wire, dim), rec in window.records.items() if dim == "tp"}
    hp.destroy_distributed()
    return result


if __name__ == "__main__":
    rank_main(run)
