"""Two kvtag-store processes over one Mooncake cluster enforce one census and share blocks."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag_proto import ids
from kvtag_proto.errors import parse_error

from tests.descriptors import mode, namespace

from .mooncake_cluster import MooncakeCluster
from .mooncake_replicas import Replica

Pair = tuple[Replica, Replica]
STRICT_MODEL = "strict-model-" + uuid.uuid4().hex[:8]


@pytest.fixture(scope="module")
def replicas(cluster: MooncakeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    workdir: Path = tmp_path_factory.mktemp("replicas")
    strict = f"--namespace-policy={ids.namespace_id(namespace(STRICT_MODEL))}=strict"
    pair = (
        Replica(cluster, workdir, "replica1", [strict]),
        Replica(cluster, workdir, "replica2", [strict]),
    )
    for replica in pair:
        replica.start()
    yield pair
    for replica in pair:
        replica.stop()


def fresh_model() -> str:
    return "model-" + uuid.uuid4().hex[:10]


def test_block_stored_through_replica_one_is_a_hit_through_replica_two(
    replicas: Pair,
) -> None:
    one, two = replicas
    ns = namespace(fresh_model())
    s1 = one.open(ns, mode(), "engine-1").session_id
    s2 = two.open(ns, mode(), "engine-2").session_id
    assert one.put(s1, (b"k0", b"block zero"), (b"k1", b"block one")) == [pb.STORED, pb.STORED]
    found = two.lookup(s2, b"k0", b"k1", b"k2")
    assert found.prefix_length == 2
    assert list(found.statuses) == [pb.HIT, pb.HIT, pb.MISS]
    assert [r.value for r in two.get(s2, b"k0", b"k1")] == [b"block zero", b"block one"]
    # The second replica's put of the same block is idempotent, not a second store.
    assert two.put(s2, (b"k0", b"block zero")) == [pb.ALREADY_PRESENT]


def test_strict_mode_established_through_replica_one_refuses_another_mode_on_replica_two(
    replicas: Pair,
) -> None:
    one, two = replicas
    ns = namespace(STRICT_MODEL)
    one.open(ns, mode(lookahead=1), "engine-1")
    with pytest.raises(grpc.RpcError) as refused:
        two.open(ns, mode(lookahead=0), "engine-2")
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    error = parse_error(refused.value)
    assert error is not None and error.reason == "MODE_REFUSED"
    # The established mode itself is still admitted on replica 2.
    assert two.open(ns, mode(lookahead=1), "engine-3").session_id


def test_isolate_tag_from_replica_one_is_enforced_on_replica_two(replicas: Pair) -> None:
    one, two = replicas
    ns = namespace(fresh_model())
    s1 = one.open(ns, mode(lookahead=1), "engine-1").session_id
    s2 = two.open(ns, mode(lookahead=0), "engine-2").session_id
    assert one.put(s1, (b"k", b"lookahead bytes")) == [pb.STORED]
    assert list(two.lookup(s2, b"k").statuses) == [pb.MODE_MISMATCH]
    [result] = two.get(s2, b"k")
    assert result.status == pb.MODE_MISMATCH and result.value == b""
    assert two.put(s2, (b"k", b"legacy bytes")) == [pb.CONFLICT]
    assert [r.value for r in one.get(s1, b"k")] == [b"lookahead bytes"]


def test_probe_recorded_through_replica_one_flags_disagreement_on_replica_two(
    replicas: Pair,
) -> None:
    one, two = replicas
    ns = namespace(fresh_model())
    one.open(ns, mode(), "engine-1", probe=[b"seed-a-0", b"seed-a-1"])
    opened = two.open(ns, mode(), "engine-2", probe=[b"seed-b-0", b"seed-b-1"])
    assert [w.kind for w in opened.warnings] == ["PROBE_DISAGREEMENT"]


def test_probe_disagreement_is_refused_on_replica_two_when_strict(replicas: Pair) -> None:
    one, two = replicas
    ns = namespace(STRICT_MODEL)
    one.open(ns, mode(lookahead=1), "engine-1")
    with pytest.raises(grpc.RpcError) as refused:
        two.open(ns, mode(lookahead=1), "engine-2", probe=[b"drifted-0", b"drifted-1"])
    error = parse_error(refused.value)
    assert error is not None and error.reason == "PROBE_DISAGREEMENT"


def test_restarted_replica_serves_what_mooncake_still_holds(replicas: Pair) -> None:
    one, _ = replicas
    ns = namespace(fresh_model())
    s1 = one.open(ns, mode(), "engine-1").session_id
    assert one.put(s1, (b"kept", b"survives a restart")) == [pb.STORED]
    one.stop()
    one.start()
    s1 = one.open(ns, mode(), "engine-1").session_id
    assert [r.value for r in one.get(s1, b"kept")] == [b"survives a restart"]


def test_both_replicas_report_the_clusters_figures(replicas: Pair) -> None:
    one, two = replicas
    ns = namespace(fresh_model())
    s1 = one.open(ns, mode(), "engine-1").session_id
    one.put(s1, (b"counted", bytes(4096)))
    first = one.stub.GetStats(pb.GetStatsRequest(), timeout=10)
    second = two.stub.GetStats(pb.GetStatsRequest(), timeout=10)
    assert first.backend == second.backend == "mooncake"
    assert first.capacity_bytes == second.capacity_bytes > 0
    assert second.used_bytes >= 4096
    assert second.keys >= 1
