"""The contract every BlockBackend + CensusStore pair fulfils, as a reusable test class.

Beyond BlockBackend, each capability a backend offers (backends.base.Capabilities:
TenantAware, AtomicLookup, PackedLookup, ViewReads, SharedMemoryBackend) is tested
through its Protocol; a test of a capability the backend does not offer is skipped.
The shared-memory tests also skip when the backend has no arena for the namespace
(it keeps or stages values in anonymous memory).

How to run it against a backend: subclass it in a test module and provide a
`backend` fixture that returns (BlockBackend, CensusStore). Nothing else is
needed; every test uses fresh namespace ids, so one long-lived backend (e.g.
a session-scoped Mooncake cluster) can serve all tests.

    from tests.contract.backend_contract import BackendContract

    class TestMyBackendContract(BackendContract):
        @pytest.fixture
        def backend(self) -> tuple[BlockBackend, CensusStore]:
            return MyBackend(...), MyCensus(...)

Optional hooks a subclass may override:
- `corrupt_stored_value(backend, namespace_id, address)`: damage the stored
  bytes of one block (an injected fault) so the checksum test runs; the
  default skips that test.
"""

from __future__ import annotations

import mmap
import uuid
from typing import TypeVar

import pytest
from kvtag_store.backends.base import (
    NO_RESERVATION,
    BlockAddress,
    BlockBackend,
    BlockKey,
    Capabilities,
    CensusStore,
    KeyStatus,
    ProbeRecord,
    PutOutcome,
    PutResult,
    SharedArena,
    SharedMemoryBackend,
    SlotReference,
)

Pair = tuple[BlockBackend, CensusStore]

MODE_A = "m-aaaaaaaaaaaaaaaa"
MODE_B = "m-bbbbbbbbbbbbbbbb"


def addr(name: str, group: int = 0) -> BlockAddress:
    return (group, BlockKey(name.encode()))


C = TypeVar("C")


def offered(capability: C | None, name: str) -> C:
    """The capability, or skip the test: the backend does not offer it."""
    if capability is None:
        pytest.skip(f"this backend does not offer {name}")
    return capability


def shared_arena(store: SharedMemoryBackend, namespace_id: str) -> SharedArena:
    arena = store.shared_arena(namespace_id)
    if arena is None or not arena.path:
        pytest.skip("this backend keeps no shared-memory arena a client could map for the namespace")
    return arena


class Mapping:
    """A same-host client's view of an arena: the file mapped, as the client library maps it."""

    def __init__(self, arena: SharedArena) -> None:
        assert arena.path is not None
        with open(arena.path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), arena.size)

    def write(self, slot: SlotReference, value: bytes) -> None:
        assert len(value) == slot.length
        self._map[slot.offset : slot.offset + len(value)] = value

    def read(self, slot: SlotReference) -> bytes:
        return self._map[slot.offset : slot.offset + slot.length]

    def close(self) -> None:
        self._map.close()


