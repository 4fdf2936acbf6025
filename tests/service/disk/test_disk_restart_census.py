"""InflightBudget across a restart (census_snapshot): a strict namespace keeps the mode it established,
from the snapshot in the disk dir or, when the snapshot is lost, from the modes of its blocks on disk.

Each "restart" is a fresh server and census over the same directory (real files, real gRPC); the
process-level restarts with the disk tier are in test_disk_restart.py."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_proto import ids
from kvtag_store.app.server import start_server
from kvtag_store.backends.memory import MemoryBackend
from kvtag_store.config import ServiceConfig
from kvtag_store.policy.census_snapshot import SNAPSHOT_NAME, Restored, SnapshotCensus

from tests.descriptors import PROBE, mode, namespace

from ..helpers import Store, error_of

STRICT = ServiceConfig(default_policy=pb.POLICY_STRICT)
LOOKAHEAD, LEGACY = mode(lookahead=1), mode(lookahead=0)

Restart = Callable[..., Store]


@pytest.fixture
def restart(tmp_path: Path) -> Iterator[Restart]:
    """restart(restored=None, config=STRICT) -> a Store whose census reads tmp_path's snapshot; the
    previous one is stopped first, as a process restart would."""
    running: list[Store] = []

    def start(restored: Restored | None = None, config: ServiceConfig = STRICT) -> Store:
        for store in running:
            store.server.stop(grace=0)
            assert store.channel is not None
            store.channel.close()
        running.clear()
        backend = MemoryBackend(8 << 20)
        census = SnapshotCensus(tmp_path / SNAPSHOT_NAME, restored)
        server = start_server(backend, census, config, listen="127.0.0.1:0")
        channel = grpc.insecure_channel(server.address)
        store = Store(server, store_pb2_grpc.KvStoreStub(channel), backend, channel)  # type: ignore[no-untyped-call]
        running.append(store)
        return store

    yield start
    for store in running:
        store.server.stop(grace=0)
        assert store.channel is not None
        store.channel.close()


def test_a_strict_refusal_survives_a_restart(restart: Restart, tmp_path: Path) -> None:
    first = restart().open(hashing=LOOKAHEAD)
    store = restart()
    refusal = error_of(lambda: store.open(engine_id="legacy", hashing=LEGACY))
    assert refusal.reason == "MODE_REFUSED"
    assert refusal.mode_refusal is not None
    assert refusal.mode_refusal.established_mode_id == first.mode_id
    assert [d.field for d in refusal.mode_refusal.diffs] == ["lookahead_tokens"]
    assert store.open(engine_id="again", hashing=LOOKAHEAD).mode_id == first.mode_id
    (report,) = store.diagnose().namespaces
    assert report.established_mode_id == first.mode_id and len(report.refused) == 1
    assert oct((tmp_path / SNAPSHOT_NAME).stat().st_mode & 0o777) == "0o600"


def test_a_probe_reference_survives_a_restart(restart: Restart) -> None:
    restart(config=ServiceConfig()).open(hashing=LOOKAHEAD)
    store = restart(config=ServiceConfig())
    drifted = [bytes(reversed(k)) for k in PROBE]
    answer = store.open(engine_id="other-seed", hashing=LOOKAHEAD, probe=drifted)
    assert [w.kind for w in answer.warnings] == ["PROBE_DISAGREEMENT"]
    assert "engine-a" in answer.warnings[0].message, "the reference engine is the one before the restart"


def test_without_a_snapshot_a_strict_namespace_admits_only_its_blocks_modes(
    restart: Restart, tmp_path: Path
) -> None:
    restart().open(hashing=LOOKAHEAD)
    (tmp_path / SNAPSHOT_NAME).write_text('{"format": "kvtag.census/v1", "modes": {"ns-')  # torn
    ns_id = ids.namespace_id(namespace())
    store = restart(restored={ns_id: (None, frozenset({ids.mode_id(LOOKAHEAD)}))})
    assert (tmp_path / (SNAPSHOT_NAME + ".corrupt")).exists(), "the unreadable snapshot is kept aside"
    refusal = error_of(lambda: store.open(engine_id="legacy", hashing=LEGACY))
    assert refusal.reason == "MODE_REFUSED"
    assert refusal.mode_refusal is not None
    assert refusal.mode_refusal.established_mode_id == ids.mode_id(LOOKAHEAD)
    assert "blocks on the disk tier" in refusal.message
    assert store.open(engine_id="again", hashing=LOOKAHEAD).mode_id == ids.mode_id(LOOKAHEAD)
    # Once established again, the snapshot holds it: the next restart refuses with the field diff.
    store = restart()
    refusal = error_of(lambda: store.open(engine_id="legacy", hashing=LEGACY))
    assert refusal.mode_refusal is not None
    assert [d.field for d in refusal.mode_refusal.diffs] == ["lookahead_tokens"]


def test_a_snapshot_is_replaced_whole_and_names_only_what_admission_needs(
    restart: Restart, tmp_path: Path
) -> None:
    store = restart()
    for tenant in ("a", "b"):
        store.open(hashing=LOOKAHEAD, ns=namespace(tenant=tenant))
    snapshot = json.loads((tmp_path / SNAPSHOT_NAME).read_text())
    assert snapshot["format"] == "kvtag.census/v1"
    assert set(snapshot["modes"]) == {ids.namespace_id(namespace(tenant=t)) for t in ("a", "b")}
    assert not (tmp_path / (SNAPSHOT_NAME + ".tmp")).exists()
