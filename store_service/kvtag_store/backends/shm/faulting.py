"""An arena's pages reserved and touched ahead of use, so neither a put nor a client's first access
pays a first-touch fault, and a full tmpfs answers ENOSPC here instead of SIGBUS in a client.

Pages are reserved (posix_fallocate) and touched in extents: up front to an arena's `eager` size
(the capacity its pool leaves it), then a window ahead of its bump pointer, by one background thread
per process (PREFAULTER). The touched prefix is published in the arena header's faulted word, so a
mapping client maps those pages into its own page tables as they appear.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import weakref
from typing import Protocol

from kvtag_proto import pages
from kvtag_proto.arena_layout import EXTENT

from kvtag_store.backends.shm.files import ArenaMemory

log = logging.getLogger("kvtag_store.backends.shm")

# How far above the bump pointer pages are kept touched (by a background thread), so a put never
# waits for first-touch faults unless it outruns this window. Beyond it, an arena is touched up front
# to its `eager` size (the capacity its pool leaves it) from the moment it is created.
PREFAULT_WINDOW = 64 << 20
# The up-front (eager) prefault runs this many threads over disjoint chunks of this size: page
# zeroing is per-core work, so one thread leaves the other cores idle.
PREFAULT_THREADS = max(1, min(8, os.cpu_count() or 1))
PREFAULT_CHUNK = 32 << 20


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


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


class Faulting:
    """The touched prefix of one arena's mapping: how far it reaches, the threads that extend it, and
    the pages above it still held until given back. `faulted` moves under the fault lock."""

    def __init__(self, memory: ArenaMemory, size: int, eager: int) -> None:
        self._memory = memory
        self._mmap = memory.mmap
        self.size = size
        self.faulted = 0
        # A small store does not need 64 MiB touched ahead (the arena is about twice the capacity).
        self.window = min(PREFAULT_WINDOW, max(EXTENT, size // 4))
        self.eager = min(size, round_up(eager, EXTENT))
        self.lock = threading.Lock()
        # Chunks being touched without the fault lock (prefault_eager); close() waits for them, so the
        # mapping and the file descriptor outlive every call on them.
        self._touching = 0
        self._untouched = threading.Condition(self.lock)
        self.closed = False
        self._held_end = 0  # touched pages may reach this far above the touched prefix

    @property
    def held(self) -> int:
        """Where the pages this process may hold end: the touched prefix or above it."""
        return max(self.faulted, self._held_end)

    def fault(self, end: int) -> bool:
        """Reserve and touch pages up to `end` (in whole extents); False when the file system is full.
        Usually a no-op: prefault_ahead() keeps a window of touched pages above the bump pointer."""
        if end <= self.faulted:  # the common case: no lock (the prefaulter may hold it for ms)
            return True
        with self.lock:
            while self.faulted < end:
                if not self._fault_extent():
                    return False
            return True

    def wants_prefault(self, top: int) -> bool:
        return self.faulted < max(self.eager, min(self.size, top + self.window // 2))

    def prefault_ahead(self, top: int) -> None:
        """Touch pages up to the eager size (prefault_eager), then the prefault window above the bump
        pointer `top` an extent at a time. Called from the prefault thread, outside the backend lock
        (the fault lock is taken per extent, so a put that outruns it waits one extent)."""
        if self.faulted < self.eager:
            self.prefault_eager(PREFAULT_THREADS)
        while not self.closed and self.faulted < max(self.eager, min(self.size, top + self.window)):
            with self.lock:
                if self.closed or not self._fault_extent():
                    return

    def prefault_eager(self, threads: int) -> bool:
        """Reserve and touch [faulted, eager) with `threads` threads, each taking the next chunk in
        order; the touched prefix (published in the header) advances over finished chunks, so puts
        and mapping clients use the lower pages while the upper ones are still touched. False when the
        file system is full or the arena closed."""
        claim = threading.Lock()
        chunks = iter(range(self.faulted, self.eager, PREFAULT_CHUNK))
        done: dict[int, int] = {}  # finished chunks above the touched prefix: start -> end
        failed: list[int] = []

        def work() -> None:
            while True:
                with claim:
                    start = next(chunks, None)
                end = min(self.eager, start + PREFAULT_CHUNK) if start is not None else 0
                with self.lock:
                    if start is None or failed or self.closed:
                        return
                    self._touching += 1
                # A tmpfs file's eager pages are only reserved here (allocated and zeroed),
                # not mapped into this process: that halves the work (docs/benchmarks.md), mapping
                # clients map them themselves, and the service's own first access to a page is a
                # minor fault, not a first touch.
                touched = self.reserve_and_touch(start, end, map_here=not self._memory.in_memory_file)
                with self.lock:
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
        return not failed and not self.closed

    def _advance(self, done: dict[int, int]) -> None:
        """Move the touched prefix over finished chunks that reach it (a put may have moved it into one
        meanwhile, an extent at a time). Caller holds the fault lock."""
        moved = True
        while moved:
            moved = False
            for start, end in list(done.items()):
                if start <= self.faulted:
                    del done[start]
                    if end > self.faulted:
                        self.faulted = end
                        moved = True
        if not self.closed:
            pages.publish_faulted(self._mmap, self.faulted)

    def reserve_and_touch(self, start: int, end: int, map_here: bool = True) -> bool:
        """Reserve [start, end) of the file and map its pages in this process (unless `map_here` is
        False: a file's pages then only exist), with no lock held (both calls release the GIL; a put
        faulting the same pages meanwhile is harmless). The prefault threads count themselves in
        `_touching`, so close() waits for them."""
        if self._memory.fd >= 0:
            try:
                os.posix_fallocate(self._memory.fd, start, end - start)
            except OSError as exc:
                log.warning(
                    "shared-memory arena %s cannot grow to %d bytes (%s); evicting instead",
                    self._memory.segment,
                    end,
                    exc,
                )
                return False
        if map_here:
            populate_write(self._mmap, start, end - start)
        return True

    def _fault_extent(self) -> bool:
        """One more extent reserved (posix_fallocate: ENOSPC here, not SIGBUS later) and its pages
        mapped in this process. Caller holds the fault lock."""
        start = self.faulted
        end = min(self.size, start + EXTENT)
        if start >= end or not self.reserve_and_touch(start, end):
            return False
        self.faulted = end
        pages.publish_faulted(self._mmap, end)
        return True

    def lower_to(self, end: int) -> None:
        """A hole was given back below the touched prefix: the prefix ends at `end` now (the pages above
        stay held until release_above). The window is touched again from there."""
        with self.lock:
            if self.closed:
                return
            if end < self.faulted:
                self._held_end = max(self._held_end, self.faulted)
                self.faulted = end
                pages.publish_faulted(self._mmap, end)

    def release_above(self, keep: int, base: int) -> int:
        """Give back every page held above `keep` (mapping at `base`); the bytes released."""
        with self.lock:
            if self.closed:
                return 0
            held = self.held
            if not pages.remove_pages(base, keep, held - keep):
                return 0
            self._held_end = 0
            if self.faulted > keep:
                self.faulted = keep
                pages.publish_faulted(self._mmap, keep)
            return held - keep

    def close(self) -> None:
        """No more touching: wait for the prefault threads still touching chunks."""
        with self.lock:
            self.closed = True
            while self._touching:
                self._untouched.wait()


class Prefaulted(Protocol):
    """What the prefault thread needs of an arena."""

    segment: str

    def wants_prefault(self) -> bool: ...

    def prefault_ahead(self) -> None: ...


class _Prefaulter:
    """One daemon thread per process that keeps every open arena's prefault window touched. Arenas
    are held weakly; allocate() kicks it when a window runs low."""

    def __init__(self) -> None:
        self._arenas: weakref.WeakSet[Prefaulted] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._kick = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, arena: Prefaulted) -> None:
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
