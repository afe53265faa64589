"""A model of torch's CUDA caching allocator, replayed forward over a snapshot's trace.

Every rule cites the function of c10/cuda/CUDACachingAllocator.cpp (``DeviceCachingAllocator``) that it follows.
The file was studied at pytorch/pytorch commit 001074d2, the version nearest to the v2.14.1 tag that could be read
here (the tag itself could not be fetched); ``max_non_split_rounding_size`` (kLargeBuffer in that file's
get_free_block, a CUDAAllocatorConfig knob in newer ones) is read from the file's settings when it is there. The model keeps the allocator's own structures:
per pool (small/large, default or a CUDA graph's private pool) the free blocks ordered by (stream, size,
address), blocks chained inside their segment (prev/next), expandable segments as chains of mapped and
unmapped blocks. Pure and standard-library only (no torch, no Bridge).

Two kinds of device sit under the model (``Device``):

- ``RecordedDevice`` (the proof on the file): what CUDA did is taken from the trace (whether ``cudaMalloc``
  succeeded, the address it returned, what was released); the model decides everything the allocator decides
  (rounding, pool, best fit, splitting, the segment size, coalescing) and is compared with the recorded
  address of each allocation. After a divergence the model is set to what the file recorded, so each
  allocation is judged from the allocator's true state (``Proof.first_divergence`` says where it first differed).
- ``ModelDevice`` (what if): a GPU of a given capacity; ``cudaMalloc`` succeeds while the reserved bytes fit.
  Addresses of new segments are the model's own (a fresh virtual range each), so they never match the file.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from .replay import rounded_size

# CUDACachingAllocator.cpp constants (v2.14.1).
K_MIN_BLOCK = 512                  # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 << 20             # kSmallSize: largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 << 20           # kSmallBuffer: small allocations are packed in 2 MiB segments
K_LARGE_BUFFER = 20 << 20          # kLargeBuffer: allocations between 1 and 10 MiB may use a 20 MiB segment
K_MIN_LARGE_ALLOC = 10 << 20       # kMinLargeAlloc
K_ROUND_LARGE = 2 << 20            # kRoundLarge: larger allocations are rounded up to 2 MiB
ROUNDUP_START = 1 << 20            # CUDAAllocatorConfig roundup_power2_divisions: intervals from 1 MiB
NO_LIMIT = (1 << 64) - 1           # CUDAAllocatorConfig::max_split_size() default: SIZE_MAX
DEFAULT_POOL = (0, 0)
EXPANDABLE_SPACE = 1 << 42         # ExpandableSegment: virtual range of 1 1/8 of the GPU; any bound above use


@dataclass(frozen=True)
class Settings:
    """The allocator settings the model follows (CUDAAllocatorConfig.h accessors of the same names)."""
    max_split_size: int = NO_LIMIT
    roundup_power2_divisions: tuple[int, ...] = ()       # per power-of-two interval from 1 MiB (16 of them)
    expandable_segments: bool = False
    garbage_collection_threshold: float = 0.0
    max_non_split_rounding_size: int = K_LARGE_BUFFER
    memory_fraction: float | None = None                  # torch.cuda.set_per_process_memory_fraction

    def describe(self) -> str:
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size != NO_LIMIT:
            parts.append(f"max_split_size_mb:{self.max_split_size >> 20}")
        if self.garbage_collection_threshold > 0:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold:g}")
        if self.max_non_split_rounding_size != K_LARGE_BUFFER:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_size >> 20}")
        if any(d > 1 for d in self.roundup_power2_divisions):
            parts.append("roundup_power2_divisions:[" + ",".join(
                f"{(ROUNDUP_START << i) >> 20}:{d}" for i, d in enumerate(self.roundup_power2_divisions) if d) + "]")
        if self.memory_fraction is not None:
            parts.append(f"memory_fraction:{self.memory_fraction:g}")
        return ",".join(parts) or "(defaults)"


def round_size(size: int, s: Settings) -> int:
    """DeviceCachingAllocator::round_size (+ roundup_power2_next_division)."""
    div = 0
    if s.roundup_power2_divisions and size >= K_MIN_BLOCK:
        index = max(0, (size.bit_length() - 1) - (ROUNDUP_START.bit_length() - 1))
        div = s.roundup_power2_divisions[min(index, len(s.roundup_power2_divisions) - 1)]
    return rounded_size(size, div)


def allocation_size(size: int) -> int:
    """DeviceCachingAllocator::get_allocation_size: the size of a new cudaMalloc segment for a rounded request."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


class Block:
    """A block of a segment (CUDACachingAllocator.cpp ``struct Block``)."""
    __slots__ = ("ptr", "size", "stream", "pool", "allocated", "pending", "prev", "next", "seg", "mapped",
                 "requested", "gc_base")

    def __init__(self, ptr: int, size: int, stream: int, pool: Pool, seg: ExpandableSegment | None = None,
                 mapped: bool = True):
        self.ptr, self.size, self.stream, self.pool = ptr, size, stream, pool
        self.allocated = self.pending = False
        self.prev: Block | None = None
        self.next: Block | None = None
        self.seg, self.mapped, self.requested, self.gc_base = seg, mapped, 0, 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def free_and_idle(self) -> bool:
        return not self.allocated and not self.pending

    def split_front(self, address: int) -> Block:
        """Cut [ptr, address) off as a new block linked before this one, which keeps [address, end): the
        prev/next surgery of alloc_found_block's split (the new block takes the front). Pool bookkeeping is the
        caller's."""
        head = Block(self.ptr, address - self.ptr, self.stream, self.pool, self.seg, mapped=self.mapped)
        head.prev, head.next = self.prev, self
        if self.prev is not None:
            self.prev.next = head
        self.prev = head
        self.size -= address - self.ptr
        self.ptr = address
        return head

    def split_back(self, address: int) -> Block:
        """Cut [address, end) off as a new block linked after this one, which keeps [ptr, address)."""
        tail = Block(address, self.ptr + self.size - address, self.stream, self.pool, self.seg, mapped=self.mapped)
        tail.prev, tail.next = self, self.next
        if self.next is not None:
            self.next.prev = tail
        self.next = tail
        self.size = address - self.ptr
        return tail


