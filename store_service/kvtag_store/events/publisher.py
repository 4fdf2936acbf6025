"""The publisher: queues what the backends tell it (BlockEvents), and on its own thread turns the
queue into vLLM event batches, one per topic, on a ZMQ PUB socket, keeping the last ones for replay on
a ROUTER socket.

Bounds, so that no subscriber reaches back into a put:
- a backend's call only appends to a queue (O(1) under the backend's lock); past `queue_events` the
  event is dropped and counted (`dropped_events`: lost for every subscriber);
- the PUB socket's send never blocks. A batch that a subscriber has no room for (its `hwm` batches
  are queued) is still sent to the others and counted (`missed_batches`); the one that missed it sees a
  gap in the sequence and asks the replay socket for it;
- the replay buffer keeps at most `replay_batches` batches and `replay_bytes` bytes, and one replay
  answer sends at most `hwm` batches (ask again from the last one received).

Framing is vLLM's ZmqEventPublisher's: a batch goes out as (topic, seq as 8 bytes big-endian, payload);
seq counts every batch of this store, across topics, so a subscriber to the whole store sees it increase
by one. It starts at the start-up time in microseconds (`first_seq`), with an AllBlocksCleared on the
store topic (kvtag/*): a restart is a gap like any other, and the replay that fills it begins with that
AllBlocksCleared. A replay request is (identity, b"", start seq) on the ROUTER; the answer is
(identity, b"", topic, seq, payload) per kept batch from `start` on, then (identity, b"", b"", END_SEQ,
b"").
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import zmq
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvtag_store.backends.base import BlockAddress
from kvtag_store.events import wire
from kvtag_store.events.access import CurveAccess
from kvtag_store.events.options import EventOptions

log = logging.getLogger("kvtag_store.events.publisher")

# The mode's hash block size (tokens) for BlockStored.block_size, None while the census has no
# description of the mode.
BlockSizeOf = Callable[[str, str], int | None]
# How long an unknown mode's block size is not asked for again.
_UNKNOWN_RETRY_S = 1.0
# Token notes held at most (~200 bytes each with 32-token blocks: ~3 MiB).
MAX_TOKEN_NOTES = 16384
_STORED, _REMOVED = True, False


@dataclass(frozen=True)
class PublisherCounts:
    """What the publisher did since start-up (the Prometheus figures, for tests and the status)."""

    batches: int
    events: dict[str, int]
    dropped_events: int
    missed_batches: int
    replayed_batches: int
    replay_buffer_batches: int
    replay_buffer_bytes: int
    queued_events: int
    refused_handshakes: int


def _tcp(address: str) -> tuple[str, bool]:
    """HOST:PORT -> a ZMQ endpoint (port 0: any free port) and whether it is IPv6."""
    host, _, port = address.rpartition(":")
    ipv6 = ":" in host.strip("[]")
    if ipv6 and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{'*' if port == '0' else port}", ipv6


class EventPublisher:
    """A BlockEvents that publishes vLLM KV events. start() once; stop() closes the sockets."""

    def __init__(
        self, options: EventOptions, block_size_of: BlockSizeOf, access: CurveAccess | None = None
    ) -> None:
        """Binds both sockets now (an address in use fails here, before the store serves)."""
        self.options = options
        self._block_size_of = block_size_of
        self._access = access
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pending: deque[tuple[bool, str, str, BlockAddress, str]] = deque()
        self._limit = options.queue_events
        # Token ids sent with puts, by (namespace, group, key), until the block's BlockStored takes them:
        # oldest first out past the bound (a put answered ALREADY_PRESENT leaves its entry behind).
        self._tokens: dict[tuple[str, int, bytes], bytes] = {}
        self._tokens_lock = threading.Lock()
        self.dropped_events = 0
        self.missed_batches = 0
        self.replayed_batches = 0
        self.batches = 0
        self.events: dict[str, int] = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self._buffer: deque[tuple[int, bytes, bytes]] = deque()
        self._buffer_bytes = 0
        # The first batch's number: the start time in microseconds since the Unix epoch, so that numbers
        # keep increasing across restarts and a restart shows as a gap, which a subscriber fills from the
        # replay socket like any other, receiving the restarted store's AllBlocksCleared first.
        self.first_seq = self._seq = time.time_ns() // 1000
        self._block_sizes: dict[tuple[str, str], int] = {}
        self._unknown: dict[tuple[str, str], float] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            if access is not None:
                access.start(self._context)
            self._pub = self._socket(zmq.PUB, options.listen)
            self._pub.setsockopt(zmq.XPUB_NODROP, 1)  # tells us when a subscriber is full (_send)
            self._replay = self._socket(zmq.ROUTER, options.replay_address())
            self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full requester raises, never blocks
        except BaseException:
            self._close()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        # Every start-up tells the subscribers that what they knew of this store is gone; what the store
        # still holds (a disk tier's blocks) follows as BlockStored (MemoryBackend.observe_blocks).
        self._publish(wire.STORE_TOPIC, [wire.AllBlocksCleared()])

    def _socket(self, kind: int, address: str) -> zmq.Socket[bytes]:
        endpoint, ipv6 = _tcp(address)
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.options.hwm)
        if ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        if self._access is not None:
            self._access.secure(sock)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise OSError(f"cannot listen for KV events on {address}: {exc}") from None
        return sock

    # -- BlockEvents: called by the backends, under their locks ------------------

    def stored(self, namespace_id: str, mode_id: str, address: BlockAddress, tier: str) -> None:
        if len(self._pending) >= self._limit:
            self.dropped_events += 1
            return
        self._pending.append((_STORED, namespace_id, mode_id, address, tier))

    def removed(self, namespace_id: str, mode_id: str, address: BlockAddress, tier: str) -> None:
        if len(self._pending) >= self._limit:
            self.dropped_events += 1
            return
        self._pending.append((_REMOVED, namespace_id, mode_id, address, tier))

    def note_tokens(self, namespace_id: str, items: Sequence[tuple[int, bytes, bytes]]) -> None:
        """(group, key, token_ids as uint32 little-endian) of blocks about to be stored: their
        BlockStored carries the tokens. Called by the API before the put reaches the backend."""
        with self._tokens_lock:
            tokens = self._tokens
            for group, key, token_ids in items:
                tokens[(namespace_id, group, key)] = token_ids
            while len(tokens) > MAX_TOKEN_NOTES:
                del tokens[next(iter(tokens))]

    def _token_ids(self, namespace_id: str, group: int, key: bytes) -> list[int]:
        with self._tokens_lock:
            token_ids = self._tokens.pop((namespace_id, group, key), None)
        return list(struct.unpack(f"<{len(token_ids) // 4}I", token_ids)) if token_ids else []

    # -- the thread ------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvtag-kv-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Publish what is queued, then close the sockets."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        self._close()

    def _close(self) -> None:
        for name in ("_pub", "_replay"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)
        if self._access is not None:
            self._access.stop()
        self._context.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        flush_ms = self.options.flush_ms
        while True:
            stopping = self._stopping.is_set()
            try:
                if poller.poll(0 if stopping else flush_ms):
                    self._answer_replays()
                self._flush()
            except Exception:  # a bug must not end the events silently: log it, keep serving puts
                log.exception("KV events: publishing failed")
                time.sleep(0.1)
            if stopping:
                return

    def _flush(self) -> None:
        """Turn what is queued into one batch per topic (at most batch_events events each)."""
        pending = self._pending
        if not pending:
            return
        by_topic: dict[tuple[str, str], list[wire.Event]] = {}
        mediums = wire.MEDIUMS
        for _ in range(len(pending)):
            kind, namespace_id, mode_id, (group, key), tier = pending.popleft()
            events = by_topic.get((namespace_id, mode_id))
            if events is None:
                events = by_topic[(namespace_id, mode_id)] = []
            medium = mediums.get(tier, tier.upper())
            if kind:
                events.append(
                    wire.BlockStored(
                        block_hashes=[key],
                        parent_block_hash=None,
                        token_ids=self._token_ids(namespace_id, group, key) if self._tokens else [],
                        block_size=self._block_size(namespace_id, mode_id),
                        lora_id=None,
                        medium=medium,
                        lora_name=None,
                        group_idx=group,
                    )
                )
            else:
                events.append(wire.BlockRemoved(block_hashes=[key], medium=medium, group_idx=group))
        step = self.options.batch_events
        for (namespace_id, mode_id), events in by_topic.items():
            name = wire.topic(namespace_id, mode_id)
            for start in range(0, len(events), step):
                self._publish(name, events[start : start + step])

    def _block_size(self, namespace_id: str, mode_id: str) -> int:
        """The mode's hash block size, from the census (cached: a mode id names fixed fields); 0 while
        the census does not describe the mode."""
        key = (namespace_id, mode_id)
        size = self._block_sizes.get(key)
        if size is not None:
            return size
        now = time.monotonic()
        if now - self._unknown.get(key, -_UNKNOWN_RETRY_S) < _UNKNOWN_RETRY_S:
            return 0
        found = self._block_size_of(namespace_id, mode_id)
        if found is None:
            if len(self._unknown) > 4096:
                self._unknown.clear()
            self._unknown[key] = now
            return 0
        self._unknown.pop(key, None)
        if len(self._block_sizes) > 65536:  # modes of namespaces long forgotten
            self._block_sizes.clear()
        self._block_sizes[key] = found
        return found

    def _publish(self, topic_name: str, events: list[wire.Event]) -> None:
        """Number, encode, send and keep one batch. Only the thread calls it (and __init__, before)."""
        payload = wire.encode(wire.EventBatch(ts=time.time(), events=events))
        seq = self._seq
        self._seq += 1
        topic_bytes = topic_name.encode()
        self._send((topic_bytes, wire.seq_bytes(seq), payload))
        self.batches += 1
        for event in events:
            self.events[type(event).__name__] += 1
        buffer = self._buffer
        buffer.append((seq, topic_bytes, payload))
        self._buffer_bytes += len(payload)
        while buffer and (
            len(buffer) > self.options.replay_batches or self._buffer_bytes > self.options.replay_bytes
        ):
            self._buffer_bytes -= len(buffer.popleft()[2])

    def _send(self, frames: tuple[bytes, bytes, bytes]) -> None:
        """Send without blocking. With XPUB_NODROP the socket refuses (Again) when any subscriber's
        queue is full: that is counted, and the batch goes to the others with the option off."""
        pub = self._pub
        try:
            pub.send_multipart(frames, flags=zmq.NOBLOCK)
            return
        except zmq.Again:
            self.missed_batches += 1
        pub.setsockopt(zmq.XPUB_NODROP, 0)
        try:
            pub.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        finally:
            pub.setsockopt(zmq.XPUB_NODROP, 1)

    def _answer_replays(self) -> None:
        replay = self._replay
        while replay.poll(0):
            frames = replay.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
                log.debug("KV events: ignored a malformed replay request (%d frames)", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            sent = 0
            try:
                for seq, topic_bytes, payload in list(self._buffer):
                    if seq < start:
                        continue
                    if sent >= self.options.hwm:
                        break  # the rest in another request, from the last seq received
                    replay.send_multipart(
                        (identity, b"", topic_bytes, wire.seq_bytes(seq), payload), zmq.NOBLOCK
                    )
                    sent += 1
                replay.send_multipart((identity, b"", b"", wire.END_SEQ, b""), zmq.NOBLOCK)
            except (zmq.Again, zmq.ZMQError):  # the requester is full or gone (ROUTER_MANDATORY)
                pass
            self.replayed_batches += sent

    # -- reporting ---------------------------------------------------------------

    def counts(self) -> PublisherCounts:
        return PublisherCounts(
            batches=self.batches,
            events=dict(self.events),
            dropped_events=self.dropped_events,
            missed_batches=self.missed_batches,
            replayed_batches=self.replayed_batches,
            replay_buffer_batches=len(self._buffer),
            replay_buffer_bytes=self._buffer_bytes,
            queued_events=len(self._pending),
            refused_handshakes=self._access.refused if self._access is not None else 0,
        )

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(_PublisherCollector(self))


class _PublisherCollector(Collector):
    def __init__(self, publisher: EventPublisher) -> None:
        self._publisher = publisher

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        counts = self._publisher.counts()
        events = CounterMetricFamily(
            "kvtag_kv_events_published", "KV events published, by type", labels=["type"]
        )
        for kind, count in sorted(counts.events.items()):
            events.add_metric([kind], count)
        yield events
        yield CounterMetricFamily(
            "kvtag_kv_event_batches_published", "KV event batches published", value=counts.batches
        )
        yield CounterMetricFamily(
            "kvtag_kv_events_dropped",
            "KV events dropped before publishing (the queue was full): lost for every subscriber",
            value=counts.dropped_events,
        )
        yield CounterMetricFamily(
            "kvtag_kv_event_batches_missed",
            "KV event batches one or more subscribers missed live (their queue was full); replayable "
            "while in the replay buffer",
            value=counts.missed_batches,
        )
        yield CounterMetricFamily(
            "kvtag_kv_event_batches_replayed",
            "KV event batches sent in replay answers",
            value=counts.replayed_batches,
        )
        yield CounterMetricFamily(
            "kvtag_kv_event_handshakes_refused",
            "KV event subscribers refused (CURVE key not the one handed to admins)",
            value=counts.refused_handshakes,
        )
        yield GaugeMetricFamily(
            "kvtag_kv_event_replay_buffer_bytes",
            "Bytes of KV event batches kept for replay",
            value=counts.replay_buffer_bytes,
        )
        yield GaugeMetricFamily(
            "kvtag_kv_event_queue_events",
            "KV events waiting for the publisher thread",
            value=counts.queued_events,
        )
