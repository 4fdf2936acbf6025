"""KV events against a real server on 127.0.0.1 and a real ZMQ subscriber: what a router sees of the
blocks entering and leaving the store, the bounds that keep a slow subscriber off the put path, and
who may subscribe (docs/kv-events.md)."""

from __future__ import annotations

import errno
import json
import os
import struct
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import zmq
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_store.app.server import RunningServer, start_server
from kvtag_store.backends.base import BlockKey, KeyStatus
from kvtag_store.backends.memory import MemoryBackend, MemoryCensus
from kvtag_store.config import ServiceConfig
from kvtag_store.events import wire
from kvtag_store.events.options import EventOptions
from kvtag_store.events.subscriber import Received, Subscriber, fetch_sources
from kvtag_store.security.options import Security
from kvtag_store.security.tokens import TokenRegistry

from tests.descriptors import PROBE, mode, namespace
from tests.net import free_port, wait_until

from ..helpers import Store
from ..security_harness import write_tokens

VALUE = 4096


@dataclass
class EventStore:
    store: Store
    metrics: str  # http://127.0.0.1:PORT of the status port
    subscribers: list[Subscriber] = field(default_factory=list)

    @property
    def server(self) -> RunningServer:
        return self.store.server

    def subscribe(self, curve: dict[str, str] | None = None, **kwargs: Any) -> Subscriber:
        publisher = self.server.events
        assert publisher is not None
        subscriber = Subscriber(publisher.endpoint, publisher.replay_endpoint, curve=curve, **kwargs)
        self.subscribers.append(subscriber)
        return subscriber

    def sources(self, token: str | None = None) -> dict[str, Any]:
        return fetch_sources(self.metrics, token)


def started(
    capacity: int = 64 << 20,
    events: EventOptions | None = None,
    security: Security | None = None,
    disk_dir: Path | None = None,
    listen: str = "127.0.0.1:0",
    shm_dir: Path | None = None,
) -> EventStore:
    backend = MemoryBackend(
        capacity,
        shm_dir=str(shm_dir) if shm_dir is not None else None,
        disk_dir=str(disk_dir) if disk_dir is not None else None,
        disk_capacity=4 * capacity if disk_dir is not None else 0,
        prefault="lazy",
    )
    server = start_server(
        backend,
        MemoryCensus(),
        ServiceConfig(),
        listen=listen,
        metrics_listen="127.0.0.1:0",
        security=security,
        events=events or EventOptions(listen="127.0.0.1:0", flush_ms=2),
    )
    channel = grpc.insecure_channel(server.address)
    stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
    store = Store(server=server, stub=stub, backend=backend, channel=channel)
    return EventStore(store, f"http://{server.metrics_address}")


@pytest.fixture
def make_event_store() -> Iterator[Callable[..., EventStore]]:
    running: list[EventStore] = []

    def factory(**kwargs: Any) -> EventStore:
        running.append(started(**kwargs))
        return running[-1]

    yield factory
    for event_store in running:
        for subscriber in event_store.subscribers:
            subscriber.close()
        assert event_store.store.channel is not None
        event_store.store.channel.close()
        event_store.server.stop(grace=0)


def collect(
    subscriber: Subscriber, until: Callable[[list[Received]], bool], timeout_s: float = 10.0
) -> list[Received]:
    """Batches (gaps filled by replay) until `until` holds of them; fails after timeout_s."""
    got: list[Received] = []
    wait_until(lambda: _more(subscriber, got) or until(got), timeout_s, "the expected KV events")
    return got


def _more(subscriber: Subscriber, got: list[Received]) -> bool:
    got.extend(subscriber.batches(0.05))
    return False


def events_of(batches: list[Received], kind: type, topic: str | None = None) -> list[tuple[str, Any]]:
    return [
        (b.topic, e)
        for b in batches
        for e in b.batch.events
        if isinstance(e, kind) and (topic is None or b.topic == topic)
    ]


def connected(subscriber: Subscriber, event_store: EventStore, session_id: str) -> None:
    """Wait until the subscriber's SUB is joined (ZMQ's slow joiner): put a marker until it arrives."""
    got: list[Received] = []

    def arrived() -> bool:
        event_store.store.put(session_id, (os.urandom(16), b"m"))
        got.extend(subscriber.batches(0.1))
        return bool(got)

    wait_until(arrived, 10, "the subscriber to join")


