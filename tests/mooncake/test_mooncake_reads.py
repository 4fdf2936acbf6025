"""Reads on a real cluster: every size served exactly, damaged or resized values never served, and a
down master an error rather than misses (the checks any faster read path must keep).

Values are planted with a raw Mooncake client to break them in ways kvtag's own puts never do.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtag_store.backends.base import BackendUnavailable, BlockAddress, BlockKey, KeyStatus, PutOutcome
from kvtag_store.backends.mooncake.backend import MooncakeBackend
from kvtag_store.backends.mooncake.client import MooncakeClient, connect
from kvtag_store.backends.mooncake.format import HEADER_BYTES, object_key

from .mooncake_cluster import MooncakeCluster, settings_for

MODE = "m-0123456789abcdef"
OTHER_MODE = "m-fedcba9876543210"


def addr(name: str) -> BlockAddress:
    return (0, BlockKey(name.encode()))


def fresh_ns() -> str:
    return "ns-" + uuid.uuid4().hex[:16]


def replant(raw: MooncakeClient, mkey: str, value: bytes) -> None:
    raw.batch_remove([mkey], True)
    assert raw.put(mkey, value) == 0


def test_one_get_returns_exact_bytes_for_every_size_beside_misses_and_other_modes(
    mooncake_backend: MooncakeBackend,
) -> None:
    ns = fresh_ns()
    sizes = [0, 1, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 1, 4096, 300_001, 1 << 20]
    blocks = {addr(f"s{size}"): bytes((size + i) % 251 for i in range(size)) for size in sizes}
    outcomes = mooncake_backend.put_many(ns, MODE, list(blocks.items()))
    assert all(r.outcome is PutOutcome.STORED for r in outcomes), outcomes
    assert mooncake_backend.put(ns, OTHER_MODE, addr("theirs"), b"x" * 5000).outcome is PutOutcome.STORED
    wanted = [addr("absent-1"), *blocks, addr("theirs"), addr("absent-2")]
    results = mooncake_backend.get(ns, MODE, wanted)
    assert [r.status for r in results] == (
        [KeyStatus.MISS] + [KeyStatus.HIT] * len(blocks) + [KeyStatus.MODE_MISMATCH, KeyStatus.MISS]
    )
    for (address, value), result in zip(blocks.items(), results[1:], strict=False):
        assert type(result.value) is bytes and result.value == value, address
    assert results[0].value is None and results[-2].value is None


@pytest.mark.parametrize(
    "damage",
    ["flip a payload byte", "append a byte", "drop the last byte", "swap in another block's payload"],
)
def test_a_damaged_value_is_a_miss_and_dropped(
    mooncake_backend: MooncakeBackend, raw_client: MooncakeClient, damage: str
) -> None:
    ns = fresh_ns()
    payload = bytes(range(256)) * 64
    assert mooncake_backend.put(ns, MODE, addr("k"), payload).outcome is PutOutcome.STORED
    assert mooncake_backend.put(ns, MODE, addr("o"), payload[::-1]).outcome is PutOutcome.STORED
    mkey = object_key(ns, MODE, *addr("k"))
    stored = bytearray(raw_client.get(mkey))
    if damage == "flip a payload byte":
        stored[HEADER_BYTES + 1000] ^= 0x40
    elif damage == "append a byte":
        stored.append(0)
    elif damage == "drop the last byte":
        del stored[-1]
    else:
        stored[HEADER_BYTES:] = raw_client.get(object_key(ns, MODE, *addr("o")))[HEADER_BYTES:]
    replant(raw_client, mkey, bytes(stored))
    before = mooncake_backend.stats().corrupted_dropped
    [result] = mooncake_backend.get(ns, MODE, [addr("k")])
    assert result.status is KeyStatus.MISS and result.value is None
    assert mooncake_backend.stats().corrupted_dropped == before + 1
    assert raw_client.batch_is_exist([mkey]) == [0]
    [other] = mooncake_backend.get(ns, MODE, [addr("o")])
    assert other.value == payload[::-1]


@pytest.fixture
def lone_cluster(tmp_path: Path) -> Iterator[MooncakeCluster]:
    c = MooncakeCluster(tmp_path)
    c.start_master()
    c.start_storage(32 << 20)
    yield c
    c.stop()


def test_get_with_the_master_down_is_unavailable_not_misses(lone_cluster: MooncakeCluster) -> None:
    backend = MooncakeBackend(connect(settings_for(lone_cluster)), settings_for(lone_cluster))
    try:
        ns = fresh_ns()
        assert backend.put(ns, MODE, addr("k"), b"v" * 1000).outcome is PutOutcome.STORED
        lone_cluster.kill_master()
        started = time.monotonic()
        with pytest.raises(BackendUnavailable, match="Mooncake master"):
            backend.get(ns, MODE, [addr("k"), addr("absent")])
        assert time.monotonic() - started < 30
        assert backend.errors.snapshot().get("master_rpc", 0) >= 1
    finally:
        backend.close()
