"""The one place the conformance checks import a framework: building a small model, asking
the framework for gradients, optimizers (conformance.py, design note)."""

from __future__ import annotations

import numpy as np

import hyper_parallel as hp


def framework_side():
    """The small framework-specific helper of the current platform (imports it lazily)."""
    name = hp.get_platform().name
    if name == "torch":
        return _TorchSide()
    if name == "mindspore":
        return _MindSporeSide()
    raise NotImplementedError(f"tests/platform/framework_sides.py has no framework side for platform "
                              f"{name!r}: add a _<Name>Side class next to _TorchSide")


def _model_values(seed: int = 7) -> dict:
    rng = np.random.default_rng(seed)
    return {"fc1.weight": rng.standard_normal((3, 4)).astype(np.float32),
            "fc1.bias": rng.standard_normal(3).astype(np.float32),
            "inner.fc2.weight": rng.standard_normal((2, 3)).astype(np.float32),
            "inner.fc2.bias": rng.standard_normal(2).astype(np.float32)}


def model_reference(x: np.ndarray, values: dict | None = None) -> np.ndarray:
    """numpy forward of the model ``framework_side().model()`` builds: fc2(relu(fc1(x)))."""
    v = values or _model_values()
    h = np.maximum(x @ v["fc1.weight"].T + v["fc1.bias"], 0.0)
    return h @ v["inner.fc2.weight"].T + v["inner.fc2.bias"]