def test_each_stored_block_is_one_block_stored_with_its_key_medium_group_and_block_size(
    make_event_store: Callable[..., EventStore],
) -> None:
    event_store = make_event_store()
    subscriber = event_store.subscribe()
    opened = event_store.store.open()
    connected(subscriber, event_store, opened.session_id)
    keys = [f"block-{i}".encode() for i in range(20)]
    assert event_store.store.put(opened.session_id, *[(k, b"v" * VALUE) for k in keys]) == [pb.STORED] * 20

    topic = wire.topic(opened.namespace_id, opened.mode_id)
    batches = collect(subscriber, lambda got: len(events_of(got, wire.BlockStored, topic)) >= 20)
    stored = [e for _, e in events_of(batches, wire.BlockStored, topic)]
    assert [e.block_hashes for e in stored] == [[k] for k in keys], "one BlockStored per block, in put order"
    assert {e.medium for e in stored} == {"CPU"}
    assert {e.group_idx for e in stored} == {0}
    assert {e.block_size for e in stored} == {mode().hash_block_size}
    assert all(e.token_ids == [] and e.parent_block_hash is None for e in stored)
    seqs = [b.seq for b in batches]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), "sequence numbers only increase"


def test_eviction_publishes_block_removed_for_the_evicted_keys(
    make_event_store: Callable[..., EventStore],
) -> None:
    event_store = make_event_store(capacity=8 * VALUE)
    subscriber = event_store.subscribe()
    opened = event_store.store.open()
    topic = wire.topic(opened.namespace_id, opened.mode_id)
    keys = [f"evict-{i}".encode() for i in range(16)]
    for key in keys:  # one put each: the first ones are the least recently used
        assert event_store.store.put(opened.session_id, (key, b"x" * VALUE)) == [pb.STORED]

    batches = collect(subscriber, lambda got: len(events_of(got, wire.BlockRemoved, topic)) >= 8, 10)
    removed = [e for _, e in events_of(batches, wire.BlockRemoved, topic)]
    assert [e.block_hashes[0] for e in removed][:8] == keys[:8], "the least recently used leave first"
    assert {e.medium for e in removed} == {"CPU"}
    assert event_store.server.events is not None
    assert event_store.server.events.counts().events["BlockRemoved"] >= 8


def test_a_restart_without_disk_clears_every_topic_and_announces_nothing_old(tmp_path: Path) -> None:
    port, replay = free_port(), free_port()
    events = EventOptions(listen=f"127.0.0.1:{port}", replay_listen=f"127.0.0.1:{replay}", flush_ms=2)
    first = started(events=events)
    subscriber = Subscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
    try:
        opened = first.store.open()
        connected(subscriber, first, opened.session_id)
        assert first.store.put(opened.session_id, (b"old-block", b"v")) == [pb.STORED]
        collect(
            subscriber,
            lambda got: any(e.block_hashes == [b"old-block"] for _, e in events_of(got, wire.BlockStored)),
        )
        first.server.stop(grace=0)

        second = started(events=events)
        try:
            reopened = second.store.open()
            # The subscriber reconnects by itself (puts until it has: a batch sent before is not seen
            # live), sees the sequence begin again and replays the new store's from 0.
            batches: list[Received] = []

            def new_blocks_seen() -> bool:
                assert second.store.put(reopened.session_id, (os.urandom(8), b"v")) == [pb.STORED]
                batches.extend(subscriber.batches(0.1))
                return any(b.topic == wire.STORE_TOPIC for b in batches)

            wait_until(new_blocks_seen, 10, "the restarted store's events")
        finally:
            second.server.stop(grace=0)
    finally:
        subscriber.close()
    assert second.server.events is not None
    after = batches[[b.seq for b in batches].index(second.server.events.first_seq) :]
    assert after[0].topic == wire.STORE_TOPIC and after[0].batch.events == [wire.AllBlocksCleared()]
    assert after[0].replayed, "the restart was a gap in the sequence, filled from the replay socket"
    old = [e for _, e in events_of(after, wire.BlockStored) if e.block_hashes == [b"old-block"]]
    assert old == [], "a store without its disk tier announces none of the blocks it lost"


