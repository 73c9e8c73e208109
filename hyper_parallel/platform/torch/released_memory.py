"""Memory that ``release_storage`` freed, kept for the next request of the same size.

[Note: why CPU torch keeps released memory]
torch's CPU allocator is glibc's malloc, which hands blocks of megabytes back to the
kernel on free (munmap, or a trim of the heap's top). The next block of that size is then
mapped fresh and every 4 KiB page of it faults in, zeroed by the kernel, on first touch:
for the full parameters a unit gathers, re-gathers and frees every step, that is tens of
thousands of page faults per step (the benchmark's ``minor_faults_per_step``), paid inside
the collective that first writes the buffer. CUDA has a caching allocator for this; CPU
has none, so the platform keeps what it released here and hands it to the next gather of
the same size.

How memory moves without anyone seeing a different tensor: a full parameter autograd saved
(and every view of it) must stay the same storage object across release and restore. The
pool therefore swaps the *memory* between storage objects (``_swap_data_ptr_`` exchanges
the data pointer and size of two storages): release moves the memory out into a holder
storage kept here, and the parameter's storage is left empty, exactly as ``resize_(0)``
leaves it; restore swaps a kept block back in. A block is only ever in one storage, so
reuse can alias nothing that release_storage's own contract would not already forbid
(no collective may still touch memory being released).

The pool holds at most ``limit`` bytes, which the core sets to what a step holds at once
anyway (fully_shard/iteration.py, ``keep_working_set``): the full parameters of units that
keep them through forward, plus two units that reshard after forward (one computing, one
prefetched). Enough that a steady state of gather, release and re-gather never asks
malloc; small enough that the process's peak does not grow and the memory a sharded model
saves is not held back. Blocks beyond it are freed as before. The limit only rises (the
largest asked for wins), and the blocks stay with the process until a gather takes them.
Sizes must match exactly: a parameter's gather and its re-gather ask for the same bytes
every step.
"""

from __future__ import annotations

import torch


class ReleasedMemory:
    """Blocks of freed memory by size in bytes, up to ``limit`` bytes in all."""

    def __init__(self) -> None:
        self.limit = 0
        self._held = 0
        self._blocks: dict[int, list[torch.UntypedStorage]] = {}

    def raise_limit(self, nbytes: int) -> None:
        self.limit = max(self.limit, nbytes)

    def release(self, storage: torch.UntypedStorage) -> None:
        """Empty ``storage`` (as ``resize_(0)`` would), keeping its memory if it fits."""
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        if self._held + nbytes > self.limit:
            storage.resize_(0)
            return
        holder = torch.UntypedStorage(0, device=storage.device)
        storage._swap_data_ptr_(holder)
        self._blocks.setdefault(nbytes, []).append(holder)
        self._held += nbytes

    def take(self, nbytes: int) -> torch.UntypedStorage | None:
        """A kept block of exactly ``nbytes`` (now the caller's), or None."""
        blocks = self._blocks.get(nbytes)
        if not blocks:
            return None
        self._held -= nbytes
        return blocks.pop()

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> bool:
        """Give the empty ``storage`` a kept block of exactly ``nbytes``; False if none."""
        block = self.take(nbytes) if storage.nbytes() == 0 else None
        if block is None:
            return False
        storage._swap_data_ptr_(block)
        return True

    @property
    def held_bytes(self) -> int:
        return self._held
