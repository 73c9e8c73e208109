"""Portable sharded checkpoints: safetensors files and a JSON index that both frameworks
read and write, at any world size and mesh (docs/checkpoints.md)."""

from hyper_parallel.checkpoint.index import CheckpointError
from hyper_parallel.checkpoint.load import load_checkpoint
from hyper_parallel.checkpoint.names import torch_nn_names
from hyper_parallel.checkpoint.save import save_checkpoint

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint", "torch_nn_names"]
