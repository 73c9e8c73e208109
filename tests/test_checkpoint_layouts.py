"""Checkpoints of layouts beyond data parallelism, in the suite's shared 4-rank launches:
torch tensor parallelism (tests/tp_checkpoint_scenarios.py: saved at (dp=2, tp=2), resumed
in six layouts, then in this process in a plain model) and, on both frameworks, a mesh with
a dim that is not data parallel (tests/checkpoint_scenarios.py ``mesh_run``); and, without
processes, regions that straddle stored slices (2 -> 3 ranks), the choice of the rank that
writes a region (ranks as threads of this process, exchanging through a stand-in
``all_gather``), and torch's tensor-parallel blocks."""

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
from tests.checkpoint_scenarios import STEPS
from tests.test_checkpoint import BACKENDS, SAME_FRAMEWORK_RTOL, _mean, _rel

# 4 ranks, in the suite's shared 4-rank launch of each framework (tests/shared_launch.py)
shared_launch.register(__name__, "checkpoint_mesh", 4, "tests.checkpoint_scenarios:mesh_run",
                       lambda backend: (os.path.join(shared_launch.directory(
                           f"ckpt-mesh-{backend}"), "ckpt"),), timeout_s=300)
shared_launch.register(__name__, "checkpoint_tensor_parallel", 4,
                       "tests.tp_checkpoint_scenarios:run_all",
                       lambda backend: (shared_launch.directory("ckpt-tp"),),
                       backends=("torch",), timeout_s=180)


NO_TENSOR_PARALLEL = ("these cases build torch's DTensor tensor parallelism; the checkpoints of "
                      "MindSpore's (the core's styles) are tests/test_core_tp_fully_shard.py's "
                      "and tests/test_core_tp_checkpoints.py's")
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


# ------------------------------------------------------------------ regions, without processes
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


def test_pipeline_stages_write_their_own_values():
    """4 ranks, pp ranks 0, 0, 1, 1 (each stage sharded over two ranks): each stage's
    values are written by its lowest rank holding each region, whatever the other stage
    holds. A rank holding other values than its stage's other rank, and a value held at
    both pp ranks, make every rank raise, naming them."""
    from hyper_parallel.checkpoint.layout import Held, written_here

    stages = {0: [("embed", (6, 4)), ("blocks.0.w", (4, 4))], 1: [("head", (5, 4))]}

    def held(rank, extra=()):
        names = stages[rank // 2] + list(extra)
        return [Held(n, None, None, "float32", s, (s[0] // 2 * (rank % 2), 0),
                     (s[0] - s[0] // 2 if rank % 2 else s[0] // 2, 4)) for n, s in names]

    ranks = _ThreadRanks(4)
    written = ranks.run(lambda rank: [h.name for h in written_here(ranks, held(rank),
                                                                   rank // 2)])
    assert written == [["embed", "blocks.0.w"], ["embed", "blocks.0.w"], ["head"], ["head"]]
    errors = ranks.run(lambda rank: written_here(
        ranks, held(rank, [("norm", (4,))] if rank == 3 else []), rank // 2))
    for error in errors:
        assert isinstance(error, CheckpointError), error
        assert "rank 3 holds other parameters or shapes than rank 2 (2 values against 1, " \
               "both at pp rank 1)" in str(error)
    errors = ranks.run(lambda rank: written_here(
        ranks, held(rank, [("embed", (6, 4))] if rank >= 2 else []), rank // 2))
    for error in errors:
        assert isinstance(error, CheckpointError), error
        assert "'embed' is held at pp ranks 0 and 1" in str(error)


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

    from hyper_parallel.interop.torch.tensor_parallel import TP_SPEC, TorchTensorParallel

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
