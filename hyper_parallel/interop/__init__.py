"""What makes a framework's own ecosystem accept hyper_parallel's units: one package per
framework that has one (torch/).

[Note: registered from above]
The layers run one way (docs/architecture.md, "Layers"): the platform imports no core, the
core imports no adapter. An adapter builds on both (torch's all-gather extension is a core
``GatherCodec``), so it cannot live in platform/. The core reaches it through the Platform
methods it implements: ``register()``, which the public surface (hyper_parallel/__init__.py)
calls at import, before anything asks for a platform, has the platform layer create a
framework's platform with its adapters. The framework itself is imported only then.
"""

from __future__ import annotations

from hyper_parallel.platform import Platform, register_platform_factory


def _torch_platform() -> Platform:
    from hyper_parallel.interop.torch.platform import TorchEcosystemPlatform

    return TorchEcosystemPlatform()


def register() -> None:
    """Have ``get_platform()`` create each framework's platform with its adapters."""
    register_platform_factory("torch", _torch_platform)
