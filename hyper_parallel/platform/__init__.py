"""Choose the framework: ``get_platform()`` returns one cached Platform per process.

HP_BACKEND selects it ("torch" or "mindspore", case-insensitive). When it is unset the
installed framework is used; when both are installed, torch wins (it is the reference
framework of our API and the cheaper import). One Platform is created per backend name
and cached; set HP_BACKEND before the first call and leave it.
"""

from __future__ import annotations

import functools
import importlib.util
import os

from hyper_parallel.platform.base import MeshDescription, Platform
from hyper_parallel.platform.collectives import Gathered, Handle

BACKENDS = ("torch", "mindspore")
_INSTALL_HINT = {
    "torch": "pip install 'hyper_parallel[torch]'  (or: pip install torch)",
    "mindspore": "pip install 'hyper_parallel[mindspore]'  (or: pip install 'mindspore==2.10.*' 'numpy<2')",
}


def resolve_backend_name(value: str | None = None) -> str:
    """The backend named by ``value`` (default: $HP_BACKEND), validated, or the installed one."""
    raw = os.environ.get("HP_BACKEND", "") if value is None else value
    name = raw.strip().lower()
    if name:
        if name not in BACKENDS:
            raise ValueError(
                f"HP_BACKEND={raw!r} is not a backend hyper_parallel knows; valid values: "
                f"{', '.join(BACKENDS)} (case-insensitive)")
        if importlib.util.find_spec(name) is None:
            raise ImportError(f"HP_BACKEND={name} but {name} is not installed; fix: {_INSTALL_HINT[name]}")
        return name
    for candidate in BACKENDS:
        if importlib.util.find_spec(candidate) is not None:
            return candidate
    raise ImportError("hyper_parallel needs torch or mindspore; install one: "
                      + " | ".join(_INSTALL_HINT.values()))


@functools.lru_cache(maxsize=None)
def _platform_for(name: str) -> Platform:
    if name == "torch":
        from hyper_parallel.platform.torch.platform import TorchPlatform

        return TorchPlatform()
    from hyper_parallel.platform.mindspore.platform import MindSporePlatform

    return MindSporePlatform()


def get_platform() -> Platform:
    """The cached Platform of the backend HP_BACKEND names (or the installed one)."""
    return _platform_for(resolve_backend_name())


__all__ = ["BACKENDS", "Gathered", "Handle", "MeshDescription", "Platform", "get_platform",
           "resolve_backend_name"]
