"""What the API counts as it answers: the census (per-session hits, misses, conflicts) and the
Prometheus metrics, kept in step in one place."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvtag.v1 import store_pb2 as pb

from kvtag_store.backends.base import KeyStatus, PutOutcome
from kvtag_store.observe.metrics import KEY_STATUS_NAMES, PUT_STATUS_NAMES, StoreMetrics
from kvtag_store.policy.census import Census
from kvtag_store.policy.sessions import Session

_HIT, _MISS, _MISMATCH = KeyStatus.HIT, KeyStatus.MISS, KeyStatus.MODE_MISMATCH


class KeyTally(NamedTuple):
    hits: int
    misses: int
    mismatches: int

    @classmethod
    def of(cls, statuses: Sequence[int]) -> KeyTally:
        """Counted by C-level count (a list of KeyStatus or a status byte per key alike)."""
        hits = statuses.count(_HIT)
        mismatches = statuses.count(_MISMATCH)
        return cls(hits, len(statuses) - hits - mismatches, mismatches)

    def prefix_length(self, statuses: Sequence[int]) -> int:
        """Index of the first non-HIT, found by C-level index rather than a Python loop."""
        first = len(statuses)
        if self.misses:
            first = statuses.index(_MISS)
        if self.mismatches:
            first = min(first, statuses.index(_MISMATCH))
        return first


class Counting:
    def __init__(self, census: Census, metrics: StoreMetrics) -> None:
        self.census = census
        self.metrics = metrics

    def looked_up(self, session: Session, tally: KeyTally, cross_mode: Counter[str] | None) -> None:
        """A Lookup's keys, with the misses another mode holds (by base key)."""
        hits, misses, mismatches = tally
        self.census.count(
            session, hits=hits, misses=misses, mode_mismatches=mismatches, cross_mode=cross_mode
        )
        self._keys(self.metrics.lookup_keys, tally)
        if cross_mode:
            self.metrics.cross_mode_misses.inc(sum(cross_mode.values()))

    def read(self, session: Session, tally: KeyTally) -> None:
        """A Get's (or GetReferences') keys; the bytes are counted by `served` once sent or referenced."""
        hits, misses, mismatches = tally
        self.census.count(session, hits=hits, misses=misses, mode_mismatches=mismatches)
        self._keys(self.metrics.get_keys, tally)

    def reported(self, session: Session, usage: pb.UsageReport, cross_mode: Counter[str] | None) -> None:
        """A companion engine's own counts, from its heartbeat: its bytes move on another data path
        (vLLM's MooncakeStoreConnector), so only the engine can count them. `cross_mode`: its sampled
        misses another mode stored, by base key (api/usage.py)."""
        self.census.count(
            session,
            hits=usage.hit_blocks,
            misses=usage.missed_blocks,
            stored=usage.stored_blocks,
            cross_mode=cross_mode,
            elsewhere=True,
        )
        self._keys(self.metrics.lookup_keys, KeyTally(usage.hit_blocks, usage.missed_blocks, 0))
        if cross_mode:
            self.metrics.cross_mode_misses.inc(sum(cross_mode.values()))
        if usage.base_keys_dropped:
            self.metrics.usage_base_keys_dropped.inc(usage.base_keys_dropped)

    def served(self, nbytes: int) -> None:
        self.metrics.get_bytes.inc(nbytes)

    def puts(self, session: Session, counts: Counter[PutOutcome], stored_bytes: int) -> None:
        """Put outcomes, from inline puts, reservations answered at once and commits alike."""
        self.census.count(session, conflicts=counts[PutOutcome.CONFLICT], stored=counts[PutOutcome.STORED])
        for outcome, count in counts.items():
            self.metrics.put_items.labels(PUT_STATUS_NAMES[outcome]).inc(count)  # type: ignore[index]
        if stored_bytes:
            self.metrics.put_bytes.inc(stored_bytes)

    def session_refused(self, reason: str) -> None:
        self.metrics.sessions_refused.labels(reason).inc()
        if reason == "PROBE_DISAGREEMENT":
            self.metrics.probe_disagreements.inc()

    def session_admitted(self, warnings: Sequence[pb.CensusWarning]) -> None:
        if any(w.kind == "PROBE_DISAGREEMENT" for w in warnings):
            self.metrics.probe_disagreements.inc()

    def session_expired(self) -> None:
        self.metrics.sessions_expired.inc()

    @staticmethod
    def _keys(counter: Any, tally: KeyTally) -> None:
        hits, misses, mismatches = tally
        if hits:
            counter.labels(KEY_STATUS_NAMES[pb.HIT]).inc(hits)
        if misses:
            counter.labels(KEY_STATUS_NAMES[pb.MISS]).inc(misses)
        if mismatches:
            counter.labels(KEY_STATUS_NAMES[pb.MODE_MISMATCH]).inc(mismatches)
