"""Pipeline schedules (torch's ``ScheduleGPipe``, ``Schedule1F1B``): the order of a step's
forwards and backwards on each stage, run over ``PipelineStage``.

[Note: the orders, torch's]
On stage ``s`` of ``S``, with ``n`` micro-batches (``F i``: forward of micro-batch i,
``B i`` its backward):

- GPipe: ``F 0 .. F n-1``, then ``B 0 .. B n-1``; every micro-batch's activations are
  alive at once.
- 1F1B: ``w = min(n, S - s)`` forwards, then one backward and one forward in turn until
  the forwards are done, then the remaining backwards; at most ``S - s`` micro-batches'
  activations are alive on stage ``s`` (``S`` on the first).

Sends are asynchronous and receives wait, so each order runs as torch's does: a stage
waits only for what its next action needs.

[Note: which forwards keep their graph]
Where the platform can run only the latest pending forward's backward (MindSpore,
``capabilities.backward_of_latest_forward_only``), the forwards that keep their graph
must nest: forward ``i`` keeps its graph only if every kept forward still pending when
``i`` starts has its backward after ``i``'s. ``graphs_to_keep`` chooses them greedily in
order; the others keep only their inputs, and their backward recomputes the forward
(platform.forward_for_later_backward). On the last stage under 1F1B each backward follows
its forward, so all keep theirs; under GPipe one forward of ``n`` does.
"""

from __future__ import annotations

from typing import Any, Callable

from hyper_parallel.pipelining.microbatch import split_args_kwargs_into_chunks, split_target
from hyper_parallel.pipelining.stage import PipelineStage
from hyper_parallel.platform import get_platform


def gpipe_order(stage_index: int, num_stages: int, n: int) -> list:
    del stage_index, num_stages
    return [("F", i) for i in range(n)] + [("B", i) for i in range(n)]


def one_f_one_b_order(stage_index: int, num_stages: int, n: int) -> list:
    warmup = min(n, num_stages - stage_index)
    order = [("F", i) for i in range(warmup)]
    for i in range(n - warmup):
        order += [("B", i), ("F", warmup + i)]
    return order + [("B", i) for i in range(n - warmup, n)]


def graphs_to_keep(order: list) -> dict:
    """``{micro-batch: keep its graph}`` for a platform whose backwards must be of the
    latest pending forward (the note above)."""
    start = {mb: i for i, (kind, mb) in enumerate(order) if kind == "F"}
    end = {mb: i for i, (kind, mb) in enumerate(order) if kind == "B"}
    kept: list = []
    keep = {}
    for mb in sorted(start, key=start.get):
        open_kept = [k for k in kept if end[k] > start[mb]]
        keep[mb] = all(end[k] > end[mb] for k in open_kept)
        if keep[mb]:
            kept.append(mb)
    return keep


class _Schedule:
    """A schedule of one stage per rank; ``order(stage_index, num_stages, n)`` is its
    order of actions."""

    order: Callable = staticmethod(gpipe_order)

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec: Any = None, kwargs_chunk_spec: Any = None,
                 output_merge_spec: Any = None, scale_grads: bool = True):
        if not isinstance(stage, PipelineStage):
            raise TypeError(f"the schedule takes an hp.pipelining.PipelineStage, got "
                            f"{type(stage).__name__}")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be at least 1, got {n_microbatches}")
        if any(spec is not None for spec in (args_chunk_spec, kwargs_chunk_spec,
                                             output_merge_spec)):
            raise ValueError("chunk and merge specs are not supported: inputs are cut on "
                             "dim 0 (torch's default); leave them None")
        if stage.num_stages != stage.group_size:
            raise ValueError(f"{type(self).__name__} runs one stage per rank: "
                             f"{stage.num_stages} stages on a pp mesh of {stage.group_size} "
                             f"ranks (num_stages must equal the pp mesh's size)")
        if stage.is_last and loss_fn is None:
            raise ValueError("the last stage computes the loss: pass loss_fn")
        self._stage, self._n_microbatches = stage, n_microbatches
        self._loss_fn, self.scale_grads = loss_fn, scale_grads

    def step(self, *args, target: Any = None, losses: list | None = None,
             return_outputs: bool = True, **kwargs) -> None:
        """One step: the first stage cuts ``args``/``kwargs`` into micro-batches, the last
        one ``target`` and appends each micro-batch's loss to ``losses``. Parameter
        gradients accumulate as one backward of the whole batch would give them."""
        del return_outputs  # outputs are not merged: the last stage's losses are
        stage, n = self._stage, self._n_microbatches
        if stage.is_last and target is None:
            raise ValueError("the last stage needs the step's target: step(target=...)")
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list, got {type(losses).__name__}")
        if stage.is_first:
            arg_mbs, kwarg_mbs = split_args_kwargs_into_chunks(args, kwargs, n)
        else:
            arg_mbs, kwarg_mbs = [()] * n, [{}] * n
        targets = split_target(target, n) if stage.is_last else [None] * n
        order = self.order(stage.stage_index, stage.num_stages, n)
        keep = (graphs_to_keep(order)
                if get_platform().capabilities.backward_of_latest_forward_only
                else dict.fromkeys(range(n), True))
        last_backward = [mb for kind, mb in order if kind == "B"][-1]
        step_losses = {}
        stage.begin_step()
        failed = True
        try:
            for kind, mb in order:
                if kind == "F":
                    step_losses[mb] = stage.forward_one_chunk(
                        mb, arg_mbs[mb], kwarg_mbs[mb], targets[mb], self._loss_fn, keep[mb])
                else:
                    stage.backward_one_chunk(mb, mb == last_backward,
                                             1.0 / n if self.scale_grads else 1.0)
            failed = False
        finally:
            stage.end_step(failed)
        if stage.is_last and losses is not None:
            losses.extend(step_losses[mb] for mb in range(n))


class ScheduleGPipe(_Schedule):
    """All forwards, then all backwards (torch's ``ScheduleGPipe``)."""

    order = staticmethod(gpipe_order)


class Schedule1F1B(_Schedule):
    """One forward, one backward in turn after a warm-up (torch's ``Schedule1F1B``)."""

    order = staticmethod(one_f_one_b_order)
