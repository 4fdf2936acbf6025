"""The mode in the object key: Lookups answer from existence checks alone, across replicas, while
CONFLICT, ALREADY_PRESENT and MODE_MISMATCH keep their meaning (mooncake.modes)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any, cast

import pytest
from kvtag_store.backends.base import KeyStatus, PutOutcome
from kvtag_store.backends.mooncake.backend import MooncakeBackend
from kvtag_store.backends.mooncake.client import MooncakeClient, connect
from kvtag_store.backends.mooncake.format import (
    HEADER_BYTES,
    directory_key,
    encode_header,
    object_key,
)
from kvtag_store.backends.mooncake.modes import MAX_MODES

from .legacy_keys import legacy_object_key
from .mooncake_cluster import MooncakeCluster, settings_for
from .test_mooncake_reads import MODE, OTHER_MODE, addr, fresh_ns


class _CountingClient:
    """The real Mooncake client, counting calls by name and the keys each existence check asks."""

    def __init__(self, client: MooncakeClient) -> None:
        self._client = client
        self.calls: Counter[str] = Counter()
        self.exist_keys: list[int] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            if name == "batch_is_exist":
                self.exist_keys.append(len(args[0]))
            return attr(*args, **kwargs)

        return counted


def _replica(cluster: MooncakeCluster) -> tuple[MooncakeBackend, _CountingClient]:
    client = _CountingClient(connect(settings_for(cluster)))
    return MooncakeBackend(cast(MooncakeClient, client), settings_for(cluster)), client


@pytest.fixture
def pair(cluster: MooncakeCluster) -> Iterator[tuple[MooncakeBackend, MooncakeBackend, _CountingClient]]:
    """Two fresh replicas over one cluster; the second one's calls are counted."""
    a, _ = _replica(cluster)
    b, counted = _replica(cluster)
    yield a, b, counted
    a.close()
    b.close()


def test_a_replica_finds_another_replicas_blocks_by_existence_checks_alone(
    pair: tuple[MooncakeBackend, MooncakeBackend, _CountingClient],
) -> None:
    a, b, counted = pair
    ns = fresh_ns()
    ours = [addr(f"ours{i}") for i in range(300)]
    theirs = [addr(f"theirs{i}") for i in range(40)]
    absent = [addr(f"absent{i}") for i in range(30)]
    assert {r.outcome for r in a.put_many(ns, MODE, [(x, b"v" * 700) for x in ours])} == {PutOutcome.STORED}
    assert {r.outcome for r in a.put_many(ns, OTHER_MODE, [(x, b"w" * 70) for x in theirs])} == {
        PutOutcome.STORED
    }
    asked = [*ours[:100], *absent[:10], *theirs, *ours[100:], *absent[10:]]
    expected = [
        KeyStatus.HIT if x in ours else KeyStatus.MODE_MISMATCH if x in theirs else KeyStatus.MISS
        for x in asked
    ]
    counted.calls.clear()
    # B never saw the namespace: it reads the directory (2 slots), then one existence check for the
    # blocks in its mode and one for the misses in the other mode. No value or header is read.
    assert b.lookup(ns, MODE, asked) == expected
    assert counted.calls["get_into_ranges"] == counted.calls["get_batch"] == 0
    assert counted.calls["get"] == 2  # the two directory slots, once
    assert counted.calls["batch_is_exist"] == 3
    # Later lookups are the existence checks alone; all hits take one.
    counted.calls.clear()
    assert b.lookup(ns, MODE, asked) == expected
    assert b.lookup(ns, MODE, ours) == [KeyStatus.HIT] * len(ours)
    assert counted.calls == Counter({"batch_is_exist": 3})
    mirror = {KeyStatus.HIT: KeyStatus.MODE_MISMATCH, KeyStatus.MODE_MISMATCH: KeyStatus.HIT}
    assert b.lookup(ns, OTHER_MODE, asked) == [mirror.get(s, s) for s in expected]


def test_a_wrong_mode_replica_gets_no_bytes_and_a_mode_mismatch(
    pair: tuple[MooncakeBackend, MooncakeBackend, _CountingClient], raw_client: MooncakeClient
) -> None:
    a, b, _ = pair
    ns = fresh_ns()
    assert a.put(ns, MODE, addr("k"), b"secret").outcome is PutOutcome.STORED
    [result] = b.get(ns, OTHER_MODE, [addr("k"), addr("absent")])[:1]
    assert result.status is KeyStatus.MODE_MISMATCH and result.value is None
    # A value of MODE planted under OTHER_MODE's key is refused by the header check and dropped.
    planted = raw_client.get(object_key(ns, MODE, *addr("k")))
    assert raw_client.put(object_key(ns, OTHER_MODE, *addr("k")), planted) == 0
    assert b.lookup(ns, OTHER_MODE, [addr("k")]) == [KeyStatus.HIT]  # existence alone
    [result] = b.get(ns, OTHER_MODE, [addr("k")])
    assert result.status is not KeyStatus.HIT and result.value is None
    assert raw_client.batch_is_exist([object_key(ns, OTHER_MODE, *addr("k"))]) == [0]


