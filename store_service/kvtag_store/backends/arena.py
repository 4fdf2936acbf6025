"""Value memory for the memory backend: one arena per tenant, in a shared-memory file when possible.

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
Pages are reserved (posix_fallocate) and touched by the service in extents ahead of use, never by a
client's put; a tmpfs that is full answers ENOSPC here instead of SIGBUS in a client.

Pages are given back too, or an arena would keep its high-water mark for good (mixed sizes push the
bump pointer to the arena's end while eviction moves blocks between arenas): freeing the top slot
lowers the bump pointer over every free slot below it, and pages more than the prefault window above
it are released; free slots' whole pages are released (MADV_REMOVE: a hole punched in the file, or in
anonymous shared memory) once they have stayed free a while, and reserved and touched again by the
service before the slot is handed out. Nothing below the up-front (eager) prefault is given back.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import mmap
import os
import secrets
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
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

log = logging.getLogger("kvtag_store.backends.arena")

# How far above the bump pointer pages are kept touched (by a background thread), so a put never
# waits for first-touch faults unless it outruns this window. Beyond it, an arena is touched up front
# to its `eager` size (the capacity its pool leaves it) from the moment it is created.
PREFAULT_WINDOW = 64 << 20
# The up-front (eager) prefault runs this many threads over disjoint chunks of this size: page
# zeroing is per-core work, so one thread leaves the other cores idle.
PREFAULT_THREADS = max(1, min(8, os.cpu_count() or 1))
PREFAULT_CHUNK = 32 << 20
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


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _round_down(n: int, to: int) -> int:
    return n // to * to


def populate_write(memory: mmap.mmap, start: int, length: int) -> None:
    """Map [start, start+length) writable in this process now: one madvise with the GIL released (the
    prefaulter runs beside the threads serving calls), or a write per page where the kernel lacks
    MADV_POPULATE_WRITE. `start` is page-aligned."""
    try:
        pages.populate_write(pages.base_address(memory), start, length)
    except OSError:
        zero = b"\0"
        for offset in range(start, start + length, mmap.PAGESIZE):
            memory[offset : offset + 1] = zero


def on_memory_file_system(fd: int) -> bool:
    """Whether the open file lives in a tmpfs (or hugetlbfs): there reserving its pages allocates
    them in memory, zeroed; on a disk file system it only reserves blocks."""
    device = os.fstat(fd).st_dev
    wanted = f"{os.major(device)}:{os.minor(device)}"
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and fields[2] == wanted and " - " in line:
                return line.split(" - ", 1)[1].split()[0] in ("tmpfs", "hugetlbfs")
    return False


def shared_memory_room(directory: str) -> int:
    """Bytes still free on the file system of `directory` (a container's /dev/shm is often 64 MiB)."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def remove_orphans(directory: str) -> int:
    """Delete arena files left by services that died without cleaning up (SIGKILL, OOM): their flock
    is gone. A live service, even in another container sharing the directory, holds its lock. Returns
    how many were removed."""
    removed = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if not entry.name.startswith("kvtag-") or not entry.is_file(follow_symlinks=False):
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held: a live service's arena
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    removed += 1
            finally:
                os.close(fd)
    if removed:
        log.warning("removed %d orphaned shared-memory arena file(s) from %s", removed, directory)
    return removed


def arena_size(capacity_bytes: int) -> int:
    """Virtual size of an arena for a store of `capacity_bytes` of values. Pages are only used as
    slots are carved, so the slack (room for slot headers and fragmentation) costs address space."""
    return _round_up(ARENA_HEADER + 2 * capacity_bytes + (16 << 20), EXTENT)


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
        self.path: str | None = None
        self.segment = "anon-" + secrets.token_hex(6)
        self._fd = -1
        self._in_memory_file = False
        if directory is not None:
            digest = hashlib.sha256(tenant.encode()).hexdigest()[:12]
            name = f"kvtag-{os.getpid()}-{secrets.token_hex(4)}-{digest}"
            path = str(Path(directory) / name)
            # Created under a name remove_orphans skips, locked, then renamed: no window in which
            # another starting service could take it for an orphan.
            hidden = str(Path(directory) / f".{name}")
            self._fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                # Held for the service's lifetime: a file nobody holds is an orphan (remove_orphans).
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if group is not None:
                    os.fchown(self._fd, -1, group)
                os.fchmod(self._fd, 0o600 if group is None else 0o660)  # whatever the umask
                os.ftruncate(self._fd, size)
                self._mmap = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED)
                os.rename(hidden, path)
            except BaseException:
                os.close(self._fd)
                os.unlink(hidden)
                raise
            self.path = path
            self.segment = name
            self._in_memory_file = on_memory_file_system(self._fd)
        else:
            self._mmap = mmap.mmap(-1, size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        self.view = memoryview(self._mmap)
        self._faulted = 0
        # A small store does not need 64 MiB touched ahead (the arena is about twice the capacity).
        self._window = min(PREFAULT_WINDOW, max(EXTENT, size // 4))
        self._eager = min(size, _round_up(eager, EXTENT))
        self._fault_lock = threading.Lock()
        # Chunks being touched without the fault lock (prefault_eager); close() waits for them, so the
        # mapping and the file descriptor outlive every call on them.
        self._touching = 0
        self._untouched = threading.Condition(self._fault_lock)
        self._closed = False
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
        self._floor = self._eager  # pages below it are never given back
        # Two generations, start -> span: freed in the current period, and in the one before (given
        # back when the current one ends, if still free).
        self._idle: dict[int, int] = {}
        self._idle_old: dict[int, int] = {}
        self._frees = 0
        self._period_ends = 0.0  # the first check starts the first period
        self._top_high = ARENA_HEADER  # the highest the bump pointer reached this period
        self._held_end = 0  # touched pages may reach this far above the touched prefix
        self._given_back: set[int] = set()
        self.give_back_age_s = GIVE_BACK_AGE_S
        self.given_back_bytes = 0  # released over the arena's life (a figure for tests and soaks)
        self._base = pages.base_address(self._mmap)
        if not self._fault(ARENA_HEADER):
            self.close()
            raise OSError(f"cannot reserve the first pages of the arena in {directory}")
        PREFAULTER.watch(self)
        write_header(self.view, self.nonce)

    @property
    def shared(self) -> bool:
        return self.path is not None

    @property
    def faulted_bytes(self) -> int:
        return self._faulted

    @property
    def eager(self) -> int:
        """Bytes prefaulted up front, whatever is used (the pool's first arena)."""
        return self._eager

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
        if self._faulted < self._top + self._window // 2 and self._faulted < self.size:
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
        if slots and self._faulted < self._top + self._window // 2 and self._faulted < self.size:
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
        lowest_hole = self._faulted
        while (below := self._free_ends.get(top)) is not None:
            if self._unfree(below, top - below):
                lowest_hole = below
            elif self._give_back:
                self._forget(below, top)
            top = below
        self._top = top
        if lowest_hole >= self._faulted:
            return
        with self._fault_lock:
            if self._closed:
                return
            # A given-back slot now above the pointer is a hole in the touched prefix: the prefix
            # ends below it, and the window is touched again from there. The pages above stay held
            # until _shrink.
            end = max(self._floor, _round_down(lowest_hole, PAGE))
            if end < self._faulted:
                self._held_end = max(self._held_end, self._faulted)
                self._faulted = end
                pages.publish_faulted(self._mmap, end)
        if self._faulted < top + self._window // 2:
            PREFAULTER.kick()

    def _shrink(self) -> None:
        """Give back the pages beyond the prefault window above the highest the bump pointer reached
        in the period now ending. Caller: release_idle, under the backend's lock."""
        high = max(self._top_high, self._top)
        self._top_high = self._top
        keep = max(self._floor, _round_up(high + self._window, EXTENT))
        held = max(self._faulted, self._held_end)
        if held <= keep + 2 * EXTENT:  # hysteresis: a few extents are not worth a syscall and a refault
            return
        with self._fault_lock:
            if self._closed:
                return
            held = max(self._faulted, self._held_end)
            if pages.remove_pages(self._base, keep, held - keep):
                self.given_back_bytes += held - keep
                self._held_end = 0
                if self._faulted > keep:
                    self._faulted = keep
                    pages.publish_faulted(self._mmap, keep)

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
            low, high = _round_up(max(start, self._floor), PAGE), _round_down(end, PAGE)
            if high > low and pages.remove_pages(self._base, low, high - low):
                self.given_back_bytes += high - low

    def _forget(self, start: int, end: int) -> None:
        """Zero the slot's head (FORGET_HEAD, or its whole first page) before its pages are given back."""
        stop = min(end, max(start + FORGET_HEAD, _round_up(start + 1, PAGE)))
        self.view[start:stop] = _ZEROS[: stop - start]

    def _take_back(self, start: int, span: int) -> bool:
        """Reserve and touch again the pages of a slot whose pages were given back; False (the slot
        then stays free, its pages given back) when the file system is full."""
        low, high = _round_down(start, PAGE), _round_up(start + span, PAGE)
        if self._reserve_and_touch(low, high):
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
        if self._top + span <= self.size and self._fault(self._top + span):
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
            low, high = _round_down(found, PAGE), _round_up(found + span, PAGE)
            if not self._reserve_and_touch(low, high):
                self._restore(found, found + span, True)
                return None
        if found is None and self._top + span <= self.size and self._fault(self._top + span):
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

    def _fault(self, end: int) -> bool:
        """Reserve and touch pages up to `end` (in whole extents); False when the file system is full.
        Usually a no-op: prefault_ahead() keeps a window of touched pages above the bump pointer."""
        if end <= self._faulted:  # the common case: no lock (the prefaulter may hold it for ms)
            return True
        with self._fault_lock:
            while self._faulted < end:
                if not self._fault_extent():
                    return False
            return True

    def prefault_ahead(self) -> None:
        """Touch pages up to the eager size (prefault_eager), then the prefault window above the bump
        pointer an extent at a time, so puts find their slots faulted. Called from the prefault thread,
        outside the backend lock (the fault lock is taken per extent, so a put that outruns it waits one
        extent)."""
        if self._faulted < self._eager:
            self.prefault_eager(PREFAULT_THREADS)
        while not self._closed and self._faulted < max(self._eager, min(self.size, self._top + self._window)):
            with self._fault_lock:
                if self._closed or not self._fault_extent():
                    return

    def prefault_eager(self, threads: int) -> bool:
        """Reserve and touch [faulted, eager) with `threads` threads, each taking the next chunk in
        order; the touched prefix (`faulted_bytes`, published in the header) advances over finished
        chunks, so puts and mapping clients use the lower pages while the upper ones are still
        touched. False when the file system is full or the arena closed."""
        claim = threading.Lock()
        chunks = iter(range(self._faulted, self._eager, PREFAULT_CHUNK))
        done: dict[int, int] = {}  # finished chunks above the touched prefix: start -> end
        failed: list[int] = []

        def work() -> None:
            while True:
                with claim:
                    start = next(chunks, None)
                end = min(self._eager, start + PREFAULT_CHUNK) if start is not None else 0
                with self._fault_lock:
                    if start is None or failed or self._closed:
                        return
                    self._touching += 1
                # A tmpfs file's eager pages are only reserved here (allocated and zeroed),
                # not mapped into this process: that halves the work (docs/benchmarks.md), mapping
                # clients map them themselves, and the service's own first access to a page is a
                # minor fault, not a first touch.
                touched = self._reserve_and_touch(start, end, map_here=not self._in_memory_file)
                with self._fault_lock:
                    self._touching -= 1
                    self._untouched.notify_all()
                    if not touched:
                        failed.append(start)
                        return
                    done[start] = end
                    self._advance(done)

        workers = [
            threading.Thread(target=work, name=f"kvtag-prefault-{n}", daemon=True) for n in range(threads - 1)
        ]
        for worker in workers:
            worker.start()
        work()
        for worker in workers:
            worker.join()
        return not failed and not self._closed

    def _advance(self, done: dict[int, int]) -> None:
        """Move the touched prefix over finished chunks that reach it (a put may have moved it into one
        meanwhile, an extent at a time). Caller holds the fault lock."""
        moved = True
        while moved:
            moved = False
            for start, end in list(done.items()):
                if start <= self._faulted:
                    del done[start]
                    if end > self._faulted:
                        self._faulted = end
                        moved = True
        if not self._closed:
            pages.publish_faulted(self._mmap, self._faulted)

    def _reserve_and_touch(self, start: int, end: int, map_here: bool = True) -> bool:
        """Reserve [start, end) of the file and map its pages in this process (unless `map_here` is
        False: a file's pages then only exist), with no lock held (both calls release the GIL; a put
        faulting the same pages meanwhile is harmless). The caller counts itself in `_touching`, so
        close() waits."""
        if self._fd >= 0:
            try:
                os.posix_fallocate(self._fd, start, end - start)
            except OSError as exc:
                log.warning(
                    "shared-memory arena %s cannot grow to %d bytes (%s); evicting instead",
                    self.segment,
                    end,
                    exc,
                )
                return False
        if map_here:
            populate_write(self._mmap, start, end - start)
        return True

    def wants_prefault(self) -> bool:
        return self._faulted < max(self._eager, min(self.size, self._top + self._window // 2))

    def _fault_extent(self) -> bool:
        """One more extent reserved (posix_fallocate: ENOSPC here, not SIGBUS later) and its pages
        mapped in this process. Caller holds the fault lock."""
        start = self._faulted
        end = min(self.size, start + EXTENT)
        if start >= end or not self._reserve_and_touch(start, end):
            return False
        self._faulted = end
        pages.publish_faulted(self._mmap, end)
        return True

    def close(self) -> None:
        with self._fault_lock:
            self._closed = True
            while self._touching:
                self._untouched.wait()
        with contextlib.suppress(BufferError, ValueError):
            self.view.release()
            self._mmap.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class _Prefaulter:
    """One daemon thread per process that keeps every open arena's prefault window touched. Arenas
    are held weakly; allocate() kicks it when a window runs low."""

    def __init__(self) -> None:
        self._arenas: weakref.WeakSet[Arena] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._kick = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, arena: Arena) -> None:
        with self._lock:
            self._arenas.add(arena)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvtag-prefault", daemon=True)
                self._thread.start()
        self._kick.set()

    def kick(self) -> None:
        self._kick.set()

    def _run(self) -> None:
        while True:
            self._kick.wait(1.0)
            self._kick.clear()
            with self._lock:
                arenas = list(self._arenas)
            for arena in arenas:
                try:
                    if arena.wants_prefault():
                        arena.prefault_ahead()
                except Exception:  # a closed or broken arena must not stop the others' prefaulting
                    log.exception("prefaulting arena %s failed", arena.segment)
            del arenas


PREFAULTER = _Prefaulter()
