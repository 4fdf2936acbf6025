"""An arena gives freed slots' pages back: the bump pointer falls when the top slot is freed, pages
beyond the prefault window go, and long-free slots' pages are released, while the bytes of every
slot in use stay exactly as written and a slot handed out again is backed (reserved) first."""

from __future__ import annotations

import os
import random
import tempfile
import time

from kvtag_proto.arena_layout import EXTENT
from kvtag_store.backends.shm.arena import PAGE, Arena, Slot

from tests.net import wait_until
from tests.service.memory.test_arena import assert_disjoint


def file_bytes(arena: Arena) -> int:
    """Bytes the arena's tmpfs file holds in memory (its allocated blocks)."""
    assert arena.path is not None
    return os.stat(arena.path).st_blocks * 512


def fill(arena: Arena, slot: Slot) -> None:
    arena.view[slot.offset : slot.offset + slot.length] = bytes([slot.generation % 251]) * slot.length


def intact(arena: Arena, slot: Slot) -> bool:
    return bytes(arena.view[slot.offset : slot.offset + slot.length]) == bytes([slot.generation % 251]) * (
        slot.length
    )


def allocate(arena: Arena, length: int, count: int, first_generation: int = 1) -> list[Slot]:
    slots = [arena.allocate(length, first_generation + n) for n in range(count)]
    assert all(slot is not None for slot in slots), "the arena ran out of room"
    return [slot for slot in slots if slot is not None]


def test_freeing_the_top_slots_lowers_the_bump_pointer_and_gives_pages_beyond_the_window_back() -> None:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        arena = Arena("t", 64 * EXTENT, directory)  # window: 16 extents (a quarter of the size)
        window = 16 * EXTENT
        try:
            slots = allocate(arena, 1 << 20, 48)
            wait_until(
                lambda: arena.faulted_bytes >= min(arena.size, arena._top + window // 2),
                10,
                "the prefault window",
            )
            held = file_bytes(arena)
            assert held >= 48 << 20
            now = time.monotonic()
            arena.release_idle(now)  # a period starts
            for slot in reversed(slots[8:]):  # the top 40 MiB, top slot first
                arena.free(slot)
            assert arena._top == slots[8].start, "the bump pointer must fall to the highest slot in use"
            assert not arena._free, "slots under the falling pointer must leave the free lists"
            arena.release_idle(now + 1.0)  # the pointer was high in this period: pages kept
            assert arena.given_back_bytes == 0 and file_bytes(arena) >= held - EXTENT
            arena.release_idle(now + 2.0)  # low for a whole period: pages beyond the window go
            # What stays: 8 MiB in use plus the window above the pointer, in whole extents.
            assert arena.faulted_bytes <= slots[8].start + window + EXTENT
            assert file_bytes(arena) <= held - (16 << 20), f"{held} -> {file_bytes(arena)} bytes"
            assert arena.given_back_bytes >= 16 << 20
            assert all(arena.generation(slot.offset) == slot.generation for slot in slots[:8])
            # The pointer climbs again over pages the arena reserves and touches anew.
            again = allocate(arena, 1 << 20, 40, 100)
            assert arena.faulted_bytes >= again[-1].offset + (1 << 20)
            assert file_bytes(arena) >= again[-1].offset + (1 << 20)
        finally:
            arena.close()


def settled(arena: Arena) -> bool:
    """The arena's touched pages did not grow over 0.3 s."""
    faulted = arena.faulted_bytes
    time.sleep(0.3)
    return arena.faulted_bytes == faulted


def test_slots_free_for_a_while_give_their_pages_back_and_are_backed_again_when_handed_out() -> None:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        arena = Arena("t", 64 * EXTENT, directory)
        try:
            slots: list[Slot] = []
            for n in range(12):
                slot = arena.allocate(512 << 10, n + 1)
                assert slot is not None
                fill(arena, slot)
                slots.append(slot)
            wait_until(lambda: arena.faulted_bytes >= arena._top + 8 * EXTENT, 10, "the prefault window")
            # ...and the prefault thread at rest, so no page it touches later offsets the give-back measured
            # below (measuring while it still ran failed a CI rehearsal).
            wait_until(lambda: settled(arena), 10, "the prefault thread at rest")
            before = file_bytes(arena)
            freed = [*slots[2:10:2], slots[1]]  # none at the top
            now = time.monotonic()
            arena.release_idle(now)  # a period starts: these slots are free from its start
            for slot in freed:
                arena.free(slot)
            arena.release_idle(now + 0.5)  # not yet a period (1 s) on: nothing goes
            assert arena.given_back_bytes == 0, "a slot free for less than a period keeps its pages"
            arena.release_idle(now + 1.0)  # they were freed in the period before: still held
            assert arena.given_back_bytes == 0
            arena.release_idle(now + 2.0)  # free a whole period since: given back
            assert arena.given_back_bytes >= 5 * (512 << 10) - 5 * 2 * PAGE
            assert file_bytes(arena) <= before - (1 << 20)
            for slot in freed:
                assert arena.generation(slot.offset) == 0, "a given-back slot's generation must read 0"
            for slot in [slots[0], *slots[3:10:2], *slots[10:]]:
                assert intact(arena, slot), f"the slot at {slot.start} in use lost its bytes"
            # Handed out again: the same slots (exact span), reserved before the service writes.
            again = [arena.allocate(512 << 10, 100 + n) for n in range(5)]
            assert {s.start for s in again if s is not None} == {s.start for s in [*freed, slots[1]]}
            assert file_bytes(arena) >= before - 2 * PAGE
            for slot in again:
                assert slot is not None and arena.generation(slot.offset) == slot.generation
        finally:
            arena.close()


def test_random_churn_with_give_back_never_overlaps_nor_touches_the_bytes_of_slots_in_use() -> None:
    for directory in (None, "/dev/shm"):
        with tempfile.TemporaryDirectory(dir="/dev/shm") as scratch:
            arena = Arena("t", 8 * EXTENT, scratch if directory else None)
            arena.give_back_age_s = 0.0
            rng = random.Random(11)
            live: list[Slot] = []
            try:
                for n in range(3000):
                    if live and (rng.random() < 0.45 or len(live) > 120):
                        slot = live.pop(rng.randrange(len(live)))
                        assert intact(arena, slot), f"slot at {slot.start} changed while in use"
                        arena.free(slot)
                        continue
                    taken = arena.allocate(
                        rng.choice([100, 4096, 65536, 70000, rng.randrange(1, 300_000)]), n + 1
                    )
                    if taken is None:
                        continue
                    slot = taken
                    assert arena.generation(slot.offset) == slot.generation
                    fill(arena, slot)
                    live.append(slot)
                    if n % 50 == 0:
                        assert_disjoint(arena, live)
                assert arena.given_back_bytes > 0, "the churn should have given pages back"
                assert all(intact(arena, slot) for slot in live)
                assert arena.slots_in_use == len(live)
            finally:
                arena.close()


def test_an_arena_told_not_to_give_back_keeps_its_pages() -> None:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        arena = Arena("t", 32 * EXTENT, directory, give_back=False)
        try:
            slots = allocate(arena, 1 << 20, 30)
            held = file_bytes(arena)
            for slot in reversed(slots):
                arena.free(slot)
            assert arena.given_back_bytes == 0 and file_bytes(arena) >= held
        finally:
            arena.close()
