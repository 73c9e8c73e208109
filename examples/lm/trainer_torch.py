"""The torch side of examples/train_lm.py: build (eagerly or on the meta device), shard
each decoder layer and the root, and run one AdamW step."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

import hyper_parallel as hp
from examples.lm.config import VOCAB, set_initial_values
from examples.lm.model_torch import LlamaLM, build
from examples.lm.progress import peak_resident_mb


class Trainer:
    def __init__(self, size: str, mesh, mp_policy, deferred: bool, lr: float,
                 weight_decay: float, clip: float):
        torch.manual_seed(0)
        self.device = torch.device(hp.get_platform().device_type())
        if deferred:
            with torch.device("meta"):
                model = LlamaLM(size)
        else:
            model = build(size).to(self.device)
        for layer in model.model.layers:
            hp.fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
        hp.fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        if deferred:
            model.to_empty(device=self.device)  # allocates each rank's shards only
            model.model.init_rope()
            set_initial_values(model)
        self.model, self.clip = model, clip
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

    def _loss(self, ids: np.ndarray, targets: np.ndarray):
        logits = self.model(torch.from_numpy(ids).to(self.device))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB),
                               torch.from_numpy(targets).to(self.device).reshape(-1))

    def step(self, ids: np.ndarray, targets: np.ndarray) -> tuple:
        """One optimizer step on this rank's rows; (local loss, global gradient norm)."""
        loss = self._loss(ids, targets)
        loss.backward()
        norm = hp.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.item(), float(norm)

    def evaluate(self, ids: np.ndarray, targets: np.ndarray) -> float:
        with torch.no_grad():
            return self._loss(ids, targets).item()

    def mean_over_ranks(self, values: list) -> list:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(tensor)
        return (tensor / torch.distributed.get_world_size()).tolist()

    def peak_memory_mb(self) -> float:
        """The accelerator's peak allocation on GPU; on CPU the process's peak resident set."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated() / 2**20
        return peak_resident_mb()