class _TorchSide:
    def __init__(self):
        import torch

        self.torch = torch

    def optimizer(self, kind: str, params: list):
        return {"adamw": self.torch.optim.AdamW, "sgd": self.torch.optim.SGD}[kind](params, lr=0.1)

    def framework_style(self):
        """The framework's own tensor-parallel style object (None: it has none)."""
        from torch.distributed.tensor.parallel import ColwiseParallel

        return ColwiseParallel()

    def unsplittable_layer(self):
        """A layer-like module with a reason not to split it (None: the framework has none)."""
        return None

    def model(self):
        """Root with ``fc1`` Linear(4, 3) and ``inner.fc2`` Linear(3, 2); fc2(relu(fc1(x)))."""
        torch, nn = self.torch, self.torch.nn

        class Inner(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc2 = nn.Linear(3, 2)

            def forward(self, x):
                return self.fc2(x)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(4, 3)
                self.inner = Inner()

            def forward(self, x):
                return self.inner(torch.relu(self.fc1(x)))

        net = Net()
        with torch.no_grad():
            for name, param in net.named_parameters():
                param.copy_(torch.from_numpy(_model_values()[name]))
        return net

    def layer_list(self, layers: list):
        """The framework's list container of ``layers`` (what a model's stack of blocks is)."""
        return self.torch.nn.ModuleList(layers)

    def batchnorm(self):
        """A BatchNorm over 3 features, in training mode, with a non-persistent buffer
        ``scratch`` beside its statistics."""
        bn = self.torch.nn.BatchNorm1d(3)
        bn.register_buffer("scratch", self.torch.zeros(3), persistent=False)
        return bn

    def embedding(self, vocab: int, dim: int):
        return self.torch.nn.Embedding(vocab, dim)

    def conv(self):
        """A layer no linear tensor-parallel style splits."""
        return self.torch.nn.Conv1d(2, 2, 1)

    def new_param(self, array: np.ndarray, name: str, requires_grad: bool = True):
        return self.torch.nn.Parameter(self.torch.from_numpy(array.copy()),
                                       requires_grad=requires_grad)

    def deferred_param(self, shape: tuple, name: str):
        """A parameter with a shape and no values: on the meta device."""
        return self.torch.nn.Parameter(self.torch.empty(shape, device="meta"))

    def set_requires_grad(self, param, flag: bool) -> None:
        param.requires_grad_(flag)

    def tensor_parallel_param(self, array: np.ndarray, native_mesh, mesh_dim: str, dim: int):
        """``array`` as a DTensor parameter sharded on ``dim`` over ``native_mesh[mesh_dim]``
        (tensor parallelism; only torch has it)."""
        from torch.distributed.tensor import DTensor, Shard

        sub = native_mesh[mesh_dim]
        part = np.array_split(array, sub.size(), axis=dim)[sub.get_local_rank()]
        tensor = DTensor.from_local(self.torch.from_numpy(part.copy()), sub, [Shard(dim)],
                                    run_check=False)
        return self.torch.nn.Parameter(tensor)

    def native_options(self) -> list:
        """torch's own FSDP2 option objects with non-default fields, as
        ``(object, class name, {field: value expected})``."""
        from torch.distributed.fsdp import (
            CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy)

        torch = self.torch
        return [(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                 "MixedPrecisionPolicy", {"param_dtype": torch.bfloat16,
                                          "reduce_dtype": torch.float32}),
                (CPUOffloadPolicy(pin_memory=False), "CPUOffloadPolicy", {"pin_memory": False}),
                (DataParallelMeshDims(shard="dp", replicate="rep"), "DataParallelMeshDims",
                 {"shard": "dp", "replicate": "rep"})]

    def weighted_sum(self, tensor, weights: np.ndarray):
        """sum(tensor * weights) as a differentiable scalar."""
        return (tensor * self.torch.from_numpy(weights)).sum()

    def framework_attention(self):
        """The attention function models call, looked up at each call (None: none)."""
        import torch.nn.functional as F

        return lambda *args, **kwargs: F.scaled_dot_product_attention(*args, **kwargs)

    def backward(self, fn, arrays: list, params: list = ()) -> tuple:
        """Run ``fn(list_of_input_tensors) -> scalar`` and its backward; return
        ``(loss, [input grads], [param grads])`` as numpy (None where no gradient arrived)."""
        torch = self.torch
        inputs = [torch.from_numpy(np.array(a, dtype=np.float32)).requires_grad_(True)
                  for a in arrays]
        for param in params:
            param.grad = None
        loss = fn(inputs)
        loss.backward()
        platform = hp.get_platform()

        def grad_of(t):
            return None if t.grad is None else platform.to_numpy(t.grad)
        return (float(loss.detach()), [grad_of(t) for t in inputs], [grad_of(p) for p in params])


class _MindSporeSide:
    def __init__(self):
        import mindspore

        self.ms = mindspore

    def optimizer(self, kind: str, params: list):
        from mindspore.experimental.optim import SGD, AdamW

        return {"adamw": AdamW, "sgd": SGD}[kind](params, lr=0.1)

    def framework_style(self):
        return None  # MindSpore has no tensor-parallel styles of its own in PyNative

    def unsplittable_layer(self):
        return self.ms.nn.Dense(4, 4, activation="relu")  # activation after a split bias

    def model(self):
        ms, nn, ops = self.ms, self.ms.nn, self.ms.ops

        class Inner(nn.Cell):
            def __init__(self):
                super().__init__()
                self.fc2 = nn.Dense(3, 2)

            def construct(self, x):
                return self.fc2(x)

        class Net(nn.Cell):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Dense(4, 3)
                self.inner = Inner()

            def construct(self, x):
                return self.inner(ops.relu(self.fc1(x)))

        net = Net()
        values = _model_values()
        for name, param in net.parameters_and_names():
            param.set_data(ms.Tensor(values[name]))
        return net

    def layer_list(self, layers: list):
        return self.ms.nn.CellList(layers)

    def batchnorm(self):
        """A BatchNorm over 3 features, in training mode."""
        bn = self.ms.nn.BatchNorm1d(3)
        bn.set_train(True)
        return bn

    def embedding(self, vocab: int, dim: int):
        return self.ms.nn.Embedding(vocab, dim)

    def conv(self):
        """A layer no linear tensor-parallel style splits."""
        return self.ms.nn.Conv1d(2, 2, 1)

    def new_param(self, array: np.ndarray, name: str, requires_grad: bool = True):
        return self.ms.Parameter(self.ms.Tensor(array.copy()), name=name,
                                 requires_grad=requires_grad)

    def deferred_param(self, shape: tuple, name: str):
        """A parameter with a shape and no values: built under no_init_parameters()."""
        from mindspore.common.initializer import One, initializer
        from mindspore.nn.utils import no_init_parameters

        with no_init_parameters():
            return self.ms.Parameter(initializer(One(), shape, self.ms.float32), name=name)

    def set_requires_grad(self, param, flag: bool) -> None:
        param.requires_grad = flag

    def framework_attention(self):
        return None  # MindSpore has no attention function models call

    def weighted_sum(self, tensor, weights: np.ndarray):
        return (tensor * self.ms.Tensor(weights)).sum()

    def backward(self, fn, arrays: list, params: list = ()) -> tuple:
        ms = self.ms
        inputs = [ms.Tensor(np.array(a, dtype=np.float32)) for a in arrays]
        params = list(params)
        position = tuple(range(len(inputs))) if inputs else None
        grad_fn = ms.value_and_grad(lambda *xs: fn(list(xs)), grad_position=position,
                                    weights=params or None)
        loss, grads = grad_fn(*inputs)

        def as_tuple(g):  # one position or one weight comes back as a bare tensor
            return (g,) if isinstance(g, ms.Tensor) else tuple(g)
        if inputs and params:
            input_grads, param_grads = as_tuple(grads[0]), as_tuple(grads[1])
        elif inputs:
            input_grads, param_grads = as_tuple(grads), ()
        else:
            input_grads, param_grads = (), as_tuple(grads)
        platform = hp.get_platform()
        as_np = [None if g is None else platform.to_numpy(g) for g in (*input_grads, *param_grads)]
        return float(loss.asnumpy()), as_np[:len(inputs)], as_np[len(inputs):]