def test_a_restart_on_its_disk_tier_clears_then_announces_each_block_still_held(tmp_path: Path) -> None:
    port, replay = free_port(), free_port()
    events = EventOptions(listen=f"127.0.0.1:{port}", replay_listen=f"127.0.0.1:{replay}", flush_ms=2)
    first = started(events=events, disk_dir=tmp_path / "disk")
    opened = first.store.open()
    keys = [f"kept-{i}".encode() for i in range(5)]
    assert first.store.put(opened.session_id, *[(k, b"d" * VALUE) for k in keys]) == [pb.STORED] * 5
    first.server.stop(grace=0)  # closing the backend writes memory's blocks to the disk tier

    second = started(events=events, disk_dir=tmp_path / "disk")
    subscriber = Subscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
    try:
        batches = subscriber.replay(0)
    finally:
        subscriber.close()
        second.server.stop(grace=0)
    assert second.server.events is not None
    assert batches[0].seq == second.server.events.first_seq
    assert batches[0].batch.events == [wire.AllBlocksCleared()]
    topic = wire.topic(opened.namespace_id, opened.mode_id)
    restored = events_of(batches[1:], wire.BlockStored, topic)
    assert sorted(e.block_hashes[0] for _, e in restored) == sorted(keys)
    assert {e.medium for _, e in restored} == {"DISK"}


def test_the_disk_writer_announces_each_block_it_writes_as_disk(
    make_event_store: Callable[..., EventStore], tmp_path: Path
) -> None:
    event_store = make_event_store(disk_dir=tmp_path / "disk")
    subscriber = event_store.subscribe()
    opened = event_store.store.open()
    connected(subscriber, event_store, opened.session_id)
    keys = [f"spill-{i}".encode() for i in range(6)]
    assert event_store.store.put(opened.session_id, *[(k, b"s" * VALUE) for k in keys]) == [pb.STORED] * 6
    disk = event_store.store.backend.disk_tier()
    assert disk is not None and disk.drain()
    topic = wire.topic(opened.namespace_id, opened.mode_id)
    batches = collect(
        subscriber,
        lambda got: (
            {k for k in keys}
            <= {e.block_hashes[0] for _, e in events_of(got, wire.BlockStored, topic) if e.medium == "DISK"}
        ),
    )
    on_disk = [e for _, e in events_of(batches, wire.BlockStored, topic) if e.medium == "DISK"]
    assert {e.block_hashes[0] for e in on_disk} >= set(keys)


def _listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (its socket inodes matched in /proc/net/tcp{,6})."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_events_off_opens_no_event_socket_and_no_route(tmp_path: Path) -> None:
    from tests.store_process import StoreProcess

    with StoreProcess(tmp_path / "off.log") as off:
        assert off.proc is not None
        assert _listening_ports(off.proc.pid) == {off.port}, "only the gRPC port: no event socket"
    port = free_port()
    with StoreProcess(tmp_path / "on.log", "--kv-events-listen", f"127.0.0.1:{port}") as on:
        assert on.proc is not None
        assert _listening_ports(on.proc.pid) == {on.port, port, port + 1}
        assert f"tcp://127.0.0.1:{port}" in on.log_tail()


def test_route_answers_404_with_events_off() -> None:
    backend = MemoryBackend(1 << 20, prefault="lazy")
    server = start_server(backend, MemoryCensus(), ServiceConfig(), metrics_listen="127.0.0.1:0")
    try:
        assert server.events is None
        with pytest.raises(urllib.error.HTTPError) as refused:
            fetch_sources(f"http://{server.metrics_address}", None)
        assert refused.value.code == 404
        assert b"--kv-events-listen" in refused.value.read()
    finally:
        server.stop(grace=0)


