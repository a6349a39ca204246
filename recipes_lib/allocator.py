"""What CUDA's caching allocator reserves for a sequence of allocations: its rules, replayed.

A fake-tensor trace counts the bytes a step *allocates*; a GPU also needs what PyTorch's caching
allocator keeps *reserved*: whole segments obtained from ``cudaMalloc``, cached when their tensors
are freed and split to serve later requests, so that freed space too small or in the wrong place
for the next request stays reserved. How much depends on the order and the sizes of the
allocations, not on a fixed fraction. This module replays a trace's allocations and frees through
the allocator's documented rules (``c10/cuda/CUDACachingAllocator.cpp``; one stream), by
default:

- sizes round up to 512 bytes; requests up to 1 MiB come from the small pool, packed into 2 MiB
  segments; larger ones from the large pool, where a request under 10 MiB that finds no cached
  block gets a 20 MiB segment and a larger one a segment rounded up to 2 MiB;
- a request takes the smallest cached block of its pool that fits (the lowest address among
  equals) and splits it when what remains is at least 512 bytes (small pool) or over 1 MiB
  (large pool);
- a freed block merges with free neighbours of its segment and stays cached: reserved memory
  only grows, unless a ``cudaMalloc`` would pass the card's capacity, when whole free segments
  are released first (what ``empty_cache`` releases).

:class:`AllocationLog` records a run's allocations and frees on fake tensors in the order they
happen; :func:`replay` turns them into ``max_memory_allocated`` and ``max_memory_reserved``, and
:func:`min_capacity` into the smallest card the run fits.

``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (``expandable_segments=True``; torchtitan's
launch script sets it, and PyTorch's out-of-memory message suggests it) changes where memory
comes from: each pool has one segment of virtual addresses, into which physical pages (2 MiB
for the small pool, 20 MiB for the large one) are mapped as needed:

- a request that no cached block serves extends the lowest free range that can grow into
  enough unmapped space (normally the free block at the segment's end), mapping only the
  missing pages; best fit among cached blocks passes over a block that could grow, as long
  as another fits;
- any block is split when at least 512 bytes would remain;
- where mapping would pass the capacity, every whole free page is unmapped, wherever it lies,
  and a later request can map pages back into those holes: free space is never stranded in
  the wrong segment.

``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N`` (``max_split_size_mb=N``, the setting
PyTorch's out-of-memory message suggested before expandable segments) keeps large blocks whole:

- a block of N MiB or more ("oversize") is never split, serves no request under N MiB, and
  serves a larger request only when it is less than 20 MiB larger than it
  (``max_non_split_rounding_mb``'s default); a request under N MiB splits its block as before;
- where a ``cudaMalloc`` would pass the capacity, cached oversize segments are released first
  (the smallest that is at least as large as the request and N MiB; where none is, the
  largest down to the request's size), and every whole free segment only if that was not
  enough.

With expandable segments too (``expandable_segments:True,max_split_size_mb:N``, as some launch
scripts set them), PyTorch's code applies only the first rule's search part: best fit passes
over a free block of N MiB or more for a smaller request (and one 20 MiB larger than a larger
request), which then maps pages where the lowest free-and-unmapped range has room (a free
block at the segment's end still serves it there); any block is split as with expandable
segments alone, and nothing is released first (PyTorch's release of oversize blocks passes
over expandable ones).

``PYTORCH_CUDA_ALLOC_CONF=roundup_power2_divisions:D`` (``roundup_power2_divisions=D``;
axolotl's command line sets ``expandable_segments:True,roundup_power2_divisions:16``) rounds a
request up to the next of D equal steps between two powers of two, in place of 512 bytes, so
that requests of nearby sizes take blocks of one size: with 4 divisions a request of 5 MiB and
a byte takes 6 MiB, with 16 divisions 5.25 MiB. D may differ per power-of-two interval of
sizes, from 1 MiB (and below) to 32 GiB and above (``"[256:1,512:2,>:8]"``: each key is an
interval's start in MiB); a request of at most 512 x D bytes, a power of two, or D of 0 or 1
is rounded to 512 bytes as before (1 does not round to a power of two: pytorch#161139). It
combines with either setting above. PyTorch's parser and interval table, compiled into every
build's libc10, are the reference the tests compare against.

Streams are not modelled: FSDP's collectives allocate on streams of their own, whose cached
blocks serve only that stream, so an FSDP step replayed as one stream is an estimate below what
those pools take.
"""

from __future__ import annotations

import bisect
import gzip
import json
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Self

import torch
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from recipes_lib.memory import plain_tensors

MIN_BLOCK = 512  # every size is rounded up to a multiple of this
SMALL_SIZE = 1 << 20  # the largest request the small pool serves
SMALL_BUFFER = 2 << 20  # the small pool's segments
MIN_LARGE_ALLOC = 10 << 20  # a large request under this gets a LARGE_BUFFER segment
LARGE_BUFFER = 20 << 20  # also how much larger an oversize block may be than its request
ROUND_LARGE = 2 << 20  # larger segments are rounded up to this
# roundup_power2_divisions' intervals: [2^20, 2^21) bytes (and below) ... [2^35, 2^36) (and above)
ROUNDUP_INTERVALS = 16


