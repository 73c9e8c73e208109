"""The all-gather of a unit's codec leg: the parameters whose shards a ``GatherCodec``
encodes (gather_codec.py), gathered as one byte buffer and decoded into full parameters.

[Note: the codec leg on the wire]
Each rank encodes its shard of every parameter of the leg, views each tensor the codecs
return as bytes, pads each to a multiple of ``_ALIGN`` bytes (so every tensor starts where
its dtype can be read in place) and concatenates them: one piece of the same size on every
rank, since every tensor has the shard's padded rows. The piece travels as int32 words,
which every collective backend gathers (gloo has no float8, mccl's CPU gather no int8).
Rank r's tensor i is read back from its piece at the same offset on every rank, and the
ranks' tensors, concatenated along dim 0, are what ``decode`` gets. The counters see the
int32 all-gather: the bytes that went over the wire.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hyper_parallel.fully_shard.gather_codec import GatherContext
from hyper_parallel.platform import Gathered, Handle

if TYPE_CHECKING:
    from hyper_parallel.fully_shard.param import FSDPParam
    from hyper_parallel.platform import Platform

_ALIGN = 8  # bytes: the widest dtype a codec sends (float64, int64) reads in place from here


@dataclass
class Encoded:
    """One parameter's encoding on this rank: its tensors' shapes and dtypes, their byte
    offsets in the rank's piece, and the metadata its codec keeps for ``decode``."""

    fsdp_param: FSDPParam
    context: GatherContext
    shapes: list
    dtypes: list
    offsets: list
    metadata: Any


def issue_codec_gather(platform: Platform, params: list, contexts: list, group: Any,
                       size: int, async_op: bool) -> tuple[Handle, list]:
    """Encode ``params`` (their ``contexts`` in the same order) and start the all-gather
    of their bytes over ``group`` (``size`` ranks); return the handle and the encodings."""
    p = platform
    byte_parts, encoded, total = [], [], 0
    for fsdp_param, context in zip(params, contexts):
        inputs, metadata = _encode(p, fsdp_param, context)
        offsets = []
        for tensor in inputs:
            raw = p.as_bytes(p.contiguous(tensor))
            nbytes = p.shape(raw)[0]
            padding = -nbytes % _ALIGN
            byte_parts += [raw, p.zeros((padding,), p.dtype("uint8"))] if padding else [raw]
            offsets.append(total)
            total += nbytes + padding
        encoded.append(Encoded(fsdp_param, context, [p.shape(t) for t in inputs],
                               [p.dtype_of(t) for t in inputs], offsets, metadata))
    flat = byte_parts[0] if len(byte_parts) == 1 else p.cat(byte_parts, 0)
    words = p.from_bytes(flat, p.dtype("int32"), (total // 4,))
    if size == 1:
        whole = p.clone(words)
        return Handle(result=Gathered([whole], whole)), encoded
    return p.all_gather(words, group, async_op=async_op, dim="shard"), encoded


def _encode(p: Platform, fsdp_param: FSDPParam, context: GatherContext) -> tuple[list, Any]:
    """The codec's tensors for this rank's shard, each with the padded rows as dim 0 (a
    tensor with only the shard's own rows gets zero rows appended), checked."""
    fp, codec = fsdp_param, fsdp_param.gather_codec
    if fp.shard_dim != 0 or fp.is_tensor_parallel:
        raise NotImplementedError(
            f"parameter {fp.fqn!r} has a gather codec ({codec!r}) and is "
            f"{'tensor parallel' if fp.is_tensor_parallel else f'sharded on dim {fp.shard_dim}'}"
            f": a codec's tensors are gathered along dim 0 of a plain parameter; shard it on "
            f"dim 0 (shard_placement_fn) or gather it without the codec")
    inputs, metadata = codec.encode(p.local_tensor(fp.sharded_param), context)
    inputs = list(inputs)
    shapes = [p.shape(t) for t in inputs]
    if not inputs or any(len(s) == 0 or s[0] not in (fp.chunk_rows, fp.stored_rows)
                         for s in shapes):
        raise ValueError(
            f"the gather codec of parameter {fp.fqn!r} ({codec!r}) encoded its shard of shape "
            f"{p.shape(p.local_tensor(fp.sharded_param))} into tensors of shapes {shapes}: it "
            f"must return at least one tensor, each with the shard's padded rows "
            f"({fp.chunk_rows}) as dim 0, so that every rank sends the same size; fix the "
            f"codec's encode (torch: fsdp_pre_all_gather)")
    padded = []
    for tensor, shape in zip(inputs, shapes):
        if shape[0] < fp.chunk_rows:
            missing = p.zeros((fp.chunk_rows - shape[0], *shape[1:]), p.dtype_of(tensor))
            tensor = p.cat([tensor, missing], 0)
        padded.append(tensor)
    return padded, metadata


def codec_outputs(platform: Platform, encoded: Encoded, pieces: list) -> list:
    """One parameter's gathered tensors out of the per-rank pieces: tensor i of every rank,
    concatenated along dim 0."""
    p = platform
    outputs = []
    for shape, dtype, offset in zip(encoded.shapes, encoded.dtypes, encoded.offsets):
        nbytes = math.prod(shape) * p.element_size(dtype)
        parts = [p.from_bytes(p.narrow(p.as_bytes(piece), 0, offset, nbytes), dtype, shape)
                 for piece in pieces]
        outputs.append(parts[0] if len(parts) == 1 else p.cat(parts, 0))
    return outputs


def decode_full(platform: Platform, encoded: Encoded, pieces: list, dtype: Any) -> Any:
    """The full parameter decoded from the gathered pieces, checked to have its shape."""
    p, fp = platform, encoded.fsdp_param
    full = fp.gather_codec.decode(codec_outputs(p, encoded, pieces), encoded.metadata, dtype,
                                  encoded.context)
    shape = p.shape(full)
    if shape and shape[0] == fp.shard_size * fp.chunk_rows and fp.rows != shape[0]:
        full = p.narrow(full, 0, 0, fp.rows)  # the padding rows of the last ranks
        shape = p.shape(full)
    if tuple(shape) != tuple(fp.full_shape):
        raise ValueError(
            f"the gather codec of parameter {fp.fqn!r} ({fp.gather_codec!r}) decoded a full "
            f"parameter of shape {tuple(shape)}; the parameter's shape is "
            f"{tuple(fp.full_shape)}: fix the codec's decode (torch: fsdp_post_all_gather)")
    return full


def decode_into(platform: Platform, encoded: Encoded, pieces: list, dtype: Any,
                full: Any) -> None:
    """Rebuild ``full`` (an earlier ``decode_full`` result, its memory restored) in place."""
    fp = encoded.fsdp_param
    fp.gather_codec.decode(codec_outputs(platform, encoded, pieces), encoded.metadata, dtype,
                           encoded.context, out=full)
