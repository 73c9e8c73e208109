"""Checkpoints that are safe to load and to save (tests/checkpoint_safety_scenarios.py), on
both frameworks: an index from an untrusted source is read only inside its directory and
type-checked, a tensor's bytes are checked against their checksum, a save never replaces
or removes what the library did not write, wrong arguments are a TypeError before anything
happens, and an asynchronous save left pending is published by ``destroy_distributed``
and at interpreter exit (a save the exit cannot publish fails the process). Every failing
call is shown to leave the model, the optimizer and the files as they were, on every rank.

The checks run in the checkpoint suite's launches (tests/checkpoint_launches.py): torch
at 1 rank, MindSpore at 2, each on copies of the suite's checkpoint A; the exit hook in
processes of their own per framework.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hyper_parallel.checkpoint.save import UNPUBLISHED_EXIT_CODE
from hyper_parallel.launch import find_free_port, rank_environment
from tests.checkpoint_launches import checkpoint_dir, launch_crossing, launch_resuming, \
    launch_saving, workdir
from tests.checkpoint_safety_scenarios import CORRUPTIONS, READ_FAILURES
from tests.checkpoint_scenarios import _initial
from tests.multirank import REPO_ROOT, run_plain_ranks

BACKENDS = ["torch", "mindspore"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_destroy_distributed_publishes_a_pending_async_save(backend):
    """``hp.save_checkpoint(..., async_save=True)`` and ``hp.destroy_distributed()`` right
    after it, at 2 ranks: the checkpoint is published (no path.saving left), and it loads
    (torch, 1 rank) as the parameters the run saved."""
    launch = (launch_saving if backend == "torch" else launch_crossing)()
    path = checkpoint_dir(f"pending-{backend}")
    assert sorted(os.listdir(workdir())).count(f"pending-{backend}.saving") == 0
    assert sorted(os.listdir(path)) == ["index.json", "rank-00000.safetensors",
                                        "rank-00001.safetensors"]
    loaded = launch_resuming()[f"pending_{backend}"]
    assert loaded["extra"] == {"pending": backend}
    assert sorted(loaded["full"]) == sorted(launch[0]["pending"])
    for key, value in launch[0]["pending"].items():
        np.testing.assert_array_equal(loaded["full"][key], value, err_msg=key)


def _exit_with_pending_save(backend: str, path, then_a_file_there: bool):
    """A process of its own running ``exit_with_pending_save``: its outcome."""
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    return subprocess.run(
        [sys.executable, "-c", "import sys; from tests.checkpoint_safety_scenarios import "
         "exit_with_pending_save; exit_with_pending_save(sys.argv[1], sys.argv[2] == '1')",
         str(path), "1" if then_a_file_there else "0"],
        cwd=REPO_ROOT, env={**os.environ, "HP_BACKEND": backend}, capture_output=True,
        text=True, timeout=240, check=False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_interpreter_exit_publishes_a_pending_async_save(backend, tmp_path):
    """A process that starts an asynchronous save and exits without waiting: its exit hook
    publishes the checkpoint (one process, no group)."""
    from safetensors.numpy import load_file

    path = tmp_path / "ckpt"
    done = _exit_with_pending_save(backend, path, False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not published" not in done.stderr, done.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    with open(path / "index.json", encoding="utf-8") as file:
        assert json.load(file)["extra"] == {"pending": "exit"}
    stored = load_file(str(path / "rank-00000.safetensors"))
    layer = ["attn_norm.weight", "mlp_norm.weight", "attn.weight", "up.weight", "up.bias",
             "down.weight"]
    assert sorted(stored) == sorted(["embed_tokens.weight", "norm.weight", "lm_head.weight",
                                     *(f"layers.{i}.{n}" for i in range(2) for n in layer)])
    for key, value in stored.items():
        np.testing.assert_array_equal(value, _initial(key, value.shape), err_msg=key)


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
    "key_map_collision": ["key_map gives", "the same stored name 'weight'"],
    "key_map_unknown": ["key_map names 'nope'", "does not have"],
    "key_map_not_a_map": ["TypeError", "key_map must be a dict"],
    "optimizer_without_mapping": ["torch.optim.adamw.AdamW", "does not map to", "optim.sgd.SGD"],
    # the index as untrusted input: every file inside the directory, every field typed
    "file_outside": ["index.json: tensors[", ".file: file '../outside-file_outside."
                     "safetensors' is not a plain file name"],
    "file_absolute": ["index.json: tensors[", "outside-file_absolute.safetensors' is not a "
                      "plain file name"],
    "shard_symlink_outside": ["file 'rank-00001.safetensors' resolves to", "outside-shard_"
                              "symlink_outside.safetensors, outside the checkpoint directory"],
    "index_symlink_outside": ["index.json", "outside-index_symlink_outside.json, outside the "
                              "checkpoint directory"],
    "file_not_a_string": ["tensors['norm.weight'].slices[0].file: the file name must be a "
                          "string, not int 5"],
    "offsets_bool": ["tensors['lm_head.weight'].slices[0].offsets must be a list of 2 "
                     "non-negative integers, not list [False, 0]"],
    "size_negative": ["tensors['lm_head.weight'].slices[0].shape must be a list of 2 "
                      "non-negative integers, not list [-1, 16]"],
    "slices_not_a_list": ["tensors['norm.weight'].slices must be a list, not dict"],
    # rank 0 of 2 finds the overlap, rank 1 the row no slice holds, 1 rank the overlap
    "slices_overlap": ["index.json: the slices of 'lm_head.weight'"],
    # the bytes of a tensor against its checksum
    "nan_over_bytes": ["rank-00001.safetensors", "tensor 'lm_head.weight'",
                       "do not match their checksum"],
}


def _checks(backend: str) -> list:
    """Per rank, the checks' results: torch at 1 rank, MindSpore at 2."""
    if backend == "torch":
        return [launch_resuming()["checks"]]
    return [r["checks"] for r in launch_crossing()]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", sorted(EXPECTED_ERRORS))
