"""Master HA: the leading master killed while a kvtag backend reads, while two replicas write and read
each other's blocks, and while replicas enforce a strict namespace, over etcd with two masters
(mooncake_ha)."""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag_store.backends.base import BackendUnavailable, KeyStatus, PutOutcome
from kvtag_store.backends.mooncake.backend import MooncakeBackend
from kvtag_store.backends.mooncake.client import connect

from tests.descriptors import namespace
from tests.net import wait_until

from .mooncake_cluster import settings_for
from .mooncake_ha import HaMooncakeCluster
from .mooncake_replicas import Replica
from .test_mooncake_census_faults import ESTABLISHED, refused
from .test_mooncake_reads import MODE, addr

# How long the backend may answer UNAVAILABLE (or misses) after the leader dies. Issue 29's target
# is 10 s; Mooncake's standby needs about 4 s to win the election and 5 more to serve (its /health
# goes standby -> leader_warmup -> serving), so the test allows twice the target on this loaded host
# and prints what it measured.
RECOVERY_BOUND_S = 20.0
# The write load's bounds: rounds per writer, and seconds after the kill.
MAX_ROUNDS = 3000
LOAD_AFTER_KILL_S = RECOVERY_BOUND_S + 5
# Blocks stored this long before the leader dies must survive it: the standby polls the oplog every
# 1 s (mooncake_master --oplog_poll_interval_ms), and what it had not fetched dies with the leader.
OPLOG_LAG_S = 3.0


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
        print(
            f"served again {recovered[0] - killed_at:.1f} s after the leading master was killed "
            f"({_mooncake_share(ha_cluster, killed_at)})"
        )
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


def _value_of(key: bytes) -> bytes:
    """A block's bytes follow from its key, so any reader can tell a wrong byte (4 KiB)."""
    return hashlib.blake2b(key).digest() * 64