def test_a_stalled_subscriber_never_holds_a_put_its_misses_are_counted_and_memory_stays_bounded(
    make_event_store: Callable[..., EventStore],
) -> None:
    options = EventOptions(listen="127.0.0.1:0", flush_ms=2, hwm=4, replay_batches=64, replay_bytes=256 << 10)
    event_store = make_event_store(capacity=256 << 20, events=options)
    stalled = event_store.subscribe(rcvhwm=1)  # connected, subscribed, never reads
    stalled._sub.setsockopt(zmq.RCVBUF, 4096)
    keeping_up = event_store.subscribe()
    opened = event_store.store.open()
    connected(keeping_up, event_store, opened.session_id)
    connected(stalled, event_store, opened.session_id)  # joined (its first batch read), then stalls
    publisher = event_store.server.events
    assert publisher is not None
    topic = wire.topic(opened.namespace_id, opened.mode_id)
    seen: set[bytes] = set()
    puts = 0
    while publisher.counts().missed_batches == 0 or puts < 200:
        keys = [os.urandom(32) for _ in range(256)]
        assert event_store.store.put(opened.session_id, *[(k, b"p") for k in keys]) == [pb.STORED] * 256
        for batch in keeping_up.batches(0.001):
            seen.update(e.block_hashes[0] for _, e in events_of([batch], wire.BlockStored, topic))
        puts += 1
        assert puts < 2000, "the stalled subscriber never filled its queue"
        if puts % 50 == 0:
            counts = publisher.counts()
            assert counts.replay_buffer_bytes <= options.replay_bytes
            assert counts.replay_buffer_batches <= options.replay_batches
    stored_total = publisher.counts().events["BlockStored"]
    collect(keeping_up, lambda got: _saw(seen, got, topic) >= stored_total - 2 * 1, 20)
    counts = publisher.counts()
    assert counts.missed_batches > 0
    assert counts.dropped_events == 0
    assert len(seen) >= puts * 256, "the subscriber keeping up saw every stored block live"
    metrics = urllib.request.urlopen(f"{event_store.metrics}/metrics").read().decode()
    missed = [line for line in metrics.splitlines() if line.startswith("kvtag_kv_event_batches_missed_total")]
    assert missed and float(missed[0].split()[-1]) == counts.missed_batches


def _saw(seen: set[bytes], got: list[Received], topic: str) -> int:
    seen.update(e.block_hashes[0] for _, e in events_of(got, wire.BlockStored, topic))
    got.clear()
    return len(seen)


def test_a_full_queue_drops_new_events_and_counts_them() -> None:
    from kvtag_store.events.publisher import EventPublisher

    publisher = EventPublisher(EventOptions(listen="127.0.0.1:0", queue_events=10), lambda _n, _m: 16)
    try:  # not started: nothing drains the queue
        for i in range(25):
            publisher.stored("ns", "mode", (0, BlockKey(bytes([i]))), "memory")
        assert publisher.counts().queued_events == 10
        assert publisher.counts().dropped_events == 15
    finally:
        publisher.stop()


def test_the_replay_socket_answers_kept_batches_from_a_seq_and_ends_with_end_seq(
    make_event_store: Callable[..., EventStore],
) -> None:
    event_store = make_event_store()
    opened = event_store.store.open()
    for i in range(5):
        assert event_store.store.put(opened.session_id, (f"r-{i}".encode(), b"v")) == [pb.STORED]
    publisher = event_store.server.events
    assert publisher is not None
    wait_until(lambda: publisher.counts().events["BlockStored"] == 5, 5, "five BlockStored")
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    requester = context.socket(zmq.DEALER)
    try:
        requester.connect(publisher.replay_endpoint)
        requester.send_multipart((b"", (publisher.first_seq + 2).to_bytes(8, "big")))
        frames = []
        while True:
            assert requester.poll(5000)
            frame = requester.recv_multipart()
            frames.append(frame)
            if frame[2] == wire.END_SEQ:
                break
    finally:
        requester.close(linger=0)
        context.term()
    assert frames[-1] == [b"", b"", wire.END_SEQ, b""]
    first = publisher.first_seq
    assert [int.from_bytes(f[2], "big") for f in frames[:-1]] == list(
        range(first + 2, first + publisher.counts().batches)
    )
    assert all(f[1] == wire.topic(opened.namespace_id, opened.mode_id).encode() for f in frames[:-1])


