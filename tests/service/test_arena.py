"""The arena's slot allocator: slots never overlap, reuse changes the generation word, mixed sizes
coalesce, and a full arena says so instead of overlapping; arena files are private and cleaned up."""

from __future__ import annotations

import os
import random
import stat
from pathlib import Path

from kvtag_store.arena import ARENA_HEADER, EXTENT, Arena, Slot, remove_orphans


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
            arena.check_disjoint(live)
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
        arena.check_disjoint([*small[:10], *small[20:], big])
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
