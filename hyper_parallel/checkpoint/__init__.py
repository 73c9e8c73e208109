"""Everything that saves, loads or exports a model's state: sharded and full state dicts
(state_dict.py, full_state.py), the portable sharded checkpoint, safetensors files and a
JSON index that both frameworks read and write at any world size and mesh (save.py,
load.py; docs/checkpoints.md), and the export to Hugging Face (export.py)."""

from hyper_parallel.checkpoint.export import export_full
from hyper_parallel.checkpoint.full_state import gather_full_state_dict, get_full_state_dict
from hyper_parallel.checkpoint.index import CheckpointError
from hyper_parallel.checkpoint.load import load_checkpoint
from hyper_parallel.checkpoint.names import torch_nn_names
from hyper_parallel.checkpoint.save import SaveHandle, save_checkpoint
from hyper_parallel.checkpoint.split_names import SplitKey, per_expert_keys
from hyper_parallel.checkpoint.state_dict import ShardedValue, get_state_dict, set_state_dict

__all__ = ["CheckpointError", "SaveHandle", "ShardedValue", "export_full", "gather_full_state_dict",
           "get_full_state_dict", "get_state_dict", "load_checkpoint", "save_checkpoint",
           "set_state_dict", "torch_nn_names", "SplitKey", "per_expert_keys"]
