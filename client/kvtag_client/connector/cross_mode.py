"""The connector's warning that its Lookups meet blocks another mode holds (issue 30, item 7).

An engine whose hashing mode differs from the one that filled a namespace gets misses, and correct
output, so nothing else tells its operator that the store is full of blocks it can never load. A
Lookup reply says MODE_MISMATCH for a key another mode stored under the same key, but a key derived
differently (lookahead on one side, off on the other) is a plain MISS there: the reply names no
mode and cannot tell such a cross-mode miss from a cold one. So the warning fires on a
MODE_MISMATCH, or on a Lookup that missed in a namespace the store's OpenSession answer said holds
another mode's blocks (MODE_SPLIT), and it names the other mode and the differing fields from the
namespace's Diagnose report, or from that MODE_SPLIT warning when Diagnose is refused (an engine
token need not be a viewer). One warning per namespace per window: the Lookups of every request
would otherwise repeat it each step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import grpc
from kvtag.v1 import store_pb2 as pb

if TYPE_CHECKING:
    from kvtag_client.store import StoreClient

logger = logging.getLogger("kvtag.connector")

# One warning per namespace this often at most.
WARNING_INTERVAL_S = 300.0
# Namespaces remembered for the rate limit (an engine uses one per TP rank; a bound all the same).
_REMEMBERED = 64
_MODE_FIELDS = [field.name for field in pb.HashingMode.DESCRIPTOR.fields]


def differing_fields(ours: pb.HashingMode, theirs: pb.HashingMode) -> list[str]:
    """`field theirs (this engine: ours)` for each hashing-mode field where the two modes differ."""
    return [
        f"{name} {getattr(theirs, name)!r} (this engine: {getattr(ours, name)!r})"
        for name in _MODE_FIELDS
        if getattr(ours, name) != getattr(theirs, name)
    ]


class CrossModeWarner:
    """Watches Lookup answers and logs, rate-limited, which mode holds the blocks this engine misses.

    `observe` runs on the Lookup thread and only counts; finding the other mode (a Diagnose call)
    runs on `submit`'s executor so the scheduler's step never waits for it."""

    def __init__(
        self,
        submit: Callable[[Callable[[], None]], object],
        interval_s: float = WARNING_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._submit = submit
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}  # namespace id -> when it was last warned about
        self.warnings_logged = 0

    def observe(self, client: StoreClient, statuses: Sequence[int]) -> None:
        """One Lookup's answer: warn (at most once a window per namespace) when it met another mode."""
        mismatched = statuses.count(pb.MODE_MISMATCH)
        missed = statuses.count(pb.MISS)
        split = [w for w in client.warnings if w.kind == "MODE_SPLIT"]
        if not mismatched and not (missed > 0 and split):
            return
        namespace_id = client.namespace_id
        now = self._clock()
        with self._lock:
            last = self._last.get(namespace_id)
            if last is not None and now - last < self.interval_s:
                return
            self._last[namespace_id] = now
            if len(self._last) > _REMEMBERED:
                del self._last[next(iter(self._last))]
        self._submit(lambda: self._warn(client, len(statuses), mismatched, missed, split))

    def _warn(
        self, client: StoreClient, asked: int, mismatched: int, missed: int, split: list[pb.CensusWarning]
    ) -> None:
        held_by = self._other_modes(client)
        if held_by is not None:
            named = "; ".join(
                f"mode {mode_id}: {', '.join(fields) or 'no hashing field differs (another store mode)'}"
                for mode_id, fields in held_by
            )
        elif split:
            named = "; ".join(f"mode {w.other_mode_id}: {w.message}" for w in split)
        else:
            named = "another mode (the Lookup reply does not name it and Diagnose was refused)"
        what = []
        if mismatched:
            what.append(f"{mismatched} stored under the same key by another mode (MODE_MISMATCH)")
        if missed and split:
            what.append(f"{missed} missed while the namespace holds another mode's blocks")
        logger.warning(
            "kvtag: Lookups in namespace %s meet blocks of another mode, never served to this engine "
            "(mode %s): of %d blocks asked, %s. Held by %s. Align the engines' hashing (e.g. the same "
            "`lookahead`, `key_scheme` and PYTHONHASHSEED) to share blocks; `kvtag-store diagnose "
            "--filter %s` shows the split. Next warning for this namespace in %.0f s at the earliest.",
            client.namespace_id,
            client.mode_id,
            asked,
            " and ".join(what),
            named,
            client.namespace_id,
            self.interval_s,
        )
        self.warnings_logged += 1

    def _other_modes(self, client: StoreClient) -> list[tuple[str, list[str]]] | None:
        """[(mode id, differing fields)] of the modes holding this namespace's blocks that this
        engine misses, from Diagnose; None when Diagnose fails or is refused."""
        try:
            answer: pb.DiagnoseResponse = client.session.stub.Diagnose(
                pb.DiagnoseRequest(namespace_id=client.namespace_id, page_size=1),
                timeout=client.rpc_timeout_s,
            )
        except grpc.RpcError:
            return None
        report = next((r for r in answer.namespaces if r.namespace_id == client.namespace_id), None)
        if report is None:
            return None
        ours = next((m for m in report.modes if m.mode_id == client.mode_id), None)
        held = {miss.held_by_mode_id for miss in ours.cross_mode_misses} if ours is not None else set()
        others = [
            m
            for m in report.modes
            if m.mode_id != client.mode_id and (m.mode_id in held or m.counters.stored > 0)
        ]
        return [(m.mode_id, differing_fields(client.mode, m.mode)) for m in others] or None