class SimulatedOutOfMemory(RuntimeError):
    """A request the capacity cannot hold, even with every whole free segment released."""


def round_size(nbytes: int, divisions: tuple[int, ...] | None = None) -> int:
    """The block size a request of ``nbytes`` takes: a multiple of 512, at least 512, or with
    ``roundup_power2_divisions`` the next of its interval's divisions.

    Args:
        nbytes: the bytes requested.
        divisions: divisions per interval (:func:`roundup_divisions`; None: none).

    Returns:
        The rounded size.

    Example:
        >>> round_size(1), round_size(513), round_size(5 * 2**20 + 1, roundup_divisions(4))
        (512, 1024, 6291456)
    """
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    d = divisions[min(max(nbytes.bit_length() - 21, 0), ROUNDUP_INTERVALS - 1)] if divisions else 0
    if d > 1 and nbytes > MIN_BLOCK * d and nbytes & (nbytes - 1):
        step = (1 << (nbytes.bit_length() - 1)) >> (d.bit_length() - 1)  # the interval / d
        return -(-nbytes // step) * step
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def roundup_divisions(value: int | tuple[int, ...] | list[int] | None
                      ) -> tuple[int, ...] | None:
    """``roundup_power2_divisions`` as one count per interval (PyTorch's table).

    Args:
        value: one count for every interval (a power of two), or ``ROUNDUP_INTERVALS`` counts
            (each 0 or a power of two), or None.

    Returns:
        ``ROUNDUP_INTERVALS`` counts, or None.

    Raises:
        ValueError: naming ``roundup_power2_divisions``, for anything else.

    Example:
        >>> roundup_divisions(16)[:3]
        (16, 16, 16)
    """
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1 or value & (value - 1):
            raise ValueError(f"roundup_power2_divisions={value!r}: a power of two (PyTorch "
                             "refuses anything else)")
        return (value,) * ROUNDUP_INTERVALS
    table = tuple(value) if isinstance(value, (tuple, list)) else ()
    if len(table) != ROUNDUP_INTERVALS or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 and not d & (d - 1)
            for d in table):
        raise ValueError(f"roundup_power2_divisions={value!r}: a power of two, or "
                         f"{ROUNDUP_INTERVALS} counts (one per power-of-two interval from 1 MiB "
                         "up), each 0 or a power of two")
    return table


def segment_size(nbytes: int) -> int:
    """The segment ``cudaMalloc`` is asked for when no cached block serves a rounded request.

    Args:
        nbytes: the rounded request.

    Returns:
        2 MiB for a small request, 20 MiB for one under 10 MiB, else the request rounded up to
        2 MiB.

    Example:
        >>> [segment_size(n) // 2**20 for n in (4096, 3 * 2**20, 11 * 2**20)]
        [2, 20, 12]
    """
    if nbytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-nbytes // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class _Block:
    """A contiguous range of one segment, allocated or cached."""

    addr: int
    size: int
    small: bool
    prev: _Block | None = None
    next: _Block | None = None
    allocated: bool = False
    mapped: bool = True  # False: virtual addresses of an expandable segment, no pages behind

    @property
    def key(self) -> tuple[int, int]:
        return (self.size, self.addr)


