"""The torch platform as torch's own ecosystem needs it: ``TorchPlatform`` (the contract,
platform/torch/) with the adapters that make torch's code accept hyper_parallel's units.

[Note: what the adapters add]
- units that are torch's ``FSDPModule`` to torch's code, and what its pipeline stage reads
  of them (``unit_bases``, ``present_unit``, ``native_unit_api``: fsdp2_units.py);
- FSDP2's all-gather extension of tensor subclasses as a gather codec (``gather_codec_of``:
  gather_hooks.py);
- parameters torch's own tensor parallelism split, as DTensors over both meshes
  (tensor_parallel.py).
The core reaches them only through the Platform methods they implement: this class is
what ``get_platform()`` returns on torch because hyper_parallel/__init__.py registers it
(hyper_parallel/interop/__init__.py).
"""

from __future__ import annotations

from hyper_parallel.interop.torch.fsdp2_units import FSDP2Unit, native_unit_api, present_unit
from hyper_parallel.interop.torch.gather_hooks import hooks_codec
from hyper_parallel.interop.torch.tensor_parallel import TorchTensorParallel
from hyper_parallel.platform.torch.platform import TorchPlatform


class TorchEcosystemPlatform(TorchTensorParallel, TorchPlatform):
    """``TorchPlatform`` and the adapters to torch's ecosystem (see the note)."""

    def unit_bases(self) -> tuple:
        return (FSDP2Unit,)

    def present_unit(self, module, reduce_accumulated) -> None:
        present_unit(module, reduce_accumulated)

    def native_unit_api(self, module):
        return native_unit_api(module)

    def gather_codec_of(self, local):
        return hooks_codec(local)
