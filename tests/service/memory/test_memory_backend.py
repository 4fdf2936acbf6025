"""Memory-backend specifics beyond the shared contract: atomic lookup+pin, eviction around leases."""

from __future__ import annotations

from kvtag_store.backends.base import BlockAddress, BlockKey, KeyStatus, PutOutcome
from kvtag_store.backends.memory import MemoryBackend


def a(name: str) -> BlockAddress:
    return (0, BlockKey(name.encode()))


def test_lookup_and_pin_pins_exactly_the_hits() -> None:
    backend = MemoryBackend(1000)
    backend.put("ns", "m", a("hit"), b"x" * 10)
    backend.put("ns", "other", a("theirs"), b"y" * 10)
    statuses, pinned = backend.lookup_and_pin("ns", "m", [a("hit"), a("miss"), a("theirs")])
    assert statuses == [KeyStatus.HIT, KeyStatus.MISS, KeyStatus.MODE_MISMATCH]
    assert list(pinned) == [a("hit")]
    assert backend.stats().leased_keys == 1
    backend.unpin("ns", pinned)
    assert backend.stats().leased_keys == 0


def test_eviction_skips_leased_blocks_and_takes_the_oldest_unleased() -> None:
    backend = MemoryBackend(300)
    for name in ("old-leased", "old", "newer"):
        assert backend.put("ns", "m", a(name), bytes(100)).outcome is PutOutcome.STORED
    backend.pin("ns", [a("old-leased")])
    assert backend.put("ns", "m", a("new"), bytes(100)).outcome is PutOutcome.STORED
    present = backend.lookup("ns", "m", [a("old-leased"), a("old"), a("newer"), a("new")])
    assert present == [KeyStatus.HIT, KeyStatus.MISS, KeyStatus.HIT, KeyStatus.HIT]
    assert (backend.stats().evictions, backend.stats().used_bytes) == (1, 300)


def test_a_put_that_cannot_fit_beside_leased_blocks_evicts_nothing() -> None:
    backend = MemoryBackend(300)
    backend.put("ns", "m", a("leased"), bytes(200))
    backend.put("ns", "m", a("free"), bytes(100))
    backend.pin("ns", [a("leased")])
    result = backend.put("ns", "m", a("big"), bytes(150))
    assert result.outcome is PutOutcome.REJECTED
    assert "200 of 300 bytes are leased" in result.reason
    assert backend.lookup("ns", "m", [a("free")]) == [KeyStatus.HIT]
    assert backend.stats().evictions == 0


def test_put_many_larger_than_one_lock_chunk_keeps_order_and_sees_earlier_items() -> None:
    backend = MemoryBackend(1 << 20)
    items = [(a(f"k{i}"), i.to_bytes(4, "big")) for i in range(2500)]
    items.append((a("k3"), b"later"))  # a repeat of an item two chunks earlier
    results = backend.put_many("ns", "m", items)
    assert [r.outcome for r in results] == [PutOutcome.STORED] * 2500 + [PutOutcome.ALREADY_PRESENT]
    read = backend.get("ns", "m", [a("k2499"), a("k3"), a("k0")])
    assert [r.value for r in read] == [(2499).to_bytes(4, "big"), (3).to_bytes(4, "big"), bytes(4)]
    assert backend.stats().keys == 2500
