"""Lookup over Mooncake takes existence from the master and tags from the mode cache (mode_cache):
the answers match the stored headers, blocks seen before cost no header read, and a stale tag
never serves bytes in the wrong mode."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import pytest
from kvtag_store.backends.base import KeyStatus, PutOutcome
from kvtag_store.backends.mooncake.backend import MooncakeBackend
from kvtag_store.backends.mooncake.client import MooncakeClient, connect
from kvtag_store.backends.mooncake.format import object_key
from kvtag_store.backends.mooncake.mode_cache import ModeCache

from .mooncake_cluster import MooncakeCluster, settings_for
from .test_mooncake_reads import MODE, OTHER_MODE, addr, fresh_ns


@pytest.fixture
def replica(cluster: MooncakeCluster) -> Iterator[MooncakeBackend]:
    """A second kvtag backend over the same cluster: another replica, with its own mode cache."""
    backend = MooncakeBackend(connect(settings_for(cluster)), settings_for(cluster))
    yield backend
    backend.close()


class _HeaderCountingClient:
    """The real Mooncake client, counting the headers it is asked to read (get_into_ranges, the
    call the backend reads headers with)."""

    def __init__(self, client: MooncakeClient) -> None:
        self._client = client
        self.header_reads: list[int] = []

    def get_into_ranges(self, buffer_ptrs: list[int], all_keys: list[list[str]], *ranges: Any) -> Any:
        self.header_reads.append(sum(len(keys) for keys in all_keys))
        return self._client.get_into_ranges(buffer_ptrs, all_keys, *ranges)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@pytest.fixture
def counted(cluster: MooncakeCluster) -> Iterator[tuple[MooncakeBackend, _HeaderCountingClient]]:
    """A kvtag backend over a client that counts the headers it reads."""
    client = _HeaderCountingClient(connect(settings_for(cluster)))
    backend = MooncakeBackend(cast(MooncakeClient, client), settings_for(cluster))
    yield backend, client
    backend.close()


def test_lookup_answers_as_the_headers_and_reads_none_for_blocks_seen_before(
    counted: tuple[MooncakeBackend, _HeaderCountingClient], replica: MooncakeBackend
) -> None:
    mooncake_backend, client = counted
    ns = fresh_ns()
    ours = [addr(f"ours{i}") for i in range(40)]
    theirs = [addr(f"theirs{i}") for i in range(10)]
    absent = [addr(f"absent{i}") for i in range(30)]
    outcomes = mooncake_backend.put_many(ns, MODE, [(a, b"v" * 700) for a in ours])
    assert all(r.outcome is PutOutcome.STORED for r in outcomes), outcomes
    outcomes = replica.put_many(ns, OTHER_MODE, [(a, b"w" * 300) for a in theirs])
    assert all(r.outcome is PutOutcome.STORED for r in outcomes), outcomes
    asked = [*ours[:20], *absent[:10], *theirs, *ours[20:], *absent[10:]]
    expected = [
        KeyStatus.HIT if a in ours else KeyStatus.MODE_MISMATCH if a in theirs else KeyStatus.MISS
        for a in asked
    ]
    reads = client.header_reads
    reads.clear()  # counted from here on
    # Ours were seen at their put; theirs were not, so only their headers are read, once.
    assert mooncake_backend.lookup(ns, MODE, asked) == expected
    assert reads == [len(theirs)]
    assert mooncake_backend.lookup(ns, MODE, asked) == expected
    assert reads == [len(theirs)]
    # The other replica, asking in its own mode, sees the mirror image.
    mirror = {KeyStatus.HIT: KeyStatus.MODE_MISMATCH, KeyStatus.MODE_MISMATCH: KeyStatus.HIT}
    assert replica.lookup(ns, OTHER_MODE, asked) == [mirror.get(s, s) for s in expected]


def test_a_block_gone_is_a_miss_and_its_new_tag_is_read(
    mooncake_backend: MooncakeBackend, replica: MooncakeBackend, raw_client: MooncakeClient
) -> None:
    ns = fresh_ns()
    assert mooncake_backend.put(ns, MODE, addr("k"), b"ours").outcome is PutOutcome.STORED
    assert mooncake_backend.lookup(ns, MODE, [addr("k")]) == [KeyStatus.HIT]
    assert raw_client.batch_remove([object_key(ns, *addr("k"))], True) == [0]
    assert mooncake_backend.lookup(ns, MODE, [addr("k")]) == [KeyStatus.MISS]
    # Seen absent, so its tag is forgotten: another mode's put of the key is read from its header.
    assert replica.put(ns, OTHER_MODE, addr("k"), b"theirs").outcome is PutOutcome.STORED
    assert mooncake_backend.lookup(ns, MODE, [addr("k")]) == [KeyStatus.MODE_MISMATCH]
    [result] = mooncake_backend.get(ns, MODE, [addr("k")])
    assert result.status is KeyStatus.MODE_MISMATCH and result.value is None


def test_a_stale_tag_never_serves_bytes_in_the_wrong_mode_and_the_get_corrects_it(
    mooncake_backend: MooncakeBackend, replica: MooncakeBackend, raw_client: MooncakeClient
) -> None:
    ns = fresh_ns()
    assert mooncake_backend.put(ns, MODE, addr("k"), b"ours").outcome is PutOutcome.STORED
    # Removed and put again in another mode, all while this service never saw it absent.
    assert raw_client.batch_remove([object_key(ns, *addr("k"))], True) == [0]
    assert replica.put(ns, OTHER_MODE, addr("k"), b"theirs").outcome is PutOutcome.STORED
    stale = mooncake_backend.lookup(ns, MODE, [addr("k")])
    assert stale in ([KeyStatus.HIT], [KeyStatus.MODE_MISMATCH])  # HIT is the documented stale answer
    [result] = mooncake_backend.get(ns, MODE, [addr("k")])
    assert result.status is KeyStatus.MODE_MISMATCH and result.value is None
    assert mooncake_backend.lookup(ns, MODE, [addr("k")]) == [KeyStatus.MODE_MISMATCH]
    # A put in our mode is a conflict, as it was before the cache.
    assert mooncake_backend.put(ns, MODE, addr("k"), b"ours").outcome is PutOutcome.CONFLICT


def test_mode_cache_learns_forgets_and_starts_over_past_its_limit() -> None:
    cache = ModeCache(limit=100)
    keys = [f"kvtag/ns/g0/{i:064x}" for i in range(60)]
    assert cache.modes(keys[:3]) == [None] * 3
    cache.learn(keys[:40], [MODE] * 40)
    cache.learn(keys[10:20], [OTHER_MODE] * 10)  # the later sight wins
    cache.learn(["kvtag/ns/g0/short", "kvtag/ns/g0/short"], [MODE, OTHER_MODE])
    assert cache.modes(keys[:40]) == [MODE] * 10 + [OTHER_MODE] * 10 + [MODE] * 20
    assert cache.modes(["kvtag/ns/g0/short", keys[50]]) == [OTHER_MODE, None]
    cache.forget(keys[:5])
    assert cache.modes(keys[:6]) == [None] * 5 + [MODE]
    assert len(cache) == 36
    cache.learn(keys[40:60] + [f"x{i}" for i in range(50)], [MODE] * 70)  # 106 > 100: start over
    assert len(cache) == 70
    assert cache.modes(keys[5:10]) == [None] * 5
    assert cache.modes(keys[40:42]) == [MODE] * 2
    assert np.unique(np.array(cache.modes(keys[40:60]))).tolist() == [MODE]
