"""torchtitan's own Llama 3 training (tests/torchtitan_scenarios.py) on 2 torch ranks, with
hyper_parallel's ``fully_shard`` in place of FSDP2's: its ``parallelize_llama``, its selective,
full or no activation checkpointing, bf16 mixed precision or float32, untied or tied
embeddings, its chunked loss, clipping, AdamW and LR schedule, 4 steps from the same
initial parameters on the same data. hyper_parallel's losses, gradient norms and final
parameters equal FSDP2's bit for bit, also under torchtitan's default spmd_backend, which
FSDP2 refuses, and in float32 match a single-process reference. The same for its Qwen3-MoE
with load balancing, and on 4 ranks for the model configured as its ``Trainer`` configures it
(tests/torchtitan_trainer_config_scenarios.py: its tensor parallelism over 2 ranks with
sequence parallelism, ``fully_shard`` over the other 2). torchtitan's float8 converter
(tests/torchtitan_float8_scenarios.py: emulated, the one setting it allows on CPU) trains
as under FSDP2, and with the converted weights wrapped for float8 all-gather
hyper_parallel sends them in float8. Its pipeline path (tests/torchtitan_pipeline_scenarios.py:
``pipeline_llm`` with ``pipeline_parallel_degree=2`` on 4 ranks, pp 2 x dp_shard 2, its
1F1B, GPipe and Interleaved1F1B schedules) trains as under FSDP2, bit for bit, with as many
reduce-scatters per step.

Needs torchtitan 0.3.0 (the ``titan`` extra: ``pip install -e ".[titan]"``); skipped without.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torchtitan", minversion="0.3.0",
                    reason='torchtitan is not installed (pip install -e ".[titan]")')

from tests.multirank import run_ranks  # noqa: E402
from tests.torchtitan_scenarios import (  # noqa: E402
    CONFIGS, LAYERS, SPMD_DEFAULT, SPMD_DEFAULT_CONFIGS, config_name)
from tests.torchtitan_trainer_config_scenarios import CONFIGS as TRAINER_CONFIGS  # noqa: E402
from tests.torchtitan_trainer_config_scenarios import MOE_EP  # noqa: E402
from tests.tolerance import FP32_RTOL  # noqa: E402
from tests.torchtitan_float8_scenarios import RUNS as FLOAT8_RUNS  # noqa: E402
from tests.torchtitan_pipeline_scenarios import SCHEDULES as PIPELINE_SCHEDULES  # noqa: E402
# one row a microbatch (torchtitan_pipeline_scenarios.trainer_config)
from tests.torchtitan_scenarios import LOCAL_BATCH as MICROBATCHES  # noqa: E402

NAMES = [config_name(*config) for config in CONFIGS]
FLOAT32 = [name for name in NAMES if "float32" in name]
BFLOAT16 = [name for name in NAMES if "bfloat16" in name]
# float32 against the reference: the ranks sum their halves of each gradient and loss
# where the reference sums them at once, a rounding apart (the suite's ATOL)
ATOL = 1e-5
# AdamW moves each parameter by about the learning rate (8e-4) per step whatever its
# gradient's scale, so a rounding apart in a near-zero gradient can move it visibly; a
# wrong gradient moves it by a step's size (tests/kit.py's ADAMW_PARAM_ATOL)
PARAM_ATOL = 1e-4
# a top-2 routing choice flipped by rounding, 4 ranks against one process (measured 5.3e-5)
MOE_NORM_RTOL = 1e-3
# bfloat16 compute against the float32 reference: bfloat16 keeps 8 significant bits
# (relative precision 2**-8, about 4e-3)
BF16_RTOL = 1e-2


def _assert_bitwise_equal(ours: dict, theirs: dict) -> None:
    """The same losses, gradient norms and final parameters, bit for bit."""
    assert ours["losses"] == theirs["losses"]
    assert ours["grad_norms"] == theirs["grad_norms"]
    assert ours["params"].keys() == theirs["params"].keys()
    for key, value in theirs["params"].items():
        np.testing.assert_array_equal(ours["params"][key], value, err_msg=key)
    assert ours["expert_biases"].keys() == theirs["expert_biases"].keys()
    for key, value in theirs["expert_biases"].items():
        np.testing.assert_array_equal(ours["expert_biases"][key], value, err_msg=key)


def _assert_near_float32_reference(run: dict, reference: dict) -> None:
    """Losses, gradient norms and final parameters within the float32 tolerances above."""
    np.testing.assert_allclose(run["losses"], reference["losses"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(run["grad_norms"], reference["grad_norms"], atol=ATOL, rtol=0)
    for key, value in reference["params"].items():
        np.testing.assert_allclose(run["params"][key], value, atol=PARAM_ATOL, rtol=0,
                                   err_msg=key)


@pytest.fixture(scope="module")
def results() -> dict:
    return run_ranks("tests.torchtitan_scenarios:run", 2, "torch", timeout_s=400)[0]


@pytest.fixture(scope="module")
def moe_results() -> dict:
    return run_ranks("tests.torchtitan_scenarios:run_moe", 2, "torch", timeout_s=400)[0]


@pytest.fixture(scope="module")
def float8_results() -> dict:
    return run_ranks("tests.torchtitan_float8_scenarios:run", 2, "torch", timeout_s=400)[0]


@pytest.fixture(scope="module")
def pipeline_results() -> list:
    """One result per rank: ranks 0 and 1 hold the first stage, 2 and 3 the last."""
    return run_ranks("tests.torchtitan_pipeline_scenarios:run", 4, "torch", timeout_s=400)


@pytest.fixture(scope="module")
def trainer_config_results() -> dict:
    return run_ranks("tests.torchtitan_trainer_config_scenarios:run", 4, "torch",
                     timeout_s=400)[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", NAMES)
def test_hyper_parallel_trains_torchtitan_exactly_as_fsdp2(results, name):
    _assert_bitwise_equal(results[name]["hp"], results[name]["fsdp2"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [config_name(*config) for config in SPMD_DEFAULT_CONFIGS])
def test_torchtitan_default_spmd_backend_trains_as_fsdp2_under_partial_dtensor(results, name):
    """Under torchtitan's default spmd_backend, "spmd_types", its parallelize_llama passes
    torch's DataParallelMeshDims with plain parameters: FSDP2 refuses them, hyper_parallel
    takes them and trains exactly as FSDP2 does under "partial_dtensor"."""
    _assert_bitwise_equal(results[name][f"hp_{SPMD_DEFAULT}"], results[name]["fsdp2"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", NAMES)
def test_chunked_loss_reduces_the_head_once_for_all_chunks(results, name):
    """torchtitan's ChunkedLossWrapper takes hyper_parallel's units for FSDP units: the
    head's gradient sync is off for all chunks but the last. So each step reduce-scatters
    every unit (the blocks, the embedding and [norm, lm_head], or with tied embeddings
    [tok_embeddings, norm, lm_head]) once, and the head's unit once more, for its norm
    (and tied embedding) in the trunk's backward; never once per chunk."""
    units = LAYERS + (1 if name.endswith("-tied") else 2)
    assert results[name]["hp"]["reduce_scatters"] == [units + 1] * len(results[name]["hp"]["losses"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("impl", ["hp", "fsdp2"])
@pytest.mark.parametrize("name", FLOAT32)
def test_float32_training_matches_the_single_process_reference(results, name, impl):
    _assert_near_float32_reference(results[name][impl], results[name]["reference"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", BFLOAT16)
def test_bfloat16_training_stays_near_the_float32_reference(results, name):
    run, reference = results[name]["hp"], results[name]["reference"]
    np.testing.assert_allclose(run["losses"], reference["losses"], rtol=BF16_RTOL)
    np.testing.assert_allclose(run["grad_norms"], reference["grad_norms"], rtol=BF16_RTOL)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", ["hp", f"hp_{SPMD_DEFAULT}"])
def test_mixture_of_experts_trains_exactly_as_fsdp2(moe_results, run):
    """torchtitan's Qwen3-MoE (grouped experts, top-2 routing, its load-balancing hook
    updating each layer's expert bias from the tokens every rank routed) trains under
    hyper_parallel as under FSDP2, bit for bit, expert biases included."""
    _assert_bitwise_equal(moe_results[run], moe_results["fsdp2"])
    biases = moe_results[run]["expert_biases"]
    assert len(biases) == LAYERS and all(np.any(b != 0) for b in biases.values())


@pytest.mark.timeout(600)
def test_mixture_of_experts_matches_the_single_process_reference(moe_results):
    """Losses and gradient norms to rounding, and the same expert biases: the ranks' token
    counts summed make the reference's. (Parameters are compared with FSDP2 above: FSDP2's
    are as far from the reference's, up to a whole AdamW step, the learning rate, where a
    rounding apart flips a near-zero gradient or a top-2 choice.)"""
    run, reference = moe_results["hp"], moe_results["reference"]
    assert run["expert_biases"].keys() == reference["expert_biases"].keys()
    np.testing.assert_allclose(run["losses"], reference["losses"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(run["grad_norms"], reference["grad_norms"], atol=ATOL, rtol=0)
    for key, value in reference["expert_biases"].items():
        np.testing.assert_array_equal(run["expert_biases"][key], value, err_msg=key)


@pytest.mark.timeout(600)
def test_expert_parallel_mixture_of_experts_trains_exactly_as_fsdp2(moe_results):
    """Qwen3-MoE at ``expert_parallel_degree=2`` on 2 ranks, configured as torchtitan's
    Trainer does: its ExpertParallel all-to-all dispatch, each rank holding 2 of the 4
    experts of each layer, the experts' unit over the (size 1) ``efsdp`` mesh and the rest
    over both ranks through ``shard_placement_fn``'s per-parameter meshes (FSDP2's
    ``ShardPlacementResult`` with its private ``mesh_info``): hyper_parallel in FSDP2's place
    trains bit for bit as FSDP2 does, and as the single process within the float32
    tolerances (expert biases exactly)."""
    _assert_bitwise_equal(moe_results["hp_ep2"], moe_results["fsdp2_ep2"])
    _assert_near_moe_reference(moe_results["hp_ep2"], moe_results["reference"])


@pytest.mark.timeout(600)
def test_expert_parallel_over_expert_data_parallel_ranks_trains_exactly_as_fsdp2(
        trainer_config_results):
    """The same on 4 ranks: 2 expert groups, each expert fully sharded over the 2 ``efsdp``
    ranks of its group (torchtitan's gradient divide factor of 1 and its loss scaled by the
    global token count), the dense parameters over all 4. A sum of 4 ranks' gradients is
    not bitwise across collective algorithms (the reduce-scatter FSDP2 issues and the one
    hyper_parallel issues on CPU add the 4 terms of some elements in another order:
    measured, the fused ``wqkv`` gradients differ by 1e-10 from the first step, every other
    gradient is equal), so FSDP2 is held to the float32 tolerances here, as the reference
    is; the 2-rank cases above, where a sum of two is the same in any order, are bitwise."""
    runs = trainer_config_results[MOE_EP]
    _assert_near_moe_reference(runs["hp_ep2"], runs["fsdp2_ep2"])
    for key, value in runs["fsdp2_ep2"]["params"].items():
        np.testing.assert_allclose(runs["hp_ep2"]["params"][key], value, atol=PARAM_ATOL,
                                   rtol=0, err_msg=key)
    # Against one process, each loss is a sum of 4 ranks' terms in another order: within
    # the suite's float32 relative tolerance (tests/tolerance.py), as FSDP2's are. The
    # gradient norms move more (measured 5.3e-5 relative, FSDP2's alike): a rounding apart
    # can flip a near-tied top-2 choice, which moves a token's gradient whole.
    for run in ("hp_ep2", "fsdp2_ep2"):
        np.testing.assert_allclose(runs[run]["losses"], runs["reference"]["losses"],
                                   rtol=FP32_RTOL, atol=0, err_msg=run)
        np.testing.assert_allclose(runs[run]["grad_norms"], runs["reference"]["grad_norms"],
                                   rtol=MOE_NORM_RTOL, atol=0, err_msg=run)


def _assert_near_moe_reference(run: dict, reference: dict) -> None:
    """Losses and gradient norms within the float32 tolerance, expert biases equal
    (test_mixture_of_experts_matches_the_single_process_reference says why not parameters)."""
    np.testing.assert_allclose(run["losses"], reference["losses"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(run["grad_norms"], reference["grad_norms"], atol=ATOL, rtol=0)
    assert run["expert_biases"].keys() == reference["expert_biases"].keys()
    for key, value in reference["expert_biases"].items():
        np.testing.assert_array_equal(run["expert_biases"][key], value, err_msg=key)


TRAINER_NAMES = [config_name(ac, mp, False) for ac, mp in TRAINER_CONFIGS]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", TRAINER_NAMES)
def test_model_configured_as_the_trainer_does_trains_exactly_as_fsdp2(trainer_config_results,
                                                                      name):
    """The model configured by ``update_from_config`` as torchtitan's Trainer does, tensor
    parallel 2 with sequence parallelism: each module distributes its own parameters and
    redistributes its inputs, so every layer computes with DTensors; hyper_parallel's full
    parameters are tensor-parallel DTensors as FSDP2's are (also across ``to_empty`` and in
    activation checkpointing's recomputation), and training is FSDP2's, bit for bit."""
    _assert_bitwise_equal(trainer_config_results[name]["hp"],
                          trainer_config_results[name]["fsdp2"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [name for name in TRAINER_NAMES if "float32" in name])
def test_model_configured_as_the_trainer_does_matches_the_reference(trainer_config_results,
                                                                    name):
    _assert_near_float32_reference(trainer_config_results[name]["hp"],
                                   trainer_config_results["reference"])


FLOAT8_GATHER_RUNS = [key for key, (_, _, wrapped, _) in FLOAT8_RUNS.items() if wrapped]
# every linear of the blocks and the head: their dims are multiples of 16
FLOAT8_LINEARS = [f"layers.{i}.{name}.weight" for i in range(LAYERS)
                  for name in ("attention.qkv_linear.wqkv", "attention.wo", "feed_forward.w1",
                               "feed_forward.w2", "feed_forward.w3")] + ["lm_head.weight"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", [key for key in FLOAT8_RUNS if key != "fsdp2"])
def test_torchtitan_float8_converter_trains_exactly_as_fsdp2(float8_results, run):
    """torchtitan's Float8LinearConverter (emulated) swaps every linear of the blocks and
    the head for its Float8Linear; hyper_parallel trains the model as FSDP2 does, bit for
    bit, with float8 all-gather off, with the flag only, and on (the scales are global, so
    the math is the same)."""
    assert float8_results[run]["float8_weights"] == sorted(FLOAT8_LINEARS)
    _assert_bitwise_equal(float8_results[run], float8_results["fsdp2"])


def _padded_to_8(nbytes: int) -> int:
    """A rank's part of a codec tensor on the wire (fully_shard/codec_leg.py)."""
    return -(-nbytes // 8) * 8


@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", FLOAT8_GATHER_RUNS)
def test_torchtitan_float8_weights_are_all_gathered_in_float8(float8_results, run):
    """With the converted weights wrapped as torchao's ``from_float`` wraps them, every
    gather of one of them sends its shard as float8, 1 byte an element, where the run
    with the flag only (torchtitan's modules alone: no weight is wrapped, no float8
    gather) sends 4: the all-gather bytes fall by exactly that, and the rest is unchanged.
    The hook was called for each float8 weight's shard."""
    world = 2
    flag_only, ours = float8_results["hp_flag_only"], float8_results[run]
    assert flag_only["float8_gathered_numels"] == []
    numels = ours["float8_gathered_numels"]
    params = ours["params"]
    assert set(numels) == {params[name].size // world for name in FLOAT8_LINEARS}
    saved = sum(world * (4 * n - _padded_to_8(n)) for n in numels)
    assert sum(flag_only["all_gather_bytes"]) - sum(ours["all_gather_bytes"]) == saved


@pytest.mark.timeout(600)
def test_torchtitan_float8_scales_are_precomputed_on_hyper_parallel_weights(float8_results):
    """torchao's ``precompute_float8_dynamic_scale_for_fsdp`` finds every wrapped weight of
    hyper_parallel's units (DTensors over its float8 tensor) and leaves its scale there."""
    assert float8_results["hp_float8_gather_precompute"]["precomputed_scales"] == \
        len(FLOAT8_LINEARS)
    assert float8_results["hp_float8_gather"]["precomputed_scales"] == 0


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", PIPELINE_SCHEDULES)
def test_torchtitan_pipeline_trains_exactly_as_fsdp2(pipeline_results, schedule):
    """torchtitan's ``pipeline_llm`` (pp 2 x dp_shard 2) with hyper_parallel's fully_shard:
    on every rank the stage's parameters and the gradient norms clipped across stages
    equal FSDP2's bit for bit, and on the last stage's ranks the losses."""
    last_stage = 0
    for rank in pipeline_results:
        ours, theirs = rank[schedule]["hp"], rank[schedule]["fsdp2"]
        _assert_bitwise_equal(ours, theirs)
        assert ours["params"]
        if ours["losses"]:  # a loss a step
            last_stage += 1
            assert len(ours["losses"]) == len(ours["grad_norms"])
    assert last_stage == 2


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", PIPELINE_SCHEDULES)
def test_torchtitan_pipeline_reduces_as_often_as_fsdp2(pipeline_results, schedule):
    """Per step, each rank issues as many reduce-scatters and all-reduces as under FSDP2
    (one c10d counter for both runs; hyper_parallel's own count agrees): the schedule's
    microbatches accumulate on the units, which reduce once per step."""
    for rank in pipeline_results:
        ours, theirs = rank[schedule]["hp"], rank[schedule]["fsdp2"]
        for kind in ("reduce_scatter", "all_reduce"):
            assert [step.get(kind, 0) for step in ours["c10d"]] == \
                [step.get(kind, 0) for step in theirs["c10d"]], kind
        assert ours["reduce_scatters"] == [step["reduce_scatter"] for step in ours["c10d"]]


def _all_gathers(run: dict) -> list:
    return [step.get("all_gather", 0) for step in run["c10d"]]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", PIPELINE_SCHEDULES)
def test_torchtitan_pipeline_all_gathers_against_fsdp2(pipeline_results, schedule):
    """All-gathers per step (one c10d counter for both runs). torchtitan keeps full
    parameters after forward under pipelining: FSDP2 gathers a unit once per step and keeps
    it to the step's end; hyper_parallel reshards every unit at each root forward (each
    microbatch's), not knowing whether an optimizer step ran since, and keeps the set the
    first backward gathers again for the later backwards (docs/api.md, torchtitan's
    "Pipeline parallelism"). So a rank whose stages compute no loss gathers each unit
    once more per microbatch, every step: the units counted by their one reduce-scatter a
    step. On the loss's stage the head unit, which the chunked loss unshards and reshards
    itself, costs FSDP2 a gather more in each microbatch's loss, so from the second step
    on (the first adds torch's shape inference, a forward and a backward outside the
    microbatches) hyper_parallel never gathers more there: as many under GPipe and
    Interleaved1F1B, fewer under 1F1B (the set kept by the first backward serves the next
    microbatch's forward)."""
    loss_ranks = 0
    for rank in pipeline_results:
        ours, theirs = rank[schedule]["hp"], rank[schedule]["fsdp2"]
        if not ours["losses"]:
            assert _all_gathers(ours) == [
                fsdp2 + MICROBATCHES * units
                for fsdp2, units in zip(_all_gathers(theirs), ours["reduce_scatters"])]
            continue
        loss_ranks += 1
        later_ours, later_theirs = _all_gathers(ours)[1:], _all_gathers(theirs)[1:]
        assert all(o <= t for o, t in zip(later_ours, later_theirs)), (later_ours, later_theirs)
        if schedule != "1F1B":
            assert later_ours == later_theirs
        else:
            assert later_ours != later_theirs
    assert loss_ranks == 2