def test_discovery_lists_each_mode_of_a_namespace_with_its_topic_fields_and_live_engines(
    make_event_store: Callable[..., EventStore],
) -> None:
    event_store = make_event_store()
    subscriber = event_store.subscribe()
    legacy = event_store.store.open(engine_id="engine-legacy", hashing=mode(lookahead=0))
    eagle = event_store.store.open(engine_id="engine-eagle", hashing=mode(lookahead=1))
    assert legacy.namespace_id == eagle.namespace_id and legacy.mode_id != eagle.mode_id
    connected(subscriber, event_store, legacy.session_id)
    assert event_store.store.put(legacy.session_id, (b"legacy-0", b"v")) == [pb.STORED]
    assert event_store.store.put(eagle.session_id, (b"eagle-0", b"v")) == [pb.STORED]

    doc = event_store.sources()
    publisher = event_store.server.events
    assert publisher is not None
    assert doc["publisher"]["endpoint"] == publisher.endpoint
    assert doc["publisher"]["replay_endpoint"] == publisher.replay_endpoint
    assert doc["curve"] is None, "no tokens: no CURVE keys"
    [ns] = doc["namespaces"]
    by_mode = {m["mode_id"]: m for m in ns["modes"]}
    assert by_mode[legacy.mode_id]["engines"] == [{"engine_id": "engine-legacy", "labels": {}}]
    assert by_mode[eagle.mode_id]["engines"] == [{"engine_id": "engine-eagle", "labels": {}}]
    assert by_mode[eagle.mode_id]["fields"]["lookahead_tokens"] == 1
    assert by_mode[legacy.mode_id]["fields"]["lookahead_tokens"] == 0

    wanted = {b"legacy-0", b"eagle-0"}
    batches = collect(
        subscriber, lambda got: wanted <= {e.block_hashes[0] for _, e in events_of(got, wire.BlockStored)}
    )
    topics = {e.block_hashes[0]: t for t, e in events_of(batches, wire.BlockStored)}
    assert topics[b"legacy-0"] == by_mode[legacy.mode_id]["topic"]
    assert topics[b"eagle-0"] == by_mode[eagle.mode_id]["topic"]


# -- who may subscribe: admin only ------------------------------------------------

GRANTS = [
    ("engine-a", "engine", ["tenant-a"]),
    ("viewer-a", "viewer", ["tenant-a"]),
    ("admin-a", "admin", ["tenant-a"]),
    ("admin", "admin", ["*"]),
]


def test_with_tokens_only_a_store_wide_admin_gets_the_sources_and_only_its_key_subscribes(
    make_event_store: Callable[..., EventStore], tmp_path: Path
) -> None:
    tokens = write_tokens(tmp_path / "tokens.toml", GRANTS)
    security = Security(tokens=TokenRegistry.from_file(tmp_path / "tokens.toml"))
    event_store = make_event_store(security=security)

    for name, status in (("engine-a", 403), ("viewer-a", 403), ("admin-a", 403), (None, 401)):
        with pytest.raises(urllib.error.HTTPError) as refused:
            event_store.sources(tokens[name] if name else None)
        assert refused.value.code == status, name
    doc = event_store.sources(tokens["admin"])
    curve = doc["curve"]
    assert set(curve) == {"server_public_key", "subscriber_public_key", "subscriber_secret_key"}

    admin = event_store.subscribe(curve=curve)
    public, secret = zmq.curve_keypair()
    forged = dict(curve, subscriber_public_key=public.decode(), subscriber_secret_key=secret.decode())
    impostor = event_store.subscribe(curve=forged)
    plain = event_store.subscribe()

    channel = event_store.store.channel
    assert channel is not None
    stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
    auth = [("authorization", f"Bearer {tokens['engine-a']}")]
    opened = stub.OpenSession(
        pb.OpenSessionRequest(
            engine_id="e", namespace=namespace(tenant="tenant-a"), mode=mode(), probe_keys=[b"p0", b"p1"]
        ),
        metadata=auth,
        timeout=5,
    )
    got: list[Received] = []

    def admin_saw_a_put() -> bool:
        put = pb.PutRequest(
            session_id=opened.session_id, items=[pb.PutItem(block=pb.BlockRef(key=os.urandom(8)), value=b"v")]
        )
        stub.Put(put, metadata=auth, timeout=5)
        got.extend(admin.batches(0.1))
        return bool(events_of(got, wire.BlockStored))

    wait_until(admin_saw_a_put, 10, "the admin subscriber's first event")
    assert list(impostor.batches(0.3)) == [], "a key the store did not hand out gets nothing"
    assert list(plain.batches(0.3)) == [], "a subscriber without CURVE gets nothing"
    assert event_store.server.events is not None
    assert event_store.server.events.counts().refused_handshakes > 0


