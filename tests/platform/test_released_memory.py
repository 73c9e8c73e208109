"""torch CPU's pool of released memory (hyper_parallel/platform/torch/released_memory.py):
blocks are reused by size, never beyond the limit, and reach every view of a storage; the
platform's StorageRelease methods (``keep_released_memory``, ``release_storage``,
``restored_flat``, ``empty``) hand them on. What it buys is measured by the benchmark
(minor_faults_per_step), not here."""

import pytest

torch = pytest.importorskip("torch")

from hyper_parallel.platform.torch.released_memory import ReleasedMemory  # noqa: E402


def _full(values):
    return torch.tensor(values, dtype=torch.float32)


def test_release_then_fill_reuses_the_same_memory_and_views_see_it():
    pool = ReleasedMemory()
    pool.raise_limit(1 << 20)
    full = _full([1.0, 2.0, 3.0, 4.0])
    view = full[1:3]
    address = full.untyped_storage().data_ptr()
    pool.release(full.untyped_storage())
    assert full.untyped_storage().nbytes() == 0 and view.untyped_storage().nbytes() == 0
    assert pool.held_bytes == 16
    assert pool.fill(full.untyped_storage(), 16)
    assert full.untyped_storage().data_ptr() == address and pool.held_bytes == 0
    full.copy_(_full([5.0, 6.0, 7.0, 8.0]))
    assert view.tolist() == [6.0, 7.0]


def test_only_an_exact_size_is_served_and_take_hands_the_block_over():
    pool = ReleasedMemory()
    pool.raise_limit(1 << 20)
    full = _full([0.0] * 8)
    address = full.untyped_storage().data_ptr()
    pool.release(full.untyped_storage())
    assert pool.take(16) is None and not pool.fill(torch.UntypedStorage(0), 64)
    block = pool.take(32)
    assert block is not None and block.data_ptr() == address and pool.held_bytes == 0
    assert pool.take(32) is None


def test_memory_beyond_the_limit_is_freed_not_kept():
    pool = ReleasedMemory()
    pool.raise_limit(40)
    first, second = _full([0.0] * 8), _full([0.0] * 8)  # 32 bytes each
    pool.release(first.untyped_storage())
    pool.release(second.untyped_storage())
    assert pool.held_bytes == 32
    assert second.untyped_storage().nbytes() == 0  # freed all the same
    pool.raise_limit(8)  # the largest limit asked for wins
    assert pool.limit == 40


def test_a_storage_that_still_has_memory_is_not_filled():
    pool = ReleasedMemory()
    pool.raise_limit(1 << 20)
    spare = _full([0.0] * 4)
    pool.release(spare.untyped_storage())
    live = _full([1.0] * 4)
    assert not pool.fill(live.untyped_storage(), 16)
    assert pool.held_bytes == 16 and live.tolist() == [1.0] * 4


def _cpu_platform():
    from hyper_parallel.platform.torch.platform import TorchPlatform

    if torch.cuda.is_available() or not hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
        pytest.skip("the pool serves CPU torch with UntypedStorage._swap_data_ptr_ only")
    return TorchPlatform()


def test_restored_flat_refills_from_the_memory_release_storage_kept():
    platform = _cpu_platform()
    platform.keep_released_memory(1 << 20)
    buffer = torch.zeros(12)
    full = buffer[2:8].view(2, 3)  # a full parameter: a read of its unit's gathered buffer
    address = buffer.untyped_storage().data_ptr()
    platform.release_storage(full)
    assert buffer.untyped_storage().nbytes() == 0
    flat = platform.restored_flat(full, 12, 2)  # the same 48 bytes: the kept block
    assert full.untyped_storage().data_ptr() == address == flat.untyped_storage().data_ptr()
    flat.copy_(torch.arange(12, dtype=torch.float32))
    assert full.tolist() == [[2.0, 3.0, 4.0], [5.0, 6.0, 7.0]]


def test_empty_takes_a_kept_block_of_its_size_only():
    platform = _cpu_platform()
    platform.keep_released_memory(1 << 20)
    full = torch.ones(8)
    address = full.untyped_storage().data_ptr()
    platform.release_storage(full)
    other = platform.empty((4,), torch.float32)  # 16 bytes: not the 32-byte block
    taken = platform.empty((2, 4), torch.float32)
    assert taken.shape == (2, 4) and taken.untyped_storage().data_ptr() == address
    assert other.untyped_storage().data_ptr() != address
    platform.restore_storage(full)  # the block is taken: new memory, not shared with it
    full.fill_(3.0)
    taken.fill_(-1.0)
    assert full.tolist() == [3.0] * 8
