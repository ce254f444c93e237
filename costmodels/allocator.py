"""PyTorch's CUDA caching allocator, replayed on a sequence of allocations and frees.

The planner cannot run the allocator (there is no GPU, and a step has tens of thousands of allocations), so its
reservation model (`overhead.reserved_bytes`) is a formula. This module is the reference that formula is checked
against: it replays an allocation trace through the allocator's documented rules, as c10/cuda/
CUDACachingAllocator.cpp (torch 2.x) applies them with the default configuration (no `max_split_size_mb`, no
`roundup_power2_divisions`, one stream):

- every request is rounded up to a multiple of 512 B (`kMinBlockSize`);
- requests up to 1 MiB (`kSmallSize`) use the small pool, larger ones the large pool;
- a request is served by the smallest free cached block of its pool that holds it (best fit, lowest address
  among equals); the rest of that block is split off when it is at least 512 B (small pool) or over 1 MiB
  (large pool), otherwise it stays part of the allocation;
- with no such block, a new segment is reserved with cudaMalloc: 2 MiB for small requests (`kSmallBuffer`),
  20 MiB for requests under 10 MiB (`kLargeBuffer`, `kMinLargeAlloc`), else the request rounded up to 2 MiB
  (`kRoundLarge`);
- a freed block merges with free neighbours of its segment; segments are never returned while it runs, except
  that a cudaMalloc beyond the device's memory first frees every cached segment with no block in use and retries
  (`release_cached_blocks`), and fails (out of memory) only if it still does not fit.

With `expandable_segments:True` (PYTORCH_CUDA_ALLOC_CONF) each pool is one segment of virtual addresses mapped in
pages of 2 MiB (small pool) or 20 MiB (large pool): a request no free block holds extends the segment's free tail
by mapping pages, and before failing the allocator unmaps every page that lies wholly inside free blocks.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 2**20  # kSmallSize: the largest small-pool request
SMALL_BUFFER = 2 * 2**20  # kSmallBuffer: small-pool segment, and the small pool's page when expandable
LARGE_BUFFER = 20 * 2**20  # kLargeBuffer: 20 MiB segment for 1-10 MiB requests; the large pool's page
MIN_LARGE_ALLOC = 10 * 2**20  # kMinLargeAlloc
ROUND_LARGE = 2 * 2**20  # kRoundLarge


class OutOfMemory(Exception):
    """The trace needs more than the capacity it was replayed under."""


def round_size(nbytes: int) -> int:
    """The block size a request occupies (`round_size`)."""
    return max(MIN_BLOCK, math.ceil(nbytes / MIN_BLOCK) * MIN_BLOCK)


def page_size(small: bool) -> int:
    """An expandable segment's page: kSmallBuffer for the small pool, kLargeBuffer for the large one."""
    return SMALL_BUFFER if small else LARGE_BUFFER


