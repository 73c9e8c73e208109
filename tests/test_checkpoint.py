"""Portable sharded checkpoints (tests/checkpoint_scenarios.py): a run saved on torch at 2
ranks (FSDP) resumes at 1 rank on torch and at 2 ranks (HSDP 2x1) on MindSpore, and
MindSpore's checkpoint (written by the HSDP run) resumes on MindSpore FSDP and on torch at 1
rank; a rank killed mid-save leaves the previous checkpoint (corrupt, hostile and foreign
checkpoints, save targets that are not ours and pending asynchronous saves:
tests/test_checkpoint_safety.py, in the same launches). A second model, written with each
framework's own nn layers (Embedding, BatchNorm1d, LayerNorm), takes the same route through
``key_map=hp.torch_nn_names``, with its buffers and MindSpore's ``requires_grad=False``
moving statistics, and resumes on torch without the map (``num_batches_tracked`` included).
Four launches in all (torch 2, MindSpore 2, torch 2 crashing, torch 1:
tests/checkpoint_launches.py), each running both models' jobs. Regions that straddle stored
slices (2 -> 3 ranks), the choice of the rank that writes a region, and torch's
tensor-parallel blocks are checked without processes. In the suite's shared 4-rank launches:
torch tensor parallelism (tests/tp_checkpoint_scenarios.py: saved at (dp=2, tp=2), resumed in six
layouts, then in this process in a plain model) and, on both frameworks, a mesh with a dim
that is not data parallel.

Same framework, the resumed loss curve continues the uninterrupted one to 1e-5 relative
(fp32). Across frameworks, to twice what the two frameworks' own single-process
references agree to over the same steps (measured in the run, reported on failure).
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from hyper_parallel.checkpoint import CheckpointError
from tests import shared_launch
from tests.checkpoint_launches import checkpoint_dir, crashed, launch_crossing, \
    launch_resuming, launch_saving
from tests.checkpoint_scenarios import STEPS

SAME_FRAMEWORK_RTOL = 1e-5
BACKENDS = ["torch", "mindspore"]

# 4 ranks, in the suite's shared 4-rank launch of each framework (tests/shared_launch.py)
shared_launch.register(__name__, "checkpoint_mesh", 4, "tests.checkpoint_scenarios:mesh_run",
                       lambda backend: (os.path.join(shared_launch.directory(
                           f"ckpt-mesh-{backend}"), "ckpt"),), timeout_s=300)
shared_launch.register(__name__, "checkpoint_tensor_parallel", 4,
                       "tests.tp_checkpoint_scenarios:run_all",
                       lambda backend: (shared_launch.directory("ckpt-tp"),),
                       backends=("torch",), timeout_s=180)


def _mean(per_rank: list, key: str) -> np.ndarray:
    return np.mean([r[key] for r in per_rank], axis=0)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.abs(b)))


def _saved() -> list:
    return [r["lm"] for r in launch_saving()]


def _bn_saved() -> list:
    return [r["bn"] for r in launch_saving()]


def _crossed() -> list:
    return [r["lm"] for r in launch_crossing()]


def _bn_crossed() -> list:
    return [r["bn"] for r in launch_crossing()]


def _resumed_on_one() -> dict:
    return launch_resuming()["lm"]


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


def _sgd(launch) -> list:
    return [r["sgd"] for r in launch]


@pytest.mark.timeout(600)
def test_sgd_momentum_resumes_at_one_rank_on_torch():
    """torch.optim.SGD(momentum=0.9) saved at 2 ranks, its momentum_buffer resharded to 1."""
    saved, r = _sgd(launch_saving()), launch_resuming()["sgd"]
    diff = _rel(r["resumed"], _mean(saved, "losses")[STEPS:])
    assert diff <= SAME_FRAMEWORK_RTOL, f"resumed at 1 rank differs by {diff:.2e}"


@pytest.mark.timeout(600)
def test_sgd_momentum_resumes_on_mindspore_resharded():
    per_rank = _sgd(launch_crossing())
    diff = _rel(_mean(per_rank, "resumed_same"), _mean(per_rank, "after_save"))
    assert diff <= SAME_FRAMEWORK_RTOL, f"MindSpore SGD resumed (2x1 -> 2) differs by {diff:.2e}"


@pytest.mark.timeout(600)
def test_sgd_momentum_moves_between_the_frameworks():
    """torch's momentum_buffer into MindSpore's accum (stat: stepped), and back."""
    saved, crossed = _sgd(launch_saving()), _sgd(launch_crossing())
    tolerance = 2 * _rel(crossed[0]["ref"], saved[0]["ref"])
    diff = _rel(_mean(crossed, "resumed"), _mean(saved, "losses")[STEPS:])
    assert diff <= tolerance, (f"MindSpore SGD resumed from torch differs by {diff:.2e}; the "
                               f"references agree to {tolerance / 2:.2e}")
    diff = _rel(launch_resuming()["sgd"]["resumed_b"], _mean(crossed, "after_save"))
    assert diff <= tolerance, (f"torch SGD resumed from MindSpore differs by {diff:.2e}; the "
                               f"references agree to {tolerance / 2:.2e}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("launch", ["torch", "mindspore"])
def test_any_optimizer_resumes_as_itself(launch):
    """Optimizers with other state than Adam's (torch: SGD without momentum, Adam with
    amsgrad, Adagrad, centered RMSprop with momentum; MindSpore: nn.SGD, nn.Momentum,
    nn.Adam with its own beta powers and global step, experimental Adam and Adagrad), each
    saved at 2 ranks and resumed into a fresh optimizer of its class."""
    per_rank = (launch_saving if launch == "torch" else launch_crossing)()
    curves = [r["optimizers"] for r in per_rank]
    for name in curves[0]:
        uninterrupted = np.mean([c[name][0] for c in curves], axis=0)
        resumed = np.mean([c[name][1] for c in curves], axis=0)
        diff = _rel(resumed, uninterrupted)
        assert diff <= SAME_FRAMEWORK_RTOL, f"{name} resumed differs by {diff:.2e}"


def _bn_uninterrupted_after_a() -> np.ndarray:
    return np.asarray(_bn_saved()[0]["losses"][2 * STEPS:])  # a training and an eval loss per step


def _bn_cross_tolerance() -> float:
    return 2 * _rel(_bn_crossed()[0]["ref"], _bn_saved()[0]["ref"])


def _max_state_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float(np.max(np.abs(np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64))))
               for k in a)


@pytest.mark.timeout(600)
def test_batchnorm_buffers_resume_on_torch_at_one_rank():
    """torch's buffers (running statistics, the int64 0-dim num_batches_tracked) saved at 2
    ranks and restored at 1: the evaluation losses, which read them, continue too."""
    r = launch_resuming()["bn"]["native"]
    saved = _bn_saved()[0]
    assert sorted(r["buffers"]) == ["bn.num_batches_tracked", "bn.running_mean", "bn.running_var"]
    assert int(r["buffers"]["bn.num_batches_tracked"]) == STEPS
    for name, value in saved["saved_buffers"].items():
        np.testing.assert_array_equal(r["buffers"][name], value, err_msg=name)
    diff = _rel(r["resumed"], _bn_uninterrupted_after_a())
    assert diff <= SAME_FRAMEWORK_RTOL, f"resumed at 1 rank differs by {diff:.2e}"
    assert _max_state_diff(r["final"], saved["final"]) <= 1e-6


@pytest.mark.timeout(600)
def test_batchnorm_moving_statistics_resume_on_mindspore_resharded():
    """MindSpore's requires_grad=False moving_mean/moving_variance, updated by training
    under fully_shard, saved from HSDP 2x1 and restored into FSDP 2."""
    for rank, r in enumerate(_bn_crossed()):
        diff = _rel(r["resumed_same"], r["after_save"])
        assert diff <= SAME_FRAMEWORK_RTOL, f"rank {rank}: resumed differs by {diff:.2e}"
        assert _max_state_diff(r["final_same"], r["final"]) <= 1e-6
        assert np.any(r["final"]["bn.running_mean"] != 0), "the moving mean never moved"


@pytest.mark.timeout(600)
def test_batchnorm_model_moves_from_torch_layers_to_mindspore_layers():
    """torch's nn.Embedding/BatchNorm1d/LayerNorm checkpoint, saved with
    key_map=hp.torch_nn_names, loaded into MindSpore's nn.Embedding/BatchNorm1d/LayerNorm
    (embedding_table, gamma/beta, moving_mean/moving_variance) with the same map."""
    saved, tolerance = _bn_saved()[0], _bn_cross_tolerance()
    for r in _bn_crossed():
        for name, value in r["loaded_buffers"].items():
            np.testing.assert_array_equal(value, saved["saved_buffers"][name], err_msg=name)
        diff = _rel(r["resumed"], _bn_uninterrupted_after_a())
        assert diff <= tolerance, (f"MindSpore resumed from torch differs by {diff:.2e}; the "
                                   f"references agree to {tolerance / 2:.2e}")


@pytest.mark.timeout(600)
def test_batchnorm_model_moves_from_mindspore_layers_to_torch_layers():
    r, tolerance = launch_resuming()["bn"], _bn_cross_tolerance()
    diff = _rel(r["from_mindspore"], _bn_crossed()[0]["after_save"])
    assert diff <= tolerance, (f"torch resumed from MindSpore differs by {diff:.2e}; the "
                               f"references agree to {tolerance / 2:.2e}")
    # through the map on the same framework: num_batches_tracked is left out, the rest is there
    assert int(r["mapped"]["buffers"]["bn.num_batches_tracked"]) == 0
    assert _rel(r["mapped"]["resumed"], _bn_uninterrupted_after_a()) <= SAME_FRAMEWORK_RTOL


@pytest.mark.timeout(600)
def test_crash_mid_save_leaves_previous_checkpoint():
    message = crashed()
    # rank 1 dies after writing its file; rank 0, waiting for it in the save's agreement,
    # may see the dead peer and fail first: then no rank was left to end
    assert ("rank 1 failed with exit code 17" in message
            or ("rank 0 failed" in message and "ended ranks []" in message)), message
    assert _resumed_on_one()["crashed"] == {"extra": {"checkpoint": "C"}, "initial": True}


@pytest.mark.timeout(600)
def test_rank_dying_in_an_async_write_leaves_previous_checkpoint():
    message = crashed("crash_async_run", "C-async")
    assert ("rank 1 failed with exit code 17" in message
            or ("rank 0 failed" in message and "ended ranks []" in message)), message
    assert launch_resuming()["crashed_async"] == {"extra": {"checkpoint": "C"}, "initial": True}
    assert os.path.isdir(checkpoint_dir("C-async") + ".saving")  # the unpublished write, cleared next save


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
        partial, file = new_partial(None), f"rank-{rank:05d}.safetensors"
        for dtype, array in full.items():
            add_slice(partial, dtype, dtype, (37, 5), file, (start, 0), (rows, 5))
        write_file(str(tmp_path / file), {d: (d, a[start:start + rows]) for d, a in full.items()})
        partials.append(partial)
    index = merge(partials, "none", 2, None)
    reader = SliceReader(str(tmp_path))
    for dtype, array in full.items():
        for start, rows in [(0, 13), (13, 13), (26, 11)]:
            held = Held(dtype, None, None, dtype, (37, 5), (start, 0), (rows, 5))
            region = _read_region(reader, str(tmp_path), dtype, index["tensors"][dtype], held)
            np.testing.assert_array_equal(region, array[start:start + rows])


class _ThreadRanks:
    """A stand-in platform for ``world`` ranks run as threads of this process: enough for
    ``written_here``, whose only collective is ``all_gather``."""

    def __init__(self, world: int):
        self.world, self._local = world, threading.local()
        self._barrier, self._inputs = threading.Barrier(world, timeout=30), [None] * world

    def rank(self):
        return self._local.rank

    def world_size(self):
        return self.world

    def is_initialized(self):
        return True

    def from_numpy(self, array):
        return array.copy()

    def to_numpy(self, array):
        return array

    def all_gather(self, tensor, group):
        self._inputs[self.rank()] = tensor
        self._barrier.wait()
        pieces = list(self._inputs)
        self._barrier.wait()
        return SimpleNamespace(wait=lambda: SimpleNamespace(pieces=pieces))

    def run(self, per_rank) -> list:
        """``per_rank(rank)`` on every rank at once: its result, or the exception it raised."""
        out = [None] * self.world

        def call(rank):
            self._local.rank = rank
            try:
                out[rank] = per_rank(rank)
            except Exception as error:  # noqa: BLE001 - compared by the test
                out[rank] = error

        threads = [threading.Thread(target=call, args=(r,)) for r in range(self.world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return out


def test_the_lowest_rank_holding_a_region_writes_it():
    """3 ranks: "w" (5 rows) sharded over ranks 0 and 1 (3 and 2 rows), rank 2 a replica of
    rank 0; "tail" split so that rank 1's part is empty; "empty" holds no elements (the
    lowest rank writes its empty slice, so the index lists it); "whole" on every rank.
    A rank that holds other values makes every rank raise, naming it."""
    from hyper_parallel.checkpoint.layout import Held, written_here

    regions = {  # rank: [(name, shape, offsets, region shape)]
        0: [("w", (5, 4), (0, 0), (3, 4)), ("tail", (4,), (0,), (4,)),
            ("empty", (0, 3), (0, 0), (0, 3)), ("whole", (), (), ())],
        1: [("w", (5, 4), (3, 0), (2, 4)), ("tail", (4,), (4,), (0,)),
            ("empty", (0, 3), (0, 0), (0, 3)), ("whole", (), (), ())],
        2: [("w", (5, 4), (0, 0), (3, 4)), ("tail", (4,), (0,), (4,)),
            ("empty", (0, 3), (0, 0), (0, 3)), ("whole", (), (), ())],
    }

    def held(rank):
        return [Held(n, None, None, "float32", s, o, r) for n, s, o, r in regions[rank]]

    ranks = _ThreadRanks(3)
    written = ranks.run(lambda rank: [h.name for h in written_here(ranks, held(rank))])
    assert written == [["w", "tail", "empty", "whole"], ["w"], []]
    regions[2] = regions[2][:3]
    errors = ranks.run(lambda rank: written_here(ranks, held(rank)))
    for error in errors:
        assert isinstance(error, CheckpointError), error
        assert "rank 2 holds other parameters or shapes than rank 0 (3 values against 4)" \
            in str(error)


def test_tensor_parallel_block_follows_dtensor_placements():
    """torch: this rank's block of the whole tensor under Shard and Replicate placements,
    uneven splits included, as DTensor lays it out; a placement that interleaves
    (_StridedShard) gives no block."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    import itertools

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import _utils
    from torch.distributed.tensor.placement_types import _StridedShard

    from hyper_parallel.platform.torch.tensor_parallel import TP_SPEC, TorchTensorParallel

    class Mesh:  # what tensor_parallel_block reads of a torch DeviceMesh
        def __init__(self, shape, coordinate):
            self.shape, self.coordinate = shape, coordinate

        def size(self, dim):
            return self.shape[dim]

        def get_coordinate(self):
            return list(self.coordinate)

    def block(shape, mesh, placements):
        param = SimpleNamespace(**{TP_SPEC: (mesh, placements, shape, None)})
        return TorchTensorParallel.tensor_parallel_block(None, param)

    cases = [((37, 5), (2,), [Shard(0)]), ((5, 37), (4,), [Shard(1)]),
             ((37, 6), (2, 3), [Shard(0), Shard(1)]), ((37, 6), (2, 2), [Shard(0), Shard(0)]),
             ((7, 6), (2, 3), [Replicate(), Shard(1)]), ((3,), (4,), [Shard(0)])]
    for shape, mesh_shape, placements in cases:
        for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
            sizes, offsets = _utils._compute_local_shape_and_global_offset(
                shape, mesh_shape, list(coordinate), placements)
            got = block(shape, Mesh(mesh_shape, coordinate), placements)
            assert got[0] == shape
            nonempty = all(sizes)
            assert not nonempty or got[1] == tuple(offsets), (shape, placements, coordinate)
    assert block((8, 4), Mesh((2,), (1,)), [_StridedShard(0, split_factor=2)]) is None


def test_optimizer_state_without_counterpart_is_named():
    """A move between corresponding optimizers (torch SGD -> MindSpore SGD) converts the
    momentum and sets MindSpore's first-step flag; a state the table does not name is an
    error naming both optimizers and the state."""
    from hyper_parallel.checkpoint.optimizers import KINDS, _convert

    torch_sgd, ms_sgd = "torch.optim.sgd.SGD", "mindspore.experimental.optim.sgd.SGD"
    momentum = np.ones((3, 2), np.float32)
    values, step = _convert("index.json", torch_sgd, ms_sgd, KINDS[torch_sgd], KINDS[ms_sgd],
                            {"momentum_buffer": momentum}, {})
    assert step is None and values["stat"] == 0 and values["accum"] is momentum
    values, _ = _convert("index.json", ms_sgd, torch_sgd, KINDS[ms_sgd], KINDS[torch_sgd],
                         {"accum": momentum, "stat": np.ones((3, 2), np.float32)}, {})
    assert values == {}, "a MindSpore parameter that has not stepped has no torch state"
    with pytest.raises(CheckpointError, match=r"torch.optim.sgd.SGD's state 'velocity' has no "
                                              r"counterpart in mindspore.experimental"):
        _convert("index.json", torch_sgd, ms_sgd, KINDS[torch_sgd], KINDS[ms_sgd],
                 {"momentum_buffer": momentum, "velocity": momentum}, {})


