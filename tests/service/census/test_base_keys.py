"""The base-key index behind cross-mode miss counts: who stored a block, bounded, per address."""

from __future__ import annotations

from kvtag_store.policy.base_keys import BaseKeyIndex


def test_a_miss_counts_the_first_other_mode_that_stored_the_block() -> None:
    index = BaseKeyIndex(100)
    index.record("ns-a", "m-1", [(0, b"k1"), (0, b"k2")])
    index.record("ns-a", "m-2", [(0, b"k2")])
    index.record("ns-a", "m-2", [(0, b"k2")])  # again: held once

    assert index.other_holders("ns-a", "m-3", [(0, b"k1"), (0, b"k2"), (0, b"k3")]) == {"m-1": 2}
    assert index.other_holders("ns-a", "m-1", [(0, b"k1"), (0, b"k2")]) == {"m-2": 1}
    assert index.other_holders("ns-a", "m-2", [(0, b"k1"), (0, b"k2")]) == {"m-1": 2}
    assert len(index) == 2


def test_namespace_and_group_are_part_of_the_address() -> None:
    index = BaseKeyIndex(100)
    index.record("ns-a", "m-1", [(0, b"k")])

    assert index.other_holders("ns-b", "m-2", [(0, b"k")]) == {}
    assert index.other_holders("ns-a", "m-2", [(1, b"k")]) == {}
    assert index.other_holders("ns-a", "m-2", [(0, b"k")]) == {"m-1": 1}


def test_the_oldest_entries_leave_first_past_the_bound() -> None:
    index = BaseKeyIndex(3)
    index.record("ns", "m-1", [(0, bytes([i])) for i in range(5)])

    assert len(index) == 3
    held = index.other_holders("ns", "m-2", [(0, bytes([i])) for i in range(5)])
    assert held == {"m-1": 3}
    assert index.other_holders("ns", "m-2", [(0, b"\x00"), (0, b"\x01")]) == {}