def test_conflict_and_already_present_across_replicas(
    pair: tuple[MooncakeBackend, MooncakeBackend, _CountingClient],
) -> None:
    a, b, _ = pair
    ns = fresh_ns()
    assert a.put(ns, MODE, addr("k"), b"first").outcome is PutOutcome.STORED
    # B never saw the namespace or MODE: the directory tells it which other mode to check.
    conflict = b.put(ns, OTHER_MODE, addr("k"), b"other")
    assert conflict.outcome is PutOutcome.CONFLICT and MODE in conflict.reason
    assert b.put(ns, MODE, addr("k"), b"second").outcome is PutOutcome.ALREADY_PRESENT
    outcomes = b.put_many(ns, OTHER_MODE, [(addr("k"), b"x"), (addr("new"), b"y")])
    assert [r.outcome for r in outcomes] == [PutOutcome.CONFLICT, PutOutcome.STORED]
    assert a.put(ns, MODE, addr("new"), b"z").outcome is PutOutcome.CONFLICT
    assert [r.value for r in a.get(ns, MODE, [addr("k"), addr("new")])] == [b"first", None]


def test_racing_puts_of_one_key_in_two_modes_leave_it_held_by_at_most_one(
    cluster: MooncakeCluster,
) -> None:
    replicas = [_replica(cluster)[0] for _ in range(2)]
    ns = fresh_ns()
    keys = [addr(f"race{i}") for i in range(64)]
    outcomes: dict[str, list[PutOutcome]] = {}
    start = threading.Barrier(2)

    def writer(backend: MooncakeBackend, mode: str) -> None:
        start.wait()
        outcomes[mode] = [backend.put_many(ns, mode, [(k, mode.encode() * 10)])[0].outcome for k in keys]

    try:
        threads = [
            threading.Thread(target=writer, args=(replicas[0], MODE)),
            threading.Thread(target=writer, args=(replicas[1], OTHER_MODE)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, k in enumerate(keys):
            pair = (outcomes[MODE][i], outcomes[OTHER_MODE][i])
            assert PutOutcome.STORED not in pair or PutOutcome.CONFLICT in pair, (i, pair)
            holders = [m for m in (MODE, OTHER_MODE) if replicas[0].lookup(ns, m, [k]) == [KeyStatus.HIT]]
            assert len(holders) <= 1, (i, holders)
            for mode, outcome in zip((MODE, OTHER_MODE), pair, strict=True):
                [result] = replicas[1].get(ns, mode, [k])
                if outcome is PutOutcome.STORED:
                    assert result.value == mode.encode() * 10
                else:
                    assert result.value is None
    finally:
        for backend in replicas:
            backend.close()


def test_blocks_an_older_version_wrote_are_ignored_as_misses(
    mooncake_backend: MooncakeBackend, raw_client: MooncakeClient
) -> None:
    """Documented in docs/mooncake.md: old blocks are never read (they age out by eviction)."""
    ns = fresh_ns()
    group, key = addr("old")
    old = legacy_object_key(ns, group, key)
    value = encode_header(ns, MODE, group, key, b"old bytes", b"n" * 8) + b"old bytes"
    assert raw_client.put(old, value) == 0
    assert mooncake_backend.lookup(ns, MODE, [addr("old")]) == [KeyStatus.MISS]
    [result] = mooncake_backend.get(ns, MODE, [addr("old")])
    assert result.status is KeyStatus.MISS and result.value is None
    assert mooncake_backend.put(ns, OTHER_MODE, addr("old"), b"new bytes").outcome is PutOutcome.STORED
    assert raw_client.get(old) == value  # left alone
    assert len(raw_client.get(object_key(ns, OTHER_MODE, group, key))) == HEADER_BYTES + len(b"new bytes")


def test_a_lost_directory_slot_is_put_back_and_conflicts_still_hold(
    pair: tuple[MooncakeBackend, MooncakeBackend, _CountingClient],
    cluster: MooncakeCluster,
    raw_client: MooncakeClient,
) -> None:
    a, _, _ = pair
    ns = fresh_ns()
    assert a.put(ns, MODE, addr("k"), b"a").outcome is PutOutcome.STORED
    assert raw_client.batch_remove([directory_key(ns, 0)], True) == [0]
    # A's next call notices the slot is gone and puts its mode back (a lookup rescans the
    # directory at most every half second).
    time.sleep(0.6)
    assert a.lookup(ns, MODE, [addr("k")]) == [KeyStatus.HIT]
    assert raw_client.batch_is_exist([directory_key(ns, 0)]) == [1]
    fresh, _ = _replica(cluster)
    try:
        assert fresh.put(ns, OTHER_MODE, addr("k"), b"b").outcome is PutOutcome.CONFLICT
    finally:
        fresh.close()


def test_a_namespace_holds_a_bounded_number_of_modes(mooncake_backend: MooncakeBackend) -> None:
    ns = fresh_ns()
    for i in range(MAX_MODES):
        assert mooncake_backend.put(ns, f"m-{i:016x}", addr(f"k{i}"), b"v").outcome is PutOutcome.STORED
    refused = mooncake_backend.put(ns, "m-one-too-many", addr("x"), b"v")
    assert refused.outcome is PutOutcome.REJECTED and f"{MAX_MODES} modes" in refused.reason
    assert mooncake_backend.lookup(ns, "m-one-too-many", [addr("k3")]) == [KeyStatus.MODE_MISMATCH]
