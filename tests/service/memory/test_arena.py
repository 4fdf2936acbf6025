"""The arena's slot allocator: slots never overlap, reuse changes the generation word, mixed sizes
coalesce, and a full arena says so instead of overlapping; arena files are private and cleaned up."""

from __future__ import annotations

import itertools
import os
import random
import stat
import tempfile
from pathlib import Path

from kvtag_proto.arena_layout import ARENA_HEADER, EXTENT, FAULTED_OFFSET
from kvtag_proto.pages import faulted as pages_faulted
from kvtag_store.backends.memory import MemoryBackend
from kvtag_store.backends.shm.arena import Arena, Slot
from kvtag_store.backends.shm.files import remove_orphans

from tests.net import wait_until


def assert_disjoint(arena: Arena, used: list[Slot]) -> None:
    """Used and free slots never overlap, and none lies above the bump pointer. Reads the arena's free
    lists and bump pointer: the allocator's own invariant, which no public call exposes."""
    free = [(start, start + span) for span, starts in arena._free.items() for start in starts]
    spans = sorted([(s.start, s.start + s.span) for s in used] + free)
    for before, after in itertools.pairwise(spans):
        assert after[0] >= before[1], f"slots overlap: {before} and {after}"
    assert all(end <= arena._top for _, end in spans), "a slot lies above the bump pointer"


def test_random_allocations_never_overlap_and_reuse_changes_the_generation() -> None:
    arena = Arena("", 4 * EXTENT, None)
    rng = random.Random(7)
    live: list[Slot] = []
    generation = 0
    seen: dict[int, int] = {}  # slot start -> generation last handed out there
    try:
        for _ in range(3000):
            if live and (rng.random() < 0.45 or len(live) > 200):
                arena.free(live.pop(rng.randrange(len(live))))
                continue
            generation += 1
            slot = arena.allocate(
                rng.choice([1, 100, 4096, 65536, 70000, rng.randrange(1, 200_000)]), generation
            )
            if slot is None:
                continue
            assert slot.offset % 64 == 0 and slot.offset >= ARENA_HEADER
            assert arena.generation(slot.offset) == generation
            if slot.start in seen:
                assert seen[slot.start] != generation, "a reused slot must carry a new generation"
            seen[slot.start] = generation
            live.append(slot)
            assert_disjoint(arena, live)
        assert arena.slots_in_use == len(live)
    finally:
        arena.close()


def test_a_full_arena_refuses_then_coalesced_free_space_serves_a_larger_slot() -> None:
    arena = Arena("", EXTENT, None)
    try:
        small: list[Slot] = []
        while (slot := arena.allocate(4000, len(small) + 1)) is not None:
            small.append(slot)
        assert arena.allocate(4000, 10_000) is None
        for slot in small[10:20]:  # ten adjacent small slots
            arena.free(slot)
        big = arena.allocate(9 * 4000, 20_000)
        assert big is not None
        assert_disjoint(arena, [*small[:10], *small[20:], big])
    finally:
        arena.close()


def test_allocate_many_takes_freed_slots_then_fresh_ones_and_stops_when_the_arena_is_full() -> None:
    arena = Arena("", EXTENT, None)
    first = arena.allocate_many(100_000, range(1, 6))
    assert [s.generation for s in first] == [1, 2, 3, 4, 5]
    arena.free(first[1])
    again = arena.allocate_many(100_000, range(10, 10_000))  # more than fit
    assert again[0].start == first[1].start  # the freed slot first, with its new generation
    assert arena.generation(again[0].offset) == 10
    assert 0 < len(again) < 9_990 and arena.slots_in_use == 4 + len(again)
    try:
        assert_disjoint(arena, [*first[:1], *first[2:], *again])
        assert arena.allocate(100_000, 1) is None
    finally:
        arena.close()


