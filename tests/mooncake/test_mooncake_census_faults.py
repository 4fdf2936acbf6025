"""Strict enforcement across two replicas when the census record is lost: deleted, with the only
storage node that held it, or with a master restart. A different mode is refused (UNAVAILABLE while
the census recovers, then MODE_REFUSED), never admitted; the established mode keeps being admitted.

Each test owns its cluster (it breaks it); the master's client TTL is 3 s (mooncake_cluster).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag_proto import ids
from kvtag_proto.errors import parse_error
from kvtag_store.backends.mooncake.client import MooncakeClient, connect
from kvtag_store.backends.mooncake.format import census_key

from tests.descriptors import mode, namespace
from tests.net import wait_until

from .mooncake_cluster import MooncakeCluster, settings_for
from .mooncake_replicas import Replica

ESTABLISHED = mode(lookahead=1)
OTHER = mode(lookahead=0)


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[MooncakeCluster]:
    c = MooncakeCluster(tmp_path)
    c.start_master()
    c.start_storage(32 << 20)
    yield c
    c.stop()


@pytest.fixture
def strict_pair(own_cluster: MooncakeCluster, tmp_path: Path) -> Iterator[tuple[Replica, Replica]]:
    pair = (
        Replica(own_cluster, tmp_path, "replica1", ["--policy=strict"]),
        Replica(own_cluster, tmp_path, "replica2", ["--policy=strict"]),
    )
    for replica in pair:
        replica.start()
    yield pair
    for replica in pair:
        replica.stop()


def refused(replica: Replica, ns: pb.NamespaceDescriptor, engine: str, timeout_s: float = 30) -> int:
    """Open in the other mode until the census answers for sure; fail if it is ever admitted.
    Returns how many attempts were turned away as UNAVAILABLE (the census failing closed)."""
    unavailable = 0
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            opened = replica.open(ns, OTHER, engine)
        except grpc.RpcError as exc:
            error = parse_error(exc)
            if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
                assert error is not None and error.reason == "MODE_REFUSED", exc
                return unavailable
            assert exc.code() is grpc.StatusCode.UNAVAILABLE, exc
            assert error is not None and error.reason == "BACKEND_UNAVAILABLE", exc
            unavailable += 1
        else:
            pytest.fail(f"a second mode was admitted in a strict namespace: session {opened.session_id}")
        assert time.monotonic() < deadline, "the census never answered for sure"
        time.sleep(0.5)


def test_record_deleted_and_rewritten_by_an_unknowing_replica_is_restored_and_the_new_mode_refused(
    own_cluster: MooncakeCluster, strict_pair: tuple[Replica, Replica]
) -> None:
    one, two = strict_pair
    ns = namespace("model-" + uuid.uuid4().hex[:10])
    one.open(ns, ESTABLISHED, "engine-1")
    raw = connect(settings_for(own_cluster))
    try:
        key = census_key(ids.namespace_id(ns), "mode")
        assert raw.batch_remove([key], True) == [0]
        # Replica 2 never saw the namespace: it writes a fresh record, which replica 1 (knowing the
        # older one) replaces before the fresh one has settled.
        assert refused(two, ns, "engine-2") == 0
        assert raw.batch_is_exist([key]) == [1]
    finally:
        raw.close()
    assert two.open(ns, ESTABLISHED, "engine-3").session_id


def test_storage_node_holding_the_record_killed_a_new_one_mounted_the_new_mode_is_refused(
    own_cluster: MooncakeCluster, strict_pair: tuple[Replica, Replica]
) -> None:
    one, two = strict_pair
    ns = namespace("model-" + uuid.uuid4().hex[:10])
    one.open(ns, ESTABLISHED, "engine-1")
    own_cluster.kill_storage()  # the only node: it held the record
    own_cluster.start_storage(32 << 20)
    # The master drops the dead node's objects once its client TTL runs out.
    wait_until(lambda: own_cluster.capacity() == 32 << 20, 15, "the master to drop the dead node")
    refused(two, ns, "engine-2")
    assert two.open(ns, ESTABLISHED, "engine-3").session_id
    assert one.open(ns, ESTABLISHED, "engine-4").session_id


def test_master_restart_forgets_the_record_the_new_mode_is_still_refused(
    own_cluster: MooncakeCluster, strict_pair: tuple[Replica, Replica]
) -> None:
    one, two = strict_pair
    ns = namespace("model-" + uuid.uuid4().hex[:10])
    one.open(ns, ESTABLISHED, "engine-1")
    own_cluster.kill_master()
    own_cluster.start_master()  # no HA: it starts empty; the storage node re-mounts by itself
    wait_until(lambda: own_cluster.capacity() > 0, 30, "the storage node to re-mount")
    refused(two, ns, "engine-2")
    assert two.open(ns, ESTABLISHED, "engine-3").session_id


def _endpoints(raw: MooncakeClient, key: str) -> set[str]:
    return {
        str(replica.get_memory_descriptor().buffer_descriptor.transport_endpoint)
        for replica in raw.batch_get_replica_desc([key]).get(key, [])
        if replica.is_memory_replica()
    }


def test_record_is_kept_on_two_storage_nodes_and_outlives_one_without_any_replica_restoring_it(
    tmp_path: Path,
) -> None:
    """Replication alone: both replicas stop before a storage node dies, so no keeper puts the record
    back; a fresh replica that never saw the namespace still reads the established mode from the
    surviving copy and refuses another mode (MODE_REFUSED, not UNAVAILABLE: nothing was lost)."""
    cluster = MooncakeCluster(tmp_path)
    cluster.start_master()
    cluster.start_storage(32 << 20)
    cluster.start_storage(32 << 20)
    raw = connect(settings_for(cluster))
    first = Replica(cluster, tmp_path, "replica1", ["--policy=strict"])
    fresh = Replica(cluster, tmp_path, "replica2", ["--policy=strict"])
    try:
        first.start()
        ns = namespace("model-" + uuid.uuid4().hex[:10])
        first.open(ns, ESTABLISHED, "engine-1")
        key = census_key(ids.namespace_id(ns), "mode")
        record = raw.get(key)
        assert record, "the census record was not written"
        assert len(_endpoints(raw, key)) == 2, "the census record is not on both storage nodes"
        first.stop()
        victim = cluster.storage.pop(0)
        victim.kill()
        victim.wait(5)
        wait_until(lambda: cluster.capacity() == 32 << 20, 15, "the master to drop the dead node")
        assert raw.get(key) == record, "the surviving copy is not the record"
        fresh.start()
        assert refused(fresh, ns, "engine-2") == 0
        assert fresh.open(ns, ESTABLISHED, "engine-3").session_id
    finally:
        first.stop()
        fresh.stop()
        raw.close()
        cluster.stop()
