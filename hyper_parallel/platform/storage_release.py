"""The optional part of the contract: freeing memory that autograd still references.

[Note: why optional]
Between a unit's forward and its backward, autograd holds the full parameters the forward
used. A platform that can free their memory and give it back before backward
(``Capabilities.can_release_storage``: torch and MindSpore) implements ``StorageRelease``
too; the core then releases full parameters after forward and gathers them again before
backward. A platform that cannot would leave it out, and the core would keep the full
parameters alive until backward instead, never calling these methods. ``copy_into_slice``
and ``restored_flat`` write into parts of a released tensor, which the core does only where
full parameters are views of a gather output (``Capabilities.kernels_read_views``).
"""

from __future__ import annotations

import abc
from typing import Any


class StorageRelease(abc.ABC):
    """Release and restore a tensor's memory, and write into restored memory."""

    @abc.abstractmethod
    def release_storage(self, tensor: Any) -> None:
        """Free the memory of ``tensor`` while keeping the object (autograd may hold it)."""

    @abc.abstractmethod
    def restore_storage(self, tensor: Any) -> None:
        """Re-allocate the memory ``release_storage`` freed (contents undefined)."""

    def copy_into_slice(self, dst: Any, dim: int, start: int, src: Any) -> None:
        """Write ``src`` into ``dst``'s slice ``[start, start + src.shape[dim])`` along
        ``dim`` in place, like ``copy_into``: refilling a restored full parameter straight
        from the all-gather output, one rank's rows at a time, costs one copy. Called only
        where ``Capabilities.kernels_read_views``: elsewhere a refill assembles the full
        parameter in memory of its own, as the first gather did, and copies it in whole."""
        raise NotImplementedError(f"{type(self).__name__}: kernels_read_views is False, so "
                                  f"full parameters are refilled whole")

    def restored_flat(self, full: Any, numel: int, start: int) -> Any:
        """Restore the memory behind ``full`` (released) to hold ``numel`` elements from
        ``start`` elements before ``full``'s first one, and return a 1-D tensor over them,
        for an all-gather to write into (``all_gather(out=...)``): ``full`` then reads
        elements ``start`` to ``start + numel(full)`` of it with no copy. Writing it leaves
        autograd's bookkeeping of ``full`` alone, as ``copy_into`` does. Called only where
        ``Capabilities.kernels_read_views``: elsewhere no full parameter is a view of a
        gather output."""
        raise NotImplementedError(f"{type(self).__name__}: kernels_read_views is False, so "
                                  f"no full parameter is gathered in place")

    def keep_released_memory(self, nbytes: int) -> None:
        """Allow up to ``nbytes`` (the largest asked for wins) of the memory
        ``release_storage`` frees to be kept for the next ``restore_storage`` or ``empty``
        of the same size, where the allocator would otherwise return it to the system and
        fault it in again page by page (CPU torch, see torch/released_memory.py). The core
        asks for what one step gathers again (iteration.py, ``keep_working_set``). The
        default keeps nothing: a caching allocator (CUDA) needs no help."""
