"""Rank side of the checkpoint safety checks (tests/test_checkpoint_safety.py), on the model
of tests/checkpoint_scenarios.py and its checkpoint A (torch, 2 ranks).

- ``error_checks_run``: loads of damaged and hostile copies of A (a file missing or
  truncated, an index naming files outside the directory or through a symbolic link,
  fields of the wrong type, NaN written over a tensor's bytes, ...), calls with wrong
  arguments, and saves to targets that are not ours (a directory of the user's files, a
  file, the working directory, a foreign ``path.saving`` or ``path.old``): per case, the
  error and whether the model, the optimizer and the files stayed as they were. Also the
  targets a save takes (an empty directory, its own checkpoint, a stale staging directory
  of its own), and A without its checksums (as written before they were recorded).
  Torch runs it at 1 rank, MindSpore at 2 (every rank must raise, none change anything).
- ``pending_at_destroy``: an asynchronous save left to ``hp.destroy_distributed()``;
  ``exit_with_pending_save``: one left to the interpreter's exit; ``loaded_state``: what
  loads from such a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

import hyper_parallel as hp
from tests.checkpoint_scenarios import DIM, VOCAB, _sharded, _side, _train
from tests.kit import get_kit


def pending_at_destroy(path: str) -> dict:
    """A launch's last job: an asynchronous save left pending, so that the
    ``hp.destroy_distributed()`` the rank calls next (tests/_rank_entry.py) must publish it
    before leaving the group. Returns the full parameters saved."""
    side = _side()
    model, opt = _sharded(side, (hp.get_platform().world_size(),))
    _train(side, model, opt, 0, 1)
    saved = hp.gather_full_state_dict(model)
    hp.save_checkpoint(path, model, opt, extra={"pending": get_kit().name}, async_save=True)
    return saved


def exit_with_pending_save(path: str, then_a_file_there: bool = False) -> None:
    """One process, no process group: the initial model saved asynchronously, then the
    interpreter exits without waiting; its exit hook must publish the save. With
    ``then_a_file_there``, a file of the user's appears at ``path`` first: the publish
    must refuse to replace it, and the hook say so."""
    side = _side()
    model = side.build()
    hp.save_checkpoint(path, model, extra={"pending": "exit"}, async_save=True)
    if then_a_file_there:
        with open(path, "w", encoding="utf-8") as file:
            file.write("the user's file\n")


def loaded_state(path: str) -> dict:
    """Checkpoint ``path`` loaded into a fresh model at this world size: its extra and the
    full parameters."""
    side = _side()
    model, opt = _sharded(side, (hp.get_platform().world_size(),))
    extra = hp.load_checkpoint(path, model, opt)
    return {"extra": extra, "full": hp.gather_full_state_dict(model)}


def _snapshot(model, opt) -> list:
    platform = hp.get_platform()
    values = [platform.to_numpy(platform.local_tensor(p)) for p in platform.optimizer_params(opt)]
    return values + [platform.to_numpy(t) for _, _, t in platform.optimizer_state(opt)]


def _barrier() -> None:
    platform = hp.get_platform()
    if platform.world_size() > 1:
        platform.barrier()


def _rank0_then_all(prepare) -> None:
    """``prepare()`` on rank 0 (the ranks share the directory), then every rank goes on."""
    if hp.get_platform().rank() == 0:
        prepare()
    _barrier()


def _header(file_path: str) -> tuple:
    """A safetensors file's header and where its data starts."""
    with open(file_path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        return json.loads(file.read(length)), 8 + length


def _corrupt(dir_a: str, work: str, how: str) -> str:
    target = os.path.join(work, how)
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(dir_a, target)
    index_path = os.path.join(target, "index.json")
    with open(index_path, encoding="utf-8") as file:
        index = json.load(file)
    shard = os.path.join(target, "rank-00001.safetensors")
    outside = os.path.join(work, f"outside-{how}.safetensors")
    slices = [s for entry in index["tensors"].values() for s in entry["slices"]]
    if how == "missing_file":
        os.remove(shard)
    elif how == "truncated":
        with open(shard, "rb+") as file:
            file.truncate(os.path.getsize(shard) // 2)
    elif how == "wrong_shape":
        index["tensors"]["lm_head.weight"]["shape"] = [VOCAB + 1, DIM]
    elif how == "missing_tensor":
        del index["tensors"]["layers.1.up.bias"]
    elif how == "missing_moment":
        del index["tensors"]["optim.exp_avg_sq.norm.weight"]
    elif how == "slice_not_in_file":
        index["tensors"]["norm.weight"]["slices"][0]["key"] = "nothing"
    elif how == "foreign":
        index = {"weight_map": {}}
    elif how in ("file_outside", "file_absolute", "shard_symlink_outside"):
        shutil.move(shard, outside)  # a file the loader must not open
        name = {"file_outside": os.path.join("..", os.path.basename(outside)),
                "file_absolute": outside}.get(how)
        if name is None:
            os.symlink(outside, shard)
        for stored in slices:
            if stored["file"] == "rank-00001.safetensors" and name is not None:
                stored["file"] = name
    elif how == "index_symlink_outside":
        with open(os.path.join(work, f"outside-{how}.json"), "w", encoding="utf-8") as file:
            json.dump(index, file)
        os.symlink(os.path.join(work, f"outside-{how}.json"), index_path + ".link")
        os.replace(index_path + ".link", index_path)
        return target
    elif how == "file_not_a_string":
        index["tensors"]["norm.weight"]["slices"][0]["file"] = 5
    elif how == "offsets_bool":
        index["tensors"]["lm_head.weight"]["slices"][0]["offsets"] = [False, 0]
    elif how == "size_negative":
        index["tensors"]["lm_head.weight"]["slices"][0]["shape"][0] = -1
    elif how == "slices_not_a_list":
        index["tensors"]["norm.weight"]["slices"] = index["tensors"]["norm.weight"]["slices"][0]
    elif how == "slices_overlap":  # rows 18-35 in the second slice: row 18 twice, 36 never
        index["tensors"]["lm_head.weight"]["slices"][1]["offsets"] = [VOCAB // 2, 0]
    elif how == "nan_over_bytes":
        header, data = _header(shard)
        start, _ = header["lm_head.weight"]["data_offsets"]
        with open(shard, "rb+") as file:
            file.seek(data + start)
            file.write(np.full(4, np.nan, np.float32).tobytes())
    elif how == "without_checksums":  # as written before checksums were recorded: loads
        for stored in slices:
            del stored["checksum"]
    with open(index_path, "w", encoding="utf-8") as file:
        json.dump(index, file)
    return target


CORRUPTIONS = ("missing_file", "truncated", "wrong_shape", "missing_tensor", "missing_moment",
               "slice_not_in_file", "foreign", "file_outside", "file_absolute",
               "shard_symlink_outside", "index_symlink_outside", "file_not_a_string",
               "offsets_bool", "size_negative", "slices_not_a_list", "slices_overlap",
               "nan_over_bytes")
# a rank reads only the files that hold its regions: these fail where they are read (on
# every rank, as a failure on another rank); the other corruptions on every rank by name
READ_FAILURES = ("missing_file", "truncated", "slice_not_in_file", "nan_over_bytes")


def _error_checks(side, dir_a: str, work: str) -> dict:
    """Per bad call: the error's text, and whether model and optimizer were unchanged."""
    model, opt = _sharded(side, (hp.get_platform().world_size(),))
    _train(side, model, opt, 0, 1)  # optimizer state that a half-done load would change
    out = {}
    _rank0_then_all(lambda: [_corrupt(dir_a, work, how)
                             for how in (*CORRUPTIONS, "without_checksums")])
    targets = {how: os.path.join(work, how) for how in (*CORRUPTIONS, "without_checksums")}
    cases = {how: (lambda how=how: hp.load_checkpoint(targets[how], model, opt))
             for how in CORRUPTIONS}
    cases["not_a_checkpoint"] = lambda: hp.load_checkpoint(work, model, opt)
    cases["extra_not_json"] = lambda: hp.save_checkpoint(os.path.join(work, "x"), model, opt,
                                                         extra={"f": object()})
    cases["key_map_collision"] = lambda: hp.save_checkpoint(
        os.path.join(work, "y"), model, opt, key_map=lambda name: name.rpartition(".")[2])
    cases["key_map_unknown"] = lambda: hp.load_checkpoint(
        dir_a, model, opt, key_map={"layers.0.up.weight": "layers.0.up.weight", "nope": "x"})
    cases["key_map_not_a_map"] = lambda: hp.load_checkpoint(dir_a, model, opt, key_map="weight")
    cases["optimizer_without_mapping"] = lambda: hp.load_checkpoint(
        dir_a, model, _side("sgd").optimizer(model))
    for how, call in cases.items():
        before = _snapshot(model, opt)
        try:
            call()
            message = None
        except (hp.CheckpointError, TypeError) as error:
            message = f"{type(error).__name__}: {error}"
        after = _snapshot(model, opt)
        out[how] = {"message": message,
                    "unchanged": all(np.array_equal(a, b) for a, b in zip(before, after))}
    # written before checksums were recorded: loads as the checkpoint itself does
    hp.load_checkpoint(dir_a, model, opt)
    expected = _snapshot(model, opt)
    _train(side, model, opt, 0, 1)
    hp.load_checkpoint(targets["without_checksums"], model, opt)
    out["without_checksums_loads"] = all(
        np.array_equal(a, b) for a, b in zip(expected, _snapshot(model, opt)))
    return out


def error_checks_run(dir_a: str, work: str) -> dict:
    """The bad checkpoints, arguments and save targets at this world size (MindSpore: each
    rank must raise and change nothing)."""
    side = _side()
    os.makedirs(work, exist_ok=True)
    return {"errors": _error_checks(side, dir_a, work),
            "targets": _target_checks(side, os.path.join(work, "targets"))}


# ------------------------------------------------------------------ what a save may replace
def _tree(path: str) -> dict:
    """Everything under ``path``: relative name -> the file's bytes, "dir" or the link."""
    out = {}
    for root, dirs, names in os.walk(path):
        for name in dirs + names:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            if os.path.islink(full):
                out[rel] = "link " + os.readlink(full)
            elif os.path.isdir(full):
                out[rel] = "dir"
            else:
                with open(full, "rb") as file:
                    out[rel] = file.read()
    return out


def _user_files(directory: str) -> None:
    os.makedirs(os.path.join(directory, "runs"))
    with open(os.path.join(directory, "mydata.txt"), "w", encoding="utf-8") as file:
        file.write("the user's data\n")
    with open(os.path.join(directory, "runs", "train.log"), "w", encoding="utf-8") as file:
        file.write("step 1\n")


def _target_checks(side, work: str) -> dict:
    """Saves to targets that are not ours (refused, the case's directory byte-identical
    after), wrong arguments (TypeError, nothing written), and targets a save takes: an
    empty directory, our own checkpoint (replaced), a stale staging directory of ours."""
    model, opt = _sharded(side, (hp.get_platform().world_size(),))
    _train(side, model, opt, 0, 1)
    cwd = os.getcwd()

    def prepare():
        shutil.rmtree(work, ignore_errors=True)
        _user_files(os.path.join(work, "user_directory", "ckpt"))
        os.makedirs(os.path.join(work, "user_file"))
        with open(os.path.join(work, "user_file", "ckpt"), "w", encoding="utf-8") as file:
            file.write("not a directory\n")
        for case in ("foreign_staging", "foreign_old"):
            suffix = ".saving" if case == "foreign_staging" else ".old"
            _user_files(os.path.join(work, case, "ckpt" + suffix))
        for case in ("not_a_model", "not_an_optimizer", "not_a_path", "export_not_a_model",
                     "verify_not_bool", "state_dict_not_a_model", "state_not_a_dict",
                     "full_state_flag_not_bool", "working_directory"):
            os.makedirs(os.path.join(work, case))
        os.makedirs(os.path.join(work, "empty_directory", "ckpt"))
        os.makedirs(os.path.join(work, "replaces_ours"))
        os.makedirs(os.path.join(work, "stale_staging_of_ours"))

    _rank0_then_all(prepare)
    ckpt = {case: os.path.join(work, case, "ckpt") for case in os.listdir(work)}
    refused = {
        "user_directory": lambda: hp.save_checkpoint(ckpt["user_directory"], model, opt),
        "user_file": lambda: hp.save_checkpoint(ckpt["user_file"], model, opt),
        "working_directory": lambda: hp.save_checkpoint(".", model, opt),
        "foreign_staging": lambda: hp.save_checkpoint(ckpt["foreign_staging"], model, opt),
        "foreign_old": lambda: hp.save_checkpoint(ckpt["foreign_old"], model, opt),
        "not_a_model": lambda: hp.save_checkpoint(ckpt["not_a_model"], "model"),
        "not_a_path": lambda: hp.load_checkpoint(None, model, opt),
        "export_not_a_model": lambda: hp.export_full(ckpt["export_not_a_model"], "model"),
        "verify_not_bool": lambda: hp.load_checkpoint(ckpt["verify_not_bool"], model, opt,
                                                      verify="yes"),
        "not_an_optimizer": lambda: hp.save_checkpoint(ckpt["not_an_optimizer"], model, "opt"),
        "state_dict_not_a_model": lambda: hp.get_state_dict(["model"]),
        "state_not_a_dict": lambda: hp.set_state_dict(model, [("weight", 1)], opt),
        "full_state_flag_not_bool": lambda: hp.get_full_state_dict(model, rank0_only="no"),
    }
    out = {}
    for case, call in refused.items():
        directory = os.path.join(work, case)
        before, state = _tree(directory), _snapshot(model, opt)
        siblings = (os.path.lexists(cwd + ".saving"), os.path.lexists(cwd + ".old"))
        try:
            call()
            message = None
        except (hp.CheckpointError, TypeError) as error:
            message = f"{type(error).__name__}: {error}"
        _barrier()
        out[case] = {"message": message, "files_same": _tree(directory) == before,
                     "state_same": all(np.array_equal(a, b) for a, b in
                                       zip(state, _snapshot(model, opt))),
                     "no_siblings": (os.path.lexists(cwd + ".saving"),
                                     os.path.lexists(cwd + ".old")) == siblings}
    taken = {}
    hp.save_checkpoint(ckpt["empty_directory"], model, opt, extra={"case": "empty"})
    taken["empty_directory"] = hp.load_checkpoint(ckpt["empty_directory"], model, opt)
    hp.save_checkpoint(ckpt["replaces_ours"], model, opt, extra={"save": 1})
    hp.save_checkpoint(ckpt["replaces_ours"], model, opt, extra={"save": 2})
    taken["replaces_ours"] = hp.load_checkpoint(ckpt["replaces_ours"], model, opt)
    _rank0_then_all(lambda: shutil.copytree(ckpt["replaces_ours"],
                                            ckpt["stale_staging_of_ours"] + ".saving"))
    hp.save_checkpoint(ckpt["stale_staging_of_ours"], model, opt, extra={"case": "stale"})
    taken["stale_staging_of_ours"] = hp.load_checkpoint(ckpt["stale_staging_of_ours"], model,
                                                        opt)
    out["taken"] = taken
    out["left_beside"] = {case: sorted(os.listdir(os.path.join(work, case)))
                          for case in ("empty_directory", "replaces_ours",
                                       "stale_staging_of_ours")}
    return out
