"""Spare slots: the last CommitSlots of a put asks for slots for a next put like it, so that put is
written with no ReserveSlots round trip."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence

from kvtag.v1 import store_pb2 as pb

from kvtag_client.session import Session

# A spare as held: (offset, generation, time the call that granted it was sent).
_Spare = tuple[int, int, float]


class SpareSlots:
    """The spare slots held for the next put: by value length, of the session and arena segment they
    were granted in.

    Only spares granted less than half a session TTL ago are written: the granting call kept the
    session alive at the store until at least a TTL after it was sent, so the store cannot have ended
    the session and handed the slots to another writer meanwhile."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self._lock = threading.Lock()
        self._held: dict[int, list[_Spare]] = {}
        self._of: tuple[str, str] = ("", "")  # (session id, arena segment)

    def held(self) -> dict[int, int]:
        """How many spares are held, by value length."""
        with self._lock:
            return {length: len(spares) for length, spares in self._held.items()}

    def take(self, lengths: Sequence[int]) -> tuple[str, str, list[tuple[int, int]]] | None:
        """(session id, segment, [(offset, generation)] in the order of `lengths`) of fresh spares,
        one per length; None, taking none, unless there is one for every length."""
        need = Counter(lengths)
        with self._lock:
            session_id = self._session.session_id
            fresh_since = self._fresh_since_locked(session_id)
            spares = self._held
            for length, count in need.items():
                held = spares.get(length, [])
                if len(held) < count or any(granted < fresh_since for *_, granted in held[-count:]):
                    return None
            picked = [spares[length].pop()[:2] for length in lengths]
            return session_id, self._of[1], picked

    def clear(self) -> None:
        """Drop every spare (they are not this mapping's: the session ended and left them behind)."""
        with self._lock:
            self._held.clear()

    def request(self, lengths: Sequence[int]) -> tuple[list[int], list[int]]:
        """What the last commit of a put of values of `lengths` asks: spare lengths that, with those
        held, make one put like this one, and the generations of held spares to give back (of other
        lengths, or stale)."""
        want = Counter(lengths)
        with self._lock:
            fresh_since = self._fresh_since_locked(self._session.session_id)
            cancel: list[int] = []
            for length in list(self._held):
                held = self._held.pop(length)
                kept = [s for s in held if length in want and s[2] >= fresh_since]
                cancel.extend(s[1] for s in held if length not in want or s[2] < fresh_since)
                if kept:
                    self._held[length] = kept
            ask = [
                length
                for length, count in want.items()
                for _ in range(count - len(self._held.get(length, ())))
            ]
        return ask, cancel

    def keep(self, session_id: str, sent_at: float, lengths: list[int], granted: pb.PackedGrants) -> None:
        """Hold the spare slots a commit was granted (one PackedGrants status per length asked)."""
        granted_lengths = [
            length
            for length, status in zip(lengths, granted.statuses, strict=False)
            if status == pb.PUT_STATUS_UNSPECIFIED
        ]
        kept = list(zip(granted_lengths, granted.offsets, granted.generations, strict=False))
        if not kept:
            return
        with self._lock:
            if self._of != (session_id, granted.segment):
                self._held.clear()
                self._of = (session_id, granted.segment)
            for length, offset, generation in kept:
                self._held.setdefault(length, []).append((offset, generation, sent_at))

    def _fresh_since_locked(self, session_id: str) -> float:
        """The oldest grant time of a spare that may still be written, after dropping the spares of an
        earlier session than `session_id`: gone with it. Caller holds the lock."""
        if self._of[0] != session_id:
            self._held.clear()
        return time.monotonic() - self._session.session_ttl_ms / 2000.0
