"""Rank side of tests/test_fsdp2_surface.py, continued (torch only): torchtitan's pattern of
activation checkpointing with a chunked loss, and FSDP2's own policy objects (run by
``fsdp2_surface_scenarios.run_all``)."""

from __future__ import annotations

import numpy as np

import hyper_parallel as hp
from tests.fsdp2_surface_scenarios import (
    D_HID, D_IN, D_OUT, GLOBAL_BATCH, STEPS, _attempt, _build_spare, _local)
from tests.kit import make_batches
from tests.scenarios import _named


def _build_checkpointed(kit, shard=None):
    """torch: torchtitan's pattern. Pre-norm residual blocks (an RMSNorm-like scale, so
    the recomputation multiplies by a parameter), each wrapped by checkpoint_wrapper and
    then (``shard``) fully_shard applied to the wrapper; the head a unit of its own; the
    model's forward stops before the head."""
    torch, nn = kit.torch, kit.nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    class Block(nn.Module):
        def __init__(self, dim, hidden):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(dim))
            self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

        def forward(self, x):
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale
            return x + self.down(torch.relu(self.up(h)))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(D_IN, D_HID)
            self.blocks = nn.ModuleList([Block(D_HID, 41) for _ in range(3)])
            self.head = nn.Linear(D_HID, D_OUT)

        def forward(self, x):
            x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            return x

    model = Model()
    kit.load(model, 0)
    if shard is not None:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
            shard(model.blocks[i])
        shard(model.head)
        shard(model)
    return model


def _chunked_step(kit, model, opt, x, y) -> float:
    """torchtitan's chunked loss: the head's backward alone (which ends a backward, so
    every unit reshards), then the trunk's with the gradient it produced."""
    h = model(kit.tensor(x))
    hd = h.detach().requires_grad_()
    loss = ((model.head(hd) - kit.tensor(y)) ** 2).mean()
    loss.backward()
    h.backward(hd.grad)
    opt.step()
    opt.zero_grad()
    return loss.item()


def run_checkpointed_chunked_loss(kit) -> dict:
    """torch: blocks under checkpoint_wrapper with fully_shard on the wrapper, and the loss
    through a head-only backward first: the recomputation in the trunk's backward reads
    the re-gathered parameters. At parity with the reference and equal to FSDP2."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out = {"losses": [], "ref_losses": [], "their_losses": []}
    model = _build_checkpointed(kit, hp.fully_shard)
    ref = _build_checkpointed(kit)
    theirs = _build_checkpointed(kit, torch_fully_shard)
    opts = [kit.optimizer(kit.params(m)) for m in (model, ref, theirs)]
    for x, y in make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=61):
        out["losses"].append(_chunked_step(kit, model, opts[0], x[_local()], y[_local()]))
        out["ref_losses"].append(_chunked_step(kit, ref, opts[1], x, y))
        out["their_losses"].append(_chunked_step(kit, theirs, opts[2], x[_local()], y[_local()]))
    full = hp.gather_full_state_dict(model)
    unwrapped = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in full.items()}
    out["param_diff"] = max(float(np.abs(unwrapped[k] - kit.to_numpy(v)).max())
                            for k, v in _named(kit, ref).items())
    return out


# ---------------------------------------------------------------------------- FSDP2's policies
def _policy_step(kit, model, opt, x, y) -> tuple:
    out = model(kit.tensor(x))
    loss = ((out.float() - kit.tensor(y)) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item(), str(out.dtype)


def run_torch_policies(kit) -> dict:
    """torch: bf16 compute, fp32 reduction, fp32 outputs from the root, input casting off on
    block 1, offloading (CPUOffloadPolicy on the root, OffloadPolicy on the blocks), given
    as hyper_parallel's policies, as FSDP2's policy objects to hp.fully_shard, and as the
    same objects to FSDP2: each run's losses, output dtypes and parameters; FSDP2's
    objects converted by hp.fully_shard; and the TypeError for a policy of the wrong kind."""
    import torch
    from torch.distributed import fsdp

    from hyper_parallel.fully_shard.policy import as_policy

    def policies(mp_class, offload_class, cpu_offload_class, bf16, fp32) -> list:
        """(mp_policy, offload_policy) of block 0, block 1 and the root."""
        return [(mp_class(param_dtype=bf16, reduce_dtype=fp32), offload_class()),
                (mp_class(param_dtype=bf16, reduce_dtype=fp32, cast_forward_inputs=False),
                 offload_class()),
                (mp_class(param_dtype=bf16, reduce_dtype=fp32, output_dtype=fp32),
                 cpu_offload_class(pin_memory=False))]

    ours = policies(hp.MixedPrecisionPolicy, hp.OffloadPolicy, hp.CPUOffloadPolicy,
                    "bfloat16", "float32")
    theirs = policies(fsdp.MixedPrecisionPolicy, fsdp.OffloadPolicy, fsdp.CPUOffloadPolicy,
                      torch.bfloat16, torch.float32)
    out = {}
    for name, shard, units in (("ours", hp.fully_shard, ours),
                               ("torch_policies", hp.fully_shard, theirs),
                               ("fsdp2", fsdp.fully_shard, theirs)):
        model = _build_spare(kit)
        kit.load(model, 0)
        for module, (mp, offload) in zip([*model.blocks, model], units):
            shard(module, mp_policy=mp, offload_policy=offload)
        opt = kit.optimizer(kit.params(model), kind="adamw")
        steps = [_policy_step(kit, model, opt, x[_local()], y[_local()])
                 for x, y in make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=71)]
        out[name] = {"losses": [loss for loss, _ in steps],
                     "out_dtypes": sorted({dtype for _, dtype in steps}),
                     "params": {k: kit.to_numpy(v.full_tensor())
                                for k, v in model.named_parameters()}}
    # hyper_parallel's equivalents, with torch's dtype objects as FSDP2's policies hold them
    same = policies(hp.MixedPrecisionPolicy, hp.OffloadPolicy, hp.CPUOffloadPolicy,
                    torch.bfloat16, torch.float32)
    describe = hp.get_platform().option_from_native
    out["converted"] = [as_policy(their, type(our), "policy", describe) == our
                        for their_pair, our_pair in zip(theirs, same)
                        for their, our in zip(their_pair, our_pair)]
    out["wrong_kind"] = _attempt(lambda: hp.fully_shard(
        _build_spare(kit), offload_policy=fsdp.MixedPrecisionPolicy()))
    return out
