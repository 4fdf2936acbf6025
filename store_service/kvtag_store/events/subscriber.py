"""The reference subscriber: `kvtag-store events` prints a store's KV events live, as decoded.

It is also the smallest complete client of the protocol (docs/kv-events.md): a SUB socket on the
store's topics, a DEALER on the replay socket for the batches it missed (a gap in the sequence, or a
start from an earlier seq), and, on a store with tokens, the CURVE keys `/kv_event_sources` hands an
admin.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import zmq

from kvtag_store.config import env_default, env_name
from kvtag_store.events import wire
from kvtag_store.events.access import client_curve


@dataclass(frozen=True)
class Received:
    """One batch as it arrived: its topic, sequence number and events; `replayed` if from the replay
    socket."""

    topic: str
    seq: int
    batch: wire.EventBatch
    replayed: bool = False


class Subscriber:
    """SUB (and DEALER for replays) on a store's event sockets. Not thread-safe: one thread uses it."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topics: Sequence[str] = (wire.TOPIC_PREFIX,),
        curve: dict[str, str] | None = None,
        rcvhwm: int = 0,
    ) -> None:
        """`rcvhwm`: the SUB socket's receive high-water mark (0: ZMQ's default)."""
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        if rcvhwm:
            self._sub.setsockopt(zmq.RCVHWM, rcvhwm)
        if curve is not None:
            client_curve(self._sub, curve)
        for name in topics:
            self._sub.setsockopt(zmq.SUBSCRIBE, name.encode())
        self._sub.connect(endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if replay_endpoint:
            self._replay = self._context.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                client_curve(self._replay, curve)
            self._replay.connect(replay_endpoint)
        self.last_seq = -1

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def receive(self, timeout_s: float) -> Received | None:
        """The next live batch, or None after `timeout_s`."""
        if not self._sub.poll(int(timeout_s * 1000)):
            return None
        topic, seq, payload = self._sub.recv_multipart()
        return Received(topic.decode(), int.from_bytes(seq, "big"), wire.decode(payload))

    def replay(self, start_seq: int, timeout_s: float = 5.0) -> list[Received]:
        """The batches the store still keeps from `start_seq` on (one answer: at most its hwm of them)."""
        if self._replay is None:
            raise RuntimeError("no replay endpoint given")
        self._replay.send_multipart((b"", start_seq.to_bytes(8, "big")))
        answer: list[Received] = []
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._replay.poll(int(left * 1000)):
                raise TimeoutError(f"the replay answer from seq {start_seq} did not end in {timeout_s} s")
            _, topic, seq, payload = self._replay.recv_multipart()
            if seq == wire.END_SEQ:
                return answer
            answer.append(Received(topic.decode(), int.from_bytes(seq, "big"), wire.decode(payload), True))

    def batches(self, timeout_s: float, from_seq: int | None = None) -> Iterator[Received]:
        """Batches in sequence order: a replay from `from_seq` first (if given), then live ones, with
        the gaps filled from the replay socket when there is one. Ends after `timeout_s` of silence."""
        if from_seq is not None:
            for received in self.replay(from_seq):
                self.last_seq = received.seq
                yield received
        while True:
            live = self.receive(timeout_s)
            if live is None:
                return
            received = live
            restarted = received.seq < self.last_seq  # the store's sequence began again
            if restarted:
                self.last_seq = -1
            if received.seq <= self.last_seq:
                continue  # already had it from a replay
            if (
                self._replay is not None
                and (self.last_seq >= 0 or restarted)
                and received.seq > self.last_seq + 1
            ):
                for missed in self.replay(self.last_seq + 1):
                    if self.last_seq < missed.seq < received.seq:
                        self.last_seq = missed.seq
                        yield missed
            self.last_seq = received.seq
            yield received


# -- the CLI command -----------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        default=env_default("--events-target", ""),
        help="the store's PUB endpoint, tcp://HOST:PORT (else the one --sources names) "
        f"[env {env_name('--events-target')}]",
    )
    parser.add_argument("--replay", default="", help="its replay endpoint (default: --target's port + 1)")
    parser.add_argument(
        "--sources",
        default="",
        help="the store's status URL, http://HOST:PORT: read /kv_event_sources for the endpoints and, "
        "on a store with tokens, the CURVE keys (an admin token: --token-file or $KVTAG_TOKEN)",
    )
    parser.add_argument(
        "--token-file", default=os.environ.get(env_name("--token-file"), ""), help="admin token file"
    )
    parser.add_argument(
        "--topic",
        action="append",
        default=None,
        help="topic prefix to subscribe to, repeatable (default: kvtag/, the whole store)",
    )
    parser.add_argument("--from-seq", type=int, default=None, help="replay from this sequence number first")
    parser.add_argument(
        "--count", type=int, default=0, help="exit after this many events (0: run until Ctrl-C)"
    )
    parser.add_argument(
        "--timeout", type=float, default=0.0, help="exit 1 after this many seconds without a batch"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per event")


def _token(token_file: str) -> str | None:
    if token_file:
        return Path(token_file).read_text().strip()
    return os.environ.get("KVTAG_TOKEN") or None


def fetch_sources(url: str, token: str | None, timeout_s: float = 5.0) -> dict[str, Any]:
    """GET <url>/kv_event_sources (the discovery document)."""
    if not url.rstrip("/").endswith("/kv_event_sources"):
        url = url.rstrip("/") + "/kv_event_sources"
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        doc: dict[str, Any] = json.load(answer)
    return doc


def _next_port(endpoint: str) -> str:
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + 1}"


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    curve: dict[str, str] | None = None
    target, replay = args.target, args.replay
    if args.sources:
        try:
            doc = fetch_sources(args.sources, _token(args.token_file))
        except OSError as exc:
            print(f"kvtag-store events: cannot read {args.sources}/kv_event_sources: {exc}", file=sys.stderr)
            return 1
        target = target or doc["publisher"]["endpoint"]
        replay = replay or doc["publisher"]["replay_endpoint"]
        curve = doc.get("curve")
    if not target:
        print(
            "kvtag-store events: give --target tcp://HOST:PORT or --sources http://HOST:PORT", file=sys.stderr
        )
        return 2
    replay = replay or _next_port(target)
    printed = 0
    timeout = args.timeout if args.timeout > 0 else 3600.0
    with Subscriber(target, replay, args.topic or [wire.TOPIC_PREFIX], curve) as subscriber:
        try:
            while True:
                for received in subscriber.batches(timeout, args.from_seq):
                    for event in received.batch.events:
                        out.write(_line(received, event, args.json) + "\n")
                        printed += 1
                        if args.count and printed >= args.count:
                            out.flush()
                            return 0
                    out.flush()
                if args.timeout > 0:
                    print(f"kvtag-store events: no batch in {args.timeout} s", file=sys.stderr)
                    return 1
                args.from_seq = None
        except KeyboardInterrupt:
            return 0


def _line(received: Received, event: wire.Event, as_json: bool) -> str:
    parsed = wire.parse_topic(received.topic)
    namespace_id, mode_id = parsed if parsed is not None else ("", "")
    if as_json:
        return json.dumps(
            {
                "seq": received.seq,
                "topic": received.topic,
                "namespace_id": namespace_id,
                "mode_id": mode_id,
                "ts": received.batch.ts,
                "replayed": received.replayed,
                "event": wire.as_json(event),
            }
        )
    where = f"{namespace_id[:12]}/{mode_id}" if parsed is not None else received.topic
    head = f"{received.seq:>8} {where} {type(event).__name__}"
    if isinstance(event, wire.BlockStored):
        hashes = ",".join(h.hex()[:16] for h in event.block_hashes)
        return f"{head} medium={event.medium} group={event.group_idx} block_size={event.block_size} {hashes}"
    if isinstance(event, wire.BlockRemoved):
        hashes = ",".join(h.hex()[:16] for h in event.block_hashes)
        return f"{head} medium={event.medium} group={event.group_idx} {hashes}"
    return head
