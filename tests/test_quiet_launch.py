"""The MindSpore demo, launched by ``hp-run``, shows the user's output without MindSpore's
native log unless the user asks for it with ``--verbose``; started as plain ``python`` with
the rendezvous variables set, on either framework, it is as quiet (``hp.init_distributed``
sets MindSpore's levels itself: hyper_parallel/platform/mindspore/native_log.py), unless
the user set a level of MindSpore's.

Design note
-----------
The unit tests in test_launch.py check the levels each rank is given and the relay's filter on
framework-free scripts; this one checks the result a user sees, on the real framework: a
2-rank MindSpore run of examples/train_mlp.py (the script ``make demo`` runs). hp-run's own
``--timeout`` ends the ranks by pid if the run hangs, well before the subprocess limit.
"""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from hyper_parallel.launch import NATIVE_LOG_VERBOSE, find_free_port, rank_environment
from tests.multirank import REPO_ROOT, run_plain_ranks

DEMO = str(REPO_ROOT / "examples" / "train_mlp.py")

# "[rank 0] [WARNING] DISTRIBUTED(123,7f..,python):date [meta_server_node.cc:..] ..."
_NATIVE_BELOW_ERROR = re.compile(r"\[(DEBUG|INFO|WARNING)\] [A-Z_]+\(\d+,\w+,")
_LEVELS = ("GLOG_v", "GLOG_logtostderr", "MS_SUBMODULE_LOG_v", "TORCH_CPP_LOG_LEVEL")
_WHATEVER_THE_LEVEL = "] Start] Event base dispatch success!"  # MindSpore's, as its threads end


@pytest.mark.timeout(400)
@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_mindspore_demo_output_has_native_log_only_when_verbose(verbose):
    _needs("mindspore")
    env = {k: v for k, v in os.environ.items() if k not in _LEVELS}
    env["HP_BACKEND"] = "mindspore"
    command = [sys.executable, "-m", "hyper_parallel.launch", "--nproc", "2", "--timeout", "300",
               *(["--verbose"] if verbose else []), DEMO]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=360)
    output = (result.stdout + result.stderr).splitlines()
    assert result.returncode == 0, "\n".join(output[-40:])
    native = [line for line in output if _NATIVE_BELOW_ERROR.search(line)]
    if verbose:
        assert native, "--verbose showed none of MindSpore's native log:\n" + "\n".join(output[-40:])
    else:
        assert not native, "native log lines in a quiet run:\n" + "\n".join(native[:10])
        assert result.stdout.strip(), "the demo printed nothing of its own"


def _needs(backend: str) -> None:
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")


def _plain_python_demo(backend: str, tmp_path, levels: dict) -> list:
    """The demo's 2 ranks started as plain ``python`` with the rendezvous variables (no
    launcher, none of the log levels hp-run sets) and ``levels``: each rank's output lines."""
    base = {k: v for k, v in os.environ.items() if k not in (*_LEVELS, NATIVE_LOG_VERBOSE[0])}
    base.update(levels)
    port = find_free_port()
    envs = [rank_environment(rank, rank, 2, 2, "127.0.0.1", port, backend, base, verbose=True)
            for rank in range(2)]
    for env in envs:  # what a launcher sets, without hp-run's log settings
        env.pop(NATIVE_LOG_VERBOSE[0])
    codes, outputs = run_plain_ranks([sys.executable, DEMO], envs, tmp_path, 300)
    output = [text.splitlines() for text in outputs]
    assert codes == [0, 0], "\n".join(output[0][-40:] + output[1][-40:])
    return output


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_plain_python_demo_output_is_the_users_own(backend, tmp_path):
    """Rank 0 prints the demo's lines; rank 1, which the demo keeps silent, nothing; neither
    any of the framework's log, but the lines MindSpore writes whatever the level
    (hyper_parallel/platform/mindspore/native_log.py)."""
    _needs(backend)
    rank0, rank1 = (
        [line for line in lines if not line.endswith(_WHATEVER_THE_LEVEL)]
        for lines in _plain_python_demo(backend, tmp_path, {}))
    native = [line for line in rank0 + rank1 if _NATIVE_BELOW_ERROR.search(line)]
    assert not native, "native log lines in a plain python run:\n" + "\n".join(native[:10])
    assert rank0[-1] == "MATCH", "\n".join(rank0[-40:])
    assert rank1 == [], "rank 1 printed:\n" + "\n".join(rank1[:20])


@pytest.mark.timeout(400)
def test_plain_python_keeps_the_users_mindspore_log_level(tmp_path):
    """``GLOG_v=1`` (info) set by the user: MindSpore's INFO lines are shown."""
    _needs("mindspore")
    rank0, rank1 = _plain_python_demo("mindspore", tmp_path, {"GLOG_v": "1"})
    info = [line for line in rank0 + rank1 if re.search(r"\[INFO\] [A-Z_]+\(\d+,", line)]
    assert len(info) > 10, "the user's GLOG_v=1 showed only:\n" + "\n".join(info)
