"""One script, both frameworks: examples/one_script/train.py, run as a script on 4 ranks,
trains the same transformer on torch and on MindSpore with only ``--model`` changed.

[Note: what is compared]
The script trains every layout in one run (``single``: each rank alone on the whole
batch, the one-process reference; ``fsdp``; ``hsdp`` 2 x 2; ``tp`` over 4 ranks, with
loss parallelism; ``dp_tp`` 2 x 2) for 5 AdamW steps with clipping, saving a checkpoint
after 3 and training the last 2 again from it in a fresh model. Per framework: each
layout's losses (the mean over data-parallel ranks of each rank's loss on its rows) equal
the reference's to ``ADAMW_RTOL``, the steps resumed from the checkpoint equal the steps
that followed the save bit for bit (the same math in the same order), and the export holds
the reference's trained parameters. Across the frameworks: the two runs of a layout are as
close as the two references are (the frameworks' kernels round differently; their
distance, not zero, is the measure).

The script is run with ``runpy`` as ``__main__`` on ranks of the suite's harness, which
leaves the group to the script (``HP_TEST_NO_DIST``): the script joins and leaves it as
under hp-run.
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
import tempfile

import numpy as np
import pytest

from tests.multirank import FAST_MINDSPORE, REPO_ROOT, run_ranks
from tests.tolerance import ADAMW_RTOL, assert_close

SCRIPT = str(REPO_ROOT / "examples" / "one_script" / "train.py")
WORLD = 4
LAYOUTS = ("fsdp", "hsdp", "tp", "dp_tp")
BACKENDS = ("torch", "mindspore")


def run_script(argv: list) -> None:
    """Rank side: the script file as ``python train.py *argv`` runs it."""
    sys.argv = [SCRIPT, *argv]
    runpy.run_path(SCRIPT, run_name="__main__")


def _read_export(directory: str) -> dict:
    from safetensors.numpy import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


@functools.lru_cache(maxsize=None)
def outcome(backend: str) -> dict:
    """``{layout: {"losses", "resumed": per step, "export": {name: values}}}`` of one run
    of the script on ``backend``; losses averaged over the data-parallel ranks."""
    pytest.importorskip(backend)
    out = tempfile.mkdtemp(prefix=f"hp-one-script-{backend}-")
    run_ranks("tests.test_one_script:run_script", WORLD, backend,
              ["--model", backend, "--out", out], timeout_s=900,
              env={"HP_TEST_NO_DIST": "1", **FAST_MINDSPORE})
    found = {}
    for layout in ("single",) + LAYOUTS:
        ranks = [json.load(open(os.path.join(out, f"{layout}.rank{r}.json")))
                 for r in range(WORLD)]
        by_dp = {r["dp_rank"]: r for r in ranks}
        assert sorted(by_dp) == list(range(ranks[0]["dp_size"])), (layout, sorted(by_dp))
        found[layout] = {
            "losses": np.mean([r["losses"] for r in by_dp.values()], axis=0),
            "resumed": np.mean([r["resumed"] for r in by_dp.values()], axis=0),
            "continued": np.mean([r["losses"][-len(r["resumed"]):] for r in by_dp.values()],
                                 axis=0),
            "export": _read_export(os.path.join(out, f"{layout}-export")),
        }
    return found


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_layout_trains_as_one_process(backend, layout):
    runs = outcome(backend)
    assert_close(runs[layout]["losses"], runs["single"]["losses"], ADAMW_RTOL,
                 f"{backend} {layout}: losses against the one-process run")
    reference = runs["single"]["export"]
    assert sorted(runs[layout]["export"]) == sorted(reference)
    for name, values in reference.items():
        assert_close(runs[layout]["export"][name], values, ADAMW_RTOL,
                     f"{backend} {layout}: exported {name} against the one-process run")


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("layout", ("single",) + LAYOUTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpoint_resumes_the_same_steps(backend, layout):
    runs = outcome(backend)
    np.testing.assert_array_equal(runs[layout]["resumed"], runs[layout]["continued"])


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_frameworks_agree_as_their_references_do(layout):
    torch_runs, mindspore_runs = outcome("torch"), outcome("mindspore")
    references = np.abs(torch_runs["single"]["losses"] - mindspore_runs["single"]["losses"])
    apart = np.abs(torch_runs[layout]["losses"] - mindspore_runs[layout]["losses"])
    scale = ADAMW_RTOL * np.abs(torch_runs["single"]["losses"])
    assert np.all(apart <= references + scale), (layout, apart, references)
