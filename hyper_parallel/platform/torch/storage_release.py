"""StorageRelease on torch: free and restore the memory autograd still references.

[Note: releasing memory autograd holds, on torch]
A full parameter's memory is its ``UntypedStorage``; releasing resizes it to 0 bytes and
restoring resizes it back, so the tensor objects autograd saved stay valid and only the
memory goes and comes back. Views are real on torch, so writes into restored memory are
zero-copy: a gather may write straight into a part of it (``copy_into_slice``,
``restored_flat``). On CPU, released memory is kept for the next gather of the same size
(released_memory.py): CPU's allocator, unlike CUDA's caching one, would return it to the
system. ``self._released`` is that pool (None where it is not used), set by
TorchPlatform.__init__.
"""

from __future__ import annotations

import torch

from hyper_parallel.platform.storage_release import StorageRelease


class TorchStorageRelease(StorageRelease):
    """The StorageRelease part of ``TorchPlatform``."""

    def keep_released_memory(self, nbytes: int) -> None:
        if self._released is not None:
            self._released.raise_limit(nbytes)

    def copy_into_slice(self, dst, dim, start, src) -> None:
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(dst):
            dst.narrow(dim, start, src.shape[dim]).copy_(src)

    def release_storage(self, tensor) -> None:
        storage = tensor.untyped_storage()
        if self._released is not None:
            self._released.release(storage)
        elif storage.size() != 0:
            storage.resize_(0)

    def restored_flat(self, full, numel, start):
        offset = full.storage_offset() - start
        storage = self._grow_storage(full, numel, offset)
        # A new tensor on the same memory, not a view of ``full``: a collective's write then
        # leaves the version counter autograd checks for ``full`` alone (it was saved by
        # the forward, and refilling the values it had is no modification).
        with torch.no_grad():
            return full.new_empty(0).set_(storage, offset, (numel,))

    def restore_storage(self, tensor) -> None:
        # Several full parameters may be views of one buffer: size it for the furthest.
        self._grow_storage(tensor, tensor.numel(), tensor.storage_offset())

    def _grow_storage(self, tensor, numel: int, offset: int):
        """The tensor's storage, given memory (kept memory first, see released_memory.py)
        if needed to hold ``numel`` elements from element ``offset`` of the storage."""
        storage = tensor.untyped_storage()
        needed = (offset + numel) * tensor.element_size()
        if storage.size() < needed and not (
                self._released is not None and self._released.fill(storage, needed)):
            storage.resize_(needed)
        return storage
