"""What a companion engine reports with its heartbeats (HeartbeatRequest.usage), until the store has it.

The counts are sums: memory stays constant, nothing waits, nothing is lost while the store is down. The
base keys (stored blocks', and a sample of missed blocks') are lists, so they are bounded: each holds at
most MAX_USAGE_BASE_KEYS entries, the store's bound per report, and a key past that is dropped and
counted (`base_keys_dropped`, reported too), never waited for.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kvtag.v1 import store_pb2 as pb
from kvtag_proto.usage import MAX_USAGE_BASE_KEYS

# (KV cache group, base key): a block as the base-key index addresses it.
BaseKey = tuple[int, bytes]


class PendingUsage:
    """Counts and base keys the store has not acknowledged. `sending` is held from `report` to
    `acknowledge`, so two heartbeats never send (and count) the same pending usage twice."""

    def __init__(self, max_base_keys: int = MAX_USAGE_BASE_KEYS) -> None:
        self.max_base_keys = max_base_keys
        self.sending = threading.Lock()
        self._lock = threading.Lock()
        self._counts = pb.UsageReport()
        self._stored: list[BaseKey] = []
        self._missed: list[BaseKey] = []
        self.dropped_total = 0  # every base key ever dropped, for logs and tests

    def add(
        self,
        *,
        lookups: int = 0,
        hits: int = 0,
        misses: int = 0,
        stored: int = 0,
        stored_base_keys: Iterable[BaseKey] = (),
        missed_base_keys: Iterable[BaseKey] = (),
        max_key_bytes: int = 0,
    ) -> None:
        """Add counts; keep base keys while their list has room, drop the rest (and keys of 0 or more than
        `max_key_bytes` bytes, which the store would refuse) and count them."""
        with self._lock:
            counts = self._counts
            counts.lookups += lookups
            counts.hit_blocks += hits
            counts.missed_blocks += misses
            counts.stored_blocks += stored
            dropped = self._keep(self._stored, stored_base_keys, max_key_bytes)
            dropped += self._keep(self._missed, missed_base_keys, max_key_bytes)
            counts.base_keys_dropped += dropped
            self.dropped_total += dropped

    def _keep(self, pending: list[BaseKey], keys: Iterable[BaseKey], max_key_bytes: int) -> int:
        dropped = 0
        for group, key in keys:
            if len(pending) < self.max_base_keys and 0 < len(key) <= (max_key_bytes or len(key)):
                pending.append((group, key))
            else:
                dropped += 1
        return dropped

    def report(self) -> pb.UsageReport:
        """A copy of what is pending (empty when nothing is)."""
        with self._lock:
            usage = pb.UsageReport()
            usage.CopyFrom(self._counts)
            usage.stored_base_keys.extend(pb.UsageBlock(group=g, base_key=k) for g, k in self._stored)
            usage.missed_base_keys.extend(pb.UsageBlock(group=g, base_key=k) for g, k in self._missed)
        return usage

    def acknowledge(self, sent: pb.UsageReport) -> None:
        """The store has `sent` (a `report()` taken under `sending`): keep only what came after it."""
        with self._lock:
            counts = self._counts
            counts.lookups -= sent.lookups
            counts.hit_blocks -= sent.hit_blocks
            counts.missed_blocks -= sent.missed_blocks
            counts.stored_blocks -= sent.stored_blocks
            counts.base_keys_dropped -= sent.base_keys_dropped
            del self._stored[: len(sent.stored_base_keys)]
            del self._missed[: len(sent.missed_base_keys)]

    def empty(self) -> bool:
        with self._lock:
            return not (self._counts.ByteSize() or self._stored or self._missed)
