"""Master HA: the leading master killed while a kvtag backend reads and while replicas enforce a strict
namespace, over etcd with two masters (mooncake_ha)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtag_store.backends.base import BackendUnavailable, KeyStatus, PutOutcome
from kvtag_store.backends.mooncake.backend import MooncakeBackend
from kvtag_store.backends.mooncake.client import connect

from tests.descriptors import namespace

from .mooncake_cluster import settings_for
from .mooncake_ha import HaMooncakeCluster
from .mooncake_replicas import Replica
from .test_mooncake_census_faults import ESTABLISHED, refused
from .test_mooncake_reads import MODE, addr

# How long the backend may answer UNAVAILABLE (or misses) after the leader dies.
RECOVERY_BOUND_S = 20.0


@pytest.fixture
def ha_cluster(tmp_path: Path) -> Iterator[HaMooncakeCluster]:
    c = HaMooncakeCluster(tmp_path)
    try:  # a start that fails half-way stops what it started too
        c.start_master()
        c.start_storage(64 << 20)
        yield c
    finally:
        c.stop()


def test_killing_the_leading_master_under_reads_serves_no_wrong_bytes_and_recovers(
    ha_cluster: HaMooncakeCluster,
) -> None:
    backend = MooncakeBackend(connect(settings_for(ha_cluster)), settings_for(ha_cluster))
    ns = "ns-" + uuid.uuid4().hex[:16]
    blocks = {addr(f"k{i}"): bytes([i]) * 4096 for i in range(32)}
    outcomes = backend.put_many(ns, MODE, list(blocks.items()))
    assert {r.outcome for r in outcomes} == {PutOutcome.STORED}
    wrong: list[str] = []
    stop = threading.Event()
    served_at: list[float] = []

    def load() -> None:
        while not stop.is_set():
            try:
                results = backend.get(ns, MODE, list(blocks))
            except BackendUnavailable:
                time.sleep(0.05)
                continue
            for (address, value), result in zip(blocks.items(), results, strict=True):
                if result.value is not None and result.value != value:
                    wrong.append(repr(address))
            if all(r.status is KeyStatus.HIT for r in results):
                served_at.append(time.monotonic())

    reader = threading.Thread(target=load)
    try:
        reader.start()
        time.sleep(1.0)
        assert served_at, "no Get was served before the kill"
        killed_at = time.monotonic()
        ha_cluster.kill_leader()
        deadline = killed_at + RECOVERY_BOUND_S
        while time.monotonic() < deadline and not [t for t in served_at if t > killed_at + 0.5]:
            time.sleep(0.1)
        recovered = [t for t in served_at if t > killed_at + 0.5]
        assert recovered, f"the blocks were not all served again within {RECOVERY_BOUND_S:.0f} s of the kill"
        print(f"served again {recovered[0] - killed_at:.1f} s after the leading master was killed")
        stop.set()
        reader.join(30)
        assert wrong == []
        # Writable again, and the old blocks are still known (the oplog carried them over).
        assert backend.put(ns, MODE, addr("after"), b"after").outcome is PutOutcome.STORED
        assert backend.lookup(ns, MODE, list(blocks)) == [KeyStatus.HIT] * len(blocks)
    finally:
        stop.set()
        reader.join(30)
        backend.close()


def test_strict_stays_strict_across_a_failover_even_for_a_replica_that_never_saw_the_namespace(
    ha_cluster: HaMooncakeCluster, tmp_path: Path
) -> None:
    """The census record outlives the leader: a replica started after the failover, which knows
    nothing to restore, reads the established mode and refuses another (MODE_REFUSED)."""
    one = Replica(ha_cluster, tmp_path, "replica1", ["--policy=strict"])
    one.start()
    fresh: Replica | None = None
    try:
        ns = namespace("model-" + uuid.uuid4().hex[:10])
        assert one.open(ns, ESTABLISHED, "engine-1").session_id
        ha_cluster.kill_leader()
        refused(one, ns, "engine-2", timeout_s=RECOVERY_BOUND_S + 10)
        assert one.open(ns, ESTABLISHED, "engine-3").session_id
        one.stop()  # no replica left that could restore the record
        fresh = Replica(ha_cluster, tmp_path, "replica2", ["--policy=strict"])
        fresh.start()
        assert refused(fresh, ns, "engine-4") == 0
        assert fresh.open(ns, ESTABLISHED, "engine-5").session_id
    finally:
        one.stop()
        if fresh is not None:
            fresh.stop()
