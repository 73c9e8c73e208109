"""MindSpore's C++ log at errors only when a process joins the job, as ``hp-run`` starts it.

hp-run gives its ranks the variables that set MindSpore's log levels (``NATIVE_LOG_QUIET``
in launch.py), so a job's first screen is the user's own output. A script started another
way (plain ``python`` with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, or msrun)
would print MindSpore's DISTRIBUTED and DEVICE start-up lines, more than half of a short
run's output. MindSpore reads those variables when its library loads (glog's ``FLAGS_v``,
from ``GLOG_v``), before the script could set them, and its per-module levels start from
``FLAGS_v`` (``InitSubModulesLogLevel`` in MindSpore's log_adapter.cc). So ``quiet`` sets the
variables (for the processes this one starts, and MindSpore's Python logger), sets
``FLAGS_v`` in the glog MindSpore ships, and has MindSpore read its levels again
(``common_log_init``, exported with C linkage). A level the user set is left alone, and
so is the default under ``hp-run --verbose`` or ``HP_NATIVE_LOG=verbose``.

What no level reaches: MindSpore's communication threads write "Event base dispatch
success!" as INFO lines when they end, at the group's destruction, through a log call that
consults no level (``MSLOG_IF``): up to two per rank, which only hp-run's relay drops.
"""

from __future__ import annotations

import ctypes
import os

import mindspore as ms

from hyper_parallel.launch import NATIVE_LOG_QUIET, NATIVE_LOG_VERBOSE

_LEVELS = NATIVE_LOG_QUIET[0]  # MindSpore's: {"GLOG_v": "3", "MS_SUBMODULE_LOG_v": ...}
_FLAGS_V = "_ZN3fLI7FLAGS_vE"  # glog's int32 FLAGS_v (namespace fLI), as libglog exports it


def quiet() -> None:
    """Errors only from here on, unless the user set a MindSpore log level or asked for
    the default ones."""
    variable, verbose = NATIVE_LOG_VERBOSE
    if os.environ.get(variable) == verbose or any(name in os.environ for name in _LEVELS):
        return
    os.environ.update(_LEVELS)
    lib = os.path.join(os.path.dirname(ms.__file__), "lib")
    try:  # both libraries are loaded already: this finds them, it loads nothing new
        flags_v = ctypes.c_int.in_dll(ctypes.CDLL(os.path.join(lib, "libglog.so.2")), _FLAGS_V)
        reread = ctypes.CDLL(os.path.join(lib, "libmindspore_core.so")).common_log_init
    except (OSError, ValueError, AttributeError):
        return  # another build of MindSpore: its log stays as loud as it started
    flags_v.value = int(_LEVELS["GLOG_v"])
    reread()