def test_bad_checkpoint_is_a_clear_error_and_changes_nothing(how, backend):
    """Every rank raises and changes nothing. A failure in a file is named by the ranks
    that read the file (the others report a failure on another rank); a bad index by
    every rank, before any shard file is opened."""
    assert set(EXPECTED_ERRORS) == {*CORRUPTIONS, "not_a_checkpoint", "extra_not_json",
                                    "key_map_collision", "key_map_unknown", "key_map_not_a_map",
                                    "optimizer_without_mapping"}
    per_rank = [r["errors"][how] for r in _checks(backend)]
    naming = []
    for rank, r in enumerate(per_rank):
        assert r["message"] is not None, f"rank {rank}, {how}: no error"
        assert r["unchanged"], f"rank {rank}, {how}: the failed call changed the model or optimizer"
        if all(part in r["message"] for part in EXPECTED_ERRORS[how]):
            naming.append(rank)
        else:
            assert how in READ_FAILURES and "failed on 1 other rank" in r["message"], \
                f"rank {rank}, {how}: {EXPECTED_ERRORS[how]} not in {r['message']!r}"
    assert naming, f"{how}: no rank names it: {[r['message'] for r in per_rank]}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoint_without_checksums_loads(backend):
    """A checkpoint written before checksums were recorded loads as before."""
    for rank, r in enumerate(_checks(backend)):
        assert r["errors"]["without_checksums_loads"], f"rank {rank}"


