"""The benchmark grid: which configurations run, on which models, with which implementations.

[Note: the grid and its pruning]
The torch grid has four dimensions: mesh (FSDP on 2 ranks, HSDP on a 2x2 mesh),
``reshard_after_forward`` (True, False), precision (fp32; bf16 parameters with fp32
reduction) and model (even 12 x Linear(2048, 2048), ~50M parameters; uneven shapes
2000/1999/2003, ~48M). The full product is 16 configurations x 4 implementations; on a
2-core machine a launch of the ~50M model takes 4-70 s, and each configuration launches
hyper_parallel, FSDP2 and compute-only three times (DEFAULT_ROUNDS), so the product needs
~45 minutes when the machine is quiet and far more when other work shares it. The default
("pruned") grid keeps every value of every dimension but varies one dimension at a time
around the baseline (fp32, even, reshard_after_forward=True): bf16 and the uneven model run
only with reshard_after_forward=True. That is 4 configurations per mesh, 8 in all (26-45
minutes with MindSpore, each launch also timing compute-only at its end and each
hyper_parallel launch the alternated rounds). ``--grid full`` runs the whole product instead.

[Note: shared rows]
DDP and the compute-only processes do not depend on ``reshard_after_forward``, so a
configuration that differs from an earlier one only in that setting reuses their
measurements (run.py keys launches by ``Impl.run_key``); the table marks nothing special,
the JSON records which launch each number came from.

[Note: MindSpore]
MindSpore CPU collectives are ~9x slower than gloo and PyNative dispatch is slower too, so
its model is smaller (8 x Dense(1024, 1024), ~8.4M parameters). MindSpore cannot free full
parameters between forward and backward (docs/platforms.md), so reshard_after_forward=True
behaves like False there; only FSDP on 2 ranks runs, fp32, even and uneven shapes.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field, replace

MODELS = {
    # name: the Linear widths, block i is Linear(dims[i], dims[i+1]) + ReLU
    "even": [2048] * 13,
    "uneven": [2000] + [1999, 2003] * 6,
    "even1k": [1024] * 9,
    "uneven1k": [1000] + [999, 1003] * 4,
    "tiny": [64] * 5,
    "tiny-uneven": [60, 59, 63, 59, 63],
}
TINY_OF = {"even": "tiny", "even1k": "tiny", "uneven": "tiny-uneven", "uneven1k": "tiny-uneven"}

TORCH_IMPLS = ("hp", "fsdp2", "ddp", "compute")
MINDSPORE_IMPLS = ("hp", "dp", "compute")
# The implementation each hyper_parallel time and memory is divided by.
REFERENCE = {"torch": "fsdp2", "mindspore": "dp"}
# Launches of hyper_parallel, of its reference and of compute-only per configuration (run.py
# --rounds). On the 2-core machine a whole launch can run ~20% slower than the same code's
# other launches in the same run; the median over the pooled steps shrugs off such a launch
# only while it holds fewer than half the steps, so at least three. MindSpore gets four:
# its launches are short (~15 s) and swing more (35% seen between two launches).
DEFAULT_ROUNDS = {"torch": 3, "mindspore": 4}
IMPL_LABELS = {"hp": "hyper_parallel", "fsdp2": "FSDP2", "ddp": "DDP", "dp": "DP baseline",
               "compute": "compute-only"}


@dataclass(frozen=True)
class Config:
    backend: str                 # "torch" or "mindspore"
    mesh: tuple                  # (S,) FSDP or (R, S) HSDP
    reshard_after_forward: bool
    precision: str               # "fp32" or "bf16" (torch) / "fp16" (MindSpore)
    model: str                   # key of MODELS
    local_batch: int
    warmup: int
    steps: int
    timeout_s: float
    impls: tuple = field(default=())

    @property
    def world_size(self) -> int:
        size = 1
        for n in self.mesh:
            size *= n
        return size

    @property
    def is_hsdp(self) -> bool:
        return len(self.mesh) == 2

    @property
    def name(self) -> str:
        mesh = f"hsdp{self.mesh[0]}x{self.mesh[1]}" if self.is_hsdp else f"fsdp{self.mesh[0]}"
        backend = "torch" if self.backend == "torch" else "ms"
        raf = "rafT" if self.reshard_after_forward else "rafF"
        return f"{backend}-{mesh}-{raf}-{self.precision}-{self.model}"

    @property
    def dims(self) -> list:
        return MODELS[self.model]

    @property
    def param_dtype(self) -> str:
        return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[self.precision]

    @property
    def reduce_dtype(self) -> str:
        return "float32"  # mixed precision here always reduces in fp32

    def to_json(self) -> dict:
        out = asdict(self)
        out.update(name=self.name, world_size=self.world_size, dims=self.dims,
                   param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)
        return out


@dataclass(frozen=True)
class Impl:
    """One launch: an implementation of one configuration."""

    config: Config
    impl: str

    @property
    def run_key(self) -> tuple:
        """Launches with equal keys measure the same thing (see the note on shared rows)."""
        c = self.config
        base = (c.backend, self.impl, c.world_size, c.model, c.precision, c.local_batch,
                c.warmup, c.steps)
        if self.impl in ("ddp", "dp", "compute"):
            return base
        return base + (c.mesh, c.reshard_after_forward)


def _torch(mesh, raf, precision, model, *, quick=False) -> Config:
    if quick:
        return Config("torch", mesh, raf, precision, model, local_batch=8, warmup=1, steps=2,
                      timeout_s=90, impls=TORCH_IMPLS)
    return Config("torch", mesh, raf, precision, model, local_batch=16, warmup=2, steps=6,
                  timeout_s=420 if len(mesh) == 2 else 300, impls=TORCH_IMPLS)


def _mindspore(raf, precision, model, *, quick=False) -> Config:
    if quick:
        return Config("mindspore", (2,), raf, precision, model, local_batch=8, warmup=1, steps=2,
                      timeout_s=120, impls=MINDSPORE_IMPLS)
    return Config("mindspore", (2,), raf, precision, model, local_batch=16, warmup=2, steps=5,
                  timeout_s=420, impls=MINDSPORE_IMPLS)


def build_grid(kind: str) -> list[Config]:
    """``quick`` (smoke test), ``pruned`` (the default, see the note) or ``full``."""
    if kind == "quick":
        return [_torch((2,), True, "fp32", "tiny", quick=True),
                _mindspore(True, "fp32", "tiny", quick=True)]
    configs = []
    for mesh in ((2,), (2, 2)):
        if kind == "full":
            for raf, precision, model in itertools.product((True, False), ("fp32", "bf16"),
                                                           ("even", "uneven")):
                configs.append(_torch(mesh, raf, precision, model))
        else:
            configs += [_torch(mesh, True, "fp32", "even"), _torch(mesh, False, "fp32", "even"),
                        _torch(mesh, True, "bf16", "even"), _torch(mesh, True, "fp32", "uneven")]
    configs += [_mindspore(True, "fp32", "even1k"), _mindspore(True, "fp32", "uneven1k")]
    return configs


def shrink(cfg: Config) -> Config:
    """The same configuration on a tiny model with 1 + 2 steps (``--tiny``: every code path of
    the grid in a few minutes, for development)."""
    return replace(cfg, model=TINY_OF.get(cfg.model, cfg.model), local_batch=8, warmup=1, steps=2,
                   timeout_s=150)


PRUNING_NOTE = ("torch grid pruned to fit ~26-45 min on 2 cores: every value of every dimension "
                "runs, one dimension varied at a time around fp32 / even / "
                "reshard_after_forward=True (bf16 and the uneven model only with "
                "reshard_after_forward=True); `--grid full` runs the whole product.")
