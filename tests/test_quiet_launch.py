"""The MindSpore demo, launched by ``hp-run``, shows the user's output without MindSpore's
native log unless the user asks for it with ``--verbose``.

Design note
-----------
The unit tests in test_launch.py check the levels each rank is given and the relay's filter on
framework-free scripts; this one checks the result a user sees, on the real framework: a
2-rank MindSpore run of examples/train_mlp.py (the script ``make demo`` runs). hp-run's own
``--timeout`` ends the ranks by pid if the run hangs, well before the subprocess limit.
"""

import os
import re
import subprocess
import sys

import pytest

from tests.multirank import REPO_ROOT

pytest.importorskip("mindspore")

# "[rank 0] [WARNING] DISTRIBUTED(123,7f..,python):date [meta_server_node.cc:..] ..."
_NATIVE_BELOW_ERROR = re.compile(r"\[(DEBUG|INFO|WARNING)\] [A-Z_]+\(\d+,\w+,")
_LEVELS = ("GLOG_v", "GLOG_logtostderr", "MS_SUBMODULE_LOG_v", "TORCH_CPP_LOG_LEVEL")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_mindspore_demo_output_has_native_log_only_when_verbose(verbose):
    env = {k: v for k, v in os.environ.items() if k not in _LEVELS}
    env["HP_BACKEND"] = "mindspore"
    command = [sys.executable, "-m", "hyper_parallel.launch", "--nproc", "2", "--timeout", "300",
               *(["--verbose"] if verbose else []), str(REPO_ROOT / "examples" / "train_mlp.py")]
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
