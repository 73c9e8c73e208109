"""Portable sharded checkpoints (tests/checkpoint_scenarios.py): a run saved on torch at 2
ranks (FSDP) resumes at 1 rank on torch and at 2 ranks (HSDP 2x1) on MindSpore, and
MindSpore's checkpoint (written by the HSDP run) resumes on MindSpore FSDP and on torch at
1 rank; a rank killed mid-save leaves the previous checkpoint; corrupt and foreign
checkpoints fail with errors naming the file and tensor, changing nothing. Four launches
in all (torch 2, MindSpore 2, torch 2 crashing, torch 1). Regions that straddle stored
slices (2 -> 3 ranks) are checked without processes.

Same framework, the resumed loss curve continues the uninterrupted one to 1e-5 relative
(fp32). Across frameworks, to twice what the two frameworks' own single-process
references agree to over the same steps (measured in the run, reported on failure).
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

import numpy as np
import pytest

from tests.checkpoint_scenarios import CORRUPTIONS, STEPS
from tests.multirank import RankFailure, run_ranks

SAME_FRAMEWORK_RTOL = 1e-5


@functools.lru_cache(maxsize=None)
def _workdir() -> str:
    path = tempfile.mkdtemp(prefix="hp-ckpt-")
    atexit.register(shutil.rmtree, path, True)
    return path


def _dir(name: str) -> str:
    return os.path.join(_workdir(), name)


def _mean(per_rank: list, key: str) -> np.ndarray:
    return np.mean([r[key] for r in per_rank], axis=0)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.abs(b)))


@functools.lru_cache(maxsize=None)
def _saved() -> list:
    return run_ranks("tests.checkpoint_scenarios:save_run", 2, "torch", _dir("A"), timeout_s=120)


@functools.lru_cache(maxsize=None)
def _crossed() -> list:
    _saved()
    return run_ranks("tests.checkpoint_scenarios:cross_run", 2, "mindspore", _dir("A"),
                     _dir("B"), timeout_s=300)


@functools.lru_cache(maxsize=None)
def _crashed() -> str:
    """The message of the save that lost rank 1 midway."""
    with pytest.raises(RankFailure) as failure:
        run_ranks("tests.checkpoint_scenarios:crash_run", 2, "torch", _dir("C"), timeout_s=60)
    return str(failure.value)


@functools.lru_cache(maxsize=None)
def _resumed_on_one() -> dict:
    _crossed()
    _crashed()
    os.makedirs(_dir("checks"), exist_ok=True)
    return run_ranks("tests.checkpoint_scenarios:resume_run", 1, "torch", _dir("A"), (1,),
                     _dir("B"), _dir("checks"), _dir("C"), timeout_s=120)[0]


def _uninterrupted_after_a() -> np.ndarray:
    return _mean(_saved(), "losses")[STEPS:]


def _cross_tolerance() -> float:
    """What torch's and MindSpore's single-process references agree to, doubled."""
    return 2 * _rel(_crossed()[0]["ref"], _saved()[0]["ref"])


@pytest.mark.timeout(600)
def test_resume_on_torch_at_one_rank():
    r = _resumed_on_one()
    assert r["extra"] == {"step": STEPS, "framework": "torch"}
    diff = _rel(r["resumed"], _uninterrupted_after_a())
    assert diff <= SAME_FRAMEWORK_RTOL, f"resumed at 1 rank differs by {diff:.2e}"


@pytest.mark.timeout(600)
def test_torch_checkpoint_resumes_on_mindspore():
    per_rank = _crossed()
    assert per_rank[0]["extra"] == {"step": STEPS, "framework": "torch"}
    tolerance = _cross_tolerance()
    diff = _rel(_mean(per_rank, "resumed"), _uninterrupted_after_a())
    assert diff <= tolerance, (f"MindSpore resumed from torch differs by {diff:.2e}; the "
                               f"references agree to {tolerance / 2:.2e}")


@pytest.mark.timeout(600)
def test_mindspore_resumes_its_own_checkpoint_resharded():
    per_rank = _crossed()
    diff = _rel(_mean(per_rank, "resumed_same"), _mean(per_rank, "after_save"))
    assert diff <= SAME_FRAMEWORK_RTOL, f"MindSpore resumed (2x1 -> 2) differs by {diff:.2e}"


@pytest.mark.timeout(600)
def test_mindspore_checkpoint_resumes_on_torch():
    tolerance = _cross_tolerance()
    diff = _rel(_resumed_on_one()["resumed_b"], _mean(_crossed(), "after_save"))
    assert diff <= tolerance, (f"torch resumed from MindSpore differs by {diff:.2e}; the "
                               f"references agree to {tolerance / 2:.2e}")


@pytest.mark.timeout(600)
def test_crash_mid_save_leaves_previous_checkpoint():
    message = _crashed()
    # rank 1 dies after writing its file; rank 0, waiting for it in the save's agreement,
    # may see the dead peer and fail first: then no rank was left to end
    assert ("rank 1 failed with exit code 17" in message
            or ("rank 0 failed" in message and "ended ranks []" in message)), message
    assert _resumed_on_one()["crashed"] == {"extra": {"checkpoint": "C"}, "initial": True}


EXPECTED_ERRORS = {
    "missing_file": ["rank-00001.safetensors", "missing"],
    "truncated": ["rank-00001.safetensors", "truncated"],
    "wrong_shape": ["index.json", "lm_head.weight", "shape"],
    "missing_tensor": ["index.json", "different model", "layers.1.up.bias"],
    "missing_moment": ["index.json", "optim.exp_avg_sq.norm.weight", "missing"],
    "slice_not_in_file": ["rank-0000", "'nothing'"],
    "foreign": ["index.json", "not a hyper_parallel checkpoint"],
    "not_a_checkpoint": ["index.json does not exist"],
    "extra_not_json": ["TypeError", "JSON-serialisable"],
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", sorted(EXPECTED_ERRORS))
def test_bad_checkpoint_is_a_clear_error_and_changes_nothing(how):
    assert set(EXPECTED_ERRORS) == {*CORRUPTIONS, "not_a_checkpoint", "extra_not_json"}
    r = _resumed_on_one()["errors"][how]
    assert r["message"] is not None, f"{how}: no error"
    for part in EXPECTED_ERRORS[how]:
        assert part in r["message"], f"{how}: {part!r} not in {r['message']!r}"
    assert r["unchanged"], f"{how}: the failed call changed the model or optimizer"


@pytest.mark.timeout(600)
def test_bfloat16_stored_as_bf16_bit_for_bit():
    r = _resumed_on_one()["bf16"]
    assert r == {"equal": True, "dtypes": ["bfloat16"], "file_says_bf16": True}


def test_regions_straddling_stored_slices(tmp_path):
    """Rows split 19/18 over 2 files (the 2-rank layout of 37 rows), read as a 3-rank layout
    (13/13/11): rank 1's rows 13-25 come from both files. bfloat16 and float32."""
    from hyper_parallel.checkpoint.files import SliceReader, write_file
    from hyper_parallel.checkpoint.index import add_slice, merge, new_partial
    from hyper_parallel.checkpoint.layout import Held
    from hyper_parallel.checkpoint.load import _read_region

    rng = np.random.default_rng(0)
    full = {"float32": rng.standard_normal((37, 5)).astype(np.float32),
            "bfloat16": (rng.standard_normal((37, 5)).astype(np.float32).view(np.uint32)
                         & 0xFFFF0000).view(np.float32)}
    partials = []
    for rank, (start, rows) in enumerate([(0, 19), (19, 18)]):
        partial, file = new_partial(False), f"rank-{rank:05d}.safetensors"
        for dtype, array in full.items():
            add_slice(partial, dtype, dtype, (37, 5), file, (start, 0), (rows, 5))
        write_file(str(tmp_path / file), {d: (d, a[start:start + rows]) for d, a in full.items()})
        partials.append(partial)
    index = merge(partials, "none", 2, None)
    reader = SliceReader(str(tmp_path))
    for dtype, array in full.items():
        for start, rows in [(0, 13), (13, 13), (26, 11)]:
            held = Held(dtype, None, None, dtype, (37, 5), 0, start, rows, rows, True)
            region = _read_region(reader, str(tmp_path), dtype, index["tensors"][dtype], held)
            np.testing.assert_array_equal(region, array[start:start + rows])
