"""An engine that opens a namespace over Mooncake is told which other modes (MODE_SPLIT) and which
sibling layouts of its model (LAYOUT_SPLIT) hold blocks it can never read, whichever replica stored
them and however long ago their engines left."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag_proto import ids

from tests.descriptors import mode, namespace

from .mooncake_cluster import MooncakeCluster
from .mooncake_replicas import Replica

Pair = tuple[Replica, Replica]


@pytest.fixture(scope="module")
def replicas(cluster: MooncakeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    workdir: Path = tmp_path_factory.mktemp("split-replicas")
    pair = (Replica(cluster, workdir, "replica1"), Replica(cluster, workdir, "replica2"))
    for replica in pair:
        replica.start()
    yield pair
    for replica in pair:
        replica.stop()


def fresh_model() -> str:
    return "split-model-" + uuid.uuid4().hex[:10]


def store_and_leave(replica: Replica, ns: pb.NamespaceDescriptor, hashing: pb.HashingMode) -> str:
    """A producer opens, stores two blocks and closes its session: nothing of it stays live."""
    session_id = replica.open(ns, hashing, "producer").session_id
    assert replica.put(session_id, (b"b0", b"block zero"), (b"b1", b"block one")) == [pb.STORED, pb.STORED]
    replica.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=10)
    return ids.mode_id(hashing)


def test_consumer_through_replica_two_is_told_of_the_mode_a_gone_producer_stored_through_replica_one(
    replicas: Pair,
) -> None:
    one, two = replicas
    ns = namespace(fresh_model())
    producer_mode = store_and_leave(one, ns, mode(lookahead=1))
    opened = two.open(ns, mode(lookahead=0), "consumer")
    [split] = [w for w in opened.warnings if w.kind == "MODE_SPLIT"]
    assert split.other_mode_id == producer_mode
    assert [(d.field, d.established, d.requested) for d in split.diffs] == [("lookahead_tokens", "1", "0")]
    assert producer_mode in split.message and "lookahead_tokens 1 there, 0 here" in split.message


def test_consumer_through_the_same_replica_is_told_after_the_producer_left(replicas: Pair) -> None:
    one, _ = replicas
    ns = namespace(fresh_model())
    producer_mode = store_and_leave(one, ns, mode(lookahead=1))
    opened = one.open(ns, mode(lookahead=0), "consumer")
    assert [(w.kind, w.other_mode_id) for w in opened.warnings] == [("MODE_SPLIT", producer_mode)]


def test_consumer_in_a_sibling_layout_is_told_which_namespace_holds_the_models_blocks(
    replicas: Pair,
) -> None:
    one, two = replicas
    eagle = namespace(fresh_model())
    eagle.kv_layout = "g0:FullAttentionSpec:bs16:page65536:layers5"  # the drafter's layer too
    plain = pb.NamespaceDescriptor()
    plain.CopyFrom(eagle)
    plain.kv_layout = "g0:FullAttentionSpec:bs16:page65536:layers4"
    store_and_leave(one, eagle, mode(lookahead=1))
    opened = two.open(plain, mode(lookahead=0), "consumer")
    [layout] = [w for w in opened.warnings if w.kind == "LAYOUT_SPLIT"]
    assert layout.other_namespace_id == ids.namespace_id(eagle)
    assert [(d.field, d.established, d.requested) for d in layout.diffs] == [
        ("kv_layout", eagle.kv_layout, plain.kv_layout)
    ]
    assert ids.namespace_id(eagle) in layout.message and "kv_layout" in layout.message
    # Nothing of another mode sits in the consumer's own namespace.
    assert not [w for w in opened.warnings if w.kind == "MODE_SPLIT"]
