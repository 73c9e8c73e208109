"""The communication floors of a step: its minimal collectives with no library around them.

[Note: raw collectives]
``round_fn`` takes a schedule from workload.py (the minimal collectives of one step, in
issue order and at their real sizes) and issues it through the hyper_parallel platform
primitives (``all_gather`` into a given buffer, ``reduce_scatter``, ``all_reduce``) on zero-filled flat
buffers made with ``platform.zeros``, each call synchronous, nothing else in between. One
round is one step's worth: what the step's communication costs when nothing overlaps it and
no library code runs around it. On MindSpore CPU the primitives are the platform's composed
ones (the reduce-scatter an exchange by one all-gather over two ranks, an all-reduce over
more), so this floor is the platform's, not an ideal network's.

[Note: the interleaved floor]
Back to back, the collectives run with nothing between them; in a step each sits between
two blocks' compute, and where a collective cannot overlap compute (MindSpore CPU: one
kernel pipeline) every switch costs something no library code causes: waking the
communication threads, the peer arriving late, caches the compute evicted. The
interleaved floor is the plain model (no library) stepped with the same schedule issued
from hooks where the step needs it (``unit_issuers``: a unit's forward all-gather before
its forward, a re-gather before its backward, its reduce-scatter and all-reduce after it),
each collective synchronous on these zero buffers. So ``step / interleaved floor - 1`` is
what the library adds beyond compute, the minimal communication and the cost of placing it
between the compute (analysis.py, "library cost"). Where the library overlaps
communication with compute (torch), the step can beat the floor.

Buffers are allocated once per distinct (op, size, dtype, dim) and reused by every call of
that shape: the calls are synchronous, so sharing is safe and the memory stays small.
"""

from __future__ import annotations


def round_fn(hp, schedule: list[dict], groups: dict, finish=None):
    """One round of ``schedule`` as a function: every collective issued synchronously, then
    ``finish()`` (MindSpore: wait for queued work)."""
    issue = _issuer(hp.get_platform(), schedule, groups, {})

    def one_round():
        issue()
        if finish is not None:
            finish()

    return one_round


def unit_issuers(hp, schedule: list[dict], groups: dict) -> dict:
    """``{(unit, phase): issue()}`` for the interleaved floor: each issues, synchronously,
    the entries of ``schedule`` that belong to that unit and phase (workload.py), on zero
    buffers shared the same way as ``round_fn``'s."""
    p, buffers, by_place = hp.get_platform(), {}, {}
    for entry in schedule:
        by_place.setdefault((entry["unit"], entry["phase"]), []).append(entry)
    return {place: _issuer(p, entries, groups, buffers) for place, entries in by_place.items()}


def _issuer(p, schedule: list[dict], groups: dict, buffers: dict):
    """A function that issues ``schedule``'s collectives one after the other, synchronously,
    on zero buffers from ``buffers`` (one per distinct op, size, dtype and dim, made here on
    first need)."""
    calls = []
    for entry in schedule:
        op, numel, dim = entry["op"], entry["numel"], entry["dim"]
        group, size = groups[dim]
        key = (op, numel, entry["dtype"], dim)
        if key not in buffers:
            dtype = p.dtype(entry["dtype"])
            if op == "all_gather":
                buffers[key] = (p.zeros((numel,), dtype), p.zeros((numel // size,), dtype))
            elif op == "reduce_scatter":  # one part per rank: the input read where it is
                flat, chunk = p.zeros((numel,), dtype), numel // size
                buffers[key] = ([[p.narrow(flat, 0, r * chunk, chunk)] for r in range(size)],)
            else:
                buffers[key] = (p.zeros((numel,), dtype),)
        calls.append((op, group, dim, buffers[key]))

    def issue():
        for op, group, dim, bufs in calls:
            if op == "all_gather":
                p.all_gather(bufs[1], group, dim=dim, out=bufs[0])
            elif op == "reduce_scatter":
                p.reduce_scatter(bufs[0], group, dim=dim).wait()
            else:
                p.all_reduce(bufs[0], group, op="sum", dim=dim)

    return issue


def interleave(model, issuers: dict):
    """Hook ``issuers`` (``unit_issuers``) into the plain ``model``'s blocks, unit i being
    ``model.blocks[i]``: the forward all-gathers before each block's forward, and, when the
    gradient of block i's output arrives (so before block i's backward and after block
    i+1's), unit i+1's after-backward collectives then unit i's before-backward ones.
    Returns the function that issues unit 0's after-backward collectives, for the step to
    call once backward has returned. Torch modules and MindSpore Cells take the same hooks."""
    def nothing():
        pass

    def issue(unit, phase):
        issuers.get((unit, phase), nothing)()

    def pre_hook(unit):
        def hook(module, args):
            issue(unit, "forward")
        return hook

    def post_hook(unit):
        def on_output_grad(grad):
            issue(unit + 1, "after_backward")
            issue(unit, "before_backward")

        def hook(module, args, output):
            output.register_hook(on_output_grad)
        return hook

    for unit, block in enumerate(model.blocks):
        block.register_forward_pre_hook(pre_hook(unit))
        block.register_forward_hook(post_hook(unit))
    return lambda: issue(0, "after_backward")


def interleaved_step(hp, model, schedule: list[dict], groups: dict, make_step):
    """The interleaved floor's step: ``make_step(after_backward)`` is the framework's step
    of the plain ``model``, which must call ``after_backward()`` between backward and the
    optimizer; ``schedule`` is hooked into ``model`` (``interleave``)."""
    return make_step(interleave(model, unit_issuers(hp, schedule, groups)))
