"""Code written for FSDP2 runs on hyper_parallel by rebinding one public name,
``torch.distributed.fsdp.fully_shard``, to ``hp.fully_shard`` (docs/api.md, "Under
torchtitan"); hyper_parallel's torch adapters hold torch's own objects from where torch
defines them, so the rebinding, made before they are first imported, does not reach them
(tests/fsdp2_rebound_scenarios.py, torch only, a launch of its own: the rank must load
hyper_parallel's platform after the rebinding, which a shared launch's rank did long before).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import shared_launch
from tests.multirank import run_ranks


@shared_launch.once
def _per_rank() -> list:
    return run_ranks("tests.fsdp2_rebound_scenarios:run", 2, "torch",
                     env={"HP_TEST_NO_DIST": "1"}, timeout_s=180)


@pytest.mark.timeout(240)
def test_fsdp2_code_calling_the_rebound_name_trains_as_on_fsdp2():
    for rank, result in enumerate(_per_rank()):
        ours, theirs = result["hyper_parallel"], result["fsdp2"]
        assert ours["ours"] == [True, True, False, False, True, False, False, False]  # root, blocks
        assert not any(theirs["ours"])
        np.testing.assert_allclose(ours["losses"], theirs["losses"], rtol=1e-6, atol=1e-7,
                                   err_msg=f"rank {rank}")
        assert ours["params"].keys() == theirs["params"].keys()
        for name, value in ours["params"].items():
            np.testing.assert_allclose(value, theirs["params"][name], rtol=1e-6, atol=1e-7,
                                       err_msg=f"rank {rank}: {name}")
