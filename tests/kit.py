"""The few framework-specific pieces the shared suite needs: models, a loss, a train step.

The default optimizer is SGD with momentum: stateful, and sensitive to any error in a
gradient's scale. AdamW is offered too, but its first steps move every weight by about
``lr * sign(grad)``, so a gradient element that is zero up to rounding makes two correct
runs differ by far more than rounding: parity with it needs a looser parameter tolerance.

Each test is written once and asks ``get_kit()`` (chosen by HP_BACKEND) for the framework
side. Models are built from numpy-seeded values, so the hyper_parallel model and its
single-process reference start identical on every rank.
"""

from __future__ import annotations

import os

import numpy as np


def get_kit():
    """The kit of HP_BACKEND's framework (kit_torch.py, kit_mindspore.py; imported here, as
    they import this file's helpers)."""
    if os.environ.get("HP_BACKEND", "torch").lower() == "torch":
        from tests.kit_torch import TorchKit

        return TorchKit()
    from tests.kit_mindspore import MindSporeKit

    return MindSporeKit()


def init_values(shapes: list, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) * (1.0 / np.sqrt(s[-1] if len(s) > 1 else s[0]))).astype(np.float32)
            for s in shapes]


def make_batches(steps: int, batch: int, d_in: int, d_out: int, seed: int = 123) -> list:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, d_in)).astype(np.float32),
             rng.standard_normal((batch, d_out)).astype(np.float32)) for _ in range(steps)]