REFUSED_CALLS = {
    "user_directory": ["CheckpointError", "user_directory/ckpt: it is a directory that is not "
                       "a hyper_parallel checkpoint (it holds mydata.txt, runs)",
                       "nothing was written", "pick a new or empty directory"],
    "user_file": ["CheckpointError", "user_file/ckpt: a file of that name exists",
                  "pick a new or empty directory"],
    "working_directory": ["CheckpointError", "it is this process's working directory",
                          "pick a new or empty directory"],
    "foreign_staging": ["CheckpointError", "foreign_staging/ckpt.saving exists and is not a "
                        "hyper_parallel checkpoint's", "move it away"],
    "foreign_old": ["CheckpointError", "foreign_old/ckpt.old exists and is not a "
                    "hyper_parallel checkpoint's", "move it away"],
    "not_a_model": ["TypeError", "save_checkpoint(model=...) takes the", "not str 'model'"],
    "not_a_path": ["TypeError", "load_checkpoint(path=...) takes the checkpoint directory",
                   "not NoneType"],
    "export_not_a_model": ["TypeError", "export_full(model=...) takes the", "not str"],
    "verify_not_bool": ["TypeError", "load_checkpoint(verify=...) takes True or False"],
    "not_an_optimizer": ["TypeError", "save_checkpoint(optimizer=...) takes None or the",
                         "optimizer built on the model's parameters"],
    "state_dict_not_a_model": ["TypeError", "get_state_dict(model=...) takes the",
                               "not list ['model']"],
    "state_not_a_dict": ["TypeError", "set_state_dict(state=...) takes a dict", "not list"],
    "full_state_flag_not_bool": ["TypeError", "get_full_state_dict(rank0_only=...) takes "
                                 "True or False, not 'no'"],
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(REFUSED_CALLS))
def test_refused_save_or_argument_changes_nothing(case, backend):
    """A save that would replace or remove what this library did not write, and a call
    with a wrong argument, raise on every rank naming the path and the fix; the case's
    directory (user files, a subdirectory, a foreign path.saving or path.old) is byte for
    byte as it was, the model and optimizer too, and no sibling of the working directory
    appeared."""
    for rank, r in enumerate(_checks(backend)):
        r = r["targets"][case]
        assert r["message"] is not None, f"rank {rank}, {case}: no error"
        for part in REFUSED_CALLS[case]:
            assert part in r["message"], f"rank {rank}, {case}: {part!r} not in {r['message']!r}"
        assert r["files_same"], f"rank {rank}, {case}: the files changed"
        assert r["state_same"], f"rank {rank}, {case}: the model or optimizer changed"
        assert r["no_siblings"], f"rank {rank}, {case}: a .saving or .old appeared"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_save_takes_an_empty_directory_and_replaces_its_own(backend):
    """An existing empty directory is taken; our own checkpoint is replaced (the second
    save's extra loads); a stale path.saving of ours is cleared; nothing is left beside."""
    for rank, r in enumerate(_checks(backend)):
        r = r["targets"]
        assert r["taken"] == {"empty_directory": {"case": "empty"},
                              "replaces_ours": {"save": 2},
                              "stale_staging_of_ours": {"case": "stale"}}, f"rank {rank}"
        assert r["left_beside"] == {case: ["ckpt"] for case in r["left_beside"]}, f"rank {rank}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_exit_says_loudly_which_save_it_could_not_publish(backend, tmp_path):
    """A file of the user's appears at the path of a pending asynchronous save before the
    process exits: the exit hook refuses to replace it, leaves it as it was (and no
    path.saving), prints an error naming the path, and the process exits non-zero."""
    path = tmp_path / "ckpt"
    done = _exit_with_pending_save(backend, path, True)
    assert done.returncode == UNPUBLISHED_EXIT_CODE, done.stderr[-3000:]
    assert (f"hyper_parallel: ERROR: the asynchronous save to {path} was not published"
            in done.stderr), done.stderr[-3000:]
    assert "a file of that name exists" in done.stderr, done.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert path.read_text(encoding="utf-8") == "the user's file\n"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_async_save_the_exit_could_not_publish_fails_the_job(backend, tmp_path):
    """2 ranks of plain ``python`` (tests/async_exit_script.py): an asynchronous save, the
    group left the framework's way before it was waited for, the script ends. Every rank
    exits non-zero with the error naming the path; nothing is published (no checkpoint at
    the path, ``path.saving`` without an index) and the user's file beside it is as it was."""
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    path = tmp_path / "ckpt"
    (tmp_path / "notes.txt").write_text("the user's\n", encoding="utf-8")
    port = find_free_port()
    envs = [rank_environment(rank, rank, 2, 2, "127.0.0.1", port, backend) for rank in range(2)]
    codes, outputs = run_plain_ranks(
        [sys.executable, str(REPO_ROOT / "tests" / "async_exit_script.py"), str(path)], envs,
        tmp_path, 240)
    for rank, output in enumerate(outputs):
        assert f"rank {rank}: the script's last line" in output, output[-3000:]
        assert codes[rank] == UNPUBLISHED_EXIT_CODE, f"rank {rank}: {codes}\n{output[-3000:]}"
        assert (f"hyper_parallel: ERROR: the asynchronous save to {path} was not published"
                in output and "left the process group" in output), output[-3000:]
    assert not path.exists()
    staging = sorted(os.listdir(tmp_path / "ckpt.saving"))
    assert "index.json" not in staging and "rank-00001.safetensors" in staging, staging
    assert (tmp_path / "notes.txt").read_text(encoding="utf-8") == "the user's\n"
