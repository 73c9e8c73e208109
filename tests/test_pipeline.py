"""torch code written around FSDP2 drives hyper_parallel's units as it drives FSDP2's (torch
only): a unit is an instance of torch's ``FSDPModule`` (docs/api.md, "Pipelines").

- torch's pipeline parallelism (tests/pipeline_scenarios.py, the shared 4-rank launch,
  mesh pp 2 x dp 2): ``ScheduleGPipe``, ``Schedule1F1B`` with bfloat16 parameters and
  float32 reduction, ``ScheduleInterleaved1F1B`` with two stages per rank, and
  ``Schedule1F1B`` under HSDP (the dp ranks replicate), gradients clipped across stages:
  losses, clipped norms and parameters bitwise FSDP2's; one reduce-scatter (HSDP: one
  all-reduce) per unit per step (``hp.track_comms``), as many reduce-scatters and
  all-reduces as FSDP2 issues (counted for both by one c10d dispatch counter, which also
  agrees with ``hp.track_comms`` for ours), as many all-gathers per step under every
  schedule, and the schedule's unshard/reshard actions reaching the units as often as
  FSDP2's;
- Lightning Fabric 2.6.6's ``ModelParallelStrategy`` with ``hp.fully_shard`` in its
  ``parallelize_fn`` (tests/lightning_scenarios.py, the shared 2-rank launch; skipped
  where lightning-fabric is not installed: the ``lightning`` extra): under
  ``no_backward_sync`` as many ``set_requires_gradient_sync`` calls reach the units as
  reach FSDP2's, and one reduce-scatter per unit per step, losses and parameters bitwise;
- the rest of torch's code that finds a unit (tests/torch_interop_scenarios.py, the shared
  2-rank launch): torch's ``fully_shard`` on a unit stops with torch's "already been
  applied" error and changes nothing, over a model of units it leaves them alone and the
  model trains bitwise like one all FSDP2, code that reads FSDP2's internal state
  (``FSDPMemTracker``) gets a NotImplementedError naming the unit, FSDP2's
  ``_set_unshard_async_op`` is accepted, a slice of a sharded ``nn.Sequential`` is a plain one (as FSDP2's), torch's
  distributed state-dict helpers save and load a unit's model, and the end of a pipeline
  step whose backwards bypassed the units (torch's zero-bubble schedules) is a
  RuntimeError naming them; and ``hp.fully_shard`` on a module FSDP2 sharded, or over
  one, is a ValueError naming it, model unchanged.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from tests import shared_launch
from tests.pipeline_scenarios import SCHEDULES

HAS_LIGHTNING = importlib.util.find_spec("lightning_fabric") is not None
NO_LIGHTNING = 'lightning-fabric is not installed (pip install -e ".[lightning]")'

shared_launch.register(__name__, "pipeline_schedules", 4, "tests.pipeline_scenarios:run_all",
                       backends=("torch",), timeout_s=300)
shared_launch.register(__name__, "torch_interop", 2, "tests.torch_interop_scenarios:run_all",
                       backends=("torch",))
if HAS_LIGHTNING:
    shared_launch.register(__name__, "lightning_no_sync", 2,
                           "tests.lightning_scenarios:run_no_backward_sync",
                           backends=("torch",), timeout_s=300)


def _schedule(name: str) -> list:
    return [(r[name]["hp"], r[name]["fsdp2"])
            for r in shared_launch.results("pipeline_schedules", "torch")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_trains_bitwise_like_fsdp2(name):
    for rank, (ours, theirs) in enumerate(_schedule(name)):
        assert ours["losses"] == theirs["losses"], f"rank {rank}: losses"
        assert ours["norms"] == theirs["norms"], f"rank {rank}: clipped norms"
        assert ours["params"].keys() == theirs["params"].keys()
        for fqn, value in theirs["params"].items():
            np.testing.assert_array_equal(ours["params"][fqn], value, err_msg=f"rank {rank}: {fqn}")
    last_stage = [ours for ours, _ in _schedule(name) if ours["losses"][0]]
    assert len(last_stage) == 2, "the two dp ranks of the last stage report their losses"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_reduces_once_per_unit_per_step_as_fsdp2(name):
    # HSDP here replicates over the dp ranks (shard size 1): no reduce-scatter, an all-reduce
    per_unit = "all_reduce" if SCHEDULES[name][3] else "reduce_scatter"
    for rank, (ours, theirs) in enumerate(_schedule(name)):
        for step, (counted, tracked, fsdp2) in enumerate(zip(
                ours["collectives"], ours["hp_collectives"], theirs["collectives"])):
            where = f"rank {rank}, step {step}"
            assert tracked.get(per_unit) == ours["units"], where
            assert counted.get("reduce_scatter") == tracked.get("reduce_scatter"), where
            assert counted.get("all_gather") == tracked.get("all_gather"), where
            for op in ("reduce_scatter", "all_reduce"):
                assert counted.get(op, 0) == fsdp2.get(op, 0), f"{where}: {op}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_all_gathers_as_often_as_fsdp2(name):
    """The kept set (fully_shard/state.py, "one kept set"): a later microbatch's backward
    copies its full parameters instead of gathering them; a backward prefetch re-gathers
    the ones its microbatch's forward used (fully_shard/iteration.py, "implicit prefetch")."""
    for rank, (ours, theirs) in enumerate(_schedule(name)):
        assert [c.get("all_gather", 0) for c in ours["collectives"]] == \
               [c.get("all_gather", 0) for c in theirs["collectives"]], f"rank {rank}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_unshards_and_reshards_units_as_fsdp2(name):
    for rank, (ours, theirs) in enumerate(_schedule(name)):
        assert ours["unshard_reshard"] == theirs["unshard_reshard"], f"rank {rank}"
    if SCHEDULES[name][1] > 1:  # the looped schedules issue UNSHARD/RESHARD actions
        assert all(calls > 0 for ours, _ in _schedule(name)
                   for calls in np.ravel(ours["unshard_reshard"]))