# ------------------------------------------------------------------ tensor parallelism, meshes
NO_TENSOR_PARALLEL = ("MindSpore has no tensor-parallel parameters (no DTensor, and no "
                      "hyper_parallel tensor-parallel layer there): the tensor-parallel "
                      "checkpoint is torch's")
# attn.k.bias gets a gradient that is zero up to rounding (softmax ignores what it adds to
# every score of a query), which AdamW turns into steps of about lr: its values after
# training follow the reduction order, which another tensor-parallel degree changes
ROUNDING_ONLY = ("layers.0.attn.k.bias", "layers.1.attn.k.bias")


def _tensor_parallel(backend: str) -> list:
    if backend == "mindspore":
        pytest.skip(NO_TENSOR_PARALLEL)
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    return shared_launch.results("checkpoint_tensor_parallel", "torch")


def _param_diff(a: dict, b: dict, skip: tuple = ()) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a if k not in skip)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_parallel_run_resumes_in_other_layouts(backend):
    """Saved at (dp=2, tp=2), resumed at (dp=2, tp=2) through dp_mesh_dims and through
    mesh["dp"], with the dims swapped, replicated over dp, at (dp=1, tp=4) and without
    tensor parallelism (FSDP over 4 ranks): losses and parameters continue the
    uninterrupted run."""
    from tests.tp_checkpoint_scenarios import LAYOUTS

    per_rank = _tensor_parallel(backend)
    uninterrupted = _mean(per_rank, "losses")[STEPS:]
    assert list(per_rank[0]["layouts"]) == list(LAYOUTS)
    for name, resumed in per_rank[0]["layouts"].items():
        assert resumed["extra"] == {"step": STEPS}, name
        diff = _rel(np.mean([r["layouts"][name]["losses"] for r in per_rank], axis=0),
                    uninterrupted)
        assert diff <= SAME_FRAMEWORK_RTOL, f"{name}: resumed losses differ by {diff:.2e}"
        same_degree = LAYOUTS[name][0] is not None and LAYOUTS[name][0][1] == 2
        diff = _param_diff(resumed["final"], per_rank[0]["final"],
                           () if same_degree else ROUNDING_ONLY)
        assert diff <= 1e-5, f"{name}: resumed parameters differ by {diff:.2e}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_parallel_parameter_outside_every_unit_is_refused(backend):
    for rank, r in enumerate(_tensor_parallel(backend)):
        assert r["outside_unit"] is not None and "embed.weight is a tensor-parallel parameter " \
            "outside every fully_shard unit" in r["outside_unit"], f"rank {rank}"
        assert not r["wrote_c"], f"rank {rank}: the refused save wrote something"
        # the full state dict too: this rank's part alone is no full value
        assert r["full_outside_unit"] is not None and "embed.weight is a tensor-parallel " \
            "parameter outside every fully_shard unit" in r["full_outside_unit"], f"rank {rank}"


