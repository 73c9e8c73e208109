"""Reproducer (MindSpore 2.10, PyNative, CPU): of the forwards whose backward is pending
under ``mindspore.vjp``, only the latest one's backward runs.

    python tests/platform/later_backward_repro.py

prints, measured on MindSpore 2.10.0:
    older first: raises Can not find top cell for backward ...
    then the latest: raises Can not find top cell for backward ...
    recomputed older over a pending one: ok, then the pending one: ok

(the first failure leaves the executor unusable: the latest one's backward fails too).
What works, and what hyper_parallel's pipelines do (platform/mindspore/later_backward.py):
run the older micro-batch's forward without recording, and at its backward run it again
under ``vjp`` followed at once by the backward, the pair being the latest on the stack.
"""

import numpy as np
import mindspore as ms
from mindspore import nn


def main() -> None:
    ms.set_device("CPU")
    net = nn.Dense(3, 2)
    weights = net.trainable_params()
    x0 = ms.Tensor(np.ones((2, 3), np.float32))
    x1 = ms.Tensor(np.full((2, 3), 2.0, np.float32))
    out0, vjp0 = ms.vjp(net, x0, weights=weights)
    out1, vjp1 = ms.vjp(net, x1, weights=weights)
    for name, fn, out in (("older first", vjp0, out0), ("then the latest", vjp1, out1)):
        try:
            fn(ms.ops.ones_like(out))
            print(f"{name}: ok")
        except RuntimeError as e:
            print(f"{name}: raises {str(e).splitlines()[0][14:60]} ...")

    ms.graph.api._pynative_executor.clear_res()
    out1, vjp1 = ms.vjp(net, x1, weights=weights)   # pending
    _, again = ms.vjp(net, x0, weights=weights)      # the older micro-batch, recomputed
    again(ms.ops.ones_like(out1))
    vjp1(ms.ops.ones_like(out1))
    print("recomputed older over a pending one: ok, then the pending one: ok")


if __name__ == "__main__":
    main()