@pytest.mark.slow
def test_killing_the_leader_under_a_write_load_serves_exact_bytes_stays_strict_and_reports_again(
    ha_cluster: HaMooncakeCluster, tmp_path: Path
) -> None:
    """Two strict replicas each put 8 fresh blocks and read them back with the other's latest, in a
    loop; the leading master is killed. Both serve full rounds again within the bound, no read ever
    returns a wrong byte, blocks stored before the kill are still there, another mode is refused,
    and GetStats reads the new leader's figures (--mooncake-metrics names both masters)."""
    replicas = [Replica(ha_cluster, tmp_path, f"writer{n}", ["--policy=strict"]) for n in range(2)]
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        for replica in replicas:
            replica.start()
        ns = namespace("model-" + uuid.uuid4().hex[:10])
        sessions = [r.open(ns, ESTABLISHED, f"engine-{n}").session_id for n, r in enumerate(replicas)]
        stored: list[list[tuple[float, bytes]]] = [[], []]  # per writer: (when answered, key)
        rounds: list[list[tuple[float, float, bool]]] = [[], []]  # (start, end, every put and get served)
        wrong: list[bytes] = []

        def load(n: int) -> None:
            replica, session = replicas[n], sessions[n]
            for i in range(MAX_ROUNDS):
                if stop.is_set():
                    return
                keys = [f"w{n}-{i}-{j}".encode() for j in range(8)]
                theirs = [k for _, k in stored[1 - n][-8:]]
                started = time.monotonic()
                try:
                    statuses = replica.put(session, *[(k, _value_of(k)) for k in keys])
                    answered = time.monotonic()
                    stored[n].extend(
                        (answered, k) for k, s in zip(keys, statuses, strict=True) if s == pb.STORED
                    )
                    results = replica.get(session, *keys, *theirs)
                except grpc.RpcError:
                    rounds[n].append((started, time.monotonic(), False))
                    time.sleep(0.05)
                    continue
                wrong.extend(
                    k
                    for k, r in zip(keys + theirs, results, strict=True)
                    if r.status == pb.HIT and r.value != _value_of(k)
                )
                served = statuses == [pb.STORED] * 8 and all(r.status == pb.HIT for r in results)
                rounds[n].append((started, time.monotonic(), served))

        threads = [threading.Thread(target=load, args=(n,)) for n in range(2)]
        for thread in threads:
            thread.start()
        wait_until(lambda: all(any(ok for *_, ok in r) for r in rounds), 20, "full rounds before the kill")
        time.sleep(1.0)
        killed_at = time.monotonic()
        ha_cluster.kill_leader()

        def again(n: int) -> float | None:
            """Seconds from the kill to the end of writer n's first full round begun after it."""
            ends = [end for start, end, ok in list(rounds[n]) if ok and start > killed_at]
            return ends[0] - killed_at if ends else None

        wait_until(
            lambda: (
                all(again(n) is not None for n in range(2))
                or time.monotonic() > killed_at + LOAD_AFTER_KILL_S
            ),
            LOAD_AFTER_KILL_S + 5,
            "the write load to end",
        )
        stop.set()
        for thread in threads:
            thread.join(30)
        recovered = [again(n) for n in range(2)]
        failed = sum(1 for r in rounds for start, _, ok in r if start > killed_at and not ok)
        print(
            f"write load: full rounds again {recovered} s after the kill "
            f"({_mooncake_share(ha_cluster, killed_at)}); {failed} rounds not fully served "
            f"meanwhile; {sum(len(r) for r in rounds)} rounds, {sum(len(s) for s in stored)} blocks stored"
        )
        assert wrong == [], f"wrong bytes served for {wrong[:4]}"
        assert all(t is not None and t < RECOVERY_BOUND_S for t in recovered), (
            f"a replica did not serve a full put+get round within {RECOVERY_BOUND_S:.0f} s: {recovered}"
        )
        # Blocks stored before the kill survive it (the oplog) and read exactly through either replica,
        # except those of the last moments: the standby polls the oplog (every second by default),
        # so what the leader took in just before it died can be gone (a miss, never wrong bytes).
        before = [(t, k) for s in stored for t, k in s if t < killed_at]
        lost: list[float] = []
        for n, replica in enumerate(replicas):
            keys = [k for _, k in before]
            results = [
                r for i in range(0, len(keys), 256) for r in replica.get(sessions[n], *keys[i : i + 256])
            ]
            assert all(
                r.value == _value_of(k) for k, r in zip(keys, results, strict=True) if r.status == pb.HIT
            )
            lost = [killed_at - t for (t, _), r in zip(before, results, strict=True) if r.status != pb.HIT]
            assert all(age < OPLOG_LAG_S for age in lost), (
                f"blocks stored {max(lost):.1f} s before the kill are gone ({len(lost)} of {len(before)})"
            )
        print(
            f"{len(lost)} of {len(before)} blocks stored before the kill lost with it, the oldest "
            f"{max(lost, default=0):.2f} s before it"
        )
        # Strict stays strict through both replicas.
        for n, replica in enumerate(replicas):
            refused(replica, ns, f"engine-other-{n}", timeout_s=RECOVERY_BOUND_S)
            assert replica.open(ns, ESTABLISHED, f"engine-again-{n}").session_id
        # GetStats follows the new leader: its figures, not a dead endpoint's error or a standby's zeros.
        for replica in replicas:
            wait_until(partial(_reports_capacity, replica, 64 << 20), 15, "GetStats from the new leader")
            assert replica.stub.GetStats(pb.GetStatsRequest(), timeout=10).keys >= len(before) - len(lost)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        for replica in replicas:
            replica.stop()


def _mooncake_share(cluster: HaMooncakeCluster, killed_at: float) -> str:
    """Mooncake's own share: seconds from the kill until the new leader's /health said it serves and
    until it counted the storage segment again (before that it answers every object absent)."""

    def after(at: float | None) -> str:
        return "?" if at is None else f"{at - killed_at:.1f} s"

    return (
        f"new leader serving after {after(cluster.serving_at)}, "
        f"segment re-mounted after {after(cluster.mounted_at)}"
    )


def _reports_capacity(replica: Replica, capacity: int) -> bool:
    """GetStats reports the cluster's capacity (False while it answers UNAVAILABLE: none leads yet)."""
    try:
        return int(replica.stub.GetStats(pb.GetStatsRequest(), timeout=10).capacity_bytes) == capacity
    except grpc.RpcError as exc:
        assert exc.code() is grpc.StatusCode.UNAVAILABLE, exc
        return False
