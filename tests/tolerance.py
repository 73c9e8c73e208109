"""How the suite compares floating-point results: bit for bit, or within a measured spread.

[Note: exact, or within a measured spread]
Two results are compared exactly (``np.testing.assert_array_equal``, a difference ``== 0``)
where both sides do the same math in the same order, which no CPU can tell apart:
hyper_parallel against torch's FSDP2 in the same processes (the same kernels on the same
shards, the same collectives), a block compiled with ``aot_eager`` against eager, an
optimizer stepped per parameter in backward against the same optimizer stepped after it,
a file against the values it was written from, a load against the save.

Everything else differs by rounding, and rounding depends on the order of the sums: a
gradient reduce-scattered over N ranks against one process's mean over the whole batch,
and the kernels the framework picks for the CPU it runs on (torch on x86:
``ATEN_CPU_CAPABILITY=default|avx2|avx512``; MindSpore's matmuls go through oneDNN, whose
``ONEDNN_MAX_CPU_ISA`` caps them). Those comparisons go through ``assert_close``: relative
to the values compared, with an absolute term ``rtol * max|expected|``, so that an element
near zero is judged on the scale of its neighbours rather than on its own.

Each tolerance below is a margin times the largest difference measured for its kind of
comparison, rounded up to 1, 2 or 5 in its decade; the figure after it is that largest
difference. Measured over every file that uses it: torch under each of the three
``ATEN_CPU_CAPABILITY`` values, MindSpore under oneDNN's SSE4.1 and its default (AVX-512),
on the 1, 2 and 4 ranks the files launch. The margin is 10 where the difference is the
rounding of fp32 sums, which moves with the kernels; it is 2 for a low-precision run
against an fp32 reference, where the difference is the low precision's own rounding, the
same to two digits under every kernel choice. Parameters are compared as the largest
absolute difference the ranks report; the suite's parameters are O(1) (initialised at
1/sqrt(fan_in)), so there absolute is relative. tools/tolerance_spread.py records both
sides' distance for every comparison of a run, to measure them again.
"""

from __future__ import annotations

import numpy as np

# fp32 training against a single-process reference, or against a run that sums in another
# order: losses and norms relative, SGD parameters absolute
FP32_RTOL = 1e-5              # measured 9.8e-07
# AdamW's first steps move a weight by about lr * sign(grad), so a gradient element that is
# zero up to rounding moves it differently in two correct runs (tests/kit.py): losses and
# parameters of AdamW runs
ADAMW_RTOL = 1e-3             # measured 7.8e-05
# a float64 model against a float64 reference
FLOAT64_RTOL = 1e-14          # measured 5.3e-16
# a float64 model whose gradients are reduced in float32
REDUCED_IN_FLOAT32_RTOL = 1e-7  # measured 5.1e-09
# bfloat16 parameters or reduction (torch), float16 (MindSpore CPU has no bfloat16 matmul),
# against fp32: margin 2
LOW_PRECISION_RTOL = {"bfloat16": 5e-2,   # measured 2.3e-02
                      "float16": 5e-4}    # measured 1.7e-04


def assert_close(actual, expected, rtol: float, err_msg: str = "") -> None:
    """``actual`` equals ``expected`` to ``rtol`` relative, and to ``rtol * max|expected|``
    absolute (the scale of the values compared)."""
    expected = np.asarray(expected, np.float64)
    scale = float(np.abs(expected).max()) if expected.size else 0.0
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol,
                               atol=rtol * scale, err_msg=err_msg)
