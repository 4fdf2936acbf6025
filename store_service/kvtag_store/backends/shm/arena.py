"""An arena: one shared-memory mapping carved into slots, for the memory backend's values and the
Mooncake backend's staging alike.

An arena is one mapping carved into slots. Each slot is a 64-byte header (the last 8 bytes hold the
slot's generation, little-endian) followed by the value, so values are 64-byte aligned:

    [0, 4096)            arena header: magic, format version, the attach nonce, faulted bytes
    [s, s+64)            slot header; generation word at s+56
    [s+64, s+64+length)  the value (its offset is what SharedMemoryRef.offset names)

Why slots and not one allocation per value: a shared-memory client writes and reads values in place,
so their memory must be stable, pre-faulted (a first touch of a page is far slower than a write to
a touched one) and reused. Free slots are kept per exact span: KV blocks of one namespace all have
one size, so an evicted block's slot is reused as-is. Mixed sizes fall back to coalescing free space.

The generation word changes every time a slot is handed out, so a reader that copied from a slot
which was evicted and reused in the meantime sees a different word afterwards and drops its copy.
Pages are reserved and touched by the service ahead of use (faulting.py), never by a client's put.

Pages are given back too, or an arena would keep its high-water mark for good (mixed sizes push the
bump pointer to the arena's end while eviction moves blocks between arenas): freeing the top slot
lowers the bump pointer over every free slot below it, and pages more than the prefault window above
it are released; free slots' whole pages are released (MADV_REMOVE: a hole punched in the file, or in
anonymous shared memory) once they have stayed free a while, and reserved and touched again by the
service before the slot is handed out. Nothing below the up-front (eager) prefault is given back.
"""

from __future__ import annotations

import mmap
import secrets
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvtag_proto import pages
from kvtag_proto.arena_layout import (
    ARENA_HEADER,
    EXTENT,
    NONCE_LENGTH,
    SLOT_HEADER,
    read_generation,
    span_for,
    write_generation,
    write_header,
)

from kvtag_store.backends.shm.faulting import PREFAULTER, Faulting, round_up
from kvtag_store.backends.shm.files import ArenaMemory

# Free slots' pages are released only once they have stayed free for one to two periods of this
# length, all such slots of an arena at once: an eviction frees slots that the same put takes again
# at once, and giving those pages back would cost that put a first touch of each
# (docs/benchmarks.md). The clock is read once every FREES_PER_CHECK frees, not per free.
GIVE_BACK_AGE_S = 1.0
FREES_PER_CHECK = 64
PAGE = mmap.PAGESIZE
# Bytes at a slot's start zeroed before its pages go: the header's generation word and the value's
# first bytes (a Mooncake staging slot keeps its own generation word there), so a reader still copying
# from the freed slot sees its generation change instead of accepting the zeros that the hole reads as.
FORGET_HEAD = 320
_ZEROS = bytes(max(PAGE, FORGET_HEAD))


def _round_down(n: int, to: int) -> int:
    return n // to * to


def arena_size(capacity_bytes: int) -> int:
    """Virtual size of an arena for a store of `capacity_bytes` of values. Pages are only used as
    slots are carved, so the slack (room for slot headers and fragmentation) costs address space."""
    return round_up(ARENA_HEADER + 2 * capacity_bytes + (16 << 20), EXTENT)


class Slot(NamedTuple):
    """A slot handed out by Arena.allocate: the value lives at [offset, offset + length). A NamedTuple,
    as the reservation records beside it: one is built per value put, and a NamedTuple is cheaper to
    build than a frozen dataclass."""

    offset: int
    length: int
    span: int  # bytes of the slot, header included
    generation: int

    @property
    def start(self) -> int:
        return self.offset - SLOT_HEADER


