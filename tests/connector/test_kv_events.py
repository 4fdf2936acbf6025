"""KV events read with vLLM's own decoder (`vllm.distributed.kv_events`, msgspec), from a real store
process fed by real-Scheduler engines of two hashing modes: what a router built on vLLM's event format
learns from kvtag alone (issue 40, docs/kv-events.md)."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import zmq
from kvtag.v1 import store_pb2 as pb
from kvtag_client.store import StoreClient
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from tests.descriptors import PROBE, mode, namespace
from tests.net import free_port, wait_until
from tests.store_process import StoreProcess

from .harness import Engine
from .test_hit_length import B, fresh_prompt

END_SEQ = (-1).to_bytes(8, "big", signed=True)
STORE_TOPIC = "kvtag/*"


@dataclass
class VllmSubscriber:
    """A router's subscriber, as vLLM's example writes one: SUB on every kvtag topic, a DEALER for
    replays when the sequence has a gap, batches decoded with vLLM's KVEventBatch."""

    endpoint: str
    replay_endpoint: str
    batches: list[tuple[str, int, KVEventBatch]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"kvtag/")
        self._sub.connect(self.endpoint)
        self._replay = self._context.socket(zmq.DEALER)
        self._replay.connect(self.replay_endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._last = -1
        self._replay_from(0, None)  # what the store published before this router joined

    def _replay_from(self, start: int, before: int | None) -> None:
        self._replay.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            assert self._replay.poll(5000), "the replay answer never ended"
            _, topic, seq, payload = self._replay.recv_multipart()
            if seq == END_SEQ:
                return
            if before is None or int.from_bytes(seq, "big") < before:
                self._take(topic, seq, payload)

    def close(self) -> None:
        self._sub.close(linger=0)
        self._replay.close(linger=0)
        self._context.term()

    def poll(self, timeout_ms: int = 50) -> bool:
        """Take what arrived (filling gaps from the replay socket); True if anything did."""
        got = False
        while self._sub.poll(timeout_ms):
            topic, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if self._last >= 0 and seq > self._last + 1:
                self._replay_from(self._last + 1, seq)
            self._take(topic, seq_bytes, payload)
            got = True
            timeout_ms = 0
        return got

    def polled(self, condition: Callable[[], bool]) -> bool:
        """Poll, then say whether `condition` holds (for wait_until)."""
        self.poll()
        return condition()

    def _take(self, topic: bytes, seq_bytes: bytes, payload: bytes) -> None:
        seq = int.from_bytes(seq_bytes, "big")
        if seq <= self._last:
            return  # had it from a replay already
        self.batches.append((topic.decode(), seq, self._decoder.decode(payload)))
        self._last = seq

    def events(self, kind: type) -> list[tuple[str, Any]]:
        return [(t, e) for t, _, b in self.batches for e in b.events if isinstance(e, kind)]


@pytest.fixture
def events_store(
    start_store: Callable[..., StoreProcess],
) -> Iterator[Callable[..., tuple[StoreProcess, str]]]:
    """events_store(*serve_args) -> (a store publishing KV events, its status URL)."""

    def start(*args: str) -> tuple[StoreProcess, str]:
        metrics = free_port()
        pub, replay = free_port(), free_port()
        store = start_store(
            "--metrics-listen",
            f"127.0.0.1:{metrics}",
            "--kv-events-listen",
            f"127.0.0.1:{pub}",
            "--kv-events-replay-listen",
            f"127.0.0.1:{replay}",
            *args,
        )
        return store, f"http://127.0.0.1:{metrics}"

    yield start


def sources(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/kv_event_sources", timeout=5) as answer:
        doc: dict[str, Any] = json.load(answer)
    return doc


def subscribe(url: str) -> VllmSubscriber:
    publisher = sources(url)["publisher"]
    return VllmSubscriber(publisher["endpoint"], publisher["replay_endpoint"])


def test_two_engines_of_two_modes_publish_under_two_topics_and_a_router_credits_each_only_its_own(
    make_engine: Callable[..., Engine], events_store: Callable[..., tuple[StoreProcess, str]]
) -> None:
    store, url = events_store()
    router = subscribe(url)
    try:
        eagle = make_engine(store.endpoint, eagle=True, extra={"engine_id": "ev-eagle"})
        legacy = make_engine(store.endpoint, eagle=True, extra={"engine_id": "ev-legacy", "lookahead": "off"})
        eagle_client, legacy_client = eagle.connector.client(), legacy.connector.client()
        assert eagle_client.namespace_id == legacy_client.namespace_id, "one namespace"
        assert eagle_client.mode_id != legacy_client.mode_id, "two modes"

        prompt = fresh_prompt(4 * B + 3)  # the same tokens in both engines
        for engine in (eagle, legacy):
            engine.add("r0", prompt, max_tokens=2)
            engine.run()
            engine.drain_saves()

        ns_id = eagle_client.namespace_id
        topics = {
            name: f"kvtag/{ns_id}/{c.mode_id}"
            for name, c in (("eagle", eagle_client), ("legacy", legacy_client))
        }
        wait_until(
            lambda: router.polled(lambda: {t for t, _ in router.events(BlockStored)} >= set(topics.values())),
            10,
            "BlockStored under both modes' topics",
        )
        doc = sources(url)
        [ns] = [n for n in doc["namespaces"] if n["namespace_id"] == ns_id]
        # An engine's scheduler and worker each hold a session ("<engine_id>/scheduler", "/worker").
        engines_of = {m["topic"]: {e["engine_id"].split("/")[0] for e in m["engines"]} for m in ns["modes"]}
        assert {e["engine_id"] for m in ns["modes"] for e in m["engines"]} >= {
            "ev-eagle/worker",
            "ev-legacy/worker",
        }
        assert engines_of[topics["eagle"]] == {"ev-eagle"}
        assert engines_of[topics["legacy"]] == {"ev-legacy"}
        fields = {m["topic"]: m["fields"]["lookahead_tokens"] for m in ns["modes"]}
        assert fields[topics["eagle"]] == 1 and fields[topics["legacy"]] == 0

        # The tiny router: a block is credited to the engines the discovery lists under its topic's mode.
        credited: dict[str, set[tuple[int, bytes]]] = {"ev-eagle": set(), "ev-legacy": set()}
        for topic, event in router.events(BlockStored):
            assert event.medium == "CPU" and event.block_size == B
            for engine_id in engines_of[topic]:
                credited[engine_id].update((event.group_idx, h) for h in event.block_hashes)
        assert credited["ev-eagle"] and credited["ev-legacy"]
        assert not credited["ev-eagle"] & credited["ev-legacy"], "the modes' keys differ"
        # The store asked for token ids (it publishes events): each block's are the prompt's, in order,
        # so a router that hashes tokens itself (llm-d) can key the block its own way.
        assert eagle_client.wants_token_ids
        chunks = [list(prompt[j * B : (j + 1) * B]) for j in range(4)]
        for topic in topics.values():
            seen = [e.token_ids for t, e in router.events(BlockStored) if t == topic]
            assert seen and all(tokens in chunks for tokens in seen), (topic, seen)
            assert seen[0] == chunks[0], "the first block stored is the prompt's first"

        # The store agrees: each engine hits every block it was credited with, and none of the other's.
        for engine_id, client in (("ev-eagle", eagle_client), ("ev-legacy", legacy_client)):
            mine = sorted(credited[engine_id])
            theirs = sorted(credited["ev-legacy" if engine_id == "ev-eagle" else "ev-eagle"])
            own = client.lookup([(g, k, b"") for g, k in mine]).statuses
            other = client.lookup([(g, k, b"") for g, k in theirs]).statuses
            assert own == [pb.HIT] * len(mine), f"{engine_id} reads every block credited to it"
            assert pb.HIT not in other, f"{engine_id} reads none of the other mode's blocks"
    finally:
        router.close()


def test_vllms_decoder_reads_stored_removed_and_the_clear_after_a_restart_without_disk(
    events_store: Callable[..., tuple[StoreProcess, str]],
) -> None:
    value = 64 << 10
    store, url = events_store("--capacity", "1MiB", "--prefault", "lazy")
    router = subscribe(url)
    client = StoreClient(
        store.endpoint,
        engine_id="interop",
        namespace=namespace(),
        mode=mode(),
        probe_keys=PROBE,
        data_path="inline",
    )
    try:
        assert client.open()
        wait_until(
            lambda: client.put([(0, os.urandom(16), b"j" * 16, b"")]) is not None and router.poll(),
            10,
            "the subscriber to join",
        )
        keys = [f"interop-{i}".encode() for i in range(32)]  # 2 MiB into a 1 MiB store
        for key in keys:
            assert client.put([(0, key, b"v" * value, b"")]) == [pb.STORED]
        topic = f"kvtag/{client.namespace_id}/{client.mode_id}"
        wait_until(
            lambda: router.polled(
                lambda: {e.block_hashes[0] for _, e in router.events(BlockStored)} >= set(keys)
            ),
            10,
            "a BlockStored per block",
        )
        stored = [e for t, e in router.events(BlockStored) if e.block_hashes[0] in set(keys)]
        assert [e.block_hashes for e in stored] == [[k] for k in keys]
        assert {(e.medium, e.group_idx, e.block_size) for e in stored} == {("CPU", 0, 16)}
        assert {t for t, e in router.events(BlockStored) if e in stored} == {topic}
        removed = [e.block_hashes[0] for t, e in router.events(BlockRemoved) if t == topic]
        assert set(keys[:8]) <= set(removed), "the least recently used blocks were evicted"
        assert all(e.medium == "CPU" for _, e in router.events(BlockRemoved))

        client.close()
        store.stop()
        store.start()  # the same ports, no disk tier
        client = StoreClient(
            store.endpoint,
            engine_id="interop",
            namespace=namespace(),
            mode=mode(),
            probe_keys=PROBE,
            data_path="inline",
        )
        assert client.open()
        before = len(router.batches)
        wait_until(
            lambda: (
                client.put([(0, os.urandom(16), b"n", b"")]) is not None
                and router.polled(lambda: any(t == STORE_TOPIC for t, _, _ in router.batches[before:]))
            ),
            15,
            "the restarted store's AllBlocksCleared",
        )
        [(_, clear)] = [(t, b) for t, _, b in router.batches[before:] if t == STORE_TOPIC]
        assert clear.events == [AllBlocksCleared()]
        seqs = [s for _, s, _ in router.batches]
        assert seqs == sorted(seqs), "the sequence increased across the restart (a gap, then replayed)"
        announced_again = [
            e
            for _, _, batch in router.batches[before:]
            for e in batch.events
            if isinstance(e, BlockStored) and e.block_hashes[0] in set(keys)
        ]
        assert announced_again == [], "a store without its disk tier announces none of the blocks it lost"
    finally:
        client.close()
        router.close()
