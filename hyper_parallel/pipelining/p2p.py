"""What crosses between two neighbouring stages: activations forward, their gradients
back, and once per step a check that both sides agree on the activation's shape.

[Note: the shape check, on both ranks]
A stage that receives a tensor of a shape it did not expect fails in its forward, and its
neighbour, blocked in a send or a receive, would wait forever. So before the first
activation of each step crosses, the sender sends a small header (its output's dtype and
shape, and whether they match the ``output_args`` it was given) and the receiver answers
with its verdict (whether they match the ``input_args`` it was given). Both ranks then
raise the same ``ValueError`` naming the two stages and both shapes, or both go on; after
the check the receiver allocates its buffers from the header, which is also how a stage
given no shapes learns them (torch's shape inference, one header per step). Sends are
asynchronous (their handles are waited at the end of the step); receives wait at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hyper_parallel.platform import get_platform

HEADER = 12                   # int32: verdict, dtype code, ndim, up to 9 dims
DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int32")


class StageLink:
    """The point-to-point side of one stage: its pp group and the pp ranks of the stages
    before and after it (None at the ends)."""

    def __init__(self, group: Any, dim: str, prev_peer: int | None, next_peer: int | None):
        self.group, self.dim = group, dim
        self.prev_peer, self.next_peer = prev_peer, next_peer
        self.sends: list = []

    # ------------------------------------------------------------------ tensors
    def send(self, tensor: Any, peer: int) -> None:
        p = get_platform()
        self.sends.append(p.send(p.contiguous(tensor), peer, self.group, dim=self.dim))

    def recv(self, shape: tuple, dtype: Any, peer: int) -> Any:
        return get_platform().recv(tuple(shape), dtype, peer, self.group, dim=self.dim).wait()

    def wait_sends(self) -> None:
        sends, self.sends = self.sends, []
        for handle in sends:
            handle.wait()

    # ------------------------------------------------------------------ the shape check
    def check_output(self, stage_index: int, output: Any, expected: Any) -> None:
        """Sender side: tell the next stage what ``output`` is; raise on either verdict."""
        p = get_platform()
        mine = _describe(output)
        ok = expected is None or mine == _describe(expected)
        self.send(_encode(ok, mine), self.next_peer)
        verdict, theirs = _decode(self.recv((HEADER,), p.dtype("int32"), self.next_peer))
        if not ok:
            raise ValueError(_mismatch(stage_index, stage_index, mine, _describe(expected),
                                       "its output_args"))
        if not verdict:
            raise ValueError(_mismatch(stage_index, stage_index + 1, mine, theirs,
                                       "the input_args"))

    def check_input(self, stage_index: int, expected: Any) -> tuple:
        """Receiver side: ``(dtype name, shape)`` the previous stage sends; raise (after
        answering) if it is not what ``expected`` (this stage's input_args) describes."""
        p = get_platform()
        ok, theirs = _decode(self.recv((HEADER,), p.dtype("int32"), self.prev_peer))
        wanted = theirs if expected is None else _describe(expected)
        self.send(_encode(wanted == theirs, wanted), self.prev_peer)
        if not ok:
            raise ValueError(f"stage {stage_index - 1}'s output does not match its own "
                             f"output_args (stage {stage_index - 1} names both)")
        if wanted != theirs:
            raise ValueError(_mismatch(stage_index - 1, stage_index, theirs, wanted,
                                       "the input_args"))
        return theirs


def _describe(tensor: Any) -> tuple:
    p = get_platform()
    if not p.is_tensor(tensor):
        raise TypeError(f"a stage's output and input between stages must be one tensor, "
                        f"got {type(tensor).__name__}: return one tensor from the stage's "
                        f"forward")
    dtype = p.dtype_of(tensor)
    names = [n for n in DTYPES if p.dtype(n) == dtype]
    if not names:
        raise TypeError(f"a tensor of dtype {dtype} cannot cross between stages "
                        f"(supported: {', '.join(DTYPES)})")
    return names[0], tuple(int(d) for d in p.shape(tensor))


def _encode(ok: bool, described: tuple) -> Any:
    name, shape = described
    if len(shape) > HEADER - 3:
        raise ValueError(f"a tensor of {len(shape)} dims cannot cross between stages "
                         f"(at most {HEADER - 3})")
    header = np.zeros(HEADER, np.int32)
    header[:3] = int(ok), DTYPES.index(name), len(shape)
    header[3:3 + len(shape)] = shape
    return get_platform().from_numpy(header)


def _decode(tensor: Any) -> tuple:
    header = get_platform().to_numpy(tensor).astype(int)
    ndim = int(header[2])
    return bool(header[0]), (DTYPES[header[1]], tuple(int(d) for d in header[3:3 + ndim]))


def _mismatch(sender: int, receiver: int, sent: tuple, wanted: tuple, whose: str) -> str:
    return (f"shape mismatch between pipeline stages {sender} and {receiver}: stage "
            f"{sender} sends {sent[0]} {list(sent[1])}, {whose} of stage {receiver} say "
            f"{wanted[0]} {list(wanted[1])}: give each stage input_args/output_args that "
            f"match what the stage before it returns (or none, to take what arrives)")
