"""The device names a mesh accepts.

[Note: device names]
A mesh names its device the way torch does, on both frameworks: "cpu", "cuda" or "npu"
(MindSpore's device targets "CPU", "GPU" and "Ascend" are "cpu", "cuda" and "npu" here).
Any other name is an error naming these, and so is a device this process does not compute
on ("cpu" always exists): a CPU-only build asked for "cuda" says so at once rather than
failing inside the framework.
"""

from __future__ import annotations

from typing import Any

DEVICE_NAMES = ("cpu", "cuda", "npu")
# other spellings, lower-cased: MindSpore's device targets ("CPU", "GPU", "Ascend"), capitals
_OTHER_SPELLINGS = {"gpu": "cuda", "ascend": "npu", **{name: name for name in DEVICE_NAMES}}


def check_device_type(platform, device_type: Any) -> None:
    """Raise unless ``device_type`` is a known name of a device this process computes on
    ([Note: device names])."""
    if not isinstance(device_type, str) or device_type not in DEVICE_NAMES:
        hint = ""
        if isinstance(device_type, str) and device_type.strip().lower() in _OTHER_SPELLINGS:
            hint = f" (for {device_type!r} write {_OTHER_SPELLINGS[device_type.strip().lower()]!r})"
        raise ValueError(f"device_type must be one of {', '.join(map(repr, DEVICE_NAMES))}, got "
                         f"{device_type!r}{hint}")
    if device_type not in ("cpu", platform.device_type()):
        raise ValueError(f"device_type {device_type!r}: this process has no {device_type} device "
                         f"({platform.name} computes on {platform.device_type()!r} here: a build "
                         f"without {device_type} support or a machine without one); use "
                         f"{platform.device_type()!r}")
