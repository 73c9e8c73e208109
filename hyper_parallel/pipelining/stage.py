"""One pipeline stage: a module, its place in the pipeline, and its micro-batches' forwards
and backwards (torch's ``PipelineStage``, written once over the platform).

[Note: what a stage does per micro-batch]
forward: take the previous stage's activation (the first stage takes the step's inputs),
run the module through ``platform.forward_for_later_backward`` (the last stage runs the
loss too), send the output on. backward: take the gradient of that output (the last stage
starts from the loss, scaled by 1 / n_microbatches as torch's ``scale_grads`` does), run
the pending backward, send the input's gradient back. What crosses, and in which order,
is p2p.py's. On MindSpore the parameter gradients each backward returns are summed into
``gradients()``; on torch they accumulate in ``.grad``.

Units (``fully_shard``) inside the stage: every backward but the step's last runs with
gradient sync off and ``is_last_backward`` off on the stage's outermost units, so the
unsharded gradients accumulate and each unit reduce-scatters once per step, in the last
backward (docs/pipelining.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hyper_parallel.device_mesh import DeviceMesh, as_device_mesh, init_device_mesh
from hyper_parallel.fully_shard import FSDPModule
from hyper_parallel.pipelining.p2p import Mailbox, decode, describe, encode, mismatch
from hyper_parallel.platform import get_platform


class PipelineStage:
    """``submodule`` as stage ``stage_index`` of ``num_stages``; ``group``: the 1-D pp
    ``DeviceMesh`` (``mesh["pp"]``; None: every rank), stage ``i`` on its pp rank
    ``i % size``. ``input_args``/``output_args``: example tensors of the stage's input and
    output per micro-batch, checked against the neighbours' (None: take what arrives)."""

    def __init__(self, submodule: Any, stage_index: int, num_stages: int, device: Any = None,
                 input_args: Any = None, output_args: Any = None, group: Any = None,
                 dw_builder: Any = None):
        if dw_builder is not None:
            raise ValueError("dw_builder (zero-bubble schedules) is not supported: leave it "
                             "None and use ScheduleGPipe, Schedule1F1B or "
                             "ScheduleInterleaved1F1B")
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index {stage_index} is not in [0, {num_stages})")
        mesh = _pp_mesh(group)
        size, pp_rank = mesh.size(), mesh.get_local_rank(0)
        if num_stages % size:
            raise ValueError(f"{num_stages} stages do not fit the pp mesh of {size} ranks: "
                             f"num_stages must be a multiple of the mesh's size")
        if stage_index % size != pp_rank:
            raise ValueError(f"stage {stage_index} belongs on pp rank {stage_index % size} "
                             f"(stage i on pp rank i % {size}), not on this rank (pp rank "
                             f"{pp_rank})")
        self.submod, self.stage_index, self.num_stages = submodule, stage_index, num_stages
        self.device, self.group_size, self.group_rank = device, size, pp_rank
        self.mesh = mesh
        self.input_args, self.output_args = _single(input_args), _single(output_args)
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self._units: list = []   # found at each step's start: a stage may be sharded after
        self._pending: dict = {}
        self._grads: list | None = None
        self._started = False

    def rank_of(self, stage_index: int) -> int:
        return stage_index % self.group_size

    # ------------------------------------------------------------------ per step
    def begin_step(self, training: bool = True) -> None:
        """``training``: a step with backwards, which starts this step's gradients."""
        self._pending.clear()
        self._started = False
        self._units = _outermost_units(self.submod)
        if training:
            self._grads = None

    def end_step(self, failed: bool) -> None:
        """After a failure, drop the forwards still pending (and what the framework's
        autograd holds of them) so that the next step starts clean."""
        if failed and self._pending:
            get_platform().discard_aborted_autograd()
        self._pending.clear()

    def gradients(self) -> list:
        """This step's gradients of the stage's trainable parameters, in their order: on
        MindSpore the sum of what the step's backwards returned (what an optimizer
        takes), on torch each parameter's ``.grad``."""
        p = get_platform()
        if p.capabilities.returns_grads_from_backward:
            if self._grads is None:
                raise RuntimeError("no backward ran on this stage since its last step: call "
                                   "schedule.step(...) first")
            return list(self._grads)
        return [p.param_grad(q) for q in _trainable(self.submod)]

    # ------------------------------------------------------------------ micro-batches
    def forward_one_chunk(self, mail: Mailbox, mb: int, args: tuple, kwargs: dict,
                          target: Any, loss_fn: Any, keep_graph: bool | None) -> Any:
        """Forward of micro-batch ``mb``; the loss on the last stage, else None.
        ``keep_graph`` None: no backward follows (``eval``), nothing is recorded."""
        p = get_platform()
        first_of_step, self._started = not self._started, True
        i = self.stage_index
        if self.is_first:
            inputs, fn = [], (lambda: self.submod(*args, **kwargs))
        else:
            if first_of_step:
                self._answer_header(mail)
            inputs, fn = [mail.get(self.rank_of(i - 1), ("act", i - 1, mb))], self.submod
        if self.is_last:
            module = fn
            fn = (lambda *xs: loss_fn(module(*xs), target))
        if keep_graph is None:
            with p.no_grad():
                output = fn(*inputs)
        else:
            output, backward = p.forward_for_later_backward(self.submod, fn, inputs,
                                                            keep_graph)
            self._pending[mb] = (output, backward)
        if self.is_last:
            return output
        if first_of_step:
            self._send_header(mail, output)
        mail.send(self.rank_of(i + 1), ("act", i, mb), output)
        return None

    def backward_one_chunk(self, mail: Mailbox, mb: int, last_backward: bool,
                           loss_scale: float) -> None:
        """Backward of micro-batch ``mb``; ``last_backward``: the step's last on this
        stage (the units reduce their gradients in it)."""
        p = get_platform()
        output, backward = self._pending.pop(mb)
        i = self.stage_index
        if self.is_last:
            grad_output = p.cast(p.from_numpy(np.full(p.shape(output), loss_scale, np.float32)),
                                 p.dtype_of(output))
        else:
            grad_output = mail.get(self.rank_of(i + 1), ("grad", i + 1, mb))
        for unit in self._units:
            unit.set_requires_gradient_sync(last_backward)
            unit.set_is_last_backward(last_backward)
        input_grads, param_grads = backward(grad_output)
        if param_grads is not None:
            self._grads = (param_grads if self._grads is None
                           else [p.add(a, b) for a, b in zip(self._grads, param_grads)])
        if not self.is_first:
            mail.send(self.rank_of(i - 1), ("grad", i, mb), input_grads[0])

    # ------------------------------------------------------------------ the shape check
    def _send_header(self, mail: Mailbox, output: Any) -> None:
        i, mine = self.stage_index, describe(output)
        ok = self.output_args is None or mine == describe(self.output_args)
        mail.send(self.rank_of(i + 1), ("hdr", i), encode(ok, mine))
        verdict, theirs = decode(mail.get(self.rank_of(i + 1), ("reply", i)))
        if not ok:
            raise ValueError(mismatch(i, i, mine, describe(self.output_args),
                                      "its output_args"))
        if not verdict:
            raise ValueError(mismatch(i, i + 1, mine, theirs, "the input_args"))

    def _answer_header(self, mail: Mailbox) -> None:
        i = self.stage_index
        ok, theirs = decode(mail.get(self.rank_of(i - 1), ("hdr", i - 1)))
        wanted = theirs if self.input_args is None else describe(self.input_args)
        mail.send(self.rank_of(i - 1), ("reply", i - 1), encode(wanted == theirs, wanted))
        if not ok:
            raise ValueError(f"stage {i - 1}'s output does not match its own output_args "
                             f"(stage {i - 1} names both)")
        if wanted != theirs:
            raise ValueError(mismatch(i - 1, i, theirs, wanted, "the input_args"))