def segment_size(rounded: int) -> int:
    """The cudaMalloc size for a request no cached block holds (`get_allocation_size`)."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return math.ceil(rounded / ROUND_LARGE) * ROUND_LARGE


@dataclass(slots=True)
class _Segment:
    """One cudaMalloc (or, with expandable segments, one pool's range of mapped pages)."""

    size: int
    small: bool


@dataclass(eq=False, slots=True)
class _Block:
    address: int
    size: int
    segment: int
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None


class _Pool:
    """Free blocks of one pool, ordered by (size, address) as the allocator's `BlockPool` set orders them."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[tuple[int, int], _Block] = {}

    def add(self, block: _Block) -> None:
        key = (block.size, block.address)
        bisect.insort(self.keys, key)
        self.blocks[key] = block

    def remove(self, block: _Block) -> None:
        key = (block.size, block.address)
        del self.keys[bisect.bisect_left(self.keys, key)]
        del self.blocks[key]

    def best_fit(self, size: int) -> _Block | None:
        position = bisect.bisect_left(self.keys, (size, -1))
        return self.blocks[self.keys[position]] if position < len(self.keys) else None


@dataclass(frozen=True, slots=True)
class Replay:
    """Peaks of one replay, bytes."""

    allocated: int
    """The most bytes in blocks handed out at once (`max_memory_allocated`: rounded, with unsplit remainders)."""
    requested: int
    """The most bytes requested at once (the tensors' own sizes)."""
    reserved: int
    """The most bytes held from the device at once (`max_memory_reserved`)."""
    touched: int
    """Expandable segments: the most bytes in pages holding a live byte at once, what the allocator can shrink to
    by unmapping free pages before it fails (0 without expandable segments)."""


class CachingAllocator:
    """One device's caching allocator (one stream). Classic segments may be capped at `capacity` reserved bytes
    (out of memory beyond it, after returning unused segments); with expandable segments the need is the `touched`
    peak, and `capacity` is not used."""

    def __init__(self, *, expandable: bool = False, capacity: int | None = None) -> None:
        self.expandable = expandable
        self.capacity = capacity
        self.pools = {True: _Pool(small=True), False: _Pool(small=False)}
        self.segments: dict[int, _Segment] = {}  # by first address
        self.tails: dict[bool, _Block] = {}  # expandable: each pool's last block
        self.live: dict[object, tuple[_Block, int]] = {}
        self.next_address = 0
        self.allocated = self.requested = self.reserved = 0
        self.touched = 0
        self.page_users: dict[tuple[bool, int], int] = {}
        self.peaks = Replay(0, 0, 0, 0)

    def malloc(self, key: object, nbytes: int) -> None:
        rounded = round_size(nbytes)
        small = rounded <= SMALL_SIZE
        pool = self.pools[small]
        block = pool.best_fit(rounded)
        if block is None:
            block = self._grow(small, rounded)
        else:
            pool.remove(block)
        block.free = False
        remaining = block.size - rounded
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = _Block(block.address + rounded, remaining, block.segment, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, rounded
            if self.tails.get(small) is block:
                self.tails[small] = rest
            self._release(rest)
        self.live[key] = (block, nbytes)
        self.allocated += block.size
        self.requested += nbytes
        if self.expandable:
            self._use_pages(block, small, 1)
        self._note_peaks()

    def free(self, key: object) -> None:
        block, nbytes = self.live.pop(key)
        self.allocated -= block.size
        self.requested -= nbytes
        if self.expandable:
            self._use_pages(block, self._is_small(block), -1)
        self._release(block)

    def _use_pages(self, block: _Block, small: bool, step: int) -> None:
        """Count a live block in (or out of) each page it touches; `touched` is the bytes of pages in use."""
        page = page_size(small)
        for index in range(block.address // page, (block.address + block.size - 1) // page + 1):
            users = self.page_users.get((small, index), 0) + step
            if users:
                self.page_users[small, index] = users
            else:
                del self.page_users[small, index]
            if users == 0 or (users == 1 and step == 1):
                self.touched += page * step

    def _release(self, block: _Block) -> None:
        """Mark `block` free, merge it with free neighbours, return it to its pool."""
        pool = self.pools[self._is_small(block)]
        block.free = True
        if block.prev is not None and block.prev.free:
            pool.remove(block.prev)
            block = self._absorb(block.prev, block)
        if block.next is not None and block.next.free:
            pool.remove(block.next)
            block = self._absorb(block, block.next)
        pool.add(block)

    def _absorb(self, left: _Block, right: _Block) -> _Block:
        """`left` grows over its neighbour `right` (and becomes its pool's tail if `right` was)."""
        left.size += right.size
        left.next = right.next
        if right.next is not None:
            right.next.prev = left
        for small, tail in self.tails.items():
            if tail is right:
                self.tails[small] = left
        return left

    def _is_small(self, block: _Block) -> bool:
        return self.segments[block.segment].small

    def _grow(self, small: bool, rounded: int) -> _Block:
        """A block of at least `rounded` bytes from new device memory (new segment, or mapped pages)."""
        if self.expandable:
            return self._extend(small, rounded)
        size = segment_size(rounded)
        if self.capacity is not None and self.reserved + size > self.capacity:
            self._free_unused_segments()
            if self.reserved + size > self.capacity:
                raise OutOfMemory(f"{rounded} B request with {self.reserved} B reserved")
        segment = self.next_address
        self.segments[segment] = _Segment(size, small)
        block = _Block(self.next_address, size, segment)
        self.next_address += size
        self.reserved += size
        return block

    def _extend(self, small: bool, rounded: int) -> _Block:
        """Expandable segments: map pages at the end of the pool's segment so its free tail holds `rounded`."""
        page = page_size(small)
        if small not in self.tails:
            segment = self.next_address
            self.segments[segment] = _Segment(0, small)
            self.next_address += 2**50  # a virtual range no trace fills
            self.tails[small] = _Block(segment, 0, segment, free=False)  # an empty start: nothing merges into it
        tail = self.tails[small]
        have = tail.size if tail.free else 0
        pages = math.ceil((rounded - have) / page)
        self.reserved += pages * page
        self.segments[tail.segment].size += pages * page
        if tail.free:
            self.pools[small].remove(tail)
            tail.size += pages * page
            return tail
        block = _Block(tail.address + tail.size, pages * page, tail.segment, prev=tail)
        tail.next = block
        self.tails[small] = block
        return block

    def _free_unused_segments(self) -> None:
        for pool in self.pools.values():
            for block in list(pool.blocks.values()):
                if block.prev is None and block.next is None:
                    pool.remove(block)
                    self.reserved -= self.segments.pop(block.segment).size

    def _note_peaks(self) -> None:
        self.peaks = Replay(max(self.peaks.allocated, self.allocated), max(self.peaks.requested, self.requested),
                            max(self.peaks.reserved, self.reserved), max(self.peaks.touched, self.touched))


Event = tuple[object, int | None]
"""(key, bytes) allocates `bytes` under `key`; (key, None) frees it."""


def replay(events: Iterable[Event], *, expandable: bool = False, capacity: int | None = None) -> Replay:
    """The allocator's peaks over `events` (OutOfMemory if they need more than `capacity` reserved bytes)."""
    allocator = CachingAllocator(expandable=expandable, capacity=capacity)
    for key, nbytes in events:
        if nbytes is None:
            allocator.free(key)
        else:
            allocator.malloc(key, nbytes)
    return allocator.peaks


def smallest_capacity(events: list[Event], *, expandable: bool = False) -> int:
    """The least device memory, bytes, under which the allocator runs `events` without an out-of-memory error.

    Without expandable segments it bisects over capped replays (in 2 MiB steps, the segments' granularity); with
    them it is the replay's `touched` peak."""
    if expandable:
        return replay(events, expandable=True).touched
    high = replay(events).reserved
    low = 0  # runs at `high`; not known to run at `low`
    while high - low > ROUND_LARGE:
        middle = (low + high) // 2 // ROUND_LARGE * ROUND_LARGE
        try:
            replay(events, capacity=middle)
        except OutOfMemory:
            low = middle
        else:
            high = middle
    return high
