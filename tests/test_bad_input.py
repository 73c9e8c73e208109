"""Bad input: a clear error naming the problem and the fix, and nothing half-changed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from hyper_parallel.launcher_job import LAUNCHER_WORLD_SIZE_VARS
from hyper_parallel.platform import resolve_backend_name
from tests import shared_launch
from tests.multirank import REPO_ROOT, run_ranks
from tests.test_fsdp2_surface import FSDP2_SHARED_PARAMETER_WORDING

BACKENDS = ["torch", "mindspore"]
_MODULES = "torch.nn.Module or a mindspore.nn.Cell"


shared_launch.register(__name__, "bad_input", 2, "tests.bad_input:run_checks", timeout_s=200)


def _checks(backend):
    return shared_launch.results("bad_input", backend)[0]


@pytest.mark.parametrize("value", ["jax", "", "tensorflow "])
def test_unknown_backend_names_the_valid_values(monkeypatch, value):
    monkeypatch.setenv("HP_BACKEND", value or "nope")
    with pytest.raises(ValueError, match="valid values: torch, mindspore"):
        resolve_backend_name()


def test_backend_name_is_case_insensitive(monkeypatch):
    monkeypatch.setenv("HP_BACKEND", "  TorCH ")
    assert resolve_backend_name() == "torch"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("check, error_type, message", [
    ("mesh_size", "ValueError", "holds 3 ranks but the world has 2"),
    ("mesh_dup_names", "ValueError", "has duplicates"),
    ("mesh_3d", "ValueError", "dp_mesh_dims=hp.DataParallelMeshDims("),
    ("shard_dim_out_of_range", "ValueError", "return a dim in [-2, 2)"),
    ("ignored_not_a_parameter", "TypeError", "is not a parameter"),
    ("twice", "ValueError", "already applied"),
    ("top_down", "ValueError", "apply it to the blocks first"),
    ("tied_across_units", "ValueError", "common ancestor"),
    *[("tied_across_units", "ValueError", phrase) for phrase in FSDP2_SHARED_PARAMETER_WORDING],
    ("unknown_reduce_op", "ValueError", "one of ('avg', 'sum')"),
    ("non_scalar_scaling", "ValueError", "one-element tensor, got shape (2,)"),
    ("negative_threshold", "ValueError", "shard_threshold_bytes must be an int >= 0"),
    ("bad_own_collective_bytes", "ValueError", "own_collective_bytes must be an int >= 0, None"),
    ("unknown_dtype_name", "ValueError", "unknown dtype name 'bf16'"),
    ("policy_none", "TypeError", "mp_policy must be a hp.MixedPrecisionPolicy, got None"),
    ("policy_lookalike", "TypeError", "mp_policy must be a hp.MixedPrecisionPolicy, got LookalikePolicy("),
    *[(f"param_dtype_{kind}", "TypeError", "param_dtype must be a floating-point dtype of {backend} "
       "({backend}.float32, {backend}.bfloat16, {backend}.float16, {backend}.float64), its name "
       "as a string (e.g. 'bfloat16') or None; got ")
      for kind in ("numpy", "python_float", "number", "integer", "complex")],
    ("reduce_dtype_integer", "TypeError", "reduce_dtype must be a floating-point dtype of {backend}"),
    ("output_dtype_integer", "TypeError", "output_dtype must be a floating-point dtype of {backend}"),
    ("dtype_name_integer", "ValueError", "unknown dtype name 'int8'; valid: float32, bfloat16"),
    ("cast_forward_inputs_text", "TypeError",
     "MixedPrecisionPolicy.cast_forward_inputs must be True or False, got 'no'"),
    ("main_grad_number", "TypeError",
     "MixedPrecisionPolicy.apply_grad_on_fp32_main_grad must be True or False, got 1"),
    ("pin_memory_text", "TypeError", "CPUOffloadPolicy.pin_memory must be True or False, got 'no'"),
    ("offload_policy_is_mp_policy", "TypeError", "offload_policy must be a hp.OffloadPolicy"),
    ("reshard_after_forward_text", "ValueError", "reshard_after_forward must be a bool, None or an int"),
    ("reshard_after_forward_fraction", "ValueError", "reshard_after_forward must be a bool, None or an int"),
    ("reshard_after_forward_not_a_factor", "ValueError", "must be a factor of the shard group size 2, got 3"),
    ("mesh_name", "TypeError", "mesh must be a hyper_parallel DeviceMesh"),
    ("placement_fn_not_callable", "TypeError", "shard_placement_fn must be a function of a parameter"),
    ("dp_mesh_dims_name", "TypeError", "dp_mesh_dims must be a hyper_parallel DataParallelMeshDims, got str"),
    ("ignored_single_param", "TypeError", "ignored_params must be a collection"),
    ("threshold_fraction", "ValueError", "shard_threshold_bytes must be an int >= 0, got 1.5"),
    ("own_collective_bytes_negative", "ValueError", "own_collective_bytes must be an int >= 0"),
    ("not_a_module_tensor", "TypeError", f"fully_shard takes a {_MODULES}, or a list of them; got a Parameter"),
    ("not_a_module_none", "TypeError", f"fully_shard takes a {_MODULES}, or a list of them; got None"),
    ("not_a_module_name", "TypeError", f"fully_shard takes a {_MODULES}, or a list of them; got a str"),
    ("list_with_a_tensor", "TypeError", "or a list of them; got a Tensor in the list"),
    ("mesh_device_gpu", "ValueError", "device_type must be one of 'cpu', 'cuda', 'npu', got 'gpu' (for 'gpu' write 'cuda')"),
    ("mesh_device_Ascend", "ValueError", "got 'Ascend' (for 'Ascend' write 'npu')"),
    ("mesh_device_0", "ValueError", "device_type must be one of 'cpu', 'cuda', 'npu', got 0"),
    ("mesh_device_absent", "ValueError", " device ({backend} computes on '"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_rejected_cleanly(backend, check, error_type, message):
    found_type, found_message, untouched = _checks(backend)[check]
    assert found_type == error_type, found_message
    assert message.replace("{backend}", backend) in found_message
    assert untouched, "the module was changed by a call that failed"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_module_shards_after_a_call_with_a_bad_dtype_failed(backend):
    """param_dtype=int8 fails before any parameter became a shard, so the same module then
    shards (no "top-down" error) and computes."""
    untouched, is_unit, output_shape = _checks(backend)["retry_after_bad_dtype"]
    assert untouched and is_unit
    assert output_shape == (2, 6)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_module_without_parameters_is_a_no_op_unit(backend):
    is_unit, values = _checks(backend)["no_params"]
    assert is_unit
    assert values == [[0.0, 2.0]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_launched_rank_that_never_joined_the_job_is_refused(backend):
    """Without hp.init_distributed() a launched rank would train alone (MindSpore: every rank
    "rank 0 of 1"; torch: an IndexError deep in its mesh code): refused before anything
    changes, under hp-run's variables and msrun's, and on a group of one rank."""
    for rank, checks in enumerate(run_ranks("tests.bad_input:unjoined_launch_checks", 2, backend,
                                            env={"HP_TEST_NO_DIST": "1"}, timeout_s=200)):
        for launcher, variable in (("hp-run", "WORLD_SIZE=2"), ("msrun", "MS_WORKER_NUM=2")):
            for call in ("fully_shard", "init_device_mesh"):
                found_type, message, untouched = checks[launcher][call]
                assert found_type == "RuntimeError", (rank, launcher, call, message)
                assert (f"{call}: the launcher started a job of 2 ranks ({variable}) but this "
                        f"process has not joined it; call hp.init_distributed() first") in message
                assert untouched
            assert checks[launcher]["joined_after"] is False
        found_type, message, untouched = checks["world_of_one"]
        assert found_type == "RuntimeError" and untouched
        assert "job of 2 ranks (WORLD_SIZE=2) but this process joined a process group of 1 rank; " \
               "join the launcher's job with hp.init_distributed()" in message


def _fresh_process(scenario: str) -> dict:
    """``tests/backend_choice.py``'s scenario in a process with no HP_BACKEND and no
    launcher's variables."""
    dropped = ("HP_BACKEND", *LAUNCHER_WORLD_SIZE_VARS, "RANK", "MS_ROLE")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(GLOG_v="3", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "tests.backend_choice", scenario], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_model_framework_decides_where_hp_backend_is_unset_and_mismatches_are_named():
    if importlib.util.find_spec("mindspore") is None or importlib.util.find_spec("torch") is None:
        pytest.skip("needs both frameworks installed (the point is a process that imported both)")
    both = _fresh_process("both_imported")
    refused = both["torch_set_cell_given"]
    assert refused["type"] == "TypeError" and refused["untouched"]
    assert refused["message"].startswith("HP_BACKEND=torch, but the module (a SequentialCell) is "
                                         "a mindspore.nn.Cell; set HP_BACKEND=mindspore")
    ambiguous = both["init_unset"]
    assert ambiguous["type"] == "RuntimeError"
    assert "imported both torch and mindspore" in ambiguous["message"]
    assert "set HP_BACKEND=torch or HP_BACKEND=mindspore" in ambiguous["message"]
    assert both["joined_after_init"] == [False, False]
    assert both["chosen"] == "mindspore" and both["output_shape"] == [2, 3]
    refused = both["torch_model_after"]
    assert refused["type"] == "TypeError" and refused["untouched"]
    assert refused["message"].startswith(
        "this process runs hyper_parallel on mindspore (the first module given to hyper_parallel "
        "was a mindspore.nn.Cell), but the module (a Sequential) is a torch.nn.Module; set "
        "HP_BACKEND=torch")

    torch_only = _fresh_process("torch_only")
    refused = torch_only["mindspore_set_torch_given"]
    assert refused["type"] == "TypeError" and refused["untouched"]
    assert refused["message"].startswith("HP_BACKEND=mindspore, but the module (a Sequential) is "
                                         "a torch.nn.Module; set HP_BACKEND=torch")
    assert torch_only["chosen"] == "torch" and torch_only["grads"] == [True, True]
    assert torch_only["mindspore_imported"] is False
    refused = torch_only["cell_after"]
    assert refused["type"] == "TypeError" and refused["untouched"]
    assert refused["message"].startswith(
        "this process runs hyper_parallel on torch (HP_BACKEND is unset and the script imported "
        "only torch), but the module (a SequentialCell) is a mindspore.nn.Cell; set "
        "HP_BACKEND=mindspore")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_leaving_twice_is_harmless_and_a_rejoin_works_or_is_refused(backend):
    """``destroy_distributed`` twice does nothing the second time (MindSpore's own teardown
    crashed in its barrier) and the process is not joined after it; joining again works on
    torch and is refused on MindSpore, whose collectives fail after a rejoin. Before any
    join, ``fully_shard`` works on MindSpore (a world of one) and on torch, whose meshes
    need a process group, is refused naming ``hp.init_distributed()``."""
    result = _fresh_process(f"leave_twice_{backend}")
    before_join = result["before_join"]
    if backend == "torch":
        assert before_join["type"] == "RuntimeError" and before_join["untouched"]
        assert "needs a process group and this process has joined none; call " \
               "hp.init_distributed() first" in before_join["message"]
    else:
        assert before_join["type"] is None
    assert result["joined_after_leaving"] is False
    if backend == "torch":
        assert result["rejoin"] == {"type": None, "world_size": 1}
    else:
        assert result["rejoin"]["type"] == "RuntimeError"
        assert "cannot join a process group again" in result["rejoin"]["message"]
        assert result["rejoin"]["joined"] is False

