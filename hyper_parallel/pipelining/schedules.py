"""Pipeline schedules (torch's ``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``): the order of a step's forwards and backwards on each pp
rank, run over its ``PipelineStage``\\ s.

[Note: the orders, torch's]
With ``n`` micro-batches, ``S`` stages, ``P`` pp ranks (``F s i``: forward of
micro-batch i on stage s, ``B s i`` its backward):

- GPipe (one stage per rank): ``F 0 .. F n-1``, then ``B 0 .. B n-1``; every
  micro-batch's activations are alive at once.
- 1F1B (one stage per rank): ``w = min(n, S - s)`` forwards, then a backward and a
  forward in turn until the forwards are done, then the remaining backwards; at most
  ``S - s`` micro-batches' activations are alive on stage ``s``.
- Interleaved 1F1B (``L`` stages per rank, stage ``s`` on rank ``s % P``): micro-batches
  in rounds of ``m = n / max(1, n // P)``; rank ``r`` warms up with
  ``w = min((L - 1) m + 2 (P - 1 - r), n L)`` forwards, then a forward and a backward in
  turn, then the remaining backwards; the k-th forward is on local stage ``(k // m) % L``,
  the k-th backward of the steady phase on local stage ``L - 1 - ((k - w) // m) % L``.

Each rank computes every rank's order, from which p2p.py knows what each peer sends it.

[Note: which forwards keep their graph]
Where the platform can run only the latest pending forward's backward (MindSpore,
``capabilities.backward_of_latest_forward_only``), the forwards that keep their graph
must nest: a forward keeps it only if every kept forward still pending when it starts has
its backward after this one's. ``graphs_to_keep`` chooses them greedily in order; the
others keep only their inputs, and their backward recomputes the forward
(platform.forward_for_later_backward). 1F1B's last stage keeps every forward's graph
(each backward follows its forward); GPipe keeps one in ``n``.
"""

from __future__ import annotations

from typing import Any, Callable

from hyper_parallel.pipelining.microbatch import split_args_kwargs_into_chunks, split_target
from hyper_parallel.pipelining.p2p import Mailbox, messages_sent
from hyper_parallel.pipelining.stage import PipelineStage
from hyper_parallel.platform import get_platform


def gpipe_order(stage: int, num_stages: int, n: int) -> list:
    del num_stages
    return [(stage, "F", i) for i in range(n)] + [(stage, "B", i) for i in range(n)]


def one_f_one_b_order(stage: int, num_stages: int, n: int) -> list:
    warmup = min(n, num_stages - stage)
    order = [(stage, "F", i) for i in range(warmup)]
    for i in range(n - warmup):
        order += [(stage, "B", i), (stage, "F", warmup + i)]
    return order + [(stage, "B", i) for i in range(n - warmup, n)]


