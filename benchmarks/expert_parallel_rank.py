"""One rank of an expert-parallel benchmark launch (expert_parallel.py), 4 ranks, one framework.

The example language model with experts (examples/lm, ``--moe``: 4 experts per layer,
top-2) is built three ways in the same processes by the example's own trainer, from the
same values:

- ``fsdp4``: fully_shard over the 4 ranks (every layer, the experts inside it, and the root);
- ``ep2``: the experts split over the ``ep`` dim of an (efsdp 2, ep 2) mesh by
  ``hp.ExpertParallel`` and sharded over ``efsdp``, the rest over the 4 ranks
  (examples/lm/expert_parallel.py);
- ``ep1``: fully_shard over the ``efsdp`` ranks of 2, no expert split: the experts' data-
  parallel degree of ``ep2``, for the memory comparison.

``fsdp4`` and ``ep2`` are stepped (AdamW, each rank its own rows of the same global batch)
in alternated rounds, one step each, order reversed every round, after ``warmup``
rounds. After one step of each model the rank reports the bytes of its parameters and
optimizer state, split into the experts and the rest. One more ``ep2`` step is counted by
``hp.comm_stats`` (the all-to-alls on the ``ep`` dim), with the per-expert counts each
layer's experts were given on this rank, from which the parent derives the bytes the
routing implies.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hyper_parallel as hp  # noqa: E402
from benchmarks.measure import alternate, rank_main  # noqa: E402
from examples.lm.data import ByteCorpus, rank_rows  # noqa: E402
from examples.lm.expert_parallel import expert_meshes  # noqa: E402


def _state_bytes(platform, trainer) -> dict:
    """``{"experts": [parameters, optimizer], "rest": [...]}`` of this rank, in bytes."""
    out = {"experts": [0, 0], "rest": [0, 0]}
    model, opt = trainer.model, trainer.optimizer
    if platform.name == "torch":
        for name, p in model.named_parameters():
            row = out["experts" if ".experts." in name else "rest"]
            local = p.to_local() if hasattr(p, "to_local") else p
            row[0] += local.numel() * local.element_size()
            row[1] += sum((v.to_local() if hasattr(v, "to_local") else v).nbytes
                          for v in opt.state[p].values() if getattr(v, "dim", lambda: 0)())
        return out
    for p, *buffers in zip(opt.parameters, opt.exp_avg, opt.exp_avg_sq, opt.max_exp_avg_sq):
        row = out["experts" if ".experts." in p.name or p.name.startswith(
            ("gate_proj", "up_proj", "down_proj")) else "rest"]
        row[0] += p.nbytes
        row[1] += sum(b.nbytes for b in buffers)
    return out


def _counts_seen(platform, model) -> list:
    """Per layer, the counts its experts are given in each call (before any dispatch)."""
    seen = []
    for layer in model.model.layers:
        calls = []
        platform.register_forward_hooks(
            layer.mlp.experts,
            lambda mod, args, kwargs, calls=calls: calls.append(
                [int(c) for c in platform.to_numpy(args[1])]),
            lambda mod, args, kwargs, output: None)
        seen.append(calls)
    return seen


def run(job: dict, rank: int, world: int) -> dict:
    hp.init_distributed()
    platform = hp.get_platform()
    if platform.name == "torch":
        import torch

        from examples.lm.trainer_torch import Trainer
        torch.set_num_threads(1)
    else:
        import mindspore as ms

        from examples.lm.trainer_mindspore import Trainer
        ms.runtime.launch_blocking()  # as every MindSpore phase of run.py
    mesh, every = expert_meshes(hp, platform.device_type(), world, 2)
    policy = hp.MixedPrecisionPolicy()

    def trainer(fsdp_mesh, ep_mesh):
        return Trainer(job["size"], fsdp_mesh, policy, False, 1e-4, 0.0, 1e9, moe=True,
                       ep_meshes=(ep_mesh, every))

    trainers = {"fsdp4": trainer(None, None), "ep2": trainer(None, mesh),
                "ep1": trainer(mesh["efsdp"], None)}
    seen = _counts_seen(platform, trainers["ep2"].model)
    corpus = ByteCorpus()
    batches = [corpus.batch(k, job["batch"], job["seq"])
               for k in range(job["warmup"] + job["rounds"])]

    def rows(kind, array):  # ep1: its 2 data-parallel ranks; the others: all 4
        return rank_rows(array, rank // 2, 2) if kind == "ep1" else rank_rows(array, rank, 4)

    def stepper(kind):
        return lambda k: trainers[kind].step(rows(kind, batches[k][0]),
                                             rows(kind, batches[k][1]))[0]

    result = alternate({kind: stepper(kind) for kind in ("fsdp4", "ep2")}, 0, job["warmup"],
                       job["rounds"])
    ids, targets = batches[0]
    trainers["ep1"].step(rows("ep1", ids), rows("ep1", targets))
    result["state_bytes"] = {kind: _state_bytes(platform, t) for kind, t in trainers.items()}
    for calls in seen:
        calls.clear()
    before = hp.comm_stats().snapshot()
    trainers["ep2"].step(rows("ep2", ids), rows("ep2", targets))
    window = hp.comm_stats().snapshot().minus(before)
    result["all_to_all"] = [window.calls("all_to_all", dim="ep"),
                            window.nbytes("all_to_all", dim="ep")]
    result["counts"] = [calls[0] for calls in seen]
    hp.destroy_distributed()
    return result


if __name__ == "__main__":
    rank_main(run)