class BackendContract:
    """Behaviour shared by all backends. Subclasses supply the `backend` fixture."""

    @pytest.fixture
    def ns(self) -> str:
        """A namespace id no other test uses."""
        return "ns-contract-" + uuid.uuid4().hex[:12]

    def corrupt_stored_value(self, backend: BlockBackend, namespace_id: str, address: BlockAddress) -> None:
        pytest.skip("this backend offers no way to inject a corrupted value")

    # -- put / get ----------------------------------------------------------

    def test_stored_value_reads_back_identically_in_its_mode(self, backend: Pair, ns: str) -> None:
        store, _ = backend
        value = bytes(range(256)) * 64
        assert store.put(ns, MODE_A, addr("k"), value).outcome is PutOutcome.STORED
        [result] = store.get(ns, MODE_A, [addr("k")])
        assert result.status is KeyStatus.HIT
        assert result.value == value

    def test_missing_key_reads_as_miss_without_bytes(self, backend: Pair, ns: str) -> None:
        store, _ = backend
        [result] = store.get(ns, MODE_A, [addr("never-stored")])
        assert result.status is KeyStatus.MISS
        assert result.value is None

    def test_same_tag_put_is_idempotent_and_keeps_the_first_value(self, backend: Pair, ns: str) -> None:
        store, _ = backend
        assert store.put(ns, MODE_A, addr("k"), b"first").outcome is PutOutcome.STORED
        assert store.put(ns, MODE_A, addr("k"), b"second").outcome is PutOutcome.ALREADY_PRESENT
        [result] = store.get(ns, MODE_A, [addr("k")])
        assert result.value == b"first"

    def test_put_in_another_mode_conflicts_and_never_overwrites(self, backend: Pair, ns: str) -> None:
        store, _ = backend
        store.put(ns, MODE_A, addr("k"), b"mode-a-bytes")
        conflict = store.put(ns, MODE_B, addr("k"), b"mode-b-bytes")
        assert conflict.outcome is PutOutcome.CONFLICT
        [result] = store.get(ns, MODE_A, [addr("k")])
        assert result.status is KeyStatus.HIT and result.value == b"mode-a-bytes"

    def test_wrong_mode_get_returns_no_bytes(self, backend: Pair, ns: str) -> None:
        store, _ = backend
        store.put(ns, MODE_A, addr("k"), b"secret")
        [result] = store.get(ns, MODE_B, [addr("k")])
        assert result.status is KeyStatus.MODE_MISMATCH
        assert result.value is None

    def test_lookup_reports_hit_miss_and_mode_mismatch_in_request_order(self, backend: Pair, ns: str) -> None:
        store, _ = backend
        store.put(ns, MODE_A, addr("a"), b"1")
        store.put(ns, MODE_B, addr("b"), b"2")
        statuses = store.lookup(ns, MODE_A, [addr("a"), addr("missing"), addr("b"), addr("a")])
        assert statuses == [KeyStatus.HIT, KeyStatus.MISS, KeyStatus.MODE_MISMATCH, KeyStatus.HIT]

    def test_namespaces_never_share_blocks(self, backend: Pair, ns: str) -> None:
        store, _ = backend
        other = ns + "-other"
        store.put(ns, MODE_A, addr("k"), b"here")
        assert store.lookup(other, MODE_A, [addr("k")]) == [KeyStatus.MISS]
        assert store.put(other, MODE_B, addr("k"), b"there").outcome is PutOutcome.STORED
        [mine] = store.get(ns, MODE_A, [addr("k")])
        assert mine.value == b"here"

    def test_cache_groups_are_separate_addresses(self, backend: Pair, ns: str) -> None:
        store, _ = backend
        store.put(ns, MODE_A, addr("k", group=0), b"attention")
        store.put(ns, MODE_A, addr("k", group=1), b"mamba-state")
        results = store.get(ns, MODE_A, [addr("k", 0), addr("k", 1), addr("k", 2)])
        assert [r.value for r in results] == [b"attention", b"mamba-state", None]

    def test_value_larger_than_the_backend_holds_is_rejected(self, backend: Pair, ns: str) -> None:
        store, _ = backend
        if store.max_value_bytes > 64 << 20:
            pytest.skip("max_value_bytes too large to allocate a larger value in a test")
        result = store.put(ns, MODE_A, addr("huge"), bytes(store.max_value_bytes + 1))
        assert result.outcome is PutOutcome.REJECTED
        assert result.reason
        assert store.lookup(ns, MODE_A, [addr("huge")]) == [KeyStatus.MISS]

    def test_put_many_answers_each_item_in_request_order(self, backend: Pair, ns: str) -> None:
        store, _ = backend
        items = [(addr(f"k{i}"), f"value-{i}".encode() * (i + 1)) for i in range(8)]
        results = store.put_many(ns, MODE_A, items)
        assert [r.outcome for r in results] == [PutOutcome.STORED] * 8
        read = store.get(ns, MODE_A, [a for a, _ in reversed(items)])
        assert [r.value for r in read] == [v for _, v in reversed(items)]

    def test_put_many_mixes_stored_present_conflict_and_rejected_in_one_batch(
        self, backend: Pair, ns: str
    ) -> None:
        store, _ = backend
        store.put(ns, MODE_A, addr("present"), b"old-a")
        store.put(ns, MODE_B, addr("other-mode"), b"old-b")
        too_big = store.max_value_bytes + 1
        if too_big > 64 << 20:
            pytest.skip("max_value_bytes too large to allocate a larger value in a test")
        items = [
            (addr("new-1"), b"fresh-1"),
            (addr("present"), b"new-a"),
            (addr("other-mode"), b"new-b"),
            (addr("huge"), bytes(too_big)),
            (addr("new-2"), b"fresh-2"),
            (addr("new-1"), b"repeat"),
        ]
        results = store.put_many(ns, MODE_A, items)
        assert [r.outcome for r in results] == [
            PutOutcome.STORED,
            PutOutcome.ALREADY_PRESENT,
            PutOutcome.CONFLICT,
            PutOutcome.REJECTED,
            PutOutcome.STORED,
            PutOutcome.ALREADY_PRESENT,
        ]
        assert results[2].reason and results[3].reason
        read = store.get(ns, MODE_A, [addr("new-1"), addr("present"), addr("other-mode"), addr("huge")])
        assert [r.value for r in read] == [b"fresh-1", b"old-a", None, None]
        assert [r.status for r in read][2:] == [KeyStatus.MODE_MISMATCH, KeyStatus.MISS]

    def test_put_many_of_nothing_returns_nothing(self, backend: Pair, ns: str) -> None:
        store, _ = backend
        assert store.put_many(ns, MODE_A, []) == []

    def test_pins_nest_and_unpinning_unknown_blocks_is_harmless(self, backend: Pair, ns: str) -> None:
        store, _ = backend
        store.put(ns, MODE_A, addr("k"), b"v")
        store.pin(ns, [addr("k"), addr("unknown")])
        store.pin(ns, [addr("k")])
        store.unpin(ns, [addr("k"), addr("unknown")])
        store.unpin(ns, [addr("k")])
        store.unpin(ns, [addr("k")])  # one more than pinned: ignored
        [result] = store.get(ns, MODE_A, [addr("k")])
        assert result.value == b"v"

    def test_stats_count_stored_keys_and_bytes(self, backend: Pair, ns: str) -> None:
        store, _ = backend
        before = store.stats()
        store.put(ns, MODE_A, addr("x"), bytes(1000))
        store.put(ns, MODE_A, addr("y"), bytes(500))
        after = store.stats()
        assert after.keys - before.keys == 2
        assert after.used_bytes - before.used_bytes >= 1500
        assert after.capacity_bytes > 0
        assert after.backend == store.name

    def test_corrupted_value_is_dropped_and_never_served(self, backend: Pair, ns: str) -> None:
        store, _ = backend
        store.put(ns, MODE_A, addr("k"), b"precious bytes" * 100)
        before = store.stats().corrupted_dropped
        self.corrupt_stored_value(store, ns, addr("k"))
        [result] = store.get(ns, MODE_A, [addr("k")])
        assert result.status is KeyStatus.MISS
        assert result.value is None
        assert store.stats().corrupted_dropped == before + 1
        assert store.lookup(ns, MODE_A, [addr("k")]) == [KeyStatus.MISS]

    # -- capabilities, each through its Protocol -----------------------------

    def test_tenant_assignment_keeps_the_namespaces_blocks_readable(self, backend: Pair, ns: str) -> None:
        store, _ = backend
        tenants = offered(Capabilities.of(store).tenants, "TenantAware")
        store.put(ns, MODE_A, addr("before"), b"stored before the tenant was known")
        tenants.assign_tenant(ns, "tenant-contract")
        assert store.put(ns, MODE_A, addr("after"), b"stored after").outcome is PutOutcome.STORED
        read = store.get(ns, MODE_A, [addr("before"), addr("after")])
        assert [r.value for r in read] == [b"stored before the tenant was known", b"stored after"]
        tenants.assign_tenant(ns, "tenant-contract")  # again: harmless
        assert store.lookup(ns, MODE_A, [addr("before"), addr("after")]) == [KeyStatus.HIT] * 2

    def test_atomic_lookup_answers_like_lookup_and_pins_exactly_the_hits(
        self, backend: Pair, ns: str
    ) -> None:
        store, _ = backend
        atomic = offered(Capabilities.of(store).atomic_lookup, "AtomicLookup")
        store.put(ns, MODE_A, addr("a"), b"1")
        store.put(ns, MODE_B, addr("b"), b"2")
        store.put(ns, MODE_A, addr("c"), b"3")
        asked = [addr("a"), addr("missing"), addr("b"), addr("c")]
        statuses, pinned = atomic.lookup_and_pin(ns, MODE_A, asked)
        try:
            assert statuses == store.lookup(ns, MODE_A, asked)
            assert sorted(pinned) == sorted([addr("a"), addr("c")])
        finally:
            store.unpin(ns, pinned)
        assert atomic.lookup_and_pin(ns, MODE_A, [addr("missing")]) == ([KeyStatus.MISS], [])

    def test_packed_lookup_answers_a_status_byte_per_key_like_lookup(self, backend: Pair, ns: str) -> None:
        store, _ = backend
        packed = offered(Capabilities.of(store).packed_lookup, "PackedLookup")
        for name, group, mode in (("k1", 0, MODE_A), ("k3", 0, MODE_B), ("k2", 1, MODE_A)):
            store.put(ns, mode, addr(name, group), name.encode())
        runs = [(0, b"k1k2k3", 2), (1, b"k2k9", 2)]
        asked = [addr("k1"), addr("k2"), addr("k3"), addr("k2", 1), addr("k9", 1)]
        statuses, pinned = packed.lookup_packed_and_pin(ns, MODE_A, runs)
        try:
            assert statuses == bytes(store.lookup(ns, MODE_A, asked))
            assert statuses == bytes([KeyStatus.HIT, KeyStatus.MISS, KeyStatus.MODE_MISMATCH]) + bytes(
                [KeyStatus.HIT, KeyStatus.MISS]
            )
            assert pinned is not None and len(pinned) == 2
        finally:
            if pinned is not None:
                store.unpin(ns, pinned)
        nothing = packed.lookup_packed_and_pin(ns, MODE_A, [(0, b"zzyy", 2)])
        assert nothing[0] == bytes([KeyStatus.MISS]) * 2 and not nothing[1]

    def test_view_reads_hold_the_same_bytes_as_copies_until_unpinned(self, backend: Pair, ns: str) -> None:
        store, _ = backend
        views = offered(Capabilities.of(store).views, "ViewReads")
        value = bytes(range(256)) * 16
        store.put(ns, MODE_A, addr("k"), value)
        store.put(ns, MODE_B, addr("other"), b"another mode")
        asked = [addr("k"), addr("missing"), addr("other")]
        results, pinned = views.get_views(ns, MODE_A, asked)
        try:
            assert [r.status for r in results] == [KeyStatus.HIT, KeyStatus.MISS, KeyStatus.MODE_MISMATCH]
            assert results[0].value is not None and bytes(results[0].value) == value
            assert [r.value for r in results[1:]] == [None, None]
            assert pinned == [addr("k")]
        finally:
            store.unpin(ns, pinned)
        assert [r.value for r in store.get(ns, MODE_A, asked)] == [value, None, None]

    def test_a_slot_written_and_committed_reads_back_by_reference(self, backend: Pair, ns: str) -> None:
        store, _ = backend
        shared = offered(Capabilities.of(store).shared_memory, "SharedMemoryBackend")
        mapping = Mapping(shared_arena(shared, ns))
        try:
            value = bytes(range(200)) * 20
            [slot] = shared.reserve(ns, MODE_A, [(addr("k"), len(value))])
            assert isinstance(slot, SlotReference), slot
            mapping.write(slot, value)
            results, stored = shared.commit(ns, MODE_A, [slot.generation])
            assert [r.outcome for r in results] == [PutOutcome.STORED] and stored == len(value)
            [again] = shared.reserve(ns, MODE_A, [(addr("k"), len(value))])
            assert isinstance(again, PutResult) and again.outcome is PutOutcome.ALREADY_PRESENT, again
            statuses, found, pinned = shared.get_references(ns, MODE_A, [addr("k"), addr("missing")])
            try:
                assert statuses == [KeyStatus.HIT, KeyStatus.MISS]
                assert found[0] is not None and found[1] is None
                assert mapping.read(found[0]) == value
            finally:
                store.unpin(ns, pinned)
            [read] = store.get(ns, MODE_A, [addr("k")])
            assert read.value == value
        finally:
            mapping.close()

    def test_a_cancelled_or_unknown_reservation_commits_to_no_such_reservation(
        self, backend: Pair, ns: str
    ) -> None:
        store, _ = backend
        shared = offered(Capabilities.of(store).shared_memory, "SharedMemoryBackend")
        shared_arena(shared, ns)
        [slot] = shared.reserve(ns, MODE_A, [(addr("k"), 64)])
        assert isinstance(slot, SlotReference), slot
        shared.cancel([slot.generation])
        results, stored = shared.commit(ns, MODE_A, [slot.generation, slot.generation + 10_000])
        assert results == [NO_RESERVATION, NO_RESERVATION] and stored == 0
        assert store.lookup(ns, MODE_A, [addr("k")]) == [KeyStatus.MISS]

    # -- census -------------------------------------------------------------

    def test_first_established_mode_wins(self, backend: Pair, ns: str) -> None:
        _, census = backend
        assert census.establish_mode(ns, b"mode-one") == b"mode-one"
        assert census.establish_mode(ns, b"mode-two") == b"mode-one"
        assert census.establish_mode(ns + "-other", b"mode-two") == b"mode-two"

    def test_first_probe_record_is_the_reference(self, backend: Pair, ns: str) -> None:
        _, census = backend
        first = ProbeRecord(engine_id="engine-a", probe_keys=(b"p1", b"p2"))
        second = ProbeRecord(engine_id="engine-b", probe_keys=(b"q1", b"q2"))
        assert census.reference_probe(ns, MODE_A, first) == first
        assert census.reference_probe(ns, MODE_A, second) == first
        assert census.reference_probe(ns, MODE_B, second) == second