@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAS_LIGHTNING, reason=NO_LIGHTNING)
def test_lightning_no_backward_sync_reaches_units_as_fsdp2s():
    for rank, result in enumerate(shared_launch.results("lightning_no_sync", "torch")):
        ours, theirs = result["hp"], result["fsdp2"]
        assert ours["losses"] == theirs["losses"], f"rank {rank}"
        for fqn, value in theirs["params"].items():
            np.testing.assert_array_equal(ours["params"][fqn], value, err_msg=f"rank {rank}: {fqn}")
        assert ours["sync_calls"] == theirs["sync_calls"] and min(ours["sync_calls"]) > 0
        for step, (counted, tracked, fsdp2) in enumerate(zip(
                ours["collectives"], ours["hp_collectives"], theirs["collectives"])):
            assert tracked.get("reduce_scatter") == ours["units"], f"rank {rank}, step {step}"
            assert counted == fsdp2, f"rank {rank}, step {step}"


def _interop() -> dict:
    return shared_launch.results("torch_interop", "torch")[0]


@pytest.mark.timeout(600)
def test_units_are_fsdp2_units_and_nothing_else_is():
    r = _interop()
    assert r["units are FSDP2's FSDPModule"] == r["units are ours"]
    assert sum(r["units are ours"]) == 3
    assert r["state for torch's pipeline stage"]


@pytest.mark.timeout(600)
def test_torch_fully_shard_on_a_unit_is_refused_unchanged():
    error, message = _interop()["torch fully_shard on a unit"]
    assert error == "AssertionError" and "fully_shard has already been applied" in message
    assert _interop()["torch fully_shard on a unit: unchanged"]


@pytest.mark.timeout(600)
def test_torch_code_reading_fsdp2_state_gets_a_named_error():
    error, message = _interop()["FSDPMemTracker"]
    assert error == "NotImplementedError"
    assert "is a hyper_parallel fully_shard unit: it holds no FSDP2 state" in message


@pytest.mark.timeout(600)
def test_set_unshard_async_op_is_accepted():
    assert _interop()["_set_unshard_async_op"] == (None, "")
    assert _interop()["_set_unshard_async_op not a bool"][0] == "TypeError"


@pytest.mark.timeout(600)
def test_torch_module_and_state_dict_code_works_on_units():
    r = _interop()
    assert r["slice of a unit"] == "Sequential"
    assert r["dcp full equals gather_full_state_dict"] and r["dcp sharded are DTensors"]
    assert r["fresh differs"] and r["dcp loaded equals saved"]


@pytest.mark.timeout(600)
def test_torch_fully_shard_over_units_trains_like_fsdp2():
    r = _interop()
    losses = r["torch fully_shard over units: losses"]
    assert losses["mixed"] == losses["fsdp2"]
    assert r["torch fully_shard over units: params equal"]
    assert r["torch fully_shard over units: blocks stay ours"] == [True, True]


@pytest.mark.timeout(600)
def test_step_end_without_a_backward_through_the_units_is_refused():
    """What torch's zero-bubble schedules (a backward split into input and weight parts)
    come to: the stage asks for the reduction, and no backward ran through the units."""
    error, message = _interop()["step end, no backward reached the units"]
    assert error == "RuntimeError"
    assert "never reached the parameters of <root> (Sequential), 0 (Sequential), " \
           "1 (Sequential)" in message and "zero-bubble" in message


@pytest.mark.timeout(600)
def test_hp_fully_shard_refuses_fsdp2_units_unchanged():
    r = _interop()
    for case, where in [("on an FSDP2 unit", "a FSDPSequential, which is"),
                        ("over FSDP2 units", "whose submodule '0' (FSDPSequential) is")]:
        error, message = r[f"hp fully_shard {case}"]
        assert error == "ValueError", case
        assert where in message and "sharded by torch's fully_shard (FSDP2)" in message, case
    assert r["hp fully_shard on FSDP2 units: unchanged"]
