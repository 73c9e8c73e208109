"""mindspore.jit and sharded cells.

A sharded cell's hooks attach the full parameters, gathered in PyNative, as the cell's
attributes before each call of ``construct``. A ``construct`` compiled by ``mindspore.jit``
does not compute with them, and trains wrong from the second step without an error. There
is no hook into the graph build, and a construct can be jitted after ``fully_shard`` as
well as before, so the check runs in the pre-forward hook, at the first
call, before anything is gathered. (``mindspore.jit(cell)`` returns a compiled bound
``construct`` that skips the cell's hooks altogether, like calling ``construct`` directly.)
"""

from __future__ import annotations


def refuse_jitted_construct(cell) -> None:
    """Raise if ``cell.construct`` is compiled by mindspore.jit (see the module note)."""
    if getattr(cell.construct, "__wrapped_by_jit__", False):
        raise RuntimeError(
            f"fully_shard: {type(cell).__name__}.construct is compiled with mindspore.jit, "
            f"which does not work on a sharded cell (the compiled graph does not read the full "
            f"parameters fully_shard gathers for each call). Leave the sharded cell's "
            f"construct un-jitted and jit the computation inside it instead: a function "
            f"that takes the parameters as arguments, e.g. "
            f"mindspore.jit(fn)(x, self.dense.weight, self.dense.bias)")