def interleaved_order(rank: int, ranks: int, local: int, n: int) -> list:
    per_round = n // max(1, n // ranks)
    warmup = min((local - 1) * per_round + 2 * (ranks - 1 - rank), n * local)
    total = n * local
    fwd_mb, bwd_mb, order = {}, {}, []

    def forward(k):
        stage = ((k // per_round) % local) * ranks + rank
        fwd_mb[stage] = fwd_mb.get(stage, -1) + 1
        order.append((stage, "F", fwd_mb[stage]))

    def backward(k):
        stage = (local - 1 - ((k - warmup) // per_round) % local) * ranks + rank
        bwd_mb[stage] = bwd_mb.get(stage, -1) + 1
        order.append((stage, "B", bwd_mb[stage]))

    for k in range(warmup):
        forward(k)
    for k in range(warmup, total):
        forward(k)
        backward(k)
    for k in range(total, total + warmup):
        backward(k)
    return order


def graphs_to_keep(order: list) -> dict:
    """``{(stage, micro-batch): keep its graph}`` for a platform whose backwards must be of
    the latest pending forward (the note above)."""
    start = {(s, mb): i for i, (s, kind, mb) in enumerate(order) if kind == "F"}
    end = {(s, mb): i for i, (s, kind, mb) in enumerate(order) if kind == "B"}
    kept, keep = [], {}
    for key in sorted(start, key=start.get):
        open_kept = [k for k in kept if end[k] > start[key]]
        keep[key] = all(end[k] > end[key] for k in open_kept)
        if keep[key]:
            kept.append(key)
    return keep


class _Schedule:
    """Runs ``stages`` (this rank's, in stage order) through the rank's order of actions."""

    def __init__(self, stages: list, n_microbatches: int, loss_fn: Callable | None,
                 args_chunk_spec: Any, kwargs_chunk_spec: Any, output_merge_spec: Any,
                 scale_grads: bool):
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise TypeError(f"the schedule takes hp.pipelining.PipelineStage objects, got "
                            f"{[type(s).__name__ for s in stages]}")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be at least 1, got {n_microbatches}")
        if any(spec is not None for spec in (args_chunk_spec, kwargs_chunk_spec,
                                             output_merge_spec)):
            raise ValueError("chunk and merge specs are not supported: inputs are cut on "
                             "dim 0 (torch's default); leave them None")
        first = stages[0]
        if any((s.num_stages, s.group_size) != (first.num_stages, first.group_size)
               for s in stages):
            raise ValueError("a schedule's stages must share num_stages and the pp group")
        if len(stages) * first.group_size != first.num_stages:
            raise ValueError(f"{type(self).__name__}: {first.num_stages} stages on a pp mesh "
                             f"of {first.group_size} ranks with {len(stages)} stage(s) per "
                             f"rank: num_stages must be the mesh's size times the stages "
                             f"given to each rank")
        if any(s.is_last for s in stages) and loss_fn is None:
            raise ValueError("the last stage computes the loss: pass loss_fn")
        self._stages = {s.stage_index: s for s in stages}
        self._n_microbatches, self._loss_fn, self.scale_grads = n_microbatches, loss_fn, scale_grads
        self._has_backward = True

    def _rank_order(self, rank: int) -> list:
        raise NotImplementedError

    def _actions(self, rank: int) -> list:
        order = self._rank_order(rank)
        return order if self._has_backward else [a for a in order if a[1] == "F"]

    def eval(self, *args, target: Any = None, losses: list | None = None, **kwargs) -> None:
        """``step`` with forwards only (no graph recorded, no gradient): the losses of a
        held-out batch, as torch's ``eval``."""
        self._has_backward = False
        try:
            self.step(*args, target=target, losses=losses, **kwargs)
        finally:
            self._has_backward = True

    def step(self, *args, target: Any = None, losses: list | None = None,
             return_outputs: bool = True, loss_kwargs: dict | None = None, **kwargs) -> None:
        """One step: the first stage cuts ``args``/``kwargs`` into micro-batches, the last
        one ``target`` and appends each micro-batch's loss (``loss_fn(output, target,
        **loss_kwargs)``) to ``losses``. Parameter gradients accumulate as one backward of
        the whole batch would give them."""
        del return_outputs  # outputs are not merged: the last stage's losses are
        n = self._n_microbatches
        some = next(iter(self._stages.values()))
        has_first = 0 in self._stages
        has_last = some.num_stages - 1 in self._stages
        if has_last and target is None:
            raise ValueError("the last stage needs the step's target: step(target=...)")
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list, got {type(losses).__name__}")
        arg_mbs, kwarg_mbs = (split_args_kwargs_into_chunks(args, kwargs, n) if has_first
                              else ([()] * n, [{}] * n))
        targets = split_target(target, n) if has_last else [None] * n
        order = self._actions(some.group_rank)
        if not self._has_backward:
            keep = dict.fromkeys(((s, mb) for s, kind, mb in order), None)
        elif get_platform().capabilities.backward_of_latest_forward_only:
            keep = graphs_to_keep(order)
        else:
            keep = dict.fromkeys(((s, mb) for s, kind, mb in order), True)
        loss_fn = self._loss_fn
        if loss_kwargs:
            loss_fn = (lambda output, target: self._loss_fn(output, target, **loss_kwargs))
        last_backward = {s: mb for s, kind, mb in order if kind == "B"}
        mail = Mailbox(some.mesh.get_group(0), some.mesh.mesh_dim_names[0], some.group_rank,
                       self._expected(some))
        step_losses, failed = {}, True
        for stage in self._stages.values():
            stage.begin_step(self._has_backward)
        try:
            for s, kind, mb in order:
                stage = self._stages[s]
                if kind == "F":
                    step_losses[mb] = stage.forward_one_chunk(
                        mail, mb, arg_mbs[mb], kwarg_mbs[mb], targets[mb], loss_fn,
                        keep[(s, mb)])
                else:
                    stage.backward_one_chunk(mail, mb, mb == last_backward[s],
                                             1.0 / n if self.scale_grads else 1.0)
            failed = False
        finally:
            mail.finish()
            for stage in self._stages.values():
                stage.end_step(failed)
        if has_last and losses is not None:
            losses.extend(step_losses[mb] for mb in range(n))

    def _expected(self, stage: PipelineStage) -> dict:
        """``{peer: what it sends this rank, in its order}``."""
        me, expected = stage.group_rank, {}
        for peer in range(stage.group_size):
            sent = messages_sent(self._actions(peer), stage.rank_of, stage.num_stages)
            expected[peer] = [msg for dst, msg in sent if dst == me]
        return expected


class _SingleStage(_Schedule):
    order: Callable = staticmethod(gpipe_order)

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec: Any = None, kwargs_chunk_spec: Any = None,
                 output_merge_spec: Any = None, scale_grads: bool = True):
        super().__init__([stage], n_microbatches, loss_fn, args_chunk_spec,
                         kwargs_chunk_spec, output_merge_spec, scale_grads)

    def _rank_order(self, rank: int) -> list:
        some = next(iter(self._stages.values()))
        return self.order(rank, some.num_stages, self._n_microbatches)


class ScheduleGPipe(_SingleStage):
    """All forwards, then all backwards (torch's ``ScheduleGPipe``)."""

    order = staticmethod(gpipe_order)


class Schedule1F1B(_SingleStage):
    """One forward, one backward in turn after a warm-up (torch's ``Schedule1F1B``)."""

    order = staticmethod(one_f_one_b_order)


class ScheduleInterleaved1F1B(_Schedule):
    """1F1B over several stages per rank (torch's ``ScheduleInterleaved1F1B``)."""

    def __init__(self, stages: list, n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec: Any = None, kwargs_chunk_spec: Any = None,
                 output_merge_spec: Any = None, scale_grads: bool = True):
        super().__init__(list(stages), n_microbatches, loss_fn, args_chunk_spec,
                         kwargs_chunk_spec, output_merge_spec, scale_grads)
        ranks = next(iter(self._stages.values())).group_size
        rounds = max(1, n_microbatches // ranks)
        if n_microbatches % rounds:
            raise ValueError(f"Interleaved 1F1B needs n_microbatches ({n_microbatches}) to be "
                             f"a multiple of the number of rounds ({rounds} = "
                             f"n_microbatches // {ranks} pp ranks)")

    def _rank_order(self, rank: int) -> list:
        some = next(iter(self._stages.values()))
        return interleaved_order(rank, some.group_size, len(self._stages),
                                 self._n_microbatches)
