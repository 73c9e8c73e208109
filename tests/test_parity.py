"""Parity: hyper_parallel on N ranks == a single-process reference on the global batch.

The suite's shared launch of each (backend, world size) (tests/shared_launch.py) runs
every scenario (tests/scenarios.py; MindSpore on 4 ranks runs the rest under ``-m slow``,
see MINDSPORE_4_DEFAULT); each test reads its scenario's result. Losses: the mean of the ranks' local losses equals the
reference loss (equal local batches, mean-reduced loss). Parameters: gathered full values
after all steps equal the reference's to rounding (tests/tolerance.py), 5 optimizer steps
(SGD with momentum; one scenario with AdamW); torch's FSDP2 on the same ranks bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import shared_launch
from tests.tolerance import ADAMW_RTOL, FP32_RTOL, assert_close

BACKENDS = ["torch", "mindspore"]
SCENARIOS = ("nested", "nested_adamw", "nested_keep", "list_unit", "tied", "twice", "ignored",
             "shard_dim1", "own_collectives", "own_mixed", "own_even", "inplace_view",
             "recompute_reentrant", "recompute_non_reentrant")


# MindSpore on 4 ranks (4 processes on the 2 cores CI has) in the default run: the
# scenarios whose sharding changes with the world size (uneven rows padded differently over
# 4, dim-1 shards, a parameter per collective, tied weights, AdamW's state). The others run
# the same core code as torch's 4-rank cases and the same MindSpore code as its 2-rank ones;
# they are kept for `-m slow`.
MINDSPORE_4_DEFAULT = ("nested", "nested_adamw", "tied", "shard_dim1", "own_collectives",
                       "own_even")


def _slow(backend: str, world_size: int, scenario: str) -> bool:
    return backend == "mindspore" and world_size == 4 and scenario not in MINDSPORE_4_DEFAULT


def _register_jobs() -> None:
    shared_launch.register(__name__, "parity_1", 1, "tests.scenarios:run_many",
                           lambda backend: (["nested"],), timeout_s=200)
    for world in (2, 4):
        shared_launch.register(
            __name__, f"parity_{world}", world, "tests.scenarios:run_many",
            lambda backend, world=world: ([s for s in SCENARIOS
                                           if not _slow(backend, world, s)],), timeout_s=400)
    shared_launch.register(__name__, "parity_4_slow", 4, "tests.scenarios:run_many",
                           lambda backend: ([s for s in SCENARIOS if _slow(backend, 4, s)],),
                           backends=("mindspore",), timeout_s=400, slow=True)
    for target in ("run_two_models", "run_memory", "run_prefetch_trace"):
        shared_launch.register(__name__, target, 2, f"tests.scenarios:{target}", timeout_s=200)
    shared_launch.register(__name__, "parity_fsdp2", 2, "tests.scenarios:run_fsdp2_compare",
                           backends=("torch",), timeout_s=200)


_register_jobs()


def _results(backend: str, world_size: int) -> list:
    """Per-rank results of the scenarios (only "nested" at world size 1)."""
    return shared_launch.results(f"parity_{world_size}", backend)


def _assert_parity(per_rank: list, tolerance: float = FP32_RTOL):
    mean_losses = np.mean([r["losses"] for r in per_rank], axis=0)
    assert_close(mean_losses, per_rank[0]["ref_losses"], tolerance)
    assert len(mean_losses) >= 5
    for r in per_rank:
        assert r["param_diff"] <= tolerance, f"gathered parameters differ by {r['param_diff']}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend,world_size,scenario", [
    pytest.param(b, w, s, marks=[pytest.mark.slow] if _slow(b, w, s) else [])
    for b in BACKENDS for w in (2, 4) for s in SCENARIOS])
def test_parity_with_single_process_reference(backend, world_size, scenario):
    key = f"parity_{world_size}" + ("_slow" if _slow(backend, world_size, scenario) else "")
    results = shared_launch.results(key, backend)
    per_rank = [r[scenario] for r in results]
    assert per_rank[0]["names_match"], "gathered state dict names differ from the reference's"
    # gradients themselves are checked at FP32_RTOL by the SGD scenarios
    _assert_parity(per_rank, ADAMW_RTOL if scenario == "nested_adamw" else FP32_RTOL)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_world_size_one_issues_no_collective(backend):
    (result,) = _results(backend, 1)
    _assert_parity([result["nested"]])
    assert result["nested"]["last_step_comms"] == {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_collective_counts_per_step(backend):
    """2 blocks + root, reshard_after_forward=True: one all-gather per unit in forward, one
    per non-root unit before backward, one reduce-scatter per unit; with
    reshard_after_forward=False no backward all-gather at all."""
    per_rank = [r["nested"] for r in _results(backend, 2)]
    comms = per_rank[0]["last_step_comms"]
    assert comms == {"all_gather": 3 + 2, "reduce_scatter": 3}
    keep = [r["nested_keep"] for r in _results(backend, 2)][0]["last_step_comms"]
    assert keep == {"all_gather": 3, "reduce_scatter": 3}
    # own_collective_bytes=0: one all-gather and one reduce-scatter per sharded parameter
    # (4 per block, 2 in the root)
    own = [r["own_collectives"] for r in _results(backend, 2)][0]
    assert own["last_step_comms"] == {"all_gather": 10 + 8, "reduce_scatter": 10}
    # MindSpore CPU has no reduce-scatter kernel: over two ranks it exchanges the chunks
    # each peer owns with one all-gather, on the world group the flat one (docs/platforms.md)
    expected_wire = "reduce_scatter" if backend == "torch" else "all_gather"
    assert per_rank[0]["wire"]["reduce_scatter"] == [expected_wire]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_activation_checkpointing_adds_no_collective(backend):
    """3 blocks + root, blocks 1 and 2 recomputed in backward. A forward that runs inside
    backward gathers only if its unit's parameters are not there, prefetches nothing and
    does not reshard (as FSDP2): one all-gather per unit in forward, then one per block
    before its backward. One reduce-scatter per unit: nothing reduced twice or skipped."""
    units, blocks = 4, 3
    for r in _results(backend, 2):
        for name in ("recompute_reentrant", "recompute_non_reentrant"):
            result = r[name]
            expected = {"all_gather": units + blocks, "reduce_scatter": units}
            assert result["last_step_comms"] == expected, (name, result["last_step_comms"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_regather_writes_straight_into_dim0_sharded_parameters(backend, world_size):
    """reshard_after_forward=True, own collectives: a parameter sharded on dim 0 (padded or
    not) is re-gathered before backward straight into its released full tensor, with no
    copy out of a gather buffer; dim-1 shards are copied in (which shows the count can
    fail)."""
    results = _results(backend, world_size)
    if not results[0]["nested"]["reads_views"]:
        pytest.skip(f"{backend}'s kernels copy a view before reading it, so no full parameter "
                    "is a view of a gather output and a re-gather copies into each one "
                    "(fully_shard/layout.py, 'views'; docs/platforms.md, 'Memory')")
    for r in results:
        for name in ("own_even", "own_collectives"):  # unpadded, padded
            assert r[name]["last_step_comms"]["all_gather"] == 10 + 8  # forward + re-gathers
            assert r[name]["refill_copies"] == 0, name
        assert r["own_mixed"]["refill_copies"] > 0  # block 1: dim-1 shards, fused biases


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_shards_stay_in_their_all_gather_input(backend):
    """Where views write through (torch), a dim-0 shard with fewer rows than its padded
    piece lives at the start of that piece, so its all-gather input needs no copy; after
    five optimizer steps (SGD, AdamW) every such parameter still lives there. MindSpore
    keeps the padding in the parameter itself (pads_local_shards) and has none."""
    results = _results(backend, 2)
    for scenario in ("nested", "nested_adamw", "own_collectives"):
        backed = [b for r in results for b in r[scenario]["backed_shards"]]
        if backend == "mindspore":
            assert backed == []
        else:  # rank 1 owns fewer rows of every odd-sized dim-0 parameter
            assert backed and all(backed), (scenario, backed)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_returned_by_backward_need_no_placeholder(backend):
    """Where backward's return value is the user's gradient and collectives cannot overlap
    compute (MindSpore on CPU), each unit reduces inside its backward and returns the
    reduced shards: no zero placeholder to fill later. Elsewhere (torch; MindSpore with
    the pipeline, tested bitwise against this path in test_hsdp.py) every managed parameter
    gets one per backward."""
    for r in _results(backend, 2):
        nested = r["nested"]
        expected = 0 if nested["reduces_in_backward"] else nested["managed_params"]
        assert nested["managed_params"] > 0 and nested["placeholders"] == expected, nested


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_models_in_one_process_train_independently(backend):
    results = shared_launch.results("run_two_models", backend)
    for i in (0, 1):
        mean_losses = np.mean([r["losses"][i] for r in results], axis=0)
        assert_close(mean_losses, results[0]["ref_losses"][i], FP32_RTOL)
    assert max(r["param_diff"] for r in results) <= FP32_RTOL


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reshard_after_forward_releases_full_parameters(backend):
    results = shared_launch.results("run_memory", backend)
    for r in results:
        for mode in ("reshard", "keep"):
            assert_close(np.mean([x[mode]["loss"] for x in results]), r[mode]["ref_loss"],
                         FP32_RTOL)
        assert all(held > 0 for held in r["keep"]["held"])
        for mode in ("reshard", "keep"):  # asked once, at the start of the iteration
            expected = r[mode]["expected_keep"]
            assert r[mode]["asked_to_keep"] == ([] if expected is None else [expected])
        assert r["reshard"]["held"] == [0, 0, 0]
        # nothing else a resharded block holds has memory beyond its shards (unit_memory.py);
        # the walk does reach the full parameters a kept block holds
        assert r["reshard"]["reachable"] == [0, 0, 0], r["reshard"]
        assert all(reached >= held > 0 for reached, held in
                   zip(r["keep"]["reachable"], r["keep"]["held"])), r["keep"]
        # a block's backward frees its full parameters before its gradient reduction makes
        # its buffers on torch (FSDP2's order), after it on MindSpore's CPU pool, which
        # would otherwise carve them out of the freed block (state.py, "releasing after
        # backward"); both by the end of the step
        at_reduction = r["reshard"]["at_reduction"]
        assert len(at_reduction) == 3, at_reduction
        if backend == "torch":
            assert at_reduction == [0, 0, 0]
        else:
            assert all(held > 0 for held in at_reduction), at_reduction
        assert all(r["reshard"]["after_step"]) and all(r["keep"]["after_step"])


@pytest.mark.timeout(300)
def test_parity_with_torch_fsdp2():
    results = shared_launch.results("parity_fsdp2", "torch")
    for r in results:
        np.testing.assert_array_equal(r["losses"], r["their_losses"])  # the same math
        assert r["param_diff"] == 0.0
        assert r["local_shapes_match"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_implicit_prefetch_issues_the_next_units_all_gather_early(backend):
    result = shared_launch.results("run_prefetch_trace", backend)[0]
    events = result["events"]

    def first(fragment):
        return next(i for i, e in enumerate(events) if fragment in e)

    for block in ("blocks.0 ", "blocks.1 "):
        prefetch = first(f"{block}(Block): prefetch all-gather issued")
        assert prefetch < first(f"{block}(Block): unshard (all-gather)"), events
    # blocks.1 runs backward first and prefetches blocks.0's re-gather
    assert first("blocks.0 (Block): prefetch re-gather issued") < \
        first("blocks.0 (Block): re-gather full parameters for backward"), events
