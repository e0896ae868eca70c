"""A model of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``, the
``DeviceCachingAllocator`` of the torch this project pins; ROCm builds run the same code,
hipified), replaying a step's allocations and frees in order to give what the card must hold:
peak reserved, the largest free cached block at that peak, and whether (and where) the step
raises an out-of-memory error on a card of a given size. No GPU and no torch: sizes and order only.

What it models, as the source does it:

- **Rounding** (``round_size``): every request rounded up to 512 bytes; with
  ``roundup_power2_divisions:N``, a request above 512 x N rounded up to the next of N equal
  divisions between two powers of two.
- **Two pools**: requests of at most 1 MiB come from the small pool, whose segments are 2 MiB;
  larger ones from the large pool, whose segments are 20 MiB for a request under 10 MiB, else the
  request rounded up to 2 MiB (``get_allocation_size``).
- **Best fit** over the pool's cached free blocks (the smallest at least as large, then the lowest
  address), one stream (the step's own).
- **Splitting** (``should_split``): a small-pool block splits when at least 512 bytes would
  remain; a large-pool block when the request is under ``max_split_size`` and more than 1 MiB
  would remain. With ``max_split_size_mb``, a block of that size or more is never handed to a
  smaller request, and a larger request takes a cached oversize block only within 20 MiB of it.
- **Freeing** returns a block to its pool, merged with free neighbours of its segment.
- **The OOM path**: a new segment that would take the reserved memory past the card's capacity
  fails; then, with ``max_split_size_mb``, cached oversize blocks are released (the smallest one
  large enough, else the largest until enough), then every unsplit cached block of both pools,
  and the segment is tried again; failing that the step raises.
- **garbage_collection_threshold** (only with a per-process memory fraction, as in the source:
  the capacity given is then the allowed maximum): before a new segment, while reserved memory is
  above threshold x capacity, unsplit cached large blocks older than the average (in pool
  searches since they were cached) are released.
- **expandable_segments:True**: one segment per pool that grows by pages (2 MiB small, 20 MiB
  large) at its end; any block splits when 512 bytes would remain; on the OOM path its free pages
  are unmapped.

What it leaves out: other streams (``record_stream``, events), CUDA graphs' private pools,
``release_lock_on_cudamalloc`` (threads), IPC, and what is not the caching allocator's (the CUDA
context, cuBLAS/cuDNN workspaces that bypass it, another process's memory); the card's driver and
context overhead stay measured per card. An expandable segment's unmapping is by whole free pages
at the ends and between live blocks, as the source unmaps them; its address-space limit is not
modelled.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Optional

MIB = 2**20
K_MIN_BLOCK = 512
K_SMALL_SIZE = MIB
K_SMALL_BUFFER = 2 * MIB
K_LARGE_BUFFER = 20 * MIB
K_MIN_LARGE_ALLOC = 10 * MIB
K_ROUND_LARGE = 2 * MIB
NO_LIMIT = 2**63
#: Trace entries that are not an allocation or a free: ``torch.cuda.empty_cache()`` (every unsplit
#: cached block back to the device, as peft's ``prepare_model_for_kbit_training`` does after its
#: casts) and ``torch.cuda.reset_peak_memory_stats()`` (the peaks start again from what is held now,
#: as the probe does before its step).
EMPTY_CACHE = -(1 << 62)
RESET_PEAK = EMPTY_CACHE + 1


class AllocConfError(ValueError):
    """A ``PYTORCH_CUDA_ALLOC_CONF`` value the allocator would refuse."""


@dataclass(frozen=True)
class AllocConf:
    """The settings of ``PYTORCH_CUDA_ALLOC_CONF`` the model follows."""

    max_split_size: int = NO_LIMIT
    roundup_power2_divisions: int = 0
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False

    @classmethod
    def parse(cls, text: Optional[str]) -> "AllocConf":
        """``key:value,key:value`` as PyTorch reads it (``max_split_size_mb``, at least 20;
        ``roundup_power2_divisions``, a power of two; ``garbage_collection_threshold``, in (0, 1);
        ``expandable_segments``, True or False). Raises AllocConfError naming the key."""
        values: dict = {}
        for part in (text or "").split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, value = part.partition(":")
            key, value = key.strip(), value.strip()
            if not sep or not value:
                raise AllocConfError(f"{part!r}: expected key:value")
            try:
                if key == "max_split_size_mb":
                    mb = int(value)
                    if mb < 20:
                        raise AllocConfError(f"max_split_size_mb: {mb} is below the allocator's minimum of 20")
                    values["max_split_size"] = mb * MIB
                elif key == "roundup_power2_divisions":
                    n = int(value)
                    if n < 1 or n & (n - 1):
                        raise AllocConfError(f"roundup_power2_divisions: {n} is not a power of two")
                    values["roundup_power2_divisions"] = n
                elif key == "garbage_collection_threshold":
                    t = float(value)
                    if not 0.0 < t < 1.0:
                        raise AllocConfError(f"garbage_collection_threshold: {t} is not in (0, 1)")
                    values["garbage_collection_threshold"] = t
                elif key == "expandable_segments":
                    if value not in ("True", "False"):
                        raise AllocConfError(f"expandable_segments: {value!r} is not True or False")
                    values["expandable_segments"] = value == "True"
                elif key in ("backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                             "pinned_num_register_threads", "pinned_use_background_threads"):
                    continue  # no effect on the device memory of one stream
                else:
                    raise AllocConfError(f"{key}: not a PYTORCH_CUDA_ALLOC_CONF key this model knows")
            except ValueError as exc:
                if isinstance(exc, AllocConfError):
                    raise
                raise AllocConfError(f"{key}: {value!r} is not a number") from None
        return cls(**values)


def round_size(size: int, conf: AllocConf) -> int:
    if size < K_MIN_BLOCK:
        return K_MIN_BLOCK
    n = conf.roundup_power2_divisions
    if n > 1 and size > K_MIN_BLOCK * n:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (n.bit_length() - 1)
        if step == 0:
            return floor << 1
        low = size & ~(step - 1)
        return size if low == size else low + step
    return K_MIN_BLOCK * ((size + K_MIN_BLOCK - 1) // K_MIN_BLOCK)


def allocation_size(size: int) -> int:
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


class OutOfMemory(Exception):
    """The modelled allocator could not find or make a block."""

    def __init__(self, size: int, allocated: int, reserved: int, event: int):
        super().__init__(f"tried to allocate {size} bytes with {allocated} allocated and {reserved} reserved")
        self.size, self.allocated, self.reserved, self.event = size, allocated, reserved, event


@dataclass(eq=False)
class Block:
    size: int
    addr: int
    small: bool
    segment: "Segment"
    allocated: bool = False
    prev: Optional["Block"] = None
    next: Optional["Block"] = None
    cached_at: int = 0  # the pool's search count when it was cached (garbage collection's age)

    def key(self) -> tuple[int, int]:
        return (self.size, self.addr)

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


@dataclass(eq=False)
class Segment:
    size: int  # bytes reserved (mapped) by this segment
    small: bool
    expandable: bool = False
    end: int = 0  # an expandable segment: the address its next pages are mapped at


class Pool:
    """Cached free blocks of one pool, ordered by (size, address) for best fit."""

    def __init__(self, small: bool):
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[tuple[int, int], Block] = {}
        self.searches = 0

    def add(self, b: Block) -> None:
        k = b.key()
        bisect.insort(self.keys, k)
        self.blocks[k] = b
        b.cached_at = self.searches

    def remove(self, b: Block) -> None:
        k = b.key()
        i = bisect.bisect_left(self.keys, k)
        del self.keys[i]
        del self.blocks[k]

    def best_fit(self, size: int) -> Optional[Block]:
        i = bisect.bisect_left(self.keys, (size, -1))
        return self.blocks[self.keys[i]] if i < len(self.keys) else None


@dataclass
class Replay:
    """What a replay found: the peaks (bytes), the largest free cached block when reserved memory
    peaked, the OOM if one was raised (the event it was raised at), and the allocator's counters."""

    peak_allocated: int = 0
    peak_reserved: int = 0
    largest_free_at_peak: int = 0
    oom: Optional[OutOfMemory] = None
    segments: int = 0
    retries: int = 0
    events: int = 0