def test_a_non_loopback_event_address_needs_tls_and_tokens_or_insecure() -> None:
    import argparse

    from kvtag_store.app.cli import build_parser
    from kvtag_store.events import options

    args = build_parser().parse_args(["serve", "--kv-events-listen", "0.0.0.0:5557"])
    with pytest.raises(argparse.ArgumentTypeError, match=r"--kv-events-listen 0\.0\.0\.0:5557 is reachable"):
        options.build(args, Security())
    args = build_parser().parse_args(["serve", "--kv-events-listen", "0.0.0.0:5557", "--insecure"])
    built = options.build(args, Security())
    assert built is not None and built.replay_address() == "0.0.0.0:5558"
    assert options.build(build_parser().parse_args(["serve"]), Security()) is None, "off by default"


def test_the_reference_subscriber_prints_decoded_events(
    make_event_store: Callable[..., EventStore], capsys: pytest.CaptureFixture[str]
) -> None:
    from kvtag_store.app.cli import build_parser
    from kvtag_store.events.subscriber import run

    event_store = make_event_store()
    opened = event_store.store.open()
    assert (
        event_store.store.put(opened.session_id, (b"printed-0", b"v"), (b"printed-1", b"v"))
        == [pb.STORED] * 2
    )
    publisher = event_store.server.events
    assert publisher is not None
    wait_until(lambda: publisher.counts().events["BlockStored"] == 2, 5, "two BlockStored")
    args = build_parser().parse_args(
        ["events", "--sources", event_store.metrics, "--from-seq", "0", "--count", "3", "--json"]
    )
    import io

    out = io.StringIO()
    assert run(args, out) == 0
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0]["event"]["type"] == "AllBlocksCleared" and lines[0]["topic"] == wire.STORE_TOPIC
    assert [line["event"]["block_hashes"] for line in lines[1:]] == [
        [b"printed-0".hex()],
        [b"printed-1".hex()],
    ]
    assert {line["mode_id"] for line in lines[1:]} == {opened.mode_id}
    assert {line["event"]["medium"] for line in lines[1:]} == {"CPU"}


@dataclass
class Recorder:
    """A BlockEvents that keeps what it is told, in order."""

    told: list[tuple[str, str, str, bytes, str]] = field(default_factory=list)

    def stored(self, namespace_id: str, mode_id: str, address: tuple[int, bytes], tier: str) -> None:
        self.told.append(("stored", namespace_id, mode_id, address[1], tier))

    def removed(self, namespace_id: str, mode_id: str, address: tuple[int, bytes], tier: str) -> None:
        self.told.append(("removed", namespace_id, mode_id, address[1], tier))


def test_the_disk_lru_tells_each_record_it_drops_as_removed_from_disk(tmp_path: Path) -> None:
    backend = MemoryBackend(
        64 << 10,
        disk_dir=str(tmp_path / "disk"),
        disk_capacity=128 << 10,
        disk_segment_bytes=16 << 10,
        prefault="lazy",
    )
    recorder = Recorder()
    try:
        backend.observe_blocks(recorder)
        keys = [f"lru-{i}".encode() for i in range(120)]  # 480 KiB through 64 KiB of memory, 128 KiB of disk
        for key in keys:
            assert backend.put("ns", "mode-a", (0, BlockKey(key)), b"d" * VALUE).outcome.name == "STORED"
            disk = backend.disk_tier()
            assert disk is not None and disk.drain()
    finally:
        backend.close()
    on_disk: set[bytes] = set()
    for kind, namespace_id, mode_id, key, tier in recorder.told:
        assert (namespace_id, mode_id) == ("ns", "mode-a")
        if tier == "disk":
            if kind == "stored":
                on_disk.add(key)
            else:
                assert key in on_disk, "a record leaves the disk only after it was announced there"
                on_disk.discard(key)
    removed_from_disk = [
        key for kind, _, _, key, tier in recorder.told if kind == "removed" and tier == "disk"
    ]
    assert removed_from_disk, "the disk LRU dropped segments"
    assert removed_from_disk[0] in keys[:40], "the least recently hit segments go first"
    in_memory = {k for kind, _, _, k, tier in recorder.told if tier == "memory" and kind == "stored"}
    assert in_memory == set(keys)


