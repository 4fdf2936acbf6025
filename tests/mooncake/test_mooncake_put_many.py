"""The batched put gives each item the outcome the single put would, from each item's stored header."""

from __future__ import annotations

import uuid

from kvtag_store.backends.base import BlockKey, KeyStatus, PutOutcome
from kvtag_store.backends.mooncake.backend import MooncakeBackend

MODE_A = "m-aaaaaaaaaaaaaaaa"
MODE_B = "m-bbbbbbbbbbbbbbbb"


def test_batched_put_reports_stored_present_conflict_and_rejected_per_item(
    mooncake_backend: MooncakeBackend,
) -> None:
    ns = "ns-" + uuid.uuid4().hex[:16]
    a, b, c = ((0, BlockKey(name)) for name in (b"a", b"b", b"c"))
    assert mooncake_backend.put(ns, MODE_A, a, b"old-a").outcome is PutOutcome.STORED
    assert mooncake_backend.put(ns, MODE_B, b, b"mode-b").outcome is PutOutcome.STORED
    huge = bytes(mooncake_backend.max_value_bytes + 1)
    outcomes = mooncake_backend.put_many(
        ns, MODE_A, [(a, b"new-a"), (b, b"mine"), (c, b"c-1"), (c, b"c-2"), ((0, BlockKey(b"huge")), huge)]
    )
    assert [r.outcome for r in outcomes] == [
        PutOutcome.ALREADY_PRESENT,
        PutOutcome.CONFLICT,
        PutOutcome.STORED,
        PutOutcome.ALREADY_PRESENT,
        PutOutcome.REJECTED,
    ]
    assert all(r.reason for r in (outcomes[1], outcomes[4]))
    results = mooncake_backend.get(ns, MODE_A, [a, b, c])
    assert [r.value for r in results] == [b"old-a", None, b"c-1"]
    assert results[1].status is KeyStatus.MODE_MISMATCH


def test_batched_put_larger_than_the_local_buffer_is_split_and_fully_stored(
    mooncake_backend: MooncakeBackend,
) -> None:
    ns = "ns-" + uuid.uuid4().hex[:16]
    value = bytes(1 << 20)
    items = [((0, BlockKey(f"k{i}".encode())), value) for i in range(24)]  # 24 MiB > a quarter of 32 MiB
    assert [r.outcome for r in mooncake_backend.put_many(ns, MODE_A, items)] == [PutOutcome.STORED] * 24
    assert mooncake_backend.lookup(ns, MODE_A, [a for a, _ in items]) == [KeyStatus.HIT] * 24