class FreeIndex:
    """The free mapped blocks of every pool by address (not the allocator's: the proof's look-ups of the file's
    addresses, kept logarithmic so that a file whose every choice diverges still replays in linear-ish time)."""

    def __init__(self):
        self.starts: list[int] = []
        self.at: dict[int, Block] = {}

    def add(self, b: Block) -> None:
        if b.ptr not in self.at:
            bisect.insort(self.starts, b.ptr)
        self.at[b.ptr] = b

    def discard(self, b: Block) -> None:
        if self.at.get(b.ptr) is b:
            del self.at[b.ptr]
            del self.starts[bisect.bisect_left(self.starts, b.ptr)]

    def containing(self, address: int) -> Block | None:
        i = bisect.bisect_right(self.starts, address) - 1
        if i < 0:
            return None
        b = self.at[self.starts[i]]
        return b if address < b.ptr + b.size else None


class Pool:
    """BlockPool: free mapped blocks ordered by BlockComparatorSize (stream, size, ptr); unmapped blocks of
    expandable segments by BlockComparatorAddress (stream, ptr)."""

    def __init__(self, small: bool, pool_id: tuple, index: FreeIndex | None = None):
        self.small, self.pool_id = small, pool_id
        self.index = index if index is not None else FreeIndex()
        self.keys: list[tuple[int, int, int]] = []
        self.blocks: dict[tuple[int, int, int], Block] = {}
        self.unmapped_keys: list[tuple[int, int]] = []
        self.unmapped: dict[tuple[int, int], Block] = {}
        self.unmapped_addresses: list[tuple[int, int]] = []   # (ptr, stream), sorted: the block holding an address
        self.get_free_blocks_call_count = 0

    def insert(self, b: Block) -> None:
        """BlockPool::insert_into_blocks (records the gc age base)."""
        key = (b.stream, b.size, b.ptr)
        bisect.insort(self.keys, key)
        self.blocks[key] = b
        self.index.add(b)
        b.gc_base = self.get_free_blocks_call_count

    def erase(self, b: Block) -> None:
        key = (b.stream, b.size, b.ptr)
        if self.blocks.pop(key, None) is not None:
            del self.keys[bisect.bisect_left(self.keys, key)]
            self.index.discard(b)

    def insert_unmapped(self, b: Block) -> None:
        key = (b.stream, b.ptr)
        bisect.insort(self.unmapped_keys, key)
        bisect.insort(self.unmapped_addresses, (b.ptr, b.stream))
        self.unmapped[key] = b

    def erase_unmapped(self, b: Block) -> None:
        key = (b.stream, b.ptr)
        if self.unmapped.pop(key, None) is not None:
            del self.unmapped_keys[bisect.bisect_left(self.unmapped_keys, key)]
            del self.unmapped_addresses[bisect.bisect_left(self.unmapped_addresses, (b.ptr, b.stream))]

    def unmapped_holding(self, address: int, besides: Block | None = None) -> Block | None:
        """The unmapped block (any stream) whose range holds ``address``, other than ``besides``: by bisection over
        the blocks sorted by address (a scan of every unmapped block per segment_map entry made the replay
        quadratic, issue 39 #15). Unmapped ranges do not overlap; where a file's do, the nearest one below the
        address is the one asked."""
        i = bisect.bisect_right(self.unmapped_addresses, (address, float("inf"))) - 1
        for j in (i, i - 1):
            if j < 0:
                break
            ptr, stream = self.unmapped_addresses[j]
            b = self.unmapped[(stream, ptr)]
            if b is besides:
                continue
            return b if b.ptr <= address < b.ptr + b.size else None
        return None


class ExpandableSegment:
    """ExpandableSegment: one virtual range per stream and pool, mapped in granules of the pool's segment size
    (2 MiB small, 20 MiB large: find_expandable_block's ``segment_size``)."""
    __slots__ = ("base", "granule", "size", "stream")

    def __init__(self, base: int, granule: int, size: int, stream: int):
        self.base, self.granule, self.size, self.stream = base, granule, size, stream


class Device:
    """What CUDA does under the allocator: cudaMalloc/cudaFree and the mapping of expandable granules."""

    def malloc(self, size: int, stream: int) -> int | None:           # an address, or None: out of memory
        raise NotImplementedError

    def map(self, address: int, size: int) -> bool:
        raise NotImplementedError

    def free(self, size: int) -> None:
        pass

    def new_expandable(self, stream: int) -> int:
        raise NotImplementedError


