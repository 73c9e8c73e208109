"""The optional part of the contract: freeing memory that autograd still references.

[Note: why optional]
Between a unit's forward and its backward, autograd holds the full parameters the forward
used. A platform that can free their memory and give it back before backward
(``Capabilities.can_release_storage``, torch) implements ``StorageRelease`` too; the core
then releases full parameters after forward and gathers them again before backward. A
platform that cannot (MindSpore) does not implement it, and the core keeps the full
parameters alive until backward instead; it never calls these methods there.
"""

from __future__ import annotations

import abc
from typing import Any

from hyper_parallel.platform.base import Handle


class StorageRelease(abc.ABC):
    """Release and restore a tensor's memory, and gather straight into restored memory."""

    @abc.abstractmethod
    def release_storage(self, tensor: Any) -> None:
        """Free the memory of ``tensor`` while keeping the object (autograd may hold it)."""

    @abc.abstractmethod
    def restore_storage(self, tensor: Any) -> None:
        """Re-allocate the memory ``release_storage`` freed (contents undefined)."""

    @abc.abstractmethod
    def all_gather_into_released(self, full: Any, input: Any, group: Any, group_size: int,
                                 async_op: bool = False, dim: str = "", start: int = 0) -> Handle:
        """Gather every rank's 1-D ``input`` straight into the memory behind ``full``, a
        tensor whose memory ``release_storage`` freed: that memory is restored to hold the
        ``group_size * numel(input)`` gathered elements (rank-major) from ``start``
        elements before ``full``'s first element on, so ``full`` reads the gathered
        elements ``start`` to ``start + numel(full)``; the rest (other parameters of the
        same gather, padding) lies in memory no tensor reads but the ones ``full`` was cut
        from. Once ``handle.wait()`` returned, ``handle.result`` is the whole gathered
        buffer (1-D, on that memory), for copying those other parts out. Like
        ``copy_into``, autograd's bookkeeping of ``full`` is not disturbed. Re-gathering a
        parameter before backward this way costs no copy out of a gather buffer."""