@dataclass
class CachingAllocator:
    """One device's caching allocator, as PyTorch's behaves on one stream.

    Attributes:
        capacity: the card's bytes for segments (None: unlimited); past it, whole free
            segments (with ``expandable_segments``: whole free pages) are released before
            more is taken, as on a full GPU.
        expandable_segments: as ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
        max_split_size_mb: as ``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N`` (None: unset,
            every block may be split); with ``expandable_segments``, as PyTorch combines
            them (the module's docstring).
        roundup_power2_divisions: as ``PYTORCH_CUDA_ALLOC_CONF=roundup_power2_divisions:D``:
            one count, or one per interval (:func:`roundup_divisions`); None: unset.
        fraction: ``capacity`` is a share of a larger card set with
            ``torch.cuda.set_per_process_memory_fraction`` (how a big GPU stands in for a
            small one), not the card's own memory. The default rules check both alike; with
            expandable segments the share is checked before a request grows a segment, against
            reserved plus the segment the default rules would take for it (``segment_size``),
            while the pages mapped are the card's to give.
        allocated: bytes in allocated blocks (rounded sizes), as ``memory_allocated``.
        reserved: bytes in segments (mapped pages), as ``memory_reserved``.
        peak_allocated: ``max_memory_allocated``.
        peak_reserved: ``max_memory_reserved``.
        segments: segments taken from ``cudaMalloc`` so far (expandable: address ranges).
        releases: times cached memory was released to make room.

    Raises:
        ValueError: for a ``max_split_size_mb`` that is not a whole number of MiB of at least
            20 (PyTorch's floor: a large block is cut from a 20 MiB segment); for divisions
            :func:`roundup_divisions` refuses.
    """

    capacity: int | None = None
    expandable_segments: bool = False
    fraction: bool = False
    max_split_size_mb: int | None = None
    roundup_power2_divisions: int | tuple[int, ...] | None = None
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    segments: int = 0
    releases: int = 0
    _free: dict[bool, list] = field(default_factory=lambda: {True: [], False: []})
    _unmapped: dict[bool, list] = field(default_factory=lambda: {True: [], False: []})
    _next_addr: int = 0
    _max_split: int = 1 << 62  # bytes: no limit
    _divisions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        self._divisions = roundup_divisions(self.roundup_power2_divisions)
        mss = self.max_split_size_mb
        if mss is None:
            return
        if not isinstance(mss, int) or isinstance(mss, bool) or mss < LARGE_BUFFER >> 20:
            raise ValueError(f"max_split_size_mb={mss!r}: a whole number of MiB, at least "
                             f"{LARGE_BUFFER >> 20} (PyTorch refuses less)")
        self._max_split = mss << 20

    def malloc(self, nbytes: int) -> _Block:
        """Serve a request of ``nbytes`` (> 0).

        Args:
            nbytes: the bytes a tensor's storage asks for.

        Returns:
            The block that holds it (pass it to :meth:`free`).

        Raises:
            ValueError: for a request that is not a positive integer.
            SimulatedOutOfMemory: when ``capacity`` cannot hold it.
        """
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes={nbytes!r}: a positive number of bytes")
        size = round_size(nbytes, self._divisions)
        small = size <= SMALL_SIZE
        if self.expandable_segments:
            block = self._take_cached_expandable(size, small) or self._grow(size, small)
        else:
            block = self._take_cached(size, small) or self._new_segment(size, small)
        least = MIN_BLOCK if small or self.expandable_segments else SMALL_SIZE + 1
        if block.size - size >= least and (small or self.expandable_segments
                                           or size < self._max_split):  # split the rest
            self._cache(self._split(block, size))
        block.allocated = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: _Block) -> None:
        """Return ``block`` to its pool, merged with free neighbours of its segment.

        Args:
            block: a block :meth:`malloc` returned and not yet freed.

        Raises:
            ValueError: for a block that is not allocated.
        """
        if not block.allocated:
            raise ValueError("block: not allocated (freed twice?)")
        block.allocated = False
        self.allocated -= block.size
        self._merge_neighbours(block)
        self._cache(block)

    def empty_cache(self) -> int:
        """Release what the cache holds, as ``torch.cuda.empty_cache``: every whole free
        segment, or with ``expandable_segments`` every whole free page.

        Returns:
            The bytes released.
        """
        released = 0
        for small in (True, False):
            for _, _, block in list(self._free[small]):
                if self.expandable_segments:
                    released += self._unmap(block)
                elif block.prev is None and block.next is None:
                    self._uncache(block)
                    released += block.size
        self.reserved -= released
        return released

    @staticmethod
    def _split(block: _Block, size: int, mapped: bool = True) -> _Block:
        """Cut ``block`` after its first ``size`` bytes; the rest, a new block after it (its
        pages mapped or not), is returned uncached."""
        rest = _Block(block.addr + size, block.size - size, block.small, prev=block,
                      next=block.next, mapped=mapped)
        if block.next is not None:
            block.next.prev = rest
        block.next, block.size = rest, size
        return rest

    def _merge_neighbours(self, block: _Block) -> None:
        """Absorb the free neighbours of ``block`` that are mapped as it is."""
        for neighbour in (block.prev, block.next):
            if neighbour is None or neighbour.allocated or neighbour.mapped != block.mapped:
                continue
            self._uncache(neighbour)
            if neighbour is block.prev:
                block.addr, block.prev = neighbour.addr, neighbour.prev
                if block.prev is not None:
                    block.prev.next = block
            else:
                block.next = neighbour.next
                if block.next is not None:
                    block.next.prev = block
            block.size += neighbour.size

    def _cache(self, block: _Block) -> None:
        if block.mapped:
            bisect.insort(self._free[block.small], (*block.key, block))
        else:
            bisect.insort(self._unmapped[block.small], (block.addr, block))

    def _uncache(self, block: _Block) -> None:
        if block.mapped:
            pool = self._free[block.small]
            del pool[bisect.bisect_left(pool, block.key, key=lambda e: e[:2])]
        else:
            pool = self._unmapped[block.small]
            del pool[bisect.bisect_left(pool, block.addr, key=lambda e: e[0])]

    def _take_cached(self, size: int, small: bool) -> _Block | None:
        """Best fit; with ``max_split_size_mb``, not an oversize block for a request under
        the limit, nor one 20 MiB or more larger than an oversize request."""
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1), key=lambda e: e[:2])
        if i == len(pool) or self._refused(pool[i][2].size, size):
            return None  # PyTorch looks no further
        return pool.pop(i)[2]

    def _refused(self, found: int, size: int) -> bool:
        """``max_split_size_mb``'s rule for the best-fit block of ``found`` bytes."""
        return found >= self._max_split and (size < self._max_split
                                             or found >= size + LARGE_BUFFER)

    def _release_oversize(self, size: int, small: bool) -> bool:
        """Release cached oversize segments for a request of ``size`` (PyTorch's
        ``release_available_cached_blocks``): the smallest at least as large as the request
        and the limit, or else the largest ones until as much is released. False where
        nothing was, or not enough."""
        pool, need = self._free[small], max(size, self._max_split)
        if self.max_split_size_mb is None or not pool:
            return False
        i = bisect.bisect_left(pool, (need, -1), key=lambda e: e[:2])
        if i < len(pool):
            chosen = [pool[i][2]]
        else:
            chosen = []
            for *_, block in reversed(pool):
                if sum(b.size for b in chosen) >= need or block.size < self._max_split:
                    break
                chosen.append(block)
        released = sum(b.size for b in chosen)
        for block in chosen:  # an oversize block is never split: each is a whole segment
            assert block.prev is None and block.next is None
            self._uncache(block)
        self.reserved -= released
        return released >= need

    def _take_cached_expandable(self, size: int, small: bool) -> _Block | None:
        """Best fit, where a block that could grow into unmapped space counts as that large; with
        ``max_split_size_mb``, not an oversize block :meth:`_take_cached` would refuse."""
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1), key=lambda e: e[:2])
        if i == len(pool):
            return None

        def reach(block: _Block) -> int:
            after = block.next
            return block.size + (after.size if after is not None and not after.mapped else 0)

        while i + 1 < len(pool) and reach(pool[i + 1][2]) < reach(pool[i][2]):
            i += 1
        if self._refused(pool[i][2].size, size):  # max_split_size_mb's search rule holds too
            return None
        return pool.pop(i)[2]

    def _new_segment(self, size: int, small: bool) -> _Block:
        nbytes = segment_size(size)

        def over() -> bool:
            return self.capacity is not None and self.reserved + nbytes > self.capacity

        if over():
            before = self.reserved
            if not self._release_oversize(size, small) or over():
                self.empty_cache()
            self.releases += self.reserved < before
            if over():
                raise SimulatedOutOfMemory(
                    f"a {size / 2**20:.1f} MiB request needs a {nbytes / 2**20:.0f} MiB segment: "
                    f"{self.reserved / 2**30:.2f} GiB reserved of {self.capacity / 2**30:.2f}")
        block = _Block(self._next_addr, nbytes, small)
        self._next_addr += nbytes
        self.reserved += nbytes
        self.segments += 1
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def _grow(self, size: int, small: bool) -> _Block:
        """A block of at least ``size`` made of free and newly mapped space: first as things
        are, then with every whole free page unmapped."""
        block = self._try_grow(size, small)
        if block is None:
            if self.empty_cache():
                self.releases += 1
            block = self._try_grow(size, small)
            if block is None:
                raise SimulatedOutOfMemory(
                    f"a {size / 2**20:.1f} MiB request needs more pages mapped: "
                    f"{self.reserved / 2**30:.2f} GiB reserved of {self.capacity / 2**30:.2f}")
        return block

    def _try_grow(self, size: int, small: bool) -> _Block | None:
        if (self.fraction and self.capacity is not None
                and self.reserved + segment_size(size) > self.capacity):
            return None  # the share's check comes first, in the default rules' sizes
        candidate = self._room(size, small)
        if not candidate.mapped and not self._map(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:  # free, then unmapped: map what is missing, merged
            after = candidate.next
            if not self._map(after, min(size - candidate.size, after.size)):
                return None
            candidate = after
        self._uncache(candidate)
        return candidate

    def _room(self, size: int, small: bool) -> _Block:
        """The lowest-addressed run of free and unmapped blocks that holds ``size``, where it
        starts; a new segment's address range where none does."""
        for _, unmapped in self._unmapped[small]:
            start = unmapped
            if unmapped.prev is not None and not unmapped.prev.allocated:
                start = unmapped.prev
            room, block = 0, start
            while room < size and block is not None and not block.allocated:
                room, block = room + block.size, block.next
            if room >= size:
                return start
        page = SMALL_BUFFER if small else LARGE_BUFFER
        total = self.capacity if self.capacity is not None and not self.fraction else 1 << 46
        # PyTorch reserves addresses for 9/8 of the card's memory, in pages (a request larger
        # than that runs out of memory when its pages are mapped)
        block = _Block(-(-self._next_addr // LARGE_BUFFER) * LARGE_BUFFER,
                       -(-max(total + total // 8, size) // page) * page, small, mapped=False)
        self._next_addr = block.addr + block.size
        self.segments += 1
        self._cache(block)
        return block

    def _map(self, block: _Block, nbytes: int) -> bool:
        """Map the pages that hold the first ``nbytes`` of unmapped ``block``; False where the
        capacity cannot hold them."""
        page = SMALL_BUFFER if block.small else LARGE_BUFFER
        mapped = -(-nbytes // page) * page
        if (self.capacity is not None and not self.fraction
                and self.reserved + mapped > self.capacity):
            return False
        self._uncache(block)
        block.mapped = True
        if mapped < block.size:
            self._cache(self._split(block, mapped, mapped=False))
        self._merge_neighbours(block)
        self._cache(block)
        self.reserved += mapped
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return True

    def _unmap(self, block: _Block) -> int:
        """Unmap the whole pages inside free ``block`` (the caller lowers ``reserved``); a
        segment left with no pages mapped goes back. Returns the bytes unmapped."""
        page = SMALL_BUFFER if block.small else LARGE_BUFFER
        start = -(-block.addr // page) * page
        end = (block.addr + block.size) // page * page
        if start >= end:
            return 0
        self._uncache(block)
        if start > block.addr:  # a partial page before stays mapped and free
            before, block = block, self._split(block, start - block.addr)
            self._cache(before)
        if end < block.addr + block.size:  # and one after
            self._cache(self._split(block, end - start))
        block.mapped = False
        self._merge_neighbours(block)
        if block.prev is not None or block.next is not None:  # else the whole range goes back
            self._cache(block)
        return end - start


# the launch settings the course compares, by name: PYTORCH_CUDA_ALLOC_CONF's value for each (the
# default; torchtitan's and PyTorch's message's expandable segments; max_split_size_mb, which the
# message suggested before, at two values users try)
SETTINGS = {"default": "", "expandable segments": "expandable_segments:True",
            "max_split_size_mb:128": "max_split_size_mb:128",
            "max_split_size_mb:512": "max_split_size_mb:512"}

# settings that change nothing a one-stream replay of device memory sees: pinned host memory,
# the allocator's lock, CUDA graphs' pools
INERT_SETTINGS = ("pinned_use_cuda_host_register", "pinned_num_register_threads",
                  "pinned_use_background_threads", "release_lock_on_cudamalloc",
                  "graph_capture_record_stream_reuse")


def parse_settings(conf: str, fraction: bool = False) -> dict[str, Any]:
    """The replay's keywords for a ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``)
    value, as PyTorch parses it: comma-separated ``key:value`` pairs, a list in brackets for
    ``roundup_power2_divisions``; empty for the defaults.

    ``garbage_collection_threshold`` is accepted and changes nothing: PyTorch collects only
    under ``torch.cuda.set_per_process_memory_fraction`` (its ``set_fraction``), so a launch
    that sets the threshold alone runs as without it. So are the settings of
    ``INERT_SETTINGS`` and ``backend:native`` (the default), and ``max_non_split_rounding_mb``
    where no block is ever oversize (no ``max_split_size_mb``) or at its default, 20: it only
    widens how much larger than a large request an oversize block may be and still serve it.

    Args:
        conf: e.g. ``"expandable_segments:True,roundup_power2_divisions:16"`` or
            ``"garbage_collection_threshold:0.6,max_split_size_mb:128"``.
        fraction: the run is under a per-process memory fraction (``replay(fraction=True)``),
            where a garbage-collection threshold acts: refused, not modelled.

    Returns:
        ``{"expandable_segments": bool, "max_split_size_mb": int | None,
        "roundup_power2_divisions": int | tuple | None}``: the divisions as one count where
        every interval has the same, else one per interval (PyTorch's list form: the first
        entry's count also covers the intervals below it, ``>`` those after the last entry,
        and an interval no entry names rounds nothing); None where none rounds.

    Raises:
        ValueError: naming the key, for one the replay does not model (it would predict the
            wrong run: ``backend:cudaMallocAsync``, ``max_non_split_rounding_mb`` above 20
            with ``max_split_size_mb``, ...) or a value that does not parse (or that PyTorch
            refuses: ``max_non_split_rounding_mb`` under 20).

    Example:
        >>> parse_settings("garbage_collection_threshold:0.6,max_split_size_mb:128")
        {'expandable_segments': False, 'max_split_size_mb': 128, 'roundup_power2_divisions': None}
        >>> parse_settings("roundup_power2_divisions:[256:1,512:2,>:8]")["roundup_power2_divisions"]
        (1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 8, 8, 8, 8, 8, 8)
    """
    out: dict[str, Any] = {"expandable_segments": False, "max_split_size_mb": None}
    table = [0] * ROUNDUP_INTERVALS
    rounding = None  # max_non_split_rounding_mb, in MiB
    for pair in _top_level_pairs(conf):
        key, _, value = (part.strip() for part in pair.partition(":"))
        if key == "expandable_segments" and value in ("True", "False"):
            out[key] = value == "True"
        elif key == "max_split_size_mb" and value.isdigit():
            out[key] = int(value)
        elif key == "roundup_power2_divisions" and _read_divisions(value, table):
            continue
        elif key == "garbage_collection_threshold" and _fraction_between_0_and_1(value):
            if fraction:
                raise ValueError(f"conf={conf!r}: garbage_collection_threshold under a "
                                 "per-process memory fraction is not modelled by the replay")
        elif key in INERT_SETTINGS or (key, value) == ("backend", "native"):
            continue
        elif key == "max_non_split_rounding_mb" and value.isdigit():
            rounding = int(value)
            if rounding < LARGE_BUFFER >> 20:
                raise ValueError(f"conf={conf!r}: max_non_split_rounding_mb:{value} is under "
                                 f"{LARGE_BUFFER >> 20} (PyTorch refuses less)")
        elif key in ("expandable_segments", "max_split_size_mb", "garbage_collection_threshold",
                     "roundup_power2_divisions", "max_non_split_rounding_mb"):
            raise ValueError(f"conf={conf!r}: {key}:{value} does not parse (True or False; "
                             "a whole number of MiB; a fraction between 0 and 1; a power of two "
                             "or a list such as [256:1,512:2,>:8])")
        else:
            raise ValueError(f"conf={conf!r}: {pair} is not modelled by the replay (it models "
                             "expandable_segments, max_split_size_mb and "
                             "roundup_power2_divisions)")
    if rounding not in (None, LARGE_BUFFER >> 20) and out["max_split_size_mb"] is not None:
        raise ValueError(f"conf={conf!r}: max_non_split_rounding_mb:{rounding} with "
                         "max_split_size_mb lets a cached block up to that much larger than a "
                         "large request serve it, which the replay does not model (it models "
                         f"PyTorch's default, {LARGE_BUFFER >> 20} MiB)")
    out["roundup_power2_divisions"] = (None if not any(table) else table[0]
                                       if len(set(table)) == 1 else tuple(table))
    CachingAllocator(**out)  # refuses what it cannot replay
    return out


def _top_level_pairs(conf: str) -> list[str]:
    """``conf``'s comma-separated pairs, a bracketed list kept whole."""
    pairs, depth, current = [], 0, ""
    for ch in conf:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            pairs.append(current)
            current = ""
        else:
            current += ch
    return [p.strip() for p in [*pairs, current] if p.strip()]


def _read_divisions(value: str, table: list[int]) -> bool:
    """Apply a ``roundup_power2_divisions`` value to ``table`` as PyTorch's parser does
    (``AcceleratorAllocatorConfig::parseRoundUpPower2Divisions``); False where it does not
    parse (``table`` then left as it may be)."""
    def count(text: str, zero: bool) -> int | None:
        n = int(text) if text.isdigit() else -1
        return n if (n > 0 or zero and n == 0) and not n & (n - 1) else None

    value = value.replace(" ", "")
    if not (value.startswith("[") and value.endswith("]")):
        n = count(value, zero=False)
        if n is not None:
            table[:] = [n] * ROUNDUP_INTERVALS
        return n is not None
    last, first = 0, True
    entries = value[1:-1].split(",")
    if entries[-1] == "":  # "[]" and a trailing comma, which PyTorch's parser passes over
        entries.pop()
    for entry in entries:
        start, sep, divisions = entry.partition(":")
        d = count(divisions, zero=True)
        if not sep or d is None:
            return False
        if start == ">":
            table[last + 1:] = [d] * (ROUNDUP_INTERVALS - last - 1)
            continue
        mib = count(start, zero=False)
        if mib is None:
            return False
        last = min(mib.bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if first:
            table[:last] = [d] * last
            first = False
        table[last] = d
    return True


def settings_conf(expandable_segments: bool = False, max_split_size_mb: int | None = None,
                  roundup_power2_divisions: int | tuple[int, ...] | None = None) -> str:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` value for the replay's keywords (what
    :func:`parse_settings` reads back).

    Args:
        expandable_segments, max_split_size_mb, roundup_power2_divisions: as :func:`replay`.

    Returns:
        The value; empty for the defaults.

    Example:
        >>> settings_conf(max_split_size_mb=128), settings_conf()
        ('max_split_size_mb:128', '')
        >>> settings_conf(True, roundup_power2_divisions=(1,) * 9 + (2, 4) + (8,) * 5)
        'expandable_segments:True,roundup_power2_divisions:[256:1,512:2,1024:4,>:8]'
    """
    parts = ["expandable_segments:True"] if expandable_segments else []
    if max_split_size_mb is not None:
        parts.append(f"max_split_size_mb:{max_split_size_mb}")
    table = roundup_divisions(roundup_power2_divisions)
    if table is not None and any(table):
        if len(set(table)) == 1:
            parts.append(f"roundup_power2_divisions:{table[0]}")
        else:  # the first entry covers the intervals below it; ">" the constant rest
            low = next(i for i, d in enumerate(table) if d != table[0]) - 1
            high = max(i for i, d in enumerate(table) if d != table[-1]) + 1
            entries = [f"{1 << i}:{table[i]}" for i in range(low, high)]
            entries.append(f">:{table[-1]}")  # high < ROUNDUP_INTERVALS: the last is constant
            parts.append(f"roundup_power2_divisions:[{','.join(entries)}]")
    return ",".join(parts)


def smallest_cards(events: list[Event], settings: dict[str, str] | None = None
                   ) -> dict[str, int]:
    """:func:`min_capacity` under each of several launch settings, each distinct one searched
    once.

    Args:
        events: the trace (:attr:`AllocationLog.events`).
        settings: name -> ``PYTORCH_CUDA_ALLOC_CONF`` value (default: ``SETTINGS``).

    Returns:
        name -> the smallest card in bytes.

    Raises:
        ValueError: for a value :func:`parse_settings` refuses.
    """
    searched: dict[tuple, int] = {}
    out = {}
    for name, conf in (SETTINGS if settings is None else settings).items():
        keywords = parse_settings(conf)
        key = tuple(keywords.items())
        if key not in searched:
            searched[key] = min_capacity(events, **keywords)
        out[name] = searched[key]
    return out


def _fraction_between_0_and_1(value: str) -> bool:
    try:
        return 0 < float(value) < 1
    except ValueError:
        return False


# a trace's events: ("alloc", id, nbytes) and ("free", id, 0)
Event = tuple[str, int, int]


def replay(events: Iterable[Event], capacity: int | None = None,
           expandable_segments: bool = False, fraction: bool = False,
           max_split_size_mb: int | None = None,
           roundup_power2_divisions: int | tuple[int, ...] | None = None) -> CachingAllocator:
    """Run a trace's allocations and frees through a fresh :class:`CachingAllocator`.

    Args:
        events: ``("alloc", id, nbytes)`` and ``("free", id, 0)`` in the order they happened
            (:attr:`AllocationLog.events`); an id freed that was never allocated is ignored
            (a storage that existed before the log started).
        capacity: the card's bytes for segments (None: unlimited).
        expandable_segments: as ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
        fraction: ``capacity`` is a per-process share of a larger card
            (:attr:`CachingAllocator.fraction`).
        max_split_size_mb: as ``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N`` (None: unset).
        roundup_power2_divisions: as ``PYTORCH_CUDA_ALLOC_CONF=roundup_power2_divisions:D``
            (one count, or one per interval: :func:`roundup_divisions`; None: unset).

    Returns:
        The allocator after the trace: its ``peak_allocated`` and ``peak_reserved``.

    Raises:
        ValueError: for an event that is neither "alloc" nor "free", or a setting
            :class:`CachingAllocator` refuses.
        SimulatedOutOfMemory: when ``capacity`` cannot hold the trace.

    Example:
        >>> a = replay([("alloc", 0, 3 * 2**20), ("alloc", 1, 3 * 2**20), ("free", 0, 0)])
        >>> a.peak_allocated // 2**20, a.peak_reserved // 2**20  # one 20 MiB segment
        (6, 20)
    """
    alloc = CachingAllocator(capacity, expandable_segments, fraction, max_split_size_mb,
                             roundup_power2_divisions)
    live: dict[int, _Block] = {}
    for kind, key, nbytes in events:
        if kind == "alloc":
            if nbytes > 0:
                live[key] = alloc.malloc(nbytes)
        elif kind == "free":
            if key in live:
                alloc.free(live.pop(key))
        else:
            raise ValueError(f"events: {kind!r} is neither 'alloc' nor 'free'")
    return alloc


def fits(events: Iterable[Event], capacity: int | None, expandable_segments: bool = False,
         fraction: bool = False, max_split_size_mb: int | None = None,
         roundup_power2_divisions: int | tuple[int, ...] | None = None
         ) -> CachingAllocator | None:
    """:func:`replay` on a card of ``capacity`` bytes, or None where the run runs out there.

    Args:
        events, capacity, expandable_segments, fraction, max_split_size_mb,
            roundup_power2_divisions: as :func:`replay`.

    Returns:
        The allocator after the trace, or None.

    Example:
        >>> fits([("alloc", 0, 3 * 2**20)], 2**20) is None  # a 20 MiB segment on a 1 MiB card
        True
    """
    try:
        return replay(events, capacity, expandable_segments, fraction, max_split_size_mb,
                      roundup_power2_divisions)
    except SimulatedOutOfMemory:
        return None


def min_capacity(events: list[Event], expandable_segments: bool = False,
                 resolution: int = ROUND_LARGE, max_split_size_mb: int | None = None,
                 roundup_power2_divisions: int | tuple[int, ...] | None = None) -> int:
    """The smallest card (bytes for PyTorch) on which a trace's replay fits, found by bisection
    between its allocated peak and what an unlimited card reserves: how much memory the run
    needs, once the allocator releases its cache under pressure as a full card makes it do.

    Whether a run fits is not always monotone in the capacity (a release at another moment
    leaves other holes), so this is the boundary the bisection finds: the run was replayed to
    fit there and not to fit within ``resolution`` below it (or that is the allocated peak).

    Args:
        events: the trace (:attr:`AllocationLog.events`).
        expandable_segments: as ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
        resolution: the bisection's granularity in bytes (default 2 MiB).
        max_split_size_mb, roundup_power2_divisions: as :func:`replay`.

    Returns:
        The capacity in bytes.

    Raises:
        ValueError: for a ``resolution`` that is not a positive integer, or a setting
            :class:`CachingAllocator` refuses.

    Example:
        >>> MiB = 2**20
        >>> events = [("alloc", 0, 40 * MiB), ("free", 0, 0), ("alloc", 1, 10 * MiB),
        ...           ("alloc", 2, 35 * MiB)]
        >>> min_capacity(events) // MiB, min_capacity(events, True) // MiB
        (76, 60)
    """
    if not isinstance(resolution, int) or isinstance(resolution, bool) or resolution <= 0:
        raise ValueError(f"resolution={resolution!r}: a positive number of bytes")
    setting = {"max_split_size_mb": max_split_size_mb,
               "roundup_power2_divisions": roundup_power2_divisions}
    unlimited = replay(events, None, expandable_segments, **setting)
    lo, hi = unlimited.peak_allocated - 1, unlimited.peak_reserved  # lo: known not to fit
    while hi - lo > resolution:
        mid = (lo + hi) // 2
        if fits(events, mid, expandable_segments, **setting) is None:
            lo = mid
        else:
            hi = mid
    return hi


def save_traces(path: str, traces: dict[str, list[Event]]) -> None:
    """Write named traces to a gzipped JSON file, compactly: an allocation as its byte count,
    a free as minus one plus minus the index of the allocation it frees.

    Args:
        path: the file (``.json.gz``).
        traces: name -> events (:attr:`AllocationLog.events`).
    """
    compact = {}
    for name, events in traces.items():
        index: dict[int, int] = {}
        out = []
        for kind, key, nbytes in events:
            if kind == "alloc":
                index[key] = len(index)
                out.append(nbytes)
            elif key in index:
                out.append(-1 - index[key])
        compact[name] = out
    with gzip.open(path, "wt") as f:
        json.dump(compact, f, separators=(",", ":"))


def load_traces(path: str) -> dict[str, list[Event]]:
    """Read :func:`save_traces`' file back as events.

    Args:
        path: the file.

    Returns:
        name -> events, ready for :func:`replay`.
    """
    with gzip.open(path, "rt") as f:
        compact = json.load(f)
    traces = {}
    for name, out in compact.items():
        events, n = [], 0
        for v in out:
            if v >= 0:
                events.append(("alloc", n, v))
                n += 1
            else:
                events.append(("free", -1 - v, 0))
        traces[name] = events
    return traces


class AllocationLog(TorchDispatchMode):
    """Record the storages created and freed on one device type, in order, as allocator
    events for :func:`replay`: every operator's outputs while the mode is active, and the
    tensors passed to :meth:`track` (those that already exist, in the order given).

    Enter it inside a ``FakeTensorMode`` to log a fake run (no memory used). A storage resized
    in place (FSDP's unsharded parameters) is logged as a free and a new allocation.

    Attributes:
        device_type: the device type whose storages are logged ("cuda", "cpu").
        fake_only: log fake tensors only (a fake run on the CPU beside real CPU tensors).
        events: ``("alloc", id, nbytes)`` / ``("free", id, 0)`` in order.

    Example:
        >>> with AllocationLog("cpu") as log:
        ...     x = torch.ones(1000)
        ...     del x
        >>> log.events
        [('alloc', 0, 4000), ('free', 0, 0)]
    """

    def __init__(self, device_type: str = "cuda", fake_only: bool = False) -> None:
        super().__init__()
        self.device_type, self.fake_only = device_type, fake_only
        self.events: list[Event] = []
        self._ids = WeakIdKeyDictionary()
        self._refs: dict[int, weakref.ref] = {}
        self._next = 0
        self._resize = None
        self._mode_on_entry = None

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Log tensors that already exist as allocated now (parameters, optimizer states).

        Args:
            tensors: any tensors; those on other device types, and storages already logged,
                are skipped.
        """
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._note(t)

    def _note(self, t: torch.Tensor) -> None:
        if t.device.type != self.device_type:
            return
        for inner in plain_tensors(t):
            if self.fake_only and not isinstance(inner, FakeTensor):
                continue
            st = inner.untyped_storage()
            if st in self._ids:
                continue
            key = self._next
            self._next += 1
            self._ids[st] = key
            self.events.append(("alloc", key, st.nbytes()))
            self._watch(st, key)

    def _watch(self, st: torch.UntypedStorage, key: int) -> None:
        self._refs[key] = weakref.ref(st, lambda _, key=key: self._freed(key))

    def _freed(self, key: int) -> None:
        self.events.append(("free", key, 0))
        self._refs.pop(key, None)

    def __enter__(self) -> Self:
        self._mode_on_entry = active_fake_mode()
        log, original = self, torch.UntypedStorage.resize_
        self._resize = original

        def resize_(st: torch.UntypedStorage, size: int):
            out = original(st, size)
            key = log._ids.get(st)
            if key is not None:  # a new block for the new size; the old one's ref is dropped
                log.events.append(("free", key, 0))
                del log._refs[key]
                log._ids[st] = log._next
                log._next += 1
                if st.nbytes():
                    log.events.append(("alloc", log._ids[st], st.nbytes()))
                log._watch(st, log._ids[st])
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):  # let DTensor run its local ops, which come back
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        # DTensor's sharding propagation runs ops in a fake mode of its own: metadata, no memory
        if active_fake_mode() is self._mode_on_entry:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._note(t)
        return out