class Arena:
    """Slots in one mapping. Not thread-safe: the memory backend calls it under its lock (except
    `view` reads and writes of slots it owns)."""

    def __init__(
        self,
        tenant: str,
        size: int,
        directory: str | None,
        group: int | None = None,
        eager: int = 0,
        give_back: bool = True,
    ) -> None:
        """A file in `directory` (e.g. /dev/shm, mode 0600) that clients may map, or anonymous
        memory when `directory` is None (the inline path only). With `group` the file is that group's
        and mode 0660: the tenant's engines, in that group under their own users, may map it.
        `eager`: bytes the background prefaulter touches from the start, whatever has been used, so a
        filling store's puts find their pages ready (a first touch is costly: docs/benchmarks.md).
        `give_back`: release free slots' pages (module docstring); False for memory a transport has
        pinned (an RDMA registration would keep the old pages while the file gets new ones)."""
        self.tenant = tenant
        self.size = size
        self.nonce = secrets.token_bytes(NONCE_LENGTH)
        self._memory = ArenaMemory(tenant, size, directory, group)
        self.path = self._memory.path
        self.segment = self._memory.segment
        self._mmap = self._memory.mmap
        self.view = memoryview(self._mmap)
        self._pages = Faulting(self._memory, size, eager)
        self._window = self._pages.window
        # When a session of the tenant last needed the arena (time.monotonic()): the backend frees an
        # arena no namespace uses only once it is idle since before the census's sweep.
        self.last_used = time.monotonic()
        self._top = ARENA_HEADER
        # span -> free slot starts (a dict as an ordered set: the latest freed is taken first, and a
        # slot under the falling bump pointer is removed in O(1)).
        self._free: dict[int, dict[int, None]] = {}
        self._free_ends: dict[int, int] = {}  # free slot end -> its start: the bump pointer's way down
        self._free_bytes = 0
        self.slots_in_use = 0
        # Free slots whose pages are still held: start -> (span, when freed), oldest first; and free
        # slots whose pages were given back (reserved and touched again when handed out).
        self._give_back = give_back
        self._floor = self._pages.eager  # pages below it are never given back
        # Two generations, start -> span: freed in the current period, and in the one before (given
        # back when the current one ends, if still free).
        self._idle: dict[int, int] = {}
        self._idle_old: dict[int, int] = {}
        self._frees = 0
        self._period_ends = 0.0  # the first check starts the first period
        self._top_high = ARENA_HEADER  # the highest the bump pointer reached this period
        self._given_back: set[int] = set()
        self.give_back_age_s = GIVE_BACK_AGE_S
        self.given_back_bytes = 0  # released over the arena's life (a figure for tests and soaks)
        self._base = pages.base_address(self._mmap)
        if not self._pages.fault(ARENA_HEADER):
            self.close()
            raise OSError(f"cannot reserve the first pages of the arena in {directory}")
        PREFAULTER.watch(self)
        write_header(self.view, self.nonce)

    @property
    def shared(self) -> bool:
        return self.path is not None

    @property
    def faulted_bytes(self) -> int:
        return self._pages.faulted

    @property
    def eager(self) -> int:
        """Bytes prefaulted up front, whatever is used (the pool's first arena)."""
        return self._pages.eager

    # -- slots -----------------------------------------------------------------

    @staticmethod
    def span_for(length: int) -> int:
        return span_for(length)

    def allocate(self, length: int, generation: int) -> Slot | None:
        """A slot for `length` bytes stamped with `generation`, or None when the arena has no room
        (the caller evicts and retries)."""
        span = self.span_for(length)
        start = self._take(span)
        if start is None:
            return None
        write_generation(self._mmap, start + SLOT_HEADER, generation)
        self.slots_in_use += 1
        if self._pages.faulted < self._top + self._window // 2 and self._pages.faulted < self.size:
            PREFAULTER.kick()
        return Slot(start + SLOT_HEADER, length, span, generation)

    def allocate_many(self, length: int, generations: Sequence[int]) -> list[Slot]:
        """allocate() for several values of one length (its span and prefault check computed once);
        fewer slots than generations when the arena runs out of room."""
        span = self.span_for(length)
        take, stamp, memory = self._take, write_generation, self._mmap
        slots: list[Slot] = []
        for generation in generations:
            start = take(span)
            if start is None:
                break
            stamp(memory, start + SLOT_HEADER, generation)
            slots.append(Slot(start + SLOT_HEADER, length, span, generation))
        self.slots_in_use += len(slots)
        if slots and self._pages.faulted < self._top + self._window // 2 and self._pages.faulted < self.size:
            PREFAULTER.kick()
        return slots

    def free(self, slot: Slot) -> None:
        """Return a slot. Its bytes and generation stay until it is handed out again or its pages are
        given back (a reader then sees generation 0 and drops its copy)."""
        self.slots_in_use -= 1
        start, span = slot.start, slot.span
        if start + span == self._top:
            if self._give_back:
                self._forget(start, start + span)
            self._lower_top(start)
            return
        starts = self._free.get(span)
        if starts is None:
            starts = self._free[span] = {}
        starts[start] = None
        self._free_ends[start + span] = start
        self._free_bytes += span
        if self._give_back:
            if span >= PAGE and start + span > self._floor:
                self._idle[start] = span
            self._frees += 1
            if not self._frees % FREES_PER_CHECK:
                self.release_idle()

    def _unfree(self, start: int, span: int) -> bool:
        """Take a free slot out of the free tables; True when its pages were given back."""
        starts = self._free[span]
        del starts[start]
        if not starts:
            del self._free[span]
        del self._free_ends[start + span]
        self._free_bytes -= span
        if self._idle.pop(start, None) is not None or self._idle_old.pop(start, None) is not None:
            return False
        if start in self._given_back:
            self._given_back.discard(start)
            return True
        return False

    def _lower_top(self, top: int) -> None:
        """The slot ending at the bump pointer is free: move the pointer down to `top`, then over every
        free slot right below it. The pages beyond the prefault window above it are given back at the
        end of a period in which the pointer stayed low (_shrink): a pointer that falls and climbs
        again within a period would otherwise have its puts touch those pages anew."""
        if self._top > self._top_high:
            self._top_high = self._top
        lowest_hole = self._pages.faulted
        while (below := self._free_ends.get(top)) is not None:
            if self._unfree(below, top - below):
                lowest_hole = below
            elif self._give_back:
                self._forget(below, top)
            top = below
        self._top = top
        if lowest_hole >= self._pages.faulted:
            return
        # A given-back slot now above the pointer is a hole in the touched prefix: the prefix ends
        # below it, and the window is touched again from there. The pages above stay held until
        # _shrink.
        self._pages.lower_to(max(self._floor, _round_down(lowest_hole, PAGE)))
        if self._pages.closed:
            return
        if self._pages.faulted < top + self._window // 2:
            PREFAULTER.kick()

    def _shrink(self) -> None:
        """Give back the pages beyond the prefault window above the highest the bump pointer reached
        in the period now ending. Caller: release_idle, under the backend's lock."""
        high = max(self._top_high, self._top)
        self._top_high = self._top
        keep = max(self._floor, round_up(high + self._window, EXTENT))
        if self._pages.held <= keep + 2 * EXTENT:  # hysteresis: a few extents are not worth a syscall
            return
        self.given_back_bytes += self._pages.release_above(keep, self._base)

    def release_idle(self, now: float | None = None) -> None:
        """At the end of a period, give back the pages of the slots free since the one before, adjacent
        ones merged so the pages they share go too. Runs under the backend's lock (free() calls it
        every FREES_PER_CHECK frees)."""
        now = time.monotonic() if now is None else now
        if now < self._period_ends:
            return
        old, self._idle_old, self._idle = self._idle_old, self._idle, {}
        self._period_ends = now + self.give_back_age_s
        self._shrink()
        if not old:
            return
        merged: list[list[int]] = []
        for start in sorted(old):
            end = start + old[start]
            self._given_back.add(start)
            self._forget(start, end)
            if merged and merged[-1][1] == start:
                merged[-1][1] = end
            else:
                merged.append([start, end])
        for start, end in merged:
            low, high = round_up(max(start, self._floor), PAGE), _round_down(end, PAGE)
            if high > low and pages.remove_pages(self._base, low, high - low):
                self.given_back_bytes += high - low

    def _forget(self, start: int, end: int) -> None:
        """Zero the slot's head (FORGET_HEAD, or its whole first page) before its pages are given back."""
        stop = min(end, max(start + FORGET_HEAD, round_up(start + 1, PAGE)))
        self.view[start:stop] = _ZEROS[: stop - start]

    def _take_back(self, start: int, span: int) -> bool:
        """Reserve and touch again the pages of a slot whose pages were given back; False (the slot
        then stays free, its pages given back) when the file system is full."""
        low, high = _round_down(start, PAGE), round_up(start + span, PAGE)
        if self._pages.reserve_and_touch(low, high):
            return True
        self._free.setdefault(span, {})[start] = None
        self._free_ends[start + span] = start
        self._free_bytes += span
        self._given_back.add(start)
        return False

    def generation(self, offset: int) -> int:
        return read_generation(self._mmap, offset)

    def _take(self, span: int) -> int | None:
        starts = self._free.get(span)
        if starts:
            start = starts.popitem()[0]  # the latest freed: its pages are the likeliest still held
            if not starts:
                del self._free[span]
            del self._free_ends[start + span]
            self._free_bytes -= span
            if (
                self._idle.pop(start, None) is not None
                or self._idle_old.pop(start, None) is not None
                or start not in self._given_back
            ):
                return start
            self._given_back.discard(start)
            if self._take_back(start, span):
                return start
        if self._top + span <= self.size and self._pages.fault(self._top + span):
            start = self._top
            self._top += span
            return start
        if self._free_bytes >= span:
            return self._take_coalesced(span)
        return None

    def _take_coalesced(self, span: int) -> int | None:
        """Slow path for mixed sizes: merge adjacent free slots, lower the bump pointer over free space
        at the top, and cut `span` out of the first free range large enough. A merged range counts as
        given back if any of its slots was (taking it reserves and touches its pages again), else as
        idle since its latest slot was freed."""
        given = self._given_back
        ranges = sorted(
            (start, start + size, start in given) for size, starts in self._free.items() for start in starts
        )
        merged: list[list[Any]] = []
        for start, end, given_back in ranges:
            if merged and merged[-1][1] == start:
                last = merged[-1]
                last[1], last[2] = end, last[2] or given_back
            else:
                merged.append([start, end, given_back])
        self._free, self._free_ends, self._free_bytes = {}, {}, 0
        self._idle, self._idle_old, self._given_back = {}, {}, set()
        if merged and merged[-1][1] == self._top:
            self._restore(*merged.pop())  # _lower_top moves the pointer over it, given back or not
            self._lower_top(self._top)
        found: int | None = None
        found_given_back = False
        for start, end, given_back in merged:
            if found is None and end - start >= span:
                found, found_given_back = start, given_back
                start += span
            if end > start:
                self._restore(start, end, given_back)
        if found is not None and found_given_back:
            low, high = _round_down(found, PAGE), round_up(found + span, PAGE)
            if not self._pages.reserve_and_touch(low, high):
                self._restore(found, found + span, True)
                return None
        if found is None and self._top + span <= self.size and self._pages.fault(self._top + span):
            found = self._top
            self._top += span
        return found

    def _restore(self, start: int, end: int, given_back: bool) -> None:
        """Put a free range back in the free tables (coalescing rebuilds them; a range whose pages are
        held counts as freed in the current period)."""
        span = end - start
        self._free.setdefault(span, {})[start] = None
        self._free_ends[end] = start
        self._free_bytes += span
        if given_back:
            self._given_back.add(start)
        elif self._give_back and span >= PAGE and end > self._floor:
            self._idle[start] = span

    # -- prefault (faulting.py) -------------------------------------------------

    def wants_prefault(self) -> bool:
        return self._pages.wants_prefault(self._top)

    def prefault_ahead(self) -> None:
        """Touch the eager pages, then the window above the bump pointer (the prefault thread)."""
        self._pages.prefault_ahead(self._top)

    def prefault_eager(self, threads: int) -> bool:
        """Reserve and touch [faulted, eager) with `threads` threads (faulting.Faulting.prefault_eager)."""
        return self._pages.prefault_eager(threads)

    def close(self) -> None:
        self._pages.close()
        self._memory.close(self.view)