def _pp_mesh(group: Any) -> DeviceMesh:
    p = get_platform()
    if group is None:
        return init_device_mesh(p.device_type(), (p.world_size(),), mesh_dim_names=("pp",))
    try:
        mesh = as_device_mesh(group)  # ours, or torch's DeviceMesh wrapped
    except TypeError:
        mesh = None
    if mesh is None or mesh.ndim != 1:
        raise TypeError(f"group must be a 1-D DeviceMesh (hp's, or torch's on torch: e.g. "
                        f"mesh['pp']) or None, got {type(group).__name__}")
    return mesh


def _single(example: Any) -> Any:
    if isinstance(example, (tuple, list)):
        if len(example) != 1:
            raise ValueError(f"a stage takes and returns one tensor between stages; got "
                             f"{len(example)} example tensors")
        return example[0]
    return example


def _outermost_units(module: Any) -> list:
    """The units of ``module``'s tree that no other unit of it holds."""
    named = [(n, m) for n, m in get_platform().named_modules(module) if isinstance(m, FSDPModule)]
    return [m for n, m in named
            if not any(o != n and (o == "" or n.startswith(o + ".")) for o, _ in named)]


def _trainable(module: Any) -> list:
    p = get_platform()
    return [q for _, m in p.named_modules(module) for _, q in p.direct_params(m)
            if p.param_requires_grad(q)]