def _tiled_once(path: str) -> dict:
    """Per stored tensor of checkpoint ``path``: how often its slices cover each element
    (the fewest and the most), and its shape."""
    with open(os.path.join(path, "index.json"), encoding="utf-8") as file:
        tensors = json.load(file)["tensors"]
    out = {}
    for key, entry in tensors.items():
        count = np.zeros(entry["shape"], np.int64)
        for stored in entry["slices"]:
            count[tuple(slice(o, o + n) for o, n in zip(stored["offsets"], stored["shape"]))] += 1
        out[key] = (int(count.min()), int(count.max()), tuple(entry["shape"]))
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_parallel_checkpoint_holds_whole_tensors(backend, monkeypatch):
    """Checkpoint A (saved at dp=2, tp=2) and B (the mesh["dp"] model's, just after it
    loaded A) store every tensor at its whole shape, each element written once; both load
    into a plain model in this process (one rank, no tensor parallelism) as the whole
    parameters the saving run gathered, as does export_full's output; that model then
    trains on as the uninterrupted run did."""
    per_rank = _tensor_parallel(backend)
    monkeypatch.setenv("HP_BACKEND", "torch")
    from safetensors.numpy import load_file

    import hyper_parallel as hp
    from tests import tp_checkpoint_scenarios as tp

    directory = shared_launch.directory("ckpt-tp")
    saved = per_rank[0]["saved"]
    a, b = _tiled_once(os.path.join(directory, "A")), _tiled_once(os.path.join(directory, "B"))
    assert a == b
    for key, (least, most, shape) in a.items():
        assert (least, most) == (1, 1), f"{key}: elements written {least} to {most} times"
        name = key.split(".", 2)[2] if key.startswith("optim.") else key
        assert shape == saved[name].shape, key
    exported = load_file(os.path.join(directory, "export", "model.safetensors"))
    assert _param_diff(exported, saved) == 0.0
    resumed = {}
    for name, extra in (("B", None), ("A", {"step": STEPS})):
        model = tp.new_model(seed=1)
        opt = tp.optimizer(model)
        assert hp.load_checkpoint(os.path.join(directory, name), model, opt) == extra
        assert _param_diff(_values(model), saved) == 0.0, name
        resumed[name] = tp.train(model, opt, tp.batches()[STEPS:])
    assert resumed["A"] == resumed["B"]  # the optimizer state too
    diff = _rel(resumed["A"], _mean(per_rank, "losses")[STEPS:])
    assert diff <= SAME_FRAMEWORK_RTOL, f"resumed on one rank, losses differ by {diff:.2e}"
    assert _param_diff(_values(model), per_rank[0]["final"], ROUNDING_ONLY) <= 1e-5


def _values(model) -> dict:
    return {k: v.detach().numpy() for k, v in model.named_parameters()}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_mesh_with_a_dim_that_is_not_data_parallel(backend):
    """A (dp=2, tp=2) mesh with dp_mesh_dims, plain parameters replicated over "tp": one
    rank of each "tp" pair writes, and FSDP over the 4 ranks resumes the run."""
    per_rank = shared_launch.results("checkpoint_mesh", backend)
    assert per_rank[0]["files"] == ["rank-00000.safetensors", "rank-00002.safetensors"]
    diff = _rel(_mean(per_rank, "resumed"), _mean(per_rank, "losses")[STEPS:])
    assert diff <= SAME_FRAMEWORK_RTOL, f"resumed at FSDP 4 differs by {diff:.2e}"