class CachingAllocator:
    """One device's caching allocator on one stream; ``capacity`` bytes may be reserved."""

    def __init__(self, conf: AllocConf = AllocConf(), capacity: int = NO_LIMIT):
        self.conf, self.capacity = conf, capacity
        self.pools = {True: Pool(True), False: Pool(False)}
        self.allocated = self.reserved = 0
        self.next_addr = 0
        self.stats = Replay()
        self.expandable: dict[bool, Optional[Segment]] = {True: None, False: None}
        self.active: set[Block] = set()

    # -- malloc -----------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> Block:
        size = round_size(nbytes, self.conf)
        small = size <= K_SMALL_SIZE
        pool = self.pools[small]
        block = self._free_block(pool, size)
        if block is None:
            if self.conf.garbage_collection_threshold > 0 and self.capacity < NO_LIMIT:
                self._garbage_collect()
            block = self._new_block(size, small)
            if block is None and self._release_available(pool, size):
                block = self._new_block(size, small)
            if block is None:
                self.stats.retries += 1
                self._release_cached()
                block = self._new_block(size, small)
            if block is None:
                raise OutOfMemory(size, self.allocated, self.reserved, self.stats.events)
        if self._should_split(block, size):
            rest = Block(block.size - size, block.addr + size, small, block.segment, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            pool.add(rest)
        block.allocated = True
        self.active.add(block)
        self.allocated += block.size
        self.stats.peak_allocated = max(self.stats.peak_allocated, self.allocated)
        return block

    def _free_block(self, pool: Pool, size: int) -> Optional[Block]:
        pool.searches += 1
        b = pool.best_fit(size)
        if b is None:
            return None
        limit = self.conf.max_split_size
        if size < limit and b.size >= limit:
            return None
        if size >= limit and b.size >= size + K_LARGE_BUFFER:
            return None
        pool.remove(b)
        return b

    def _should_split(self, b: Block, size: int) -> bool:
        remaining = b.size - size
        if b.small or self.conf.expandable_segments:
            return remaining >= K_MIN_BLOCK
        return size < self.conf.max_split_size and remaining > K_SMALL_SIZE

    def _new_block(self, size: int, small: bool) -> Optional[Block]:
        if self.conf.expandable_segments:
            return self._expand(size, small)
        alloc = allocation_size(size)
        if self.reserved + alloc > self.capacity:
            return None
        seg = Segment(alloc, small)
        self.reserved += alloc
        self.stats.segments += 1
        self._peak_reserved()
        b = Block(alloc, self.next_addr, small, seg)
        self.next_addr += alloc
        return b

    def _expand(self, size: int, small: bool) -> Optional[Block]:
        """An expandable segment: grow the pool's one segment by pages at its end (the free block
        at its end, if any, joins the new pages)."""
        page = K_SMALL_BUFFER if small else K_LARGE_BUFFER
        seg = self.expandable[small]
        pool = self.pools[small]
        tail = None
        if seg is not None:
            tail = next((b for b in pool.blocks.values() if b.segment is seg and b.next is None), None)
        have = tail.size if tail is not None else 0
        grow = (size - have + page - 1) // page * page
        if self.reserved + grow > self.capacity:
            return None
        if seg is None:  # its own range of addresses, as the source reserves the device's whole memory
            seg = self.expandable[small] = Segment(0, small, expandable=True, end=self.next_addr)
            self.next_addr += 1 << 48
            self.stats.segments += 1
        seg.size += grow
        self.reserved += grow
        self._peak_reserved()
        if tail is not None:
            pool.remove(tail)
            tail.size += grow
            seg.end += grow
            return tail
        last = self._last_block(seg)
        b = Block(grow, seg.end, small, seg, prev=last)
        if last is not None:
            last.next = b
        seg.end += grow
        return b

    def _last_block(self, seg: Segment) -> Optional[Block]:
        """The block at the end of an expandable segment (live or cached)."""
        for b in self.active:
            if b.segment is seg and b.next is None:
                return b
        for b in self.pools[seg.small].blocks.values():
            if b.segment is seg and b.next is None:
                return b
        return None

    def _peak_reserved(self) -> None:
        if self.reserved > self.stats.peak_reserved:
            self.stats.peak_reserved = self.reserved
            self.stats.largest_free_at_peak = max(
                (b.size for p in self.pools.values() for b in p.blocks.values()), default=0)

    # -- free -----------------------------------------------------------------------------
    def free(self, block: Block) -> None:
        block.allocated = False
        self.active.discard(block)
        self.allocated -= block.size
        pool = self.pools[block.small]
        for other in (block.prev, block.next):
            if other is not None and not other.allocated:
                pool.remove(other)
                if other is block.prev:
                    block.addr = other.addr
                    block.prev = other.prev
                    if other.prev is not None:
                        other.prev.next = block
                else:
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
                block.size += other.size
        pool.add(block)

    # -- releasing cached memory -----------------------------------------------------------
    def _release(self, b: Block) -> None:
        self.pools[b.small].remove(b)
        self.reserved -= b.size
        b.segment.size -= b.size
        if b.segment.expandable:
            if b.prev is not None:
                b.prev.next = b.next
            if b.next is not None:
                b.next.prev = b.prev
            if b.segment.size == 0:
                self.expandable[b.small] = None

    def _release_available(self, pool: Pool, size: int) -> bool:
        """With max_split_size: release the smallest cached oversize block that is large enough,
        else the largest ones until enough is released."""
        limit = self.conf.max_split_size
        if limit == NO_LIMIT:
            return False
        oversize = [b for b in pool.blocks.values() if b.size >= max(size, limit) and not b.is_split()]
        if oversize:
            self._release(min(oversize, key=Block.key))
            return True
        freed = 0
        for b in sorted((b for b in pool.blocks.values() if b.size >= limit and not b.is_split()),
                        key=Block.key, reverse=True):
            self._release(b)
            freed += b.size
            if freed >= size:
                return True
        return False

    def _release_cached(self) -> None:
        """Every unsplit cached block of both pools back to the device (an expandable segment's
        free pages: every free block of it)."""
        for pool in self.pools.values():
            for b in list(pool.blocks.values()):
                if not b.is_split() or b.segment.expandable:
                    self._release(b)

    def _garbage_collect(self) -> None:
        threshold = int(self.conf.garbage_collection_threshold * self.capacity)
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        pool = self.pools[False]
        while reclaimed < target:
            candidates = [b for b in pool.blocks.values() if not b.is_split()]
            if not candidates:
                return
            ages = [pool.searches - b.cached_at for b in candidates]
            average = sum(ages) / len(ages)
            old = [b for b, age in zip(candidates, ages) if age >= average]
            for b in old:
                reclaimed += b.size
                self._release(b)


def replay(trace: Iterable[int], conf: AllocConf = AllocConf(), capacity: int = NO_LIMIT) -> Replay:
    """Replay a trace: a non-negative entry allocates that many bytes (the k-th such entry is
    allocation k), a negative entry ``-(k + 1)`` frees allocation k, ``EMPTY_CACHE`` and
    ``RESET_PEAK`` do what their names say. Stops at the first OOM."""
    a = CachingAllocator(conf, capacity)
    live: dict[int, Block] = {}
    count = 0
    for i, e in enumerate(trace):
        a.stats.events = i
        if e == EMPTY_CACHE:
            a._release_cached()
        elif e == RESET_PEAK:
            a.stats.peak_allocated, a.stats.peak_reserved = a.allocated, a.reserved
            a.stats.largest_free_at_peak = max((b.size for p in a.pools.values() for b in p.blocks.values()),
                                               default=0)
        elif e >= 0:
            try:
                live[count] = a.malloc(e)
            except OutOfMemory as exc:
                a.stats.oom = exc
                return a.stats
            count += 1
        else:
            b = live.pop(-e - 1, None)
            if b is not None:
                a.free(b)
    return a.stats


def oom_capacity(trace: list[int], conf: AllocConf = AllocConf(), step: int = K_ROUND_LARGE) -> tuple[int, Replay]:
    """The largest capacity (bytes, a multiple of ``step``) at which the replay raises an OOM, by
    bisection between the peak allocated (it always fails below) and the unlimited replay's peak
    reserved (it never fails there): a card must be larger than this to run the step. With the
    unlimited replay."""
    free = replay(trace, conf)
    lo = ((free.peak_allocated - 1) // step) * step  # below the peak allocated: fails
    hi = -(-free.peak_reserved // step) * step  # runs
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if replay(trace, conf, mid).oom is not None:
            lo = mid
        else:
            hi = mid
    return lo, free


def _shift_frees(events: list[int], made: int) -> list[int]:
    """``events`` (a trace's tail) with one more allocation numbered ``made`` before them: a free
    of an allocation numbered ``made`` or later names the next number."""
    return [e if e >= 0 or e <= RESET_PEAK or -e - 1 < made else e - 1 for e in events]


def with_first(trace: list[int], nbytes: int) -> list[int]:
    """``trace`` with an allocation of ``nbytes`` made first and never freed (what the model's
    loading places before the recorded weights: a multimodal model's vision tower)."""
    return [int(nbytes)] + _shift_frees(trace, 0) if nbytes > 0 else list(trace)


def with_held(trace: list[int], nbytes: int) -> list[int]:
    """``trace`` with an allocation of ``nbytes`` made where the step starts (at its
    ``RESET_PEAK``, just before it; at the end of the trace when there is none) and never freed: memory the step's
    recorded tensors do not show but the card holds through it (the card's remainder, measured
    less dry-run peak allocated), which the allocator places as it places any other."""
    if nbytes <= 0:
        return list(trace)
    at = trace.index(RESET_PEAK) if RESET_PEAK in trace else len(trace)
    made = sum(1 for e in trace[:at] if e >= 0)
    return trace[:at] + [int(nbytes)] + _shift_frees(trace[at:], made)


def trace_of_snapshot(events: Iterable[dict]) -> tuple[list[int], dict]:
    """A real run's allocator history as a trace ``replay`` reads, and what the real allocator
    itself did. ``events``: one device's entries of ``torch.cuda.memory._snapshot()
    ["device_traces"]`` (history recorded with ``torch.cuda.memory._record_memory_history``).

    Each ``alloc`` is an allocation of its size (the request, which ``replay`` rounds as the
    allocator does), each ``free_completed`` the free of the live allocation at its address (a
    block allocated before the history began is not in it: counted, not replayed). A run of
    ``segment_free`` is ``torch.cuda.empty_cache()`` (``EMPTY_CACHE``), unless a
    ``segment_alloc`` follows it: that is the allocator's own OOM path (release the cache, retry),
    which a replay at the card's capacity makes itself. The real figures: the peak of reserved
    memory the segment events give (``segment_alloc`` / ``segment_map`` less ``segment_free`` /
    ``segment_unmap``, from what was reserved when the history began, unknown: 0) and of
    allocated memory (the blocks' sizes as the allocator counts them are not in the history; the
    requests' rounded sizes are)."""
    events = list(events)
    trace: list[int] = []
    live: dict[int, int] = {}
    made = unmatched = 0
    reserved = peak_reserved = 0
    allocated = peak_allocated = 0
    sizes: dict[int, int] = {}
    i = 0
    while i < len(events):
        e = events[i]
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = made
            trace.append(int(e["size"]))
            sizes[made] = round_size(int(e["size"]), AllocConf())
            allocated += sizes[made]
            peak_allocated = max(peak_allocated, allocated)
            made += 1
        elif action == "free_completed":
            k = live.pop(e["addr"], None)
            if k is None:
                unmatched += 1
            else:
                trace.append(-(k + 1))
                allocated -= sizes.pop(k)
        elif action in ("segment_alloc", "segment_map"):
            reserved += int(e["size"])
            peak_reserved = max(peak_reserved, reserved)
        elif action in ("segment_free", "segment_unmap"):
            j = i
            while j < len(events) and events[j].get("action") == action:
                reserved -= int(events[j]["size"])
                j += 1
            retried = j < len(events) and events[j].get("action") in ("segment_alloc", "segment_map")
            if action == "segment_free" and not retried:
                trace.append(EMPTY_CACHE)
            i = j
            continue
        i += 1
    return trace, {"events": len(events), "allocations": made, "unmatched_frees": unmatched,
                   "peak_reserved": peak_reserved, "peak_requested": peak_allocated}