def _disk_backend(disk: Path) -> MemoryBackend:
    return MemoryBackend(1 << 20, prefault="lazy", disk_dir=str(disk), disk_capacity=16 << 20)


def _restarted_with_records(disk: Path, keys: list[bytes]) -> tuple[MemoryBackend, Recorder]:
    """A backend that stored `keys` and closed (so they are on disk), restarted on its dir and observed."""
    first = _disk_backend(disk)
    for key in keys:
        first.put("ns", "mode-a", (0, BlockKey(key)), key * 512)
    first.close()
    again, recorder = _disk_backend(disk), Recorder()
    again.observe_blocks(recorder)
    return again, recorder


def test_a_restarted_disk_tier_is_told_first_and_a_record_failing_its_checks_is_removed(
    tmp_path: Path,
) -> None:
    from kvtag_store.backends.memory.disk import records

    keys = [f"chk-{i}".encode() for i in range(4)]
    again, recorder = _restarted_with_records(tmp_path / "disk", keys)
    try:
        assert recorder.told == [("stored", "ns", "mode-a", key, "disk") for key in keys]
        (segment,) = sorted((tmp_path / "disk").glob("tenants/*/*.seg"))
        data = bytearray(segment.read_bytes())
        offset = 0
        for _ in range(2):  # the third record's first value byte
            record = records.decode_meta(bytes(data[offset : offset + records.MAX_META]))
            offset += record.meta_length + record.value_length
        offset += records.decode_meta(bytes(data[offset : offset + records.MAX_META])).meta_length
        data[offset] ^= 0x01
        segment.write_bytes(bytes(data))
        del recorder.told[:]
        (result,) = again.get("ns", "mode-a", [(0, BlockKey(keys[2]))])
        assert result.status is KeyStatus.MISS
        assert recorder.told == [("removed", "ns", "mode-a", keys[2], "disk")]
    finally:
        again.close()


def test_a_disk_tier_turned_off_removes_every_record_from_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [f"off-{i}".encode() for i in range(3)]
    again, recorder = _restarted_with_records(tmp_path / "disk", keys)
    try:
        del recorder.told[:]

        def failing_read(*_: object) -> int:  # a disk that fails reads: the tier turns itself off
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "preadv", failing_read)
        (result,) = again.get("ns", "mode-a", [(0, BlockKey(keys[0]))])
        monkeypatch.undo()
        assert result.status is KeyStatus.MISS
        assert sorted(recorder.told) == sorted(("removed", "ns", "mode-a", key, "disk") for key in keys)
    finally:
        again.close()


def test_a_memory_value_failing_its_checksum_is_removed_from_memory() -> None:
    from ..faults import corrupt_memory_value

    backend, recorder = MemoryBackend(1 << 20, prefault="lazy"), Recorder()
    backend.observe_blocks(recorder)
    backend.put_many(
        "ns", "mode-a", [((0, BlockKey(b"bad")), b"x" * VALUE), ((0, BlockKey(b"good")), b"y" * VALUE)]
    )
    corrupt_memory_value(backend, "ns", (0, BlockKey(b"bad")))
    assert [r.status for r in backend.get("ns", "mode-a", [(0, BlockKey(b"bad"))])] == [KeyStatus.MISS]
    assert recorder.told == [
        ("stored", "ns", "mode-a", b"bad", "memory"),
        ("stored", "ns", "mode-a", b"good", "memory"),
        ("removed", "ns", "mode-a", b"bad", "memory"),
    ]