class ModelDevice(Device):
    """A GPU with ``capacity`` bytes for this allocator (None: unlimited); fresh addresses for new segments."""

    def __init__(self, capacity: int | None, reserved: int, next_address: int):
        self.capacity, self.reserved = capacity, reserved
        self.next_address = next_address

    def _fits(self, size: int) -> bool:
        return self.capacity is None or self.reserved + size <= self.capacity

    def malloc(self, size: int, stream: int) -> int | None:
        if not self._fits(size):
            return None
        self.reserved += size
        address = self.next_address
        self.next_address += ((size + K_LARGE_BUFFER - 1) // K_LARGE_BUFFER + 1) * K_LARGE_BUFFER
        return address

    def map(self, address: int, size: int) -> bool:
        if not self._fits(size):
            return False
        self.reserved += size
        return True

    def free(self, size: int) -> None:
        self.reserved -= size

    def new_expandable(self, stream: int) -> int:
        address = self.next_address
        self.next_address += EXPANDABLE_SPACE
        return address


@dataclass
class Stats:
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    peak_unallocated: int = 0      # peak of reserved - allocated
    segment_allocs: int = 0
    segment_frees: int = 0


class Allocator:
    """DeviceCachingAllocator for one device, on a ``Device``."""

    def __init__(self, settings: Settings, device: Device):
        self.s, self.device = settings, device
        self.pools: dict[tuple, Pool] = {}
        self.live: dict[int, Block] = {}        # allocated or pending blocks by address
        self.stats = Stats()
        self.expandable: list[ExpandableSegment] = []
        self.free_index = FreeIndex()

    # -- pools -------------------------------------------------------------------------------------------
    def pool(self, small: bool, pool_id: tuple | None) -> Pool:
        key = (pool_id or DEFAULT_POOL, small)
        p = self.pools.get(key)
        if p is None:
            p = self.pools[key] = Pool(small, key[0], self.free_index)
        return p

    def _note(self) -> None:
        st = self.stats
        st.peak_allocated = max(st.peak_allocated, st.allocated)
        st.peak_reserved = max(st.peak_reserved, st.reserved)
        st.peak_unallocated = max(st.peak_unallocated, st.reserved - st.allocated)

    # -- malloc ------------------------------------------------------------------------------------------
    def get_free_block(self, pool: Pool, size: int, stream: int) -> Block | None:
        """DeviceCachingAllocator::get_free_block: best fit on the same stream; expandable blocks ranked by the
        size they can grow to; no oversize block for a request under max_split_size; an oversize block only
        within max_non_split_rounding_size (kLargeBuffer by default) of the request."""
        s = self.s
        if s.memory_fraction is not None and s.garbage_collection_threshold > 0:
            pool.get_free_blocks_call_count += 1
        keys = pool.keys
        i = bisect.bisect_left(keys, (stream, size, -1))
        if i == len(keys) or keys[i][0] != stream:
            return None
        b = pool.blocks[keys[i]]
        if b.seg is not None:
            if s.expandable_segments:
                def grow(x: Block) -> int:
                    return x.size + (x.next.size if x.next is not None and not x.next.mapped else 0)
                j = i + 1
                while (b.seg is not None and j < len(keys) and keys[j][0] == stream
                       and grow(pool.blocks[keys[j]]) < grow(b)):
                    i, b = j, pool.blocks[keys[j]]
                    j += 1
            else:
                i += 1
                while i < len(keys) and keys[i][0] == stream and pool.blocks[keys[i]].seg is not None:
                    i += 1
                if i == len(keys) or keys[i][0] != stream:
                    return None
                b = pool.blocks[keys[i]]
        if size < s.max_split_size and b.size >= s.max_split_size:
            return None
        if size >= s.max_split_size and b.size >= size + s.max_non_split_rounding_size:
            return None
        pool.erase(b)
        return b

    def should_split(self, block: Block, size: int) -> bool:
        """DeviceCachingAllocator::should_split."""
        remaining = block.size - size
        if block.pool.small or self.s.expandable_segments:
            return remaining >= K_MIN_BLOCK
        return size < self.s.max_split_size and remaining > K_SMALL_SIZE

    def take(self, block: Block, size: int, requested: int) -> Block:
        """DeviceCachingAllocator::alloc_found_block: the block is cut from the front of the free block."""
        if self.should_split(block, size):
            remaining = block
            block = remaining.split_front(remaining.ptr + size)
            remaining.pool.insert(remaining)
        block.allocated = True
        block.requested = requested
        self.live[block.ptr] = block
        self.stats.allocated += block.size
        self._note()
        return block

    def new_segment(self, pool: Pool, size: int, stream: int) -> Block | None:
        """DeviceCachingAllocator::alloc_block (not expandable): one cudaMalloc of get_allocation_size."""
        s = self.s
        alloc = allocation_size(size)
        if s.memory_fraction is not None and self._allowed() is not None and \
                self.stats.reserved + alloc > self._allowed():
            return None
        address = self.device.malloc(alloc, stream)
        if address is None:
            return None
        return self.add_segment(pool, address, alloc, stream)

    def add_segment(self, pool: Pool, address: int, size: int, stream: int) -> Block:
        b = Block(address, size, stream, pool)
        self.stats.reserved += size
        self.stats.segment_allocs += 1
        self._note()
        return b

    def _allowed(self) -> int | None:
        cap = getattr(self.device, "capacity", None)
        return None if cap is None or self.s.memory_fraction is None else int(self.s.memory_fraction * cap)

    def malloc(self, requested: int, stream: int, pool_id: tuple | None = None) -> Block | None:
        """DeviceCachingAllocator::malloc: search the pool; else (garbage collection,) a new segment; else
        release_available_cached_blocks and retry; else release_cached_blocks and retry; else None (OOM)."""
        size = round_size(requested, self.s)
        pool = self.pool(size <= K_SMALL_SIZE, pool_id)
        b = self.get_free_block(pool, size, stream)
        if b is None:
            if self.s.memory_fraction is not None and self.s.garbage_collection_threshold > 0:
                self.garbage_collect()
            b = self.alloc_block(pool, size, stream)
            if b is None and self.release_available_cached_blocks(pool, size, stream):
                b = self.alloc_block(pool, size, stream)
            if b is None and pool.pool_id == DEFAULT_POOL:
                self.release_cached_blocks()
                b = self.alloc_block(pool, size, stream)
            if b is None:
                return None
        return self.take(b, size, requested)

    def alloc_block(self, pool: Pool, size: int, stream: int) -> Block | None:
        if self.s.expandable_segments:
            return self.try_allocate_expandable_block(pool, size, stream)
        return self.new_segment(pool, size, stream)

    # -- free --------------------------------------------------------------------------------------------
    def free(self, address: int, deferred: bool) -> Block | None:
        """DeviceCachingAllocator::free (free_requested): allocated bytes drop now; a block used on other streams
        waits for their events (``deferred``), else free_block runs at once."""
        b = self.live.get(address)
        if b is None or not b.allocated:
            return None
        b.allocated = False
        self.stats.allocated -= b.size
        self._note()                      # reserved-but-unallocated peaks when a block is freed
        if deferred:
            b.pending = True
        else:
            self.free_block(b)
        return b

    def free_block(self, b: Block) -> None:
        """DeviceCachingAllocator::free_block (free_completed): merge with free neighbours, back into the pool."""
        if b.allocated:
            self.stats.allocated -= b.size
            b.allocated = False
            self._note()
        b.pending = False
        self.live.pop(b.ptr, None)
        for other in (b.prev, b.next):
            self.try_merge(b, other)
        b.pool.insert(b)

    def try_merge(self, dst: Block, src: Block | None) -> int:
        """DeviceCachingAllocator::try_merge_blocks: only a free, idle neighbour of the same mapped state."""
        if src is None or src.allocated or src.pending or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            src.pool.erase(src)
        else:
            src.pool.erase_unmapped(src)
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # -- releasing cached memory -------------------------------------------------------------------------
    def release_block(self, b: Block) -> None:
        """DeviceCachingAllocator::release_block: cudaFree of a whole free segment."""
        b.pool.erase(b)
        self.stats.reserved -= b.size
        self.stats.segment_frees += 1
        self.device.free(b.size)

    def release_available_cached_blocks(self, pool: Pool, size: int, stream: int) -> bool:
        """DeviceCachingAllocator::release_available_cached_blocks: only with max_split_size set; frees one
        oversize block at least as large, else the largest oversize blocks of the stream until enough."""
        limit = self.s.max_split_size
        if limit == NO_LIMIT:
            return False
        key_size = max(size, limit)
        keys = pool.keys
        i = bisect.bisect_left(keys, (stream, key_size, -1))
        if i == len(keys) or keys[i][0] != stream:
            if i == 0:
                return False
            released = 0
            i -= 1
            while released < key_size and i >= 0:
                b = pool.blocks[keys[i]]
                if b.size < limit or b.stream != stream:
                    break
                released += b.size
                i -= 1
                self._release_if_whole(b)
            return released >= key_size
        self._release_if_whole(pool.blocks[keys[i]])
        return True

    def _release_if_whole(self, b: Block) -> None:
        # release_block asserts a non-expandable block; oversize blocks are never split (should_split), so whole
        if b.seg is None and not b.is_split():
            self.release_block(b)

    def release_cached_blocks(self) -> None:
        """DeviceCachingAllocator::release_cached_blocks: synchronize_and_free_events (every deferred free
        completes), then release_blocks on the large and small default pools: every unsplit free segment is
        cudaFree'd and every whole free granule of an expandable segment unmapped. Private pools are released
        only once their graphs are destroyed, which a trace does not show: they are kept."""
        for b in [b for b in self.live.values() if b.pending]:
            self.free_block(b)
        for small in (False, True):
            pool = self.pools.get((DEFAULT_POOL, small))
            if pool is None:
                continue
            to_unmap = []
            for key in list(pool.keys):
                b = pool.blocks.get(key)
                if b is None:
                    continue
                if b.seg is not None:
                    to_unmap.append(b)
                elif not b.is_split():
                    self.release_block(b)
            for b in to_unmap:
                self.unmap_block(b)

    def garbage_collect(self) -> None:
        """DeviceCachingAllocator::garbage_collect_cached_blocks: above garbage_collection_threshold of the
        allowed memory, release unsplit large free blocks older than the average age until enough is freed."""
        allowed = self._allowed()
        if allowed is None:
            return
        threshold = int(self.s.garbage_collection_threshold * allowed)
        if self.stats.reserved <= threshold:
            return
        target = self.stats.reserved - threshold
        pool = self.pools.get((DEFAULT_POOL, False))
        if pool is None:
            return
        def age(b: Block) -> int:
            return pool.get_free_blocks_call_count - b.gc_base
        candidates = [pool.blocks[k] for k in pool.keys if not pool.blocks[k].is_split()
                      and pool.blocks[k].seg is None]
        total_age, count, reclaimed = sum(age(b) for b in candidates), len(candidates), 0
        freed = True
        while reclaimed < target and freed and count > 0:
            threshold_age = total_age / count
            freed = False
            for key in list(pool.keys):
                b = pool.blocks.get(key)
                if b is None or b.is_split() or b.seg is not None or age(b) < threshold_age:
                    continue
                freed = True
                reclaimed += b.size
                total_age -= age(b)
                count -= 1
                self.release_block(b)

    # -- expandable segments -----------------------------------------------------------------------------
    def find_expandable_block(self, pool: Pool, size: int, stream: int) -> Block:
        """DeviceCachingAllocator::find_expandable_block: the lowest-address unmapped block of the stream (with
        a free block just before it) that has room for ``size``; else a new expandable segment."""
        def allocatable(b: Block | None) -> bool:
            return b is not None and not b.allocated and not b.pending
        i = bisect.bisect_left(pool.unmapped_keys, (stream, -1))
        while i < len(pool.unmapped_keys) and pool.unmapped_keys[i][0] == stream:
            c = pool.unmapped[pool.unmapped_keys[i]]
            if allocatable(c.prev):
                c = c.prev
            room, x = 0, c
            while room < size and allocatable(x):
                room += x.size
                x = x.next
            if room >= size:
                return c
            i += 1
        granule = K_SMALL_BUFFER if pool.small else K_LARGE_BUFFER
        base = self.device.new_expandable(stream)
        return self.add_expandable(pool, base, granule, stream)

    def add_expandable(self, pool: Pool, base: int, granule: int, stream: int) -> Block:
        seg = ExpandableSegment(base, granule, EXPANDABLE_SPACE, stream)
        self.expandable.append(seg)
        b = Block(base, seg.size, stream, pool, seg, mapped=False)
        pool.insert_unmapped(b)
        return b

    def map_block(self, to_map: Block, size: int) -> bool:
        """DeviceCachingAllocator::map_block (ExpandableSegment::map): whole granules from the block's start."""
        seg = to_map.seg
        g = seg.granule
        end = seg.base + -(-(to_map.ptr + size - seg.base) // g) * g
        mapped = end - to_map.ptr
        if not self.device.map(to_map.ptr, mapped):
            return False
        pool = to_map.pool
        pool.erase_unmapped(to_map)
        if mapped < to_map.size:
            pool.insert_unmapped(to_map.split_back(to_map.ptr + mapped))   # the rest stays unmapped
        to_map.mapped = True
        self.try_merge(to_map, to_map.prev)
        self.try_merge(to_map, to_map.next)
        pool.insert(to_map)
        self.stats.reserved += mapped
        self.stats.segment_allocs += 1
        self._note()
        return True

    def try_allocate_expandable_block(self, pool: Pool, size: int, stream: int) -> Block | None:
        """DeviceCachingAllocator::try_allocate_expandable_block."""
        c = self.find_expandable_block(pool, size, stream)
        if not c.mapped and not self.map_block(c, min(c.size, size)):
            return None
        while c.size < size:
            nxt = c.next
            if nxt is None or not self.map_block(nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt
        pool.erase(c)
        return c

    def unmap_block(self, b: Block) -> None:
        """DeviceCachingAllocator::unmap_block (ExpandableSegment::unmap): the whole granules inside a free
        block go back to CUDA; the parts before and after stay free and mapped."""
        seg, g = b.seg, b.seg.granule
        begin = seg.base + -(-(b.ptr - seg.base) // g) * g
        end = seg.base + ((b.ptr + b.size - seg.base) // g) * g
        if begin >= end:
            return
        self.unmap_range(b, begin, end)
        self.device.free(end - begin)

    def unmap_range(self, b: Block, begin: int, end: int) -> None:
        """[begin, end) inside the free block ``b`` leaves the pool's mapped blocks: the parts of ``b`` before and
        after it stay free and mapped, the range becomes an unmapped block merged with its unmapped neighbours
        (unmap_block's granules, or the file's own segment_unmap in the proof)."""
        pool = b.pool
        pool.erase(b)
        if begin > b.ptr:
            pool.insert(b.split_front(begin))
        if b.ptr + b.size > end:
            pool.insert(b.split_back(end))
        b.mapped = False
        self.try_merge(b, b.prev)
        self.try_merge(b, b.next)
        pool.insert_unmapped(b)
        self.stats.reserved -= end - begin
        self.stats.segment_frees += 1

    # -- inspection --------------------------------------------------------------------------------------
    def largest_free_block(self, stream: int | None = None, small: bool | None = None) -> int:
        best = 0
        for (pid, is_small), pool in self.pools.items():
            if small is not None and is_small != small:
                continue
            for (st, size, _), b in pool.blocks.items():
                if (stream is None or st == stream) and size > best:
                    best = size
        return best

    def free_block_containing(self, address: int, stream: int | None = None) -> Block | None:
        b = self.free_index.containing(address)
        return b if b is not None and (stream is None or b.stream == stream) else None

    def carve(self, b: Block, address: int, size: int, requested: int) -> Block:
        """Allocate at ``address`` inside the free block ``b`` (the file's choice, when the model's differed):
        the part before stays free, the rest is split as alloc_found_block would."""
        pool = b.pool
        pool.erase(b)
        if address > b.ptr:
            pool.insert(b.split_front(address))
        if b.size < size:
            size = b.size
        return self.take(b, size, requested)


@dataclass
class SegmentCheck:
    as_recorded: int = 0
    differed: int = 0


@dataclass
class Proof:
    """The model's choices against the file's, per device."""
    allocations: int = 0
    at_recorded: int = 0
    segments: SegmentCheck = field(default_factory=SegmentCheck)
    first_divergence: tuple[int, str, str] | None = None   # (trace index, model chose, allocator did)
    chosen: list = field(default_factory=list)             # (trace index, chosen address or None)
    not_proven: str = ""                                   # why no proof was attempted ("" when it was)

    @property
    def agreement(self) -> float:
        return self.at_recorded / self.allocations if self.allocations else 1.0


# -- the state at the first trace entry, as the model's structures ----------------------------------------
@dataclass(frozen=True)
class StartState:
    """What the backward replay knows at the start of the ring (replay.State), with each segment's pool kind."""
    blocks: dict            # address -> (size, requested, pending, stream or None)
    plain: dict             # address -> (size, stream, pool_id, small)
    mapped: tuple           # (start, size, stream, small) mapped ranges of expandable segments


def start_state(state, dump_segments, trace) -> StartState:
    """From replay.State (position 0): the pool kind of each segment comes from the dump where it names it,
    else from the size (a 2 MiB cudaMalloc is a small-pool segment: get_allocation_size gives large requests
    20 MiB or more); an expandable range is small when the dump says so or a small block lies in it."""
    kinds = {s.address: s.kind for s in dump_segments}
    # the dump's expandable segments by address, each with its place in the dump (the first one that overlaps a
    # mapped range names its kind) and the furthest end up to it: an overlap is found by bisection, not by a scan
    # of every segment per mapped range (quadratic: 28,000 segments took over 30 s, issue 39 #15)
    exp = sorted((s.address, n, s.total_size, s.kind) for n, s in enumerate(dump_segments) if s.expandable)
    exp_starts = [a for a, *_ in exp]
    exp_reach = list(itertools.accumulate((a + size for a, _, size, _ in exp), max))

    def expandable_kind(start: int, size: int) -> str | None:
        j = bisect.bisect_left(exp_starts, start + size) - 1
        found = None
        stop = max(-1, j - 64)   # torch's segments never overlap; a file's that do are looked at 64 deep, no more
        while j > stop and exp_reach[j] > start:    # only segments reaching past start can overlap
            a, n, sz, k = exp[j]
            if a + sz > start and (found is None or n < found[0]):
                found = (n, k)
            j -= 1
        return None if found is None else found[1]
    plain = {}
    for addr, (size, stream, pool) in state.segments.items():
        kind = kinds.get(addr)
        small = kind == "small" if kind else size == K_SMALL_BUFFER
        plain[addr] = (size, stream, pool or DEFAULT_POOL, small)
    blocks = {a: (b.size, b.requested, b.pending, None) for a, b in state.blocks.items()}
    mapped = []
    small_sizes = sorted(a for a, (size, *_rest) in blocks.items() if size <= K_SMALL_SIZE)
    for start, size, stream in state.mapped.ranges():
        kind = expandable_kind(start, size)
        if kind is None:
            j = bisect.bisect_left(small_sizes, start)
            small = j < len(small_sizes) and small_sizes[j] < start + size
        else:
            small = kind == "small"
        mapped.append((start, size, stream, small))
    return StartState(blocks, plain, tuple(mapped))


def load_start(alloc: Allocator, start: StartState) -> int:
    """Build the model's segments from ``start``; returns how many live blocks lay in no known segment (their
    memory is outside the model from here on)."""
    live_addrs = sorted(start.blocks)
    placed: set[int] = set()

    def fill(pool: Pool, seg: ExpandableSegment | None, lo: int, hi: int, stream: int, prev: Block | None):
        """Chain the live blocks of [lo, hi) and the free gaps between them after ``prev``; returns the last."""
        cursor = lo
        j = bisect.bisect_left(live_addrs, lo)
        pieces: list[Block] = []
        while j < len(live_addrs) and live_addrs[j] < hi:
            a = live_addrs[j]
            size, requested, pending, _ = start.blocks[a]
            j += 1
            if a < cursor:          # overlaps an estimated block before it: the file's sizes disagree
                continue
            if a > cursor:
                pieces.append(Block(cursor, a - cursor, stream, pool, seg))
            size = min(size, hi - a)
            b = Block(a, size, stream, pool, seg)
            b.requested, b.pending, b.allocated = requested, pending, not pending
            pieces.append(b)
            placed.add(a)
            cursor = a + size
        if cursor < hi:
            pieces.append(Block(cursor, hi - cursor, stream, pool, seg))
        if seg is None and not pool.small:
            # Every block of a large-pool segment is over 1 MiB (should_split leaves a remainder only when it is
            # larger than kSmallSize; merging only grows blocks), so a free gap of 1 MiB or less after a block
            # is part of it: a block freed after the ring started whose size the backward replay estimated
            # from its request (it took the whole free block).
            kept: list[Block] = []
            for b in pieces:
                if kept and b.free_and_idle() and b.size <= K_SMALL_SIZE and not kept[-1].free_and_idle():
                    kept[-1].size += b.size
                    continue
                kept.append(b)
            pieces = kept
        for b in pieces:
            b.prev = prev
            if prev is not None:
                prev.next = b
            prev = b
            if b.allocated or b.pending:
                alloc.live[b.ptr] = b
                alloc.stats.allocated += b.size if b.allocated else 0
        return prev

    def settle(head: Block | None) -> None:
        """Free neighbours merge (the allocator never keeps two adjacent free blocks); free blocks to the pool."""
        b = head
        while b is not None:
            nxt = b.next
            if b.mapped and b.free_and_idle() and nxt is not None and nxt.mapped and nxt.free_and_idle():
                b.size += nxt.size
                b.next = nxt.next
                if nxt.next is not None:
                    nxt.next.prev = b
                continue
            b = nxt
        b = head
        while b is not None:
            if b.free_and_idle():
                if b.mapped:
                    b.pool.insert(b)
                else:
                    b.pool.insert_unmapped(b)
            b = b.next

    for addr in sorted(start.plain):
        size, stream, pool_id, small = start.plain[addr]
        pool = alloc.pool(small, pool_id)
        head_holder = Block(addr, 0, stream, pool)          # a sentinel so that fill can chain after it
        fill(pool, None, addr, addr + size, stream, head_holder)
        head = head_holder.next
        if head is not None:
            head.prev = None
        alloc.stats.reserved += size
        settle(head)
    groups: dict[tuple[int, bool], list[tuple[int, int]]] = {}
    for s0, size, stream, small in start.mapped:
        groups.setdefault((stream, small), []).append((s0, size))
    for (stream, small), ranges in groups.items():
        ranges.sort()
        pool = alloc.pool(small, DEFAULT_POOL)
        granule = K_SMALL_BUFFER if small else K_LARGE_BUFFER
        base = ranges[0][0]
        seg = ExpandableSegment(base, granule, EXPANDABLE_SPACE, stream)
        alloc.expandable.append(seg)
        sentinel = Block(base, 0, stream, pool)
        last, cursor = sentinel, base
        for s0, size in ranges:
            if s0 > cursor:
                gap = Block(cursor, s0 - cursor, stream, pool, seg, mapped=False)
                gap.prev, last.next, last = last, gap, gap
            last = fill(pool, seg, s0, s0 + size, stream, last)
            alloc.stats.reserved += size
            cursor = s0 + size
        tail = Block(cursor, base + EXPANDABLE_SPACE - cursor, stream, pool, seg, mapped=False)
        tail.prev, last.next = last, tail
        head = sentinel.next
        head.prev = None
        settle(head)
    orphans = 0
    for a in live_addrs:
        if a in placed:
            continue
        size, requested, pending, _ = start.blocks[a]
        b = Block(a, size, 0, alloc.pool(size <= K_SMALL_SIZE, DEFAULT_POOL))
        b.requested, b.pending, b.allocated = requested, pending, not pending
        alloc.live[a] = b
        orphans += 1
    alloc._note()
    return orphans


def empty_cache_calls(trace) -> set[int]:
    """Trace indices where the program called torch.cuda.empty_cache() (DeviceCachingAllocator::emptyCache ->
    release_cached_blocks): a run of segment_free/segment_unmap entries that no segment_alloc, segment_map or
    oom follows within the same malloc. Inside malloc the same release (release_available_cached_blocks,
    release_cached_blocks) is followed by the retried cudaMalloc or the OOM."""
    from . import model as M
    act = trace.action
    n, out, i = len(act), set(), 0
    release = (M.SEGMENT_FREE, M.SEGMENT_UNMAP)
    while i < n:
        if act[i] in release:
            j = i
            while j < n and act[j] in release:
                j += 1
            k = j
            while k < n and act[k] == M.FREE_COMPLETED:
                k += 1
            if not (k < n and act[k] in (M.SEGMENT_ALLOC, M.SEGMENT_MAP, M.OOM)):
                out.add(i)
            i = j
        else:
            i += 1
    return out


def deferred_frees(trace) -> list[bool]:
    """Per entry: a free_requested whose free_completed does not follow at once waited on other streams'
    events (DeviceCachingAllocator::free: insert_events when stream_uses is not empty, else free_block now)."""
    from . import model as M
    act, addr = trace.action, trace.addr
    n = len(act)
    return [act[i] == M.FREE_REQUESTED and not (i + 1 < n and act[i + 1] == M.FREE_COMPLETED
                                                and addr[i + 1] == addr[i]) for i in range(n)]


class RecordedDevice(Device):
    """The proof's device: CUDA's answers are the file's (see the module docstring); the allocator itself never
    asks it, the proof hands the recorded segments over."""

    def malloc(self, size: int, stream: int) -> int | None:
        return None

    def map(self, address: int, size: int) -> bool:
        return False

    def new_expandable(self, stream: int) -> int:
        return 0


def _hex(a: int | None) -> str:
    return "a new segment" if a is None else hex(a)


def prove(trace, start: StartState, settings: Settings, keep_choices: bool = True) -> Proof:
    """Replay ``trace`` forward from ``start`` with ``settings`` and compare each allocation's address with the
    recorded one (see the module docstring: the device's answers and, after a divergence, the state are the
    file's)."""
    from . import model as M
    proof = Proof()
    act, addr, size, stream, pools = trace.action, trace.addr, trace.size, trace.stream, trace.pool
    odd = sum(1 for i in range(len(act)) if act[i] == M.ALLOC and addr[i] % K_MIN_BLOCK)
    if odd:   # every block the allocator hands out starts at a multiple of kMinBlockSize within its segment
        proof.allocations = sum(1 for a in act if a == M.ALLOC)
        proof.not_proven = (f"{odd} allocation address(es) are not multiples of 512 bytes: not addresses a CUDA "
                            "caching allocator hands out (a generated or anonymised file); nothing to prove against")
        return proof
    alloc = Allocator(settings, RecordedDevice())
    load_start(alloc, start)
    deferred = deferred_frees(trace)
    grants: list[tuple[int, int, int]] = []         # segment_alloc entries not yet used: (address, size, stream)
    maps: list[tuple[int, int, int]] = []           # segment_map entries not yet used
    for i in range(len(act)):
        a = act[i]
        if a == M.ALLOC:
            proof.allocations += 1
            req, st, recorded = size[i], stream[i], addr[i]
            rsize = round_size(req, settings)
            pool = alloc.pool(rsize <= K_SMALL_SIZE, pools[i])
            b = alloc.get_free_block(pool, rsize, st)
            fresh = False
            if b is None and grants:
                g_addr, g_size, g_stream = grants.pop(0)
                if g_size == allocation_size(rsize) and g_stream == st:
                    proof.segments.as_recorded += 1
                else:
                    proof.segments.differed += 1
                b, fresh = alloc.add_segment(pool, g_addr, g_size, st), True
            elif b is None and maps:
                b = _apply_maps(alloc, pool, maps, st, rsize, proof)
                maps.clear()
            elif b is not None and (grants or maps):
                proof.segments.differed += len(grants) + len(maps)
            for g_addr, g_size, g_stream in grants:        # segments the model did not ask for: the file's
                g_pool = alloc.pool(g_size == K_SMALL_BUFFER, pools[i])
                g_pool.insert(alloc.add_segment(g_pool, g_addr, g_size, g_stream))
            grants.clear()
            if maps:
                _apply_maps(alloc, pool, maps, st, 0, None)
                maps.clear()
            chosen = b.ptr if b is not None else None
            if b is not None and b.ptr == recorded:
                alloc.take(b, rsize, req)
                proof.at_recorded += 1
            else:
                if b is not None:      # back into the pool (a fresh segment's block joins it as a free one)
                    pool.insert(b)
                if proof.first_divergence is None:
                    proof.first_divergence = (i, f"{_hex(chosen)} ({'reused' if chosen is not None and not fresh else 'new'})",
                                              hex(recorded))
                f = alloc.free_block_containing(recorded, st)
                if f is not None:
                    alloc.carve(f, recorded, rsize, req)
                else:
                    orphan = Block(recorded, rsize, st, pool)
                    orphan.allocated, orphan.requested = True, req
                    alloc.live[recorded] = orphan
                    alloc.stats.allocated += rsize
            if keep_choices:
                proof.chosen.append((i, chosen))
        elif a == M.FREE_REQUESTED:
            alloc.free(addr[i], deferred[i])
        elif a == M.FREE_COMPLETED:
            b = alloc.live.get(addr[i])
            if b is not None:
                alloc.free_block(b)
        elif a == M.SEGMENT_ALLOC:
            grants.append((addr[i], size[i], stream[i]))
        elif a == M.SEGMENT_MAP:
            maps.append((addr[i], size[i], stream[i]))
        elif a == M.SEGMENT_FREE:
            b = _free_block_at(alloc, addr[i])
            if b is not None and b.seg is None and not b.is_split() and b.size == size[i]:
                alloc.release_block(b)
                proof.segments.as_recorded += 1
            else:
                proof.segments.differed += 1
                if b is not None and b.seg is None and not b.is_split():
                    alloc.release_block(b)
        elif a == M.SEGMENT_UNMAP:
            b = alloc.free_block_containing(addr[i])
            if b is not None and b.seg is not None and b.ptr <= addr[i] and addr[i] + size[i] <= b.ptr + b.size:
                alloc.unmap_range(b, addr[i], addr[i] + size[i])   # the file's own segment_unmap
                proof.segments.as_recorded += 1
            else:
                proof.segments.differed += 1
    return proof


def _free_block_at(alloc: Allocator, address: int) -> Block | None:
    return alloc.free_index.at.get(address)


def _unmapped_containing(alloc: Allocator, pool: Pool, address: int) -> Block | None:
    return pool.unmapped_holding(address)


def _apply_maps(alloc: Allocator, pool: Pool, maps, stream: int, size: int, proof: Proof | None) -> Block | None:
    """The file's segment_map entries for one request, applied to the model: each maps [address, +size) of an
    unmapped block (a new expandable segment when the address is in none). The model's own choice
    (find_expandable_block's candidate) is compared with the first mapped address. Returns the free block that
    serves ``size`` (try_allocate_expandable_block's candidate) or None."""
    predicted = None
    if proof is not None:
        i = bisect.bisect_left(pool.unmapped_keys, (stream, -1))
        while i < len(pool.unmapped_keys) and pool.unmapped_keys[i][0] == stream:
            c = pool.unmapped[pool.unmapped_keys[i]]
            room, x = 0, (c.prev if c.prev is not None and c.prev.free_and_idle() else c)
            while room < size and x is not None and x.free_and_idle():
                room += x.size
                x = x.next
            if room >= size:
                predicted = c.ptr
                break
            i += 1
    last = None
    for n, (address, msize, st) in enumerate(maps):
        u = _unmapped_containing(alloc, pool, address)
        if u is None:
            u = alloc.add_expandable(pool, address, K_SMALL_BUFFER if pool.small else K_LARGE_BUFFER, st)
        if proof is not None:
            ok = (predicted == address) if n == 0 else True
            if predicted is None and n == 0:
                ok = pool.unmapped_holding(address, besides=u) is None and u.ptr == address
            proof.segments.as_recorded += ok
            proof.segments.differed += not ok
        if address > u.ptr:     # split the unmapped block at the recorded address
            pool.erase_unmapped(u)
            pool.insert_unmapped(u.split_front(address))
            pool.insert_unmapped(u)
        alloc.device = _Grant()
        alloc.map_block(u, min(msize, u.size))
        alloc.device = RecordedDevice()
        last = u
    if last is None or size == 0:
        return None
    if last.size >= size and last.free_and_idle():
        last.pool.erase(last)
        return last
    return None


class _Grant(RecordedDevice):
    def map(self, address: int, size: int) -> bool:
        return True


