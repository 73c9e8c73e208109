"""The benchmark grids: which configurations run, on which models, with which implementations.

[Note: the headline grid]
``make bench`` runs the headline grid: one launch per configuration, every implementation
built in the same processes and stepped in alternated rounds (measure.py). torch: FSDP on 2
ranks and HSDP on a 2 x 2 mesh, fp32 and bf16 (bf16 parameters, fp32 reduction), on the MLP
(8 x Linear(1536, 1536) + ReLU, 18.9M parameters), and the Llama-shaped decoder
(examples/lm, size "bench", 25.4M parameters) on FSDP, fp32. MindSpore: FSDP on 2 ranks,
fp32, on an MLP of 8 x Dense(1024, 1024) (8.4M parameters; MindSpore CPU collectives are
several times slower than gloo's). The decoder on MindSpore (a launch of over 100 s on 2
cores) runs in the full grid only. The models are smaller than a real job's:
every step still moves each parameter through an all-gather and a reduce-scatter, so the
ratios between implementations measure the same mechanisms.

[Note: the full grid]
``--full``: the torch product of mesh (FSDP 2, HSDP 2 x 2), ``reshard_after_forward``
(True, False), precision (fp32, bf16) and model (12 x Linear(2048, 2048), 50.4M parameters;
the same with widths 2000 / 1999 / 2003 that no shard size divides), the decoder on both
meshes and precisions, and MindSpore's MLP (even and uneven widths) and decoder; torch
configurations add the interleaved floor and the raw collectives, and every configuration
runs more rounds.

[Note: MindSpore]
bf16 matmuls do not run on MindSpore's CPU: only FSDP on 2 ranks in fp32 runs. The full
grid adds its MLP with ``reshard_after_forward=False`` (no re-gather before backward, every
unit's full parameters kept from forward to backward): the time the re-gather costs there.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

from examples.lm.config import SIZES as LM_SIZES

MLP_MODELS = {
    # name: the Linear widths, block i is Linear(dims[i], dims[i+1]) + ReLU
    "mlp": [1536] * 9,
    "mlp-large": [2048] * 13,
    "mlp-large-uneven": [2000] + [1999, 2003] * 6,
    "mlp1k": [1024] * 9,
    "mlp1k-uneven": [1000] + [999, 1003] * 4,
    "mlp-tiny": [64] * 5,
}
# name: the examples/lm/config.py size of the Llama-shaped decoder
LM_MODELS = {"lm": "bench", "lm-tiny": "tiny"}

# Phases: the implementations, and the library-free floors (raw_collectives.py), in the
# order a round steps them: hyper_parallel sits between the phases it is divided by (its
# reference, and the interleaved floor or DDP), so with the order reversed every other
# round each ratio compares two consecutive steps.
TORCH_PHASES = {False: ("ddp", "hp", "fsdp2", "compute"),
                True: ("ddp", "floor", "hp", "fsdp2", "compute", "raw")}
MINDSPORE_PHASES = {False: ("hp", "dp", "compute"), True: ("floor", "hp", "dp", "compute", "raw")}
# The implementation each hyper_parallel time and memory is divided by.
REFERENCE = {"torch": "fsdp2", "mindspore": "dp"}
IMPL_LABELS = {"hp": "hyper_parallel", "fsdp2": "FSDP2", "ddp": "DDP", "dp": "DP baseline",
               "compute": "compute-only", "floor": "interleaved floor",
               "raw": "raw collectives"}


@dataclass(frozen=True)
class Config:
    backend: str                 # "torch" or "mindspore"
    mesh: tuple                  # (S,) FSDP or (R, S) HSDP
    precision: str               # "fp32" or "bf16"
    model: str                   # key of MLP_MODELS or LM_MODELS
    local_batch: int             # rows (MLP) or sequences (decoder) per rank and step
    warmup: int                  # alternated rounds before the measured ones
    rounds: int                  # measured alternated rounds
    timeout_s: float
    impls: tuple = field(default=())
    reshard_after_forward: bool = True

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
    def is_lm(self) -> bool:
        return self.model in LM_MODELS

    @property
    def name(self) -> str:
        mesh = f"hsdp{self.mesh[0]}x{self.mesh[1]}" if self.is_hsdp else f"fsdp{self.mesh[0]}"
        backend = "torch" if self.backend == "torch" else "ms"
        raf = "" if self.reshard_after_forward else "-rafF"
        return f"{backend}-{mesh}-{self.precision}-{self.model}{raf}"

    @property
    def dims(self) -> list | None:
        return MLP_MODELS.get(self.model)

    @property
    def tokens_per_step(self) -> int | None:
        """The global batch's tokens (decoder only)."""
        if not self.is_lm:
            return None
        return self.world_size * self.local_batch * LM_SIZES[LM_MODELS[self.model]]["seq"]

    @property
    def param_dtype(self) -> str:
        return {"fp32": "float32", "bf16": "bfloat16"}[self.precision]

    def to_json(self) -> dict:
        out = asdict(self)
        out.update(name=self.name, world_size=self.world_size, dims=self.dims,
                   lm_size=LM_MODELS.get(self.model),
                   tokens_per_step=self.tokens_per_step, param_dtype=self.param_dtype,
                   reduce_dtype="float32")
        return out


def _torch(mesh, precision, model, *, raf=True, full=False) -> Config:
    floors = full and model in MLP_MODELS
    batch = 2 if model in LM_MODELS else 16
    return Config("torch", mesh, precision, model, local_batch=batch, warmup=2,
                  rounds=8 if full else 6, timeout_s=600 if full else 240,
                  impls=TORCH_PHASES[floors], reshard_after_forward=raf)


def _mindspore(model, *, raf=True, full=False) -> Config:
    floors = model in MLP_MODELS
    batch = 2 if model in LM_MODELS else 16
    return Config("mindspore", (2,), "fp32", model, local_batch=batch, warmup=2,
                  rounds=20 if full else 16, timeout_s=600 if full else 240,
                  impls=MINDSPORE_PHASES[floors], reshard_after_forward=raf)


def _quick(cfg: Config) -> Config:
    return Config(cfg.backend, cfg.mesh, cfg.precision, cfg.model, cfg.local_batch, warmup=1,
                  rounds=2, timeout_s=90, impls=cfg.impls)


def build_grid(kind: str) -> list[Config]:
    """``quick`` (the test's smoke run), ``headline`` (``make bench``) or ``full``."""
    if kind == "quick":
        return [_quick(_torch((2,), "fp32", "mlp-tiny", full=True)),
                _quick(_torch((2,), "fp32", "lm-tiny")),
                _quick(_mindspore("mlp-tiny"))]
    if kind == "headline":
        return ([_torch(mesh, precision, "mlp") for mesh in ((2,), (2, 2))
                 for precision in ("fp32", "bf16")]
                + [_torch((2,), "fp32", "lm"), _mindspore("mlp1k")])
    configs = [_torch(mesh, precision, model, raf=raf, full=True)
               for mesh, raf, precision, model in itertools.product(
                   ((2,), (2, 2)), (True, False), ("fp32", "bf16"),
                   ("mlp-large", "mlp-large-uneven"))]
    configs += [_torch(mesh, precision, "lm", full=True)
                for mesh in ((2,), (2, 2)) for precision in ("fp32", "bf16")]
    return configs + [_mindspore(m, full=True) for m in ("mlp1k", "mlp1k-uneven", "lm")] + [
        _mindspore("mlp1k", raf=False, full=True)]