def _tokens(block: int, n: int = 32) -> list[int]:
    return [block * 1000 + i for i in range(n)]


def _packed(token_ids: list[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def test_token_ids_sent_with_a_put_reach_the_blocks_block_stored_and_sessions_are_told_to_send_them(
    make_event_store: Callable[..., EventStore],
) -> None:
    event_store = make_event_store()
    subscriber = event_store.subscribe()
    opened = event_store.store.open()
    assert opened.wants_token_ids, "a store publishing KV events asks for the token ids"
    connected(subscriber, event_store, opened.session_id)
    keys = [f"tok-{i}".encode() for i in range(4)]
    items = [
        pb.PutItem(
            block=pb.BlockRef(key=k, token_ids=_packed(_tokens(i)) if i != 2 else b""), value=b"v" * 64
        )
        for i, k in enumerate(keys)
    ]
    put = event_store.store.stub.Put(pb.PutRequest(session_id=opened.session_id, items=items), timeout=5)
    assert [r.status for r in put.results] == [pb.STORED] * 4
    topic = wire.topic(opened.namespace_id, opened.mode_id)
    batches = collect(subscriber, lambda got: len(events_of(got, wire.BlockStored, topic)) >= 4)
    by_key = {e.block_hashes[0]: e for _, e in events_of(batches, wire.BlockStored, topic)}
    assert [by_key[k].token_ids for k in keys] == [_tokens(0), _tokens(1), [], _tokens(3)]


def test_token_ids_of_a_shared_memory_put_reach_block_stored(
    make_event_store: Callable[..., EventStore], tmp_path: Path
) -> None:
    from kvtag_client.store import StoreClient

    shm = tmp_path / "shm"
    shm.mkdir()
    event_store = make_event_store(shm_dir=shm)
    subscriber = event_store.subscribe()
    client = StoreClient(
        event_store.server.address,
        engine_id="tokens-shm",
        namespace=namespace(),
        mode=mode(),
        probe_keys=list(PROBE),
    )
    try:
        client.open()
        assert client.wants_token_ids
        connected(subscriber, event_store, event_store.store.open().session_id)
        keys = [f"shm-tok-{i}".encode() for i in range(6)]
        values = [bytes([i]) * (64 << 10) for i in range(6)]
        assert client.data_path == "shared_memory"
        results = client.put(
            [(0, k, v, b"") for k, v in zip(keys, values, strict=True)],
            [_packed(_tokens(i)) for i in range(6)],
        )
        assert results == [pb.STORED] * 6
        topic = wire.topic(client.namespace_id, client.mode_id)
        batches = collect(subscriber, lambda got: len(events_of(got, wire.BlockStored, topic)) >= 6)
        by_key = {e.block_hashes[0]: e for _, e in events_of(batches, wire.BlockStored, topic)}
        assert [by_key[k].token_ids for k in keys] == [_tokens(i) for i in range(6)]
    finally:
        client.close()


def test_token_ids_that_are_not_whole_uint32s_are_refused_and_nothing_is_stored(
    make_event_store: Callable[..., EventStore],
) -> None:
    event_store = make_event_store()
    opened = event_store.store.open()
    bad = pb.PutItem(block=pb.BlockRef(key=b"odd", token_ids=b"\x01\x02\x03"), value=b"v")
    with pytest.raises(grpc.RpcError) as refused:
        event_store.store.stub.Put(pb.PutRequest(session_id=opened.session_id, items=[bad]), timeout=5)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids" in (refused.value.details() or "")
    assert event_store.store.lookup(opened.session_id, b"odd").statuses == [pb.MISS]


def test_a_store_without_events_does_not_ask_for_token_ids() -> None:
    backend = MemoryBackend(8 << 20)
    server = start_server(backend, MemoryCensus(), ServiceConfig(), listen="127.0.0.1:0")
    channel = grpc.insecure_channel(server.address)
    try:
        stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
        store = Store(server=server, stub=stub, backend=backend, channel=channel)
        assert not store.open().wants_token_ids
    finally:
        channel.close()
        server.stop(grace=0)
