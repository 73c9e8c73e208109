"""What every implementation trains on, and what its communication must at least cost.

[Note: one workload, many implementations]
Every implementation of one configuration (hyper_parallel, FSDP2, DDP, compute-only,
MindSpore's data-parallel baseline) builds the MLP from ``block_shapes`` and fills it from
``init_arrays`` (the decoder: examples/lm, seeded by parameter name), and reads its batches
from ``batches`` or ``token_batches`` with the same seeds. So they start from identical
weights, see identical data (rank r always reads rows ``[r*B, (r+1)*B)`` of the global
batch), and their losses can be compared step by step (analysis.py does, as a check that
the benchmark compares like with like). Everything here is numpy only: the parent process
never imports a framework.

[Note: the communication schedule and its minimum]
``shard_schedule`` lists the collectives one training step of a fully sharded model needs
at minimum, in issue order, with the buffer sizes that ``hp.track_comms()`` records
(all-gather: the gathered output; reduce-scatter: the input; all-reduce: the tensor):

* forward: one all-gather per unit of its padded parameters, in the parameter dtype;
* backward, per unit in reverse: a re-gather first if the unit freed its parameters after
  forward (non-root, ``reshard_after_forward=True``), then one reduce-scatter of its
  padded gradients in the reduce dtype, then (HSDP) one all-reduce of the shard's bytes over
  the replicate dim.

"Padded" is how both FSDP2 and hyper_parallel lay a parameter out: dim 0 split like
``torch.chunk`` into ``ceil(rows / S)`` rows per rank, so the buffer holds
``S * ceil(rows / S)`` rows. The same list, issued back to back on zero buffers, is the "raw
collectives" phase (raw_collectives.py), and its byte totals are the theoretical minimum
the measured bytes are divided by. The MLP's root owns no parameter of its own (every block
is a unit), so the root never gathers; the decoder's root owns the embedding, the final
norm and the output head, and its bytes are reported as measured.
"""

from __future__ import annotations

import math

import numpy as np

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

def block_shapes(dims: list[int]) -> list[list[tuple]]:
    """Parameter shapes per block: block i is Linear(dims[i], dims[i+1]) (+ ReLU)."""
    return [[(dims[i + 1], dims[i]), (dims[i + 1],)] for i in range(len(dims) - 1)]


def parameter_count(dims: list[int]) -> int:
    return sum(math.prod(s) for block in block_shapes(dims) for s in block)


def init_arrays(dims: list[int], seed: int) -> list[list[np.ndarray]]:
    """Initial (weight, bias) of every block, scaled like a Linear's default (1/sqrt(fan_in))."""
    rng = np.random.default_rng(seed)
    out = []
    for weight_shape, bias_shape in block_shapes(dims):
        scale = np.float32(1.0 / math.sqrt(weight_shape[1]))
        out.append([rng.standard_normal(weight_shape, dtype=np.float32) * scale,
                    rng.standard_normal(bias_shape, dtype=np.float32) * scale])
    return out


SEED, DATA_SEED, N_BATCHES = 1234, 4321, 4  # weights, batches, distinct batches per run


def local_mlp_batches(dims: list, local_batch: int, rank: int, world: int) -> list[tuple]:
    """This rank's rows of each of the ``N_BATCHES`` global MLP batches, as numpy arrays."""
    return [(local_rows(x, rank, world), local_rows(y, rank, world))
            for x, y in batches(N_BATCHES, local_batch * world, dims[0], dims[-1], DATA_SEED)]


def local_token_batches(seq: int, vocab: int, local_batch: int, rank: int, world: int) -> list:
    """This rank's rows of each of the ``N_BATCHES`` global token batches, as contiguous
    ``(inputs, targets)`` int64 numpy pairs (targets shifted by one token)."""
    pairs = []
    for ids in token_batches(N_BATCHES, local_batch * world, seq, vocab, DATA_SEED):
        local = local_rows(ids, rank, world)
        pairs.append((np.ascontiguousarray(local[:, :-1]), np.ascontiguousarray(local[:, 1:])))
    return pairs


def batches(count: int, global_batch: int, d_in: int, d_out: int, seed: int) -> list[tuple]:
    """``count`` distinct global (x, y) batches; steps cycle through them."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((global_batch, d_in), dtype=np.float32),
             rng.standard_normal((global_batch, d_out), dtype=np.float32)) for _ in range(count)]


def token_batches(count: int, global_batch: int, seq: int, vocab: int, seed: int) -> list:
    """``count`` distinct global batches of token ids, ``(global_batch, seq + 1)`` int64: the
    decoder reads columns ``[:-1]`` and predicts ``[1:]``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, (global_batch, seq + 1), dtype=np.int64) for _ in range(count)]


def local_rows(array: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank ``rank``'s slice of a global batch (contiguous rows, equal sizes)."""
    rows = array.shape[0] // world
    return np.ascontiguousarray(array[rank * rows:(rank + 1) * rows])


def padded_numel(shape: tuple, shard_size: int) -> int:
    """Elements of one parameter in a flat communication buffer: dim 0 padded to S*ceil(rows/S)."""
    rows, row_numel = shape[0], math.prod(shape[1:])
    return shard_size * -(-rows // shard_size) * row_numel


def shard_schedule(dims: list[int], shard_size: int, replicate_size: int,
                   regather_in_backward: bool, param_dtype: str, reduce_dtype: str,
                   usage_counts: bool = False) -> list[dict]:
    """The minimal collectives of one step, in issue order (see the note at the top).

    Each entry: ``{"op", "dim", "dtype", "numel", "unit", "phase"}`` where ``numel`` is the
    buffer ``track_comms`` counts (all-gather output, reduce-scatter input, all-reduce
    tensor), ``unit`` the block it serves and ``phase`` where in the step it belongs:
    "forward" (before the block's forward), "before_backward" / "after_backward" (around
    the block's backward); the interleaved floor issues it there (raw_collectives.py).
    ``usage_counts``: each unit's gradients travel with one count per parameter from every
    rank (torch, where an unused parameter gets no gradient: fully_shard/gradients.py).
    """
    shapes = block_shapes(dims)
    units = [sum(padded_numel(s, shard_size) for s in block) for block in shapes]
    counts = [len(block) if usage_counts else 0 for block in shapes]

    def entry(op, dim, dtype, numel, unit, phase):
        return {"op": op, "dim": dim, "dtype": dtype, "numel": numel, "unit": unit, "phase": phase}

    schedule = [entry("all_gather", "shard", param_dtype, n, unit, "forward")
                for unit, n in enumerate(units)]
    for unit in reversed(range(len(units))):
        numel = units[unit]
        if regather_in_backward:
            schedule.append(entry("all_gather", "shard", param_dtype, numel, unit, "before_backward"))
        schedule.append(entry("reduce_scatter", "shard", reduce_dtype,
                              numel + shard_size * counts[unit], unit, "after_backward"))
        if replicate_size > 1:
            schedule.append(entry("all_reduce", "replicate", reduce_dtype,
                                  numel // shard_size + counts[unit], unit, "after_backward"))
    return schedule


def schedule_bytes(schedule: list[dict]) -> dict:
    """``{op: {dim: bytes}}`` totals of a schedule, the form the measured bytes take."""
    out: dict = {}
    for entry in schedule:
        per_dim = out.setdefault(entry["op"], {})
        per_dim[entry["dim"]] = per_dim.get(entry["dim"], 0) + entry["numel"] * ELEMENT_BYTES[entry["dtype"]]
    return out
