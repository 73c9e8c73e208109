"""What is all-gathered for a parameter, and how its full parameter is rebuilt from it.

[Note: gather codecs]
By default a unit gathers each parameter's shard in its compute dtype and the gathered
rows are the full parameter. A ``GatherCodec`` changes both ends for one parameter:
``encode`` turns this rank's shard into the tensors that go over the wire (for a
low-precision gather: the shard in fewer bits, plus whatever scales rebuild it) and
``decode`` turns every rank's tensors, concatenated along dim 0, into the full parameter
the forward computes with. The gradient is the full parameter's, in the parameter's own
dtype, and is reduced as every other gradient: a codec changes only what is gathered.

This is FSDP2's all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``
on a tensor subclass) said once for both frameworks: on torch a shard whose local tensor
defines those hooks gets a codec that calls them (``Platform.gather_codec_of``), and
``set_gather_codec`` (codec_choice.py) attaches a codec to parameters of either
framework before ``fully_shard``. A parameter with a codec is gathered in its unit's codec leg
(layout.py): every rank sends its codecs' tensors as one byte buffer (whatever their
dtypes, so a dtype the collective lacks, such as float8 on gloo, travels too), and the
collective counters report those bytes.

The contract, checked at the first all-gather (``codec_leg.py``): every tensor ``encode``
returns has the shard's padded rows (``chunk_rows``) as dim 0, or the shard's own rows, to
which the core appends zero rows, so each rank's part is the same size and the gathered
rows of rank r follow rank r-1's; ``decode`` returns a tensor of the parameter's full shape
(or with every rank's padded rows: the core drops the trailing padding). A re-gather into
released memory (the re-gather before backward, with ``out``) writes into the full
parameter the first ``decode`` made, which autograd may hold: ``decode(..., out=full)``
must rebuild it in place, in the memory that ``storage_of(full)`` names, which the unit
releases when it reshards.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

#: the attribute of a parameter (set before fully_shard) naming its GatherCodec
GATHER_CODEC_ATTR = "_hp_gather_codec"


@dataclass(frozen=True)
class GatherContext:
    """What a codec may need for one parameter: the platform, the parameter's name and
    full shape, the module it is registered on, the unit's mesh (``MeshInfo``) and its
    mixed-precision dtypes (None where the policy leaves them)."""

    platform: Any
    fqn: str
    full_shape: tuple
    module: Any
    mesh_info: Any
    param_dtype: Any
    reduce_dtype: Any


class GatherCodec(abc.ABC):
    """One parameter's all-gather encoding (see the note "gather codecs")."""

    @abc.abstractmethod
    def encode(self, shard: Any, context: GatherContext) -> tuple[list, Any]:
        """``(inputs, metadata)``: the tensors this rank sends (dim 0: the shard's padded
        rows) and what ``decode`` needs besides them (kept on this rank, not gathered)."""

    @abc.abstractmethod
    def decode(self, outputs: list, metadata: Any, dtype: Any, context: GatherContext,
               out: Any = None) -> Any:
        """The full parameter in compute dtype ``dtype`` from ``outputs`` (each input
        gathered over the shard group, ranks in order along dim 0). With ``out`` (a full
        parameter an earlier ``decode`` returned, its memory restored): rebuild it in
        place and return None."""

    def storage_of(self, full: Any) -> list:
        """The tensors whose memory holds ``full``'s values: released when the unit
        reshards, restored before ``decode(out=full)``."""
        return [full]

    def aliased(self, full: Any, alias: Any) -> None:
        """The unit made ``alias``, a new tensor over ``full``'s memory (a kept unit's next
        autograd node, ``set_reshard_after_backward(False)``), which it will release and
        rebuild like ``full``. A codec that keeps state per full parameter copies it."""


class CastGather(GatherCodec):
    """Gather in a lower-precision floating dtype (``"bfloat16"``, ``"float16"``): half of
    float32's bytes, the full parameter cast back to the compute dtype. Works on every
    platform (MindSpore 2.10 has no float8 cast on CPU)."""

    def __init__(self, dtype_name: str = "bfloat16"):
        if dtype_name not in ("bfloat16", "float16"):
            raise ValueError(f"CastGather gathers in 'bfloat16' or 'float16', got {dtype_name!r}")
        self.dtype_name = dtype_name

    def encode(self, shard, context):
        p = context.platform
        return [p.cast(shard, p.dtype(self.dtype_name))], None

    def decode(self, outputs, metadata, dtype, context, out=None):
        p = context.platform
        full = p.cast(outputs[0], dtype)
        if out is None:  # the core drops the padding rows of uneven shards
            return full if full is not outputs[0] else p.clone(full)
        rows = p.shape(out)[0]
        p.copy_into(out, full if p.shape(full)[0] == rows else p.narrow(full, 0, 0, rows))
        return None

    def __repr__(self) -> str:
        return f"CastGather({self.dtype_name!r})"


class Int8RowGather(GatherCodec):
    """Gather each row of a matrix as int8 scaled by the row's largest magnitude (float32
    scales, one per row): about a quarter of float32's bytes, the full parameter rebuilt
    in the compute dtype to within half a step of its row's 1/127. Rows lie along the
    shard dim, so a rank scales its own rows: no extra collective. Works on every platform."""

    def encode(self, shard, context):
        values, scales = context.platform.int8_rows(shard)
        return [values, scales], None

    def decode(self, outputs, metadata, dtype, context, out=None):
        p = context.platform
        full = p.from_int8_rows(outputs[0], outputs[1], dtype)
        if out is None:  # the core drops the padding rows of uneven shards
            return full
        rows = p.shape(out)[0]
        p.copy_into(out, full if p.shape(full)[0] == rows else p.narrow(full, 0, 0, rows))
        return None

    def __repr__(self) -> str:
        return "Int8RowGather()"
