"""What crosses between stages: activations forward, their gradients back, and once per
step a check that both sides of each stage boundary agree on the activation's shape.

[Note: one ordered stream per pair of ranks]
Point-to-point messages between two ranks carry no tag: each arrives in the order it was
sent. With several stages per rank (interleaved schedules) one pair of ranks carries
several kinds of message (stage 0's activations and stage 2's gradients, say), sent in one
rank's order and needed in the other's. Every rank knows every rank's order of actions
(the schedule is a function of the pp rank), so ``Mailbox`` computes, for each peer, the
sequence of messages that peer sends it (``expected``), and receives in that sequence,
keeping the messages it does not need yet. Sends are asynchronous (their handles are
waited at the end of the step), so a receive only ever waits for a message its peer sends
before any message that would wait on this rank. A message between two stages of one rank
is handed over without a send.

Messages, per action of a rank (``(stage, "F" or "B", micro-batch)``):
``F s mb``: on the first forward of ``s`` in the step, answer the header of stage ``s - 1``
(``reply``), then take its activation; after the forward, on the first, send the header of
``s`` (``hdr``: dtype and shape of its output) and wait for the reply; send the
activation (``act``). ``B s mb``: take the gradient of the output from ``s + 1``
(``grad``); after the backward, send the input's gradient to ``s - 1``.

[Note: the shape check, on both ranks]
A stage that receives a tensor of a shape it did not expect fails in its forward, and its
neighbour, blocked in a receive, would wait forever. The header carries whether the
output matches the sender's ``output_args``, the reply whether it matches the receiver's
``input_args``: both ranks then raise the same ``ValueError`` naming both stages and
both shapes, or both go on. A stage given no shapes takes the header's (torch's shape
inference, one header per step and boundary).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from hyper_parallel.platform import get_platform

HEADER = 12                   # int32: verdict, dtype code, ndim, up to 9 dims
DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int32")


def messages_sent(order: list, rank_of: Callable[[int], int], num_stages: int) -> list:
    """``[(destination rank, message id), ...]`` that a rank whose actions are ``order``
    sends, in its order (the first note)."""
    out, started = [], set()
    for stage, kind, mb in order:
        if kind == "F":
            first = stage not in started
            started.add(stage)
            if stage > 0 and first:
                out.append((rank_of(stage - 1), ("reply", stage - 1)))
            if stage < num_stages - 1:
                if first:
                    out.append((rank_of(stage + 1), ("hdr", stage)))
                out.append((rank_of(stage + 1), ("act", stage, mb)))
        elif stage > 0:
            out.append((rank_of(stage - 1), ("grad", stage, mb)))
    return out


class Mailbox:
    """This rank's messages of one step: ``expected[peer]`` is what ``peer`` sends here, in
    its order."""

    def __init__(self, group: Any, dim: str, rank: int, expected: dict):
        self.group, self.dim, self.rank = group, dim, rank
        self._expected = {peer: list(ids) for peer, ids in expected.items()}
        self._next = dict.fromkeys(expected, 0)
        self._arrived: dict = {}
        self._shapes: dict = {}     # ("act" or "grad", stage) -> (dtype name, shape)
        self._sends: list = []

    def send(self, peer: int, msg: tuple, tensor: Any) -> None:
        p = get_platform()
        if msg[0] == "hdr":
            self._shapes[("grad", msg[1] + 1)] = decode(tensor)[1]
        if peer == self.rank:
            self._store(msg, tensor)
        else:
            self._sends.append(p.send(p.contiguous(tensor), peer, self.group, dim=self.dim))

    def get(self, peer: int, msg: tuple) -> Any:
        """Message ``msg`` from ``peer``, receiving (and keeping) the ones it sent before."""
        while msg not in self._arrived:
            if peer == self.rank:
                raise RuntimeError(f"pipeline message {msg} was never handed over")
            sequence = self._expected[peer]
            if self._next[peer] >= len(sequence):
                raise RuntimeError(f"pipeline message {msg} is not in what pp rank {peer} "
                                   f"sends this rank")
            nxt = sequence[self._next[peer]]
            self._next[peer] += 1
            name, shape = self._shape_of(nxt)
            p = get_platform()
            self._store(nxt, p.recv(shape, p.dtype(name), peer, self.group,
                                    dim=self.dim).wait())
        return self._arrived.pop(msg)

    def finish(self) -> None:
        sends, self._sends = self._sends, []
        for handle in sends:
            handle.wait()

    def _store(self, msg: tuple, tensor: Any) -> None:
        if msg[0] == "hdr":
            self._shapes[("act", msg[1])] = decode(tensor)[1]
        self._arrived[msg] = tensor

    def _shape_of(self, msg: tuple) -> tuple:
        if msg[0] in ("hdr", "reply"):
            return "int32", (HEADER,)
        return self._shapes[(msg[0], msg[1])]


def describe(tensor: Any) -> tuple:
    """``(dtype name, shape)`` of a tensor that crosses between stages."""
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


def encode(ok: bool, described: tuple) -> Any:
    name, shape = described
    if len(shape) > HEADER - 3:
        raise ValueError(f"a tensor of {len(shape)} dims cannot cross between stages "
                         f"(at most {HEADER - 3})")
    header = np.zeros(HEADER, np.int32)
    header[:3] = int(ok), DTYPES.index(name), len(shape)
    header[3:3 + len(shape)] = shape
    return get_platform().from_numpy(header)


def decode(tensor: Any) -> tuple:
    """``(verdict, (dtype name, shape))``."""
    header = get_platform().to_numpy(tensor).astype(int)
    ndim = int(header[2])
    return bool(header[0]), (DTYPES[header[1]], tuple(int(d) for d in header[3:3 + ndim]))


def mismatch(sender: int, receiver: int, sent: tuple, wanted: tuple, whose: str) -> str:
    return (f"shape mismatch between pipeline stages {sender} and {receiver}: stage "
            f"{sender} sends {sent[0]} {list(sent[1])}, {whose} of stage {receiver} say "
            f"{wanted[0]} {list(wanted[1])}: give each stage input_args/output_args that "
            f"match what the stage before it returns (or none, to take what arrives)")
