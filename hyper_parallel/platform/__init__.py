"""Choose the framework: ``get_platform()`` returns one cached Platform per process.

[Note: which framework]
This is the one place that decides, in this order:

1. ``HP_BACKEND`` set ("torch" or "mindspore", case-insensitive): that framework, read at
   every call. A module of the other framework is an error naming both.
2. Unset, a choice already made in this process: that one (a module of the other framework
   is an error naming both and how the choice was made).
3. Unset, first call given a module (``fully_shard``): the module's framework, a
   ``torch.nn.Module`` or a ``mindspore.nn.Cell``.
4. Unset, first call without a module (``init_distributed``, ``init_device_mesh``,
   ``get_platform()``): the framework the script imported (``sys.modules``); where it
   imported both, msrun's variables (``MS_ROLE``) say MindSpore, and otherwise the call is
   ambiguous: an error asking for ``HP_BACKEND``; where it imported neither, msrun's
   variables, else the installed framework (torch where both are).

Nothing here imports a framework the process has not imported: a module's framework is
read through ``sys.modules``. One Platform is created per backend name and cached.

[Note: a platform completed from above]
A framework's platform is its class in platform/<framework>/, unless a layer above
registered a factory for it (``register_platform_factory``): hyper_parallel/interop/ does,
for the adapters that make torch's ecosystem accept the library's units. So this package
never imports a layer above it; the registration runs when ``hyper_parallel`` is imported,
before any platform is created.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from typing import Any, Callable

from hyper_parallel.platform.base import MeshDescription, Platform
from hyper_parallel.platform.collectives import Gathered, Handle

BACKENDS = ("torch", "mindspore")
#: each backend's module class, as (module it lives in, class name, how users spell it)
MODULE_CLASSES = {"torch": ("torch.nn", "Module", "torch.nn.Module"),
                  "mindspore": ("mindspore.nn", "Cell", "mindspore.nn.Cell")}
_INSTALL_HINT = {
    "torch": "pip install 'hyper_parallel[torch]'  (or: pip install torch)",
    "mindspore": "pip install 'hyper_parallel[mindspore]'  (or: pip install 'mindspore==2.10.*' 'numpy<2')",
}
# the choice made where HP_BACKEND is unset: {"name": backend, "why": how it was made}
_UNSET_CHOICE: dict = {}
# backend -> what creates its Platform instead of its own class ([Note: a platform
# completed from above])
_FACTORIES: dict = {}


def module_framework(obj: Any) -> str | None:
    """The backend whose module class ``obj`` is an instance of; None for anything else
    (a tensor, None, a framework the process never imported)."""
    for name, (module_name, class_name, _) in MODULE_CLASSES.items():
        module = sys.modules.get(module_name)
        if module is not None and isinstance(obj, getattr(module, class_name)):
            return name
    return None


def _mismatch(why: str, module: Any) -> TypeError:
    other = module_framework(module)
    return TypeError(f"{why}, but the module (a {type(module).__name__}) is a "
                     f"{MODULE_CLASSES[other][2]}; set HP_BACKEND={other} (one framework per "
                     f"process)")


def _named(raw: str) -> str:
    name = raw.strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"HP_BACKEND={raw!r} is not a backend hyper_parallel knows; valid values: "
                         f"{', '.join(BACKENDS)} (case-insensitive)")
    if importlib.util.find_spec(name) is None:
        raise ImportError(f"HP_BACKEND={name} but {name} is not installed; fix: {_INSTALL_HINT[name]}")
    return name


def _first_choice(module: Any) -> tuple[str, str]:
    """(backend, why) where HP_BACKEND is unset and nothing was chosen yet ([Note: which
    framework], 3 and 4)."""
    found = module_framework(module)
    if found is not None:
        return found, f"the first module given to hyper_parallel was a {MODULE_CLASSES[found][2]}"
    imported = [name for name in BACKENDS if name in sys.modules]
    if len(imported) == 1:
        return imported[0], f"HP_BACKEND is unset and the script imported only {imported[0]}"
    under_msrun = os.environ.get("MS_ROLE") in ("MS_SCHED", "MS_WORKER")
    if under_msrun and importlib.util.find_spec("mindspore") is not None:
        return "mindspore", "HP_BACKEND is unset and msrun started this process"
    if imported:
        raise RuntimeError("HP_BACKEND is unset and the script imported both torch and mindspore, "
                           "so hyper_parallel cannot tell which framework this call is for; set "
                           "HP_BACKEND=torch or HP_BACKEND=mindspore (or give fully_shard the "
                           "model first: its framework then decides)")
    for candidate in BACKENDS:
        if importlib.util.find_spec(candidate) is not None:
            return candidate, (f"HP_BACKEND is unset, the script had imported no framework and "
                               f"{candidate} is installed")
    raise ImportError("hyper_parallel needs torch or mindspore; install one: "
                      + " | ".join(_INSTALL_HINT.values()))


def resolve_backend_name(value: str | None = None, module: Any = None) -> str:
    """The backend to use ([Note: which framework]): ``value`` (default: $HP_BACKEND)
    validated, else this process's choice. ``module``: the model a call was given, whose
    framework must match (a TypeError naming both where it does not)."""
    raw = os.environ.get("HP_BACKEND", "") if value is None else value
    if raw.strip():
        name = _named(raw)
        if module_framework(module) not in (None, name):
            raise _mismatch(f"HP_BACKEND={name}", module)
        return name
    if not _UNSET_CHOICE:
        name, why = _first_choice(module)
        _UNSET_CHOICE.update(name=name, why=why)
    name = _UNSET_CHOICE["name"]
    if module_framework(module) not in (None, name):
        raise _mismatch(f"this process runs hyper_parallel on {name} ({_UNSET_CHOICE['why']})",
                        module)
    return name


def register_platform_factory(name: str, factory: Callable[[], Platform]) -> None:
    """Create backend ``name``'s platform with ``factory()`` ([Note: a platform completed
    from above]); before the first ``get_platform()`` of that backend."""
    if name not in BACKENDS:
        raise ValueError(f"no backend {name!r}; known: {', '.join(BACKENDS)}")
    _FACTORIES[name] = factory


@functools.lru_cache(maxsize=None)
def _platform_for(name: str) -> Platform:
    if name in _FACTORIES:
        return _FACTORIES[name]()
    if name == "torch":
        from hyper_parallel.platform.torch.platform import TorchPlatform

        return TorchPlatform()
    from hyper_parallel.platform.mindspore.platform import MindSporePlatform

    return MindSporePlatform()


def get_platform(module: Any = None) -> Platform:
    """The cached Platform of this process's framework ([Note: which framework]); given
    ``module`` (a model a public call received), its framework decides the first choice
    and must match any later one."""
    return _platform_for(resolve_backend_name(module=module))


__all__ = ["BACKENDS", "Gathered", "Handle", "MeshDescription", "Platform", "get_platform",
           "module_framework", "register_platform_factory", "resolve_backend_name"]
