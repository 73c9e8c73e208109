"""StorageRelease on MindSpore, and the one write that refills released memory.

[Note: releasing memory autograd holds, on MindSpore]
A tensor's memory is its ``UntypedStorage``, shared by every tensor object over it (the full
parameter the module reads and the one autograd saved for backward). Releasing is
``storage.resize_(0)``, restoring ``storage.resize_(nbytes)``: the tensor objects, and
autograd's references to them, stay; only the memory goes and comes back, as on torch.
Both wait for the kernels already queued, so none still reads memory it frees. This holds
for tensors with memory of their own: a kernel copies a *view* before reading it, and
autograd keeps that copy, so full parameters are never views here
(``kernels_read_views`` is False; fully_shard/layout.py, "views").

[Note: every write is a whole-storage copy]
Refilling must not count as a modification of what autograd saved: ``Tensor.copy_`` into a
saved tensor bumps its version and backward then refuses it ("modified by an inplace
operation"). So every write goes through a tensor of its own set onto the same storage
(``Tensor.set_``, its own version counter) and is a ``copy_`` of the *whole* storage: on
CPU ``copy_`` compares the two memories' sizes (a part of a storage is refused or, at an
offset, silently left unwritten), it needs a source with memory of its own (a view is
copied first), and slice assignment (``window[a:b] = src``) is no alternative: it writes
nothing once an exception has aborted a ``value_and_grad`` in the process (what
``reset_iter_state``'s tests exercise). ``UntypedStorage.copy_`` is none either: it runs later, on
the pipeline, without keeping its source alive. A destination that is part of a larger
storage gets the rest of the storage copied back around it; the core writes only whole
full parameters and gradients (no ``copy_into_slice``, no ``restored_flat``: they serve
gathering into views).
"""

from __future__ import annotations

from mindspore import mint, ops

from hyper_parallel.platform.storage_release import StorageRelease


def _over_storage(storage, dtype, numel: int):
    """A 1-D tensor over the first ``numel`` elements of ``storage``: a tensor of its own
    (its own version counter) on the same memory."""
    tensor = mint.empty((0,), dtype=dtype)
    tensor.set_(storage, 0, (numel,), (1,))
    return tensor


def _owns_storage(tensor) -> bool:
    """Whether ``tensor`` is exactly its storage's memory, densely."""
    return (tensor.storage_offset() == 0 and tensor.is_contiguous()
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.itemsize)


class MindSporeStorageRelease(StorageRelease):
    """``StorageRelease`` and ``copy_into`` over MindSpore storages (see the notes)."""

    def copy_into(self, dst, src) -> None:
        # dst is dense (the core's full parameters, gradients, parameters), so its elements
        # are one stretch of its storage
        storage = dst.untyped_storage()
        total = storage.nbytes() // dst.itemsize
        values = (src if src.dtype == dst.dtype else src.astype(dst.dtype)).reshape(-1)
        if not _owns_storage(dst):  # the rest of the storage is written back as it was
            first, numel = dst.storage_offset(), dst.numel()
            old = _over_storage(storage, dst.dtype, total)
            values = ops.cat([mint.narrow(old, 0, 0, first), values,
                              mint.narrow(old, 0, first + numel, total - first - numel)])
        elif not _owns_storage(values):
            values = values + 0  # InplaceCopy reads only tensors with memory of their own
        _over_storage(storage, dst.dtype, total).copy_(values)

    def starts_with(self, whole, part) -> bool:
        return part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr() and \
            part.storage_offset() == whole.storage_offset() and part.is_contiguous()

    def release_storage(self, tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.nbytes() != 0:
            storage.resize_(0)

    def restore_storage(self, tensor) -> None:
        # Several tensors may be reads of one buffer: size it for the furthest.
        storage = tensor.untyped_storage()
        needed = (tensor.storage_offset() + tensor.numel()) * tensor.itemsize
        if storage.nbytes() < needed:
            storage.resize_(needed)
