"""Run by test_checkpoint_safety.py on 2 ranks, started as plain ``python`` with the
rendezvous variables set: an asynchronous save, then the process group left the
framework's own way (as ``torch.distributed.destroy_process_group()`` would, not
``hp.destroy_distributed()``, which publishes the save first), and the script ends with
the save never waited for. Its exit hook cannot publish it.

Usage: python tests/async_exit_script.py PATH
"""

import os
import sys

# Run as a script, Python puts tests/ first on the path, where tests/platform would shadow
# the standard library's platform module: put the repository root there instead.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import hyper_parallel as hp  # noqa: E402
from tests.checkpoint_scenarios import _sharded, _side  # noqa: E402

hp.init_distributed()
platform = hp.get_platform()
side = _side()
model, opt = _sharded(side, (platform.world_size(),))
rank = platform.rank()
hp.save_checkpoint(sys.argv[1], model, opt, async_save=True)
platform.destroy_process_group()
print(f"rank {rank}: the script's last line", flush=True)
