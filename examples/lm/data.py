"""Byte-level batches of the bundled text, the same on every framework and every world size.

Batch ``step`` is drawn from a generator seeded by (seed, step) alone, so a run resumed at
step k, on either framework and at any number of ranks, sees the batches the uninterrupted
run would have seen. Each rank takes its contiguous rows of every global batch, so the mean
of the ranks' losses is the loss of the whole batch.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

TEXT = Path(__file__).resolve().parents[1] / "data" / "kjv.txt.gz"
VALIDATION_FRACTION = 0.05


class ByteCorpus:
    """The text as uint8 bytes, split into a training part and a held-out tail."""

    def __init__(self, path: Path = TEXT):
        with gzip.open(path, "rb") as file:
            data = np.frombuffer(file.read(), dtype=np.uint8)
        split = int(len(data) * (1 - VALIDATION_FRACTION))
        self.train, self.validation = data[:split], data[split:]

    def batch(self, step: int, batch_size: int, seq: int, seed: int = 0,
              validation: bool = False) -> tuple:
        """``(inputs, targets)``, each ``(batch_size, seq)`` int64: random windows of the
        text, the targets shifted by one byte."""
        data = self.validation if validation else self.train
        rng = np.random.default_rng([seed, step, int(validation)])
        starts = rng.integers(0, len(data) - seq - 1, size=batch_size)
        windows = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int64)
        return windows[:, :-1], windows[:, 1:]


def rank_rows(array: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank ``rank``'s contiguous rows of a global batch (``world`` must divide it)."""
    rows = len(array) // world
    return array[rank * rows:(rank + 1) * rows]
