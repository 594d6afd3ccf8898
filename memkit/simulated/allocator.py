"""A model of PyTorch's CUDA caching allocator: what ``memory_reserved`` would be.

``memkit estimate`` counts live tensor storages on ``meta`` (see
:mod:`memkit.simulated.accountant`); this module replays those allocations and frees through a
simulation of the native caching allocator (``c10/cuda/CUDACachingAllocator.cpp``, default
configuration, one stream) to predict both counters a GPU would report:

* ``allocated``: the sizes of the blocks handed out (``torch.cuda.memory_allocated``). A request is
  rounded up to 512 bytes; a block that is not split keeps its whole size, so allocated can exceed
  the sum of the rounded requests.
* ``reserved``: the segments obtained from ``cudaMalloc`` (``torch.cuda.memory_reserved``).

The rules modelled (constants as in the allocator's source):

* requests of at most 1 MiB (``kSmallSize``) come from the small pool, whose segments are 2 MiB
  (``kSmallBuffer``); larger ones from the large pool, whose segments are 20 MiB
  (``kLargeBuffer``) for requests under 10 MiB (``kMinLargeAlloc``), else the request rounded up
  to 2 MiB (``kRoundLarge``);
* best fit: the smallest cached free block of the pool that is large enough (ties: lowest
  address);
* a block is split when the remainder is at least 512 bytes (small pool) or more than 1 MiB
  (large pool); freed blocks merge with free neighbours in their segment;
* when a new segment would exceed the capacity, the allocator frees every cached segment that is
  entirely free (``release_cached_blocks``) and retries; if it still does not fit, that is an
  out-of-memory error (counted in :attr:`CachingAllocatorModel.num_ooms`; the simulation goes on
  so that the peak that would have been needed is known).

Not modelled: ``expandable_segments``, ``max_split_size_mb``, ``roundup_power2_divisions``,
``garbage_collection_threshold``, several streams, and the physical address order of segments
(addresses are assigned in allocation order).

Examples:
    >>> alloc = CachingAllocatorModel()
    >>> alloc.malloc("a", 1000)
    >>> alloc.allocated, alloc.reserved
    (1024, 2097152)
    >>> alloc.free("a")
    >>> alloc.allocated, alloc.reserved
    (0, 2097152)
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable
from dataclasses import dataclass, field

__all__ = [
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "CachingAllocatorModel",
    "round_size",
]

K_MIN_BLOCK = 512
"""``kMinBlockSize``: every block is a multiple of this."""
K_SMALL_SIZE = 1 << 20
"""``kSmallSize``: requests up to 1 MiB use the small pool."""
K_SMALL_BUFFER = 2 << 20
"""``kSmallBuffer``: small-pool segments are 2 MiB."""
K_LARGE_BUFFER = 20 << 20
"""``kLargeBuffer``: large-pool segment for requests under ``K_MIN_LARGE_ALLOC``."""
K_MIN_LARGE_ALLOC = 10 << 20
"""``kMinLargeAlloc``: larger requests get a segment of their own rounded size."""
K_ROUND_LARGE = 2 << 20
"""``kRoundLarge``: large segments are rounded up to 2 MiB."""


def round_size(nbytes: int) -> int:
    """The allocator's request rounding: ``max(512, ceil(n / 512) * 512)``; an empty request
    takes no block at all (the allocator returns a null pointer for it).

    Examples:
        >>> [round_size(n) for n in (0, 1, 512, 513)]
        [0, 512, 512, 1024]
    """
    if nbytes <= 0:
        return 0
    return max(K_MIN_BLOCK, -(-nbytes // K_MIN_BLOCK) * K_MIN_BLOCK)


def _segment_size(size: int) -> int:
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    small: bool
    prev: _Block | None = None
    next: _Block | None = None
    allocated: bool = False
    key: tuple[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.key = (self.size, self.addr)


class CachingAllocatorModel:
    """Replays allocations and frees through a simulated CUDA caching allocator.

    Args:
        capacity: bytes ``cudaMalloc`` may hand out in all (the device minus the CUDA context);
            ``None`` for no limit.

    Attributes:
        allocated, reserved: current bytes (see the module docstring).
        peak_allocated, peak_reserved: their high-water marks.
        num_ooms: allocations that did not fit even after freeing the cache.
        allocated_by_pool, reserved_by_pool, segments_by_pool: current bytes, bytes and segment
            counts per pool (``True``: the small pool), as ``memory_stats`` splits them.
    """

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.num_ooms = 0
        self.allocated_by_pool: dict[bool, int] = {True: 0, False: 0}
        self.reserved_by_pool: dict[bool, int] = {True: 0, False: 0}
        self.segments_by_pool: dict[bool, int] = {True: 0, False: 0}
        self._next_addr = 0
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        self._free_blocks: dict[tuple[int, int], _Block] = {}
        self._live: dict[Hashable, _Block] = {}

    # -- free lists -------------------------------------------------------------------------
    def _add_free(self, block: _Block) -> None:
        block.key = (block.size, block.addr)
        bisect.insort(self._free[block.small], block.key)
        self._free_blocks[block.key] = block

    def _remove_free(self, block: _Block) -> None:
        pool = self._free[block.small]
        i = bisect.bisect_left(pool, block.key)
        del pool[i]
        del self._free_blocks[block.key]

    def _best_fit(self, size: int, small: bool) -> _Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        block = self._free_blocks[pool[i]]
        self._remove_free(block)
        return block

    # -- segments ---------------------------------------------------------------------------
    def _release_cached(self) -> None:
        """Free every segment that is entirely free (``release_cached_blocks``)."""
        for small in (True, False):
            for key in list(self._free[small]):
                block = self._free_blocks[key]
                if block.prev is None and block.next is None:
                    self._remove_free(block)
                    self.reserved -= block.size
                    self.reserved_by_pool[small] -= block.size
                    self.segments_by_pool[small] -= 1

    def _new_segment(self, size: int, small: bool) -> _Block:
        seg = _segment_size(size)
        if self.capacity is not None and self.reserved + seg > self.capacity:
            self._release_cached()
            if self.reserved + seg > self.capacity:
                self.num_ooms += 1
        block = _Block(self._next_addr, seg, small)
        self._next_addr += seg
        self.reserved += seg
        self.reserved_by_pool[small] += seg
        self.segments_by_pool[small] += 1
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    # -- the public interface ---------------------------------------------------------------
    def malloc(self, key: Hashable, nbytes: int) -> None:
        """Allocate a block for ``nbytes`` under ``key`` (freed later with :meth:`free`)."""
        if nbytes <= 0:
            return
        if key in self._live:
            self.free(key)
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE
        block = self._best_fit(size, small) or self._new_segment(size, small)
        remaining = block.size - size
        if remaining >= K_MIN_BLOCK if small else remaining > K_SMALL_SIZE:
            rest = _Block(block.addr + size, remaining, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._add_free(rest)
        block.allocated = True
        self._live[key] = block
        self.allocated += block.size
        self.allocated_by_pool[small] += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: Hashable) -> None:
        """Return the block allocated under ``key`` to the cache (unknown keys are ignored)."""
        block = self._live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        self.allocated_by_pool[block.small] -= block.size
        block.allocated = False
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._remove_free(neighbour)
                if neighbour is block.prev:
                    block.addr = neighbour.addr
                    block.prev = neighbour.prev
                    if neighbour.prev is not None:
                        neighbour.prev.next = block
                else:
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
                block.size += neighbour.size
        self._add_free(block)

    def inactive_split(self) -> dict[bool, tuple[int, int]]:
        """Per pool (``True``: small), the count and bytes of free blocks in segments that also
        hold allocated blocks (``memory_stats``' ``inactive_split``); one pass over the free
        blocks."""
        out = {True: (0, 0), False: (0, 0)}
        for block in self._free_blocks.values():
            if block.prev is not None or block.next is not None:
                count, nbytes = out[block.small]
                out[block.small] = (count + 1, nbytes + block.size)
        return out

    def free_blocks(self) -> list[tuple[int, bool]]:
        """``(size, small_pool)`` of every free cached block."""
        return [(size, small) for small, pool in self._free.items() for size, _ in pool]

    def release_cached(self) -> None:
        """Free every segment that is entirely free, as ``torch.cuda.empty_cache()`` does."""
        self._release_cached()

    def reset_peak(self) -> None:
        """Set the peaks to the current values."""
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved
