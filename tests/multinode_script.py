"""Run by test_multinode.py on every rank of a 2-node job (hp-run, torchrun or msrun, each
started once per "node" on this machine): HSDP on a (nodes, ranks per node) mesh, so the
replicate dim runs across the nodes and the shard dim within each, trained against the
single-process reference (tests/hsdp_scenarios.py). Each rank writes its result to
``HP_TEST_RESULT_DIR/rank<r>.json`` and, where the launcher starts ranks in sessions of
their own (msrun), its pid to ``HP_TEST_PID_DIR`` so the test can end it by pid.

Usage: python tests/multinode_script.py NODE NNODES
"""

import json
import os
import sys

# Run as a script, Python puts tests/ first on the path, where tests/platform would shadow
# the standard library's platform module: put the repository root there instead.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.environ.get("HP_TEST_PID_DIR"):
    open(os.path.join(os.environ["HP_TEST_PID_DIR"], str(os.getpid())), "w").close()

import hyper_parallel as hp  # noqa: E402

node, nnodes = int(sys.argv[1]), int(sys.argv[2])
if os.environ.get("HP_BACKEND") == "torch":
    import torch

    torch.set_num_threads(1)
elif os.environ.get("HP_TEST_MS_LAUNCH_BLOCKING") == "1":  # see tests/multirank.py
    import mindspore

    mindspore.runtime.launch_blocking()
hp.init_distributed()

from tests.hsdp_scenarios import run_config  # noqa: E402

platform = hp.get_platform()
rank, world = platform.rank(), platform.world_size()
result = run_config({"mesh": (nnodes, world // nnodes)})
with open(os.path.join(os.environ["HP_TEST_RESULT_DIR"], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": world, "node": node, "losses": result["losses"],
               "ref_losses": result["ref_losses"], "param_diff": result["param_diff"],
               "comms": [[op, dim, calls] for (op, dim), calls in result["last_step_comms"][-1].items()]},
              f)
hp.destroy_distributed()
