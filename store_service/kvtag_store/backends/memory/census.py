"""The census kept in process: first-writer-wins records for a single service replica."""

from __future__ import annotations

import threading

from kvtag_store.backends.base import ProbeRecord


class MemoryCensus:
    """CensusStore in process: first-writer-wins records for a single service replica."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._modes: dict[str, bytes] = {}
        self._probes: dict[tuple[str, str], ProbeRecord] = {}

    def establish_mode(self, namespace_id: str, mode_encoding: bytes) -> bytes:
        with self._lock:
            return self._modes.setdefault(namespace_id, mode_encoding)

    def reference_probe(self, namespace_id: str, mode_id: str, record: ProbeRecord) -> ProbeRecord:
        with self._lock:
            return self._probes.setdefault((namespace_id, mode_id), record)