def test_arena_files_are_private_and_orphans_are_removed(tmp_path: Path) -> None:
    arena = Arena("tenant-a", 2 * EXTENT, str(tmp_path))
    assert arena.path is not None
    mode = stat.S_IMODE(os.stat(arena.path).st_mode)
    assert mode == 0o600
    assert remove_orphans(str(tmp_path)) == 0, "a live arena's file is locked, never an orphan"
    orphan = tmp_path / "kvtag-1-deadbeef-000000000000"
    orphan.write_bytes(b"left by a killed service")
    assert remove_orphans(str(tmp_path)) == 1
    assert not orphan.exists() and Path(arena.path).exists()
    arena.close()
    assert not Path(arena.path).exists()


def test_an_arena_touches_its_eager_size_up_front_and_publishes_how_far(tmp_path: Path) -> None:
    """A filling store's puts must find their pages ready: the prefaulter touches the eager size from
    the start, with nothing allocated, and the header's faulted word tells clients how far it got."""
    arena = Arena("eager", 16 * EXTENT, str(tmp_path), eager=6 * EXTENT)
    lazy = Arena("lazy", 16 * EXTENT, str(tmp_path))
    try:
        wait_until(lambda: arena.faulted_bytes >= 6 * EXTENT, 20, "the eager extents")
        word = int.from_bytes(arena.view[FAULTED_OFFSET : FAULTED_OFFSET + 8], "little")
        assert word == arena.faulted_bytes
        # Reserved (allocated in the file system) but not mapped here: mapping clients map the pages
        # themselves, and the service's own first access to one is a minor fault.
        assert arena.path is not None and os.stat(arena.path).st_blocks * 512 >= 6 * EXTENT
        # Without an eager size only the window above the (unused) bump pointer is touched.
        wait_until(lambda: not lazy.wants_prefault(), 20, "the lazy window")
        assert lazy.faulted_bytes <= 16 * EXTENT // 4 + EXTENT  # its window (a quarter) and the header
    finally:
        arena.close()
        lazy.close()


def test_the_memory_backend_prefaults_each_pools_capacity_once(tmp_path: Path) -> None:
    """Eager prefaulting never commits more memory than the capacities add up to: the first arena of
    a pool takes the pool's capacity, later arenas of that pool only their window."""
    capacity, quota = 24 * EXTENT, 8 * EXTENT
    backend = MemoryBackend(capacity, tenant_quotas={"q": quota}, shm_dir=str(tmp_path))
    try:
        tenants = ["first", "second", "q"]
        for n, tenant in enumerate(tenants):
            backend.assign_tenant(f"ns-{n}", tenant)
        arenas: dict[str, Arena] = {}
        for n, tenant in enumerate(tenants):
            arena = backend.shared_arena(f"ns-{n}")
            assert arena is not None, f"tenant {tenant!r}'s values live in a shared-memory file"
            arenas[tenant] = arena
        wait_until(
            lambda: (
                arenas["first"].faulted_bytes >= capacity - quota
                and arenas["q"].faulted_bytes >= quota
                and not arenas["second"].wants_prefault()
            ),
            30,
            "each pool's eager prefault",
        )
        assert arenas["second"].faulted_bytes < capacity - quota
        assert arenas["first"].faulted_bytes < capacity, "only the shared pool's share, not the quota's"
    finally:
        backend.close()


def test_an_arena_in_tmpfs_reserves_its_eager_pages_and_a_fresh_mapping_reads_them_as_zeros() -> None:
    """In a tmpfs the up-front prefault only reserves the pages (allocated and zeroed there, not
    mapped into the service): the file holds them, the faulted word says so, and they read as zeros."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        arena = Arena("eager", 16 * EXTENT, directory, eager=6 * EXTENT)
        try:
            wait_until(lambda: arena.faulted_bytes >= 6 * EXTENT, 20, "the eager extents")
            assert arena.path is not None and os.stat(arena.path).st_blocks * 512 >= 6 * EXTENT
            assert pages_faulted(arena.view) == arena.faulted_bytes
            slot = arena.allocate(EXTENT, 1)
            assert slot is not None and arena.generation(slot.offset) == 1
            assert bytes(arena.view[slot.offset + EXTENT - 8 : slot.offset + EXTENT]) == bytes(8)
        finally:
            arena.close()
