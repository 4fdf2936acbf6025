"""Background store writer: saves leave the forward path as host bytes and are put by one thread.

Memory is bounded by max_pending_bytes: a save that would exceed it is dropped and counted (a dropped
save is only a future cache miss). Audit checks compare what the store returns for a block with the
engine's final bytes of that block, read once its request finished (see SaveJob.audit).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtag.v1 import store_pb2 as pb

from kvtag_client.items import PutItem

from .stats import StatsRecorder

if TYPE_CHECKING:
    from kvtag_client.store import SharedPut, StoreClient

logger = logging.getLogger("kvtag.connector")


@dataclass(frozen=True, slots=True)
class PendingPut:
    req_id: str
    items: list[PutItem]
    # Shared-memory path: the values already sit in store slots (StoreClient.reserve); committing is
    # what is left. `items` is then empty.
    reservation: SharedPut | None = None
    # Each item's token ids (BlockTransfer.tokens), or none.
    token_ids: list[bytes] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        if self.reservation is not None:
            return self.reservation.nbytes
        return sum(len(item.value) for item in self.items)


class Saver:
    def __init__(
        self,
        client_getter: Callable[[], StoreClient],
        stats: StatsRecorder,
        max_pending_bytes: int,
        batch_blocks: int,
        audit: bool = False,
    ) -> None:
        self._client = client_getter
        self._stats = stats
        self._max_pending = max_pending_bytes
        self._batch = max(1, batch_blocks)
        self._audit = audit
        # Audit: (group, key) this engine stored (STORED, not ALREADY_PRESENT), per request. A copy
        # another engine stored may differ in low bits (a recompute is not bit-exact) without any
        # timing error, so only our own copies are compared.
        self._stored_here: dict[str, set[tuple[int, bytes]]] = {}
        self._queue: queue.Queue[PendingPut | tuple[str, list[tuple[int, bytes, bytes]]] | None] = (
            queue.Queue()
        )
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._idle = threading.Condition(self._lock)
        self._inflight = 0
        self.audit_mismatches: list[tuple[str, int, bytes]] = []
        self._thread = threading.Thread(target=self._run, name="kvtag-saver", daemon=True)
        self._thread.start()

    def submit(self, put: PendingPut) -> bool:
        """Queue a put; False (dropped, counted) when the pending bytes would exceed the bound."""
        nbytes = put.nbytes
        if not self.admit(nbytes, len(put.items)):
            return False
        self.enqueue(put, nbytes)
        return True

    def admit(self, nbytes: int, blocks: int) -> bool:
        """Count `nbytes` as pending if the bound allows (then enqueue() or withdraw() must follow);
        False (the blocks dropped, counted) when it does not."""
        with self._lock:
            if self._pending_bytes + nbytes > self._max_pending:
                self._stats.add("dropped_saves", blocks)
                return False
            self._pending_bytes += nbytes
            self._inflight += 1
        return True

    def enqueue(self, put: PendingPut, admitted: int) -> None:
        """Queue a put admitted for `admitted` bytes (it may hold fewer: slots not granted)."""
        with self._lock:
            self._pending_bytes -= admitted - put.nbytes
        self._queue.put(put)

    def withdraw(self, nbytes: int) -> None:
        """Undo an admit() whose put will not be queued."""
        with self._idle:
            self._pending_bytes -= nbytes
            self._inflight -= 1
            self._idle.notify_all()

    def submit_audit(self, req_id: str, engine_blocks: list[tuple[int, bytes, bytes]]) -> None:
        """Compare the store's copy of each (group, key) with the engine's final bytes, off the hot path."""
        with self._lock:
            self._inflight += 1
        self._queue.put((req_id, engine_blocks))

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

    def close(self, timeout: float = 5.0) -> None:
        self.wait_idle(timeout)
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            try:
                if isinstance(work, PendingPut):
                    self._put(work)
                else:
                    self._check(*work)
            except Exception:  # never let one bad batch stop the thread
                logger.exception("kvtag: background save failed")
            finally:
                with self._idle:
                    if isinstance(work, PendingPut):
                        self._pending_bytes -= work.nbytes
                    self._inflight -= 1
                    self._idle.notify_all()

    def _put(self, work: PendingPut) -> None:
        client = self._client()
        if work.reservation is not None:
            self._commit(work, work.reservation, client)
            return
        for start in range(0, len(work.items), self._batch):
            batch = work.items[start : start + self._batch]
            statuses = client.put(batch, work.token_ids[start : start + self._batch])
            if statuses is None:
                # The client counted the failed call itself (degraded_calls); this counts the blocks.
                self._stats.add("dropped_saves", len(batch))
                continue
            for item, status in zip(batch, statuses, strict=False):
                if status in (pb.STORED, pb.ALREADY_PRESENT):
                    self._stats.add("saved_blocks")
                    self._stats.add("saved_bytes", len(item.value))
                    if self._audit and status == pb.STORED:
                        self._stored_here.setdefault(work.req_id, set()).add((item.group, item.key))
                else:
                    self._stats.add("dropped_saves")

    def _commit(self, work: PendingPut, reservation: SharedPut, client: StoreClient) -> None:
        """Make a shared-memory save's slots visible (the bytes were gathered into them in the step)."""
        statuses = client.commit(reservation)
        if statuses is None:
            # The client counted the failed call itself (degraded_calls); this counts the blocks.
            self._stats.add("dropped_saves", len(reservation.items))
            return
        for (group, key, length, _), status in zip(reservation.items, statuses, strict=False):
            if status in (pb.STORED, pb.ALREADY_PRESENT):
                self._stats.add("saved_blocks")
                self._stats.add("saved_bytes", length)
                if self._audit and status == pb.STORED:
                    self._stored_here.setdefault(work.req_id, set()).add((group, key))
            else:
                self._stats.add("dropped_saves")

    def _check(self, req_id: str, engine_blocks: list[tuple[int, bytes, bytes]]) -> None:
        ours = self._stored_here.pop(req_id, set())
        engine_blocks = [(g, k, b) for g, k, b in engine_blocks if (g, k) in ours]
        if not engine_blocks:
            return
        values = self._client().get([(group, key) for group, key, _ in engine_blocks])
        for (group, key, engine_bytes), value in zip(engine_blocks, values, strict=False):
            if value is None:
                continue  # not stored (dropped, evicted) or store unreachable: nothing to compare
            self._stats.add("audit_checked_blocks")
            if hashlib.sha256(value).digest() != hashlib.sha256(engine_bytes).digest():
                self._stats.add("audit_mismatches")
                self.audit_mismatches.append((req_id, group, key))
                logger.error(
                    "kvtag audit: request %s group %d key %s: the store holds different bytes than the "
                    "engine's final block; a save read the block before it was complete",
                    req_id,
                    group,
                    key.hex()[:16],
                )
