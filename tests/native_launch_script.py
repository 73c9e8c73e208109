"""Run by test_native_launch.py under torchrun or msrun: the user joined the framework's own
way (or, with --hp-init, let hp.init_distributed find the launcher's environment); then
hyper_parallel trains the parity scenario, each rank writes its comparison to a file, and
hp.destroy_distributed() leaves the group, whoever joined it."""

import json
import os
import sys

# Run as a script, Python puts tests/ first on the path, where tests/platform would shadow
# the standard library's platform module: put the repository root there instead.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# msrun starts workers in their own sessions: record our pid so the test can end us by pid.
if os.environ.get("HP_TEST_PID_DIR"):
    open(os.path.join(os.environ["HP_TEST_PID_DIR"], str(os.getpid())), "w").close()

import hyper_parallel as hp  # noqa: E402
from tests.scenarios import run_scenario  # noqa: E402

if "--hp-init" in sys.argv:
    hp.init_distributed()
elif os.environ["HP_BACKEND"] == "torch":
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
else:
    from mindspore.communication import init

    init()
result = run_scenario("nested")
platform = hp.get_platform()
# one file per rank: ranks share stdout, where two lines written at once can interleave
with open(os.path.join(os.environ["HP_TEST_RESULT_DIR"], f"rank{platform.rank()}.json"), "w") as f:
    json.dump({"rank": platform.rank(), "world": platform.world_size(), "losses": result["losses"],
               "ref_losses": result["ref_losses"], "param_diff": result["param_diff"]}, f)
# Leave the group before exiting, as every user should: a torch gloo rank that ends on a plain
# barrier sometimes aborts in teardown (docs/platforms.md, "Leaving"), failing the launcher.
hp.destroy_distributed()
