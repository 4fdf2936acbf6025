"""The shared-memory data path: values written into and read from the store's arena slots; the
messages carry only slot references."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import xxhash
from kvtag.v1 import store_pb2 as pb

from kvtag_client.calls import Calls, Leases
from kvtag_client.items import SizedItemFields
from kvtag_client.lookups import add_runs, pack_blocks
from kvtag_client.session import _CallFailed, _Deadline
from kvtag_client.shared_memory import LARGE_SLOT_BYTES, ArenaMapping


@dataclass
class SharedPut:
    """Slots reserved for a shared-memory put (StoreClient.reserve): write each granted item's value
    into `slots[i]`, then StoreClient.commit. `statuses[i]` is already final for items without a slot
    (ALREADY_PRESENT, CONFLICT, REJECTED). `digests[i]` is the XXH3-64 of a written slot, taken at
    the first digest(i): best right after writing it, while the bytes are in cache (write_slots
    does); commit takes the missing ones itself."""

    session_id: str
    items: list[SizedItemFields]
    statuses: list[int]
    slots: list[memoryview | None]
    generations: list[int | None]  # of each granted slot: it names the reservation at commit
    digests: list[int | None]
    spare: bool = False  # the slots are spare ones: the commit binds them to their keys

    def digest(self, index: int) -> int:
        digest = self.digests[index]
        if digest is None:
            slot = self.slots[index]
            digest = value_digest(slot) if slot is not None else 0
            self.digests[index] = digest
        return digest

    @property
    def nbytes(self) -> int:
        return sum(slot.nbytes for slot in self.slots if slot is not None)


_A = TypeVar("_A")
_R = TypeVar("_R")

# How long a read lease waits for the next GetReferences to carry its release before the
# releaser thread sends it alone: a get in a steady stream then costs one RPC, and a pin
# outlives its copy by at most this much.
_RELEASE_DELAY_S = 0.02

# The store's checksum (CommitSlotsRequest.xxh3_64, GetReference.xxh3_64). It releases the GIL.
value_digest = xxhash.xxh3_64_intdigest


class SharedMemoryTransfer(Calls):
    """StoreClient's reservations, commits and reads of arena slots."""

    def reserve(self, items: Sequence[SizedItemFields]) -> SharedPut | None:
        """Slots for a shared-memory put, or None when this session is not on the shared-memory path
        (or the store failed: the items are then counted as dropped)."""
        arena = self._shared_arena()
        if arena is None or not items:
            return None
        statuses: list[int] = [pb.PUT_STATUS_UNSPECIFIED] * len(items)
        slots: list[memoryview | None] = [None] * len(items)
        generations: list[int | None] = [None] * len(items)
        sendable: list[int] = []
        for n, item in enumerate(items):
            if self._valid_key(item[1]):
                sendable.append(n)
            else:
                statuses[n] = pb.REJECTED
        spared = self._reserve_spare(arena, items, sendable, statuses)
        if spared is not None:
            return spared
        deadline = _Deadline(self.rpc_timeout_s)
        size = self._batch_size()
        session_id = ""
        try:
            for start in range(0, len(sendable), size):
                chunk = sendable[start : start + size]
                reserve_request = pb.ReserveSlotsRequest(packed_lengths=[items[n][2] for n in chunk])
                add_runs(
                    reserve_request.packed_items,
                    pack_blocks([(items[n][0], items[n][1], self._base_key(items[n][3])) for n in chunk]),
                )

                def rpc(
                    sid: str, timeout: float, request: pb.ReserveSlotsRequest = reserve_request
                ) -> tuple[str, pb.ReserveSlotsResponse]:
                    request.session_id = sid
                    return sid, self._stub.ReserveSlots(request, timeout=timeout)

                session_id, response = self._call(deadline, rpc)
                packed = response.packed
                answered = packed.statuses
                granted = iter(zip(packed.offsets, packed.generations, strict=False))
                for i, n in enumerate(chunk):
                    status = answered[i] if i < len(answered) else pb.REJECTED
                    if status != pb.PUT_STATUS_UNSPECIFIED:
                        statuses[n] = status
                        continue
                    offset, generation = next(granted, (0, 0))
                    try:
                        slots[n] = arena.slot(packed.segment, offset, items[n][2])
                    except ValueError:
                        statuses[n] = pb.REJECTED
                        continue
                    generations[n] = generation
        except _CallFailed:
            with self._lock:
                self.counters.put_dropped += len(items)
            return None
        return self._shared_put(session_id, items, statuses, slots, generations, spare=False)

    def _reserve_spare(
        self,
        arena: ArenaMapping,
        items: Sequence[SizedItemFields],
        sendable: list[int],
        statuses: list[int],
    ) -> SharedPut | None:
        """The put in spare slots an earlier commit was granted, with no round trip: only when there
        is one of the right length for every item (and they fit one commit). Items already stored
        are then written anyway, and their commit answers ALREADY_PRESENT.

        Only spares granted less than half a session TTL ago are written: the granting call kept
        the session alive at the store until at least a TTL after it was sent, so the store cannot
        have ended the session and handed the slots to another writer meanwhile."""
        if not sendable or len(sendable) > self._batch_size():
            return None
        need = Counter(items[n][2] for n in sendable)
        with self._lock:
            session_id = self.session_id
            fresh_since = self._spares_fresh_since_locked()
            spares = self._spares
            for length, count in need.items():
                held = spares.get(length, [])
                if len(held) < count or any(granted < fresh_since for *_, granted in held[-count:]):
                    return None
            picked = [spares[items[n][2]].pop() for n in sendable]
            segment = self._spares_of[1]
        slots: list[memoryview | None] = [None] * len(items)
        generations: list[int | None] = [None] * len(items)
        try:
            for n, (offset, generation, _) in zip(sendable, picked, strict=True):
                slots[n] = arena.slot(segment, offset, items[n][2])
                generations[n] = generation
        except ValueError:  # not this mapping's: the session ended and left them behind
            with self._lock:
                self._spares.clear()
            return None
        return self._shared_put(session_id, items, statuses, slots, generations, spare=True)

    def _shared_put(
        self,
        session_id: str,
        items: Sequence[SizedItemFields],
        statuses: list[int],
        slots: list[memoryview | None],
        generations: list[int | None],
        spare: bool,
    ) -> SharedPut:
        digests: list[int | None] = [None] * len(items)
        return SharedPut(session_id, list(items), statuses, slots, generations, digests, spare)

    def _spare_request(self, reservation: SharedPut, pending: list[int]) -> tuple[list[int], list[int]]:
        """What the last commit of a put asks: spare lengths that, with those held, make one put like
        this one, and the held spares of other lengths to give back."""
        if len(pending) > self._batch_size():
            return [], []
        want = Counter(reservation.items[n][2] for n in pending)
        with self._lock:
            # Give back spares of other lengths, and stale ones (see _reserve_spare).
            fresh_since = self._spares_fresh_since_locked()
            cancel: list[int] = []
            for length in list(self._spares):
                held = self._spares.pop(length)
                kept = [s for s in held if length in want and s[2] >= fresh_since]
                cancel.extend(s[1] for s in held if length not in want or s[2] < fresh_since)
                if kept:
                    self._spares[length] = kept
            ask = [
                length
                for length, count in want.items()
                for _ in range(count - len(self._spares.get(length, ())))
            ]
        return ask, cancel

    def _spares_fresh_since_locked(self) -> float:
        """The oldest grant time of a spare that may still be written (see _reserve_spare), after
        dropping the spares of an earlier session: gone with it. Caller holds the lock."""
        if self._spares_of[0] != self.session_id:
            self._spares.clear()
        return time.monotonic() - self.session_ttl_ms / 2000.0

    def _keep_spares(
        self, session_id: str, sent_at: float, lengths: list[int], granted: pb.PackedGrants
    ) -> None:
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
            if self._spares_of != (session_id, granted.segment):
                self._spares.clear()
                self._spares_of = (session_id, granted.segment)
            for length, offset, generation in kept:
                self._spares.setdefault(length, []).append((offset, generation, sent_at))

    def write_slots(self, reservation: SharedPut, fill: Callable[[int, memoryview], None]) -> None:
        """fill(index, slot) for each granted slot of a reservation, each digested right after, from
        cache; large slots in halves on two threads (_in_halves). `fill` must then be safe to call
        from two threads for distinct slots (a memmove or a torch copy: both release the GIL, so
        the halves do run at once)."""
        written = [(index, slot) for index, slot in enumerate(reservation.slots) if slot is not None]

        def write(part: list[tuple[int, memoryview]]) -> None:
            for index, slot in part:
                fill(index, slot)
                reservation.digest(index)

        self._in_halves(write, written, [slot for _, slot in written])

    def _in_halves(
        self, work: Callable[[list[_A]], _R], parts: list[_A], slots: list[memoryview]
    ) -> list[_R]:
        """work(parts), or, when there are several slots and every one is large, work on the second
        half on the client's digest thread while this thread does the first (results in order).
        Two cores each copying and then hashing measured 16 x 1 MiB in ~1.55 ms here, against
        ~2.05 ms for one copying while the other hashed each finished slot."""
        if len(parts) < 2 or any(slot.nbytes < LARGE_SLOT_BYTES for slot in slots):
            return [work(parts)]
        half = len(parts) // 2
        beside = self._run_beside(work, parts[half:])
        try:
            first = work(parts[:half])
        finally:
            second = beside.result()
        return [first, second]

    def commit(self, reservation: SharedPut) -> list[int] | None:
        """Make the written slots of a reservation visible; a PutStatus per item, or None when the
        store could not be reached (the slots are freed when the session ends). The last message
        also asks for spare slots for a next put like this one (see _reserve_spare)."""
        results = list(reservation.statuses)
        chunk_size = self._batch_size()
        pending = [n for n, generation in enumerate(reservation.generations) if generation is not None]
        ask, cancel = self._spare_request(reservation, pending)
        deadline = _Deadline(self.rpc_timeout_s)
        sent_any = False
        try:
            for start in range(0, len(pending), chunk_size):
                chunk = pending[start : start + chunk_size]
                last = start + chunk_size >= len(pending)
                request = pb.CommitSlotsRequest(
                    generations=[g for n in chunk if (g := reservation.generations[n]) is not None],
                    xxh3_64=[reservation.digest(n) for n in chunk],
                )
                if reservation.spare:  # the keys the spare slots are for
                    keyed = [reservation.items[n] for n in chunk]
                    add_runs(
                        request.packed_items,
                        pack_blocks([(g, key, self._base_key(base)) for g, key, _, base in keyed]),
                    )
                if last:
                    request.spare_lengths.extend(ask)
                    request.cancel_generations.extend(cancel)

                def rpc(
                    sid: str, timeout: float, request: pb.CommitSlotsRequest = request
                ) -> tuple[str, float, pb.CommitSlotsResponse]:
                    request.session_id = sid
                    sent_at = time.monotonic()
                    return sid, sent_at, self._stub.CommitSlots(request, timeout=timeout)

                session_id, sent_at, response = self._call(deadline, rpc)
                answered = (
                    response.packed_statuses if reservation.spare else [r.status for r in response.results]
                )
                for n, status in zip(chunk, answered, strict=False):
                    results[n] = status
                if last and ask:
                    self._keep_spares(session_id, sent_at, ask, response.spare)
                sent_any = True
        except _CallFailed:
            pass
        self._count_put_results(results)
        if pending and not sent_any and all(r == pb.PUT_STATUS_UNSPECIFIED for r in results):
            return None
        return [int(r) for r in results]

    def _get_shared(
        self,
        arena: ArenaMapping,
        blocks: Sequence[tuple[int, bytes]],
        leases: Leases,
        sink: Callable[[int, memoryview], bool],
    ) -> list[bool]:
        """get_into() over the arena (see StoreClient.get_into)."""
        served = [False] * len(blocks)
        if not blocks:
            if leases:
                self.release(leases)
            return served
        valid = [n for n, (_, key) in enumerate(blocks) if self._valid_key(key)]
        size = self._batch_size()
        chunks = [valid[i : i + size] for i in range(0, len(valid), size)] or [[]]
        deadline = _Deadline(self.rpc_timeout_s)
        # One lease goes with the last message; several are released after it. Without one, the
        # first message carries the release of an earlier get's read lease (saves a ReleaseLeases).
        attached = leases[0] if len(leases) == 1 else ""
        carried = "" if attached else self._take_pending_release()
        try:
            for c, chunk in enumerate(chunks):
                last = c == len(chunks) - 1
                get_request = pb.GetRequest(lease_id=attached if last else "", verify_in_client=True)
                if carried and c == 0:
                    get_request.lease_id = carried
                add_runs(
                    get_request.packed_blocks, pack_blocks([(blocks[n][0], blocks[n][1], b"") for n in chunk])
                )

                def rpc(
                    sid: str, timeout: float, request: pb.GetRequest = get_request
                ) -> pb.GetReferencesResponse:
                    request.session_id = sid
                    response: pb.GetReferencesResponse = self._stub.GetReferences(request, timeout=timeout)
                    return response

                try:
                    response = self._call(deadline, rpc)
                except _CallFailed:
                    if c == 0 and carried:
                        self._release_soon(carried)  # not delivered: the releaser sends it
                    raise
                corrupted: list[int] = []
                try:
                    packed = response.packed
                    hits = [n for n, status in zip(chunk, packed.statuses, strict=False) if status == pb.HIT]
                    segment = packed.segment
                    # (hit, block, offset, slot, generation) of each reference inside the arena
                    found: list[tuple[int, int, int, memoryview, int]] = []
                    for h, (n, offset, length, generation) in enumerate(
                        zip(hits, packed.offsets, packed.lengths, packed.generations, strict=False)
                    ):
                        try:
                            found.append((h, n, offset, arena.slot(segment, offset, length), generation))
                        except ValueError:
                            continue

                    corrupted = self._copy_out(arena, found, list(packed.xxh3_64), sink, served)
                finally:
                    if response.lease.lease_id:
                        self._release_soon(response.lease.lease_id)
                if corrupted:
                    self._report_corrupted(deadline, [blocks[n] for n in corrupted])
            if len(leases) > 1:
                self.release(leases)
        except _CallFailed:
            if leases:
                self.release(leases)
        with self._lock:
            self.counters.get_failed += served.count(False)
        return served

    def _copy_out(
        self,
        arena: ArenaMapping,
        found: list[tuple[int, int, int, memoryview, int]],
        digests: list[int],
        sink: Callable[[int, memoryview], bool],
        served: list[bool],
    ) -> list[int]:
        """sink() each found reference's slot while it holds its generation, and check the copy
        against the committed digest, from the cache the copy just warmed (the one read of the
        value): `served[block]` for each copy that stands; returns the blocks whose copy failed its
        digest. Large slots go in halves on two threads (_in_halves)."""

        def serve(part: list[tuple[int, int, int, memoryview, int]]) -> list[int]:
            corrupted: list[int] = []
            for h, n, offset, source, generation in part:
                if not (
                    arena.current(offset, generation)
                    and sink(n, source)
                    and arena.current(offset, generation)
                ):
                    continue
                if digests and (h >= len(digests) or value_digest(source) != digests[h]):
                    corrupted.append(n)
                    continue
                served[n] = True
            return corrupted

        return [n for part in self._in_halves(serve, found, [f[3] for f in found]) for n in part]

    def _report_corrupted(self, deadline: _Deadline, blocks: list[tuple[int, bytes]]) -> None:
        """Ask again, unverified, for blocks whose copy failed its digest: the service then checks them
        itself and drops the corrupted values (MISS, corrupted_dropped), so the next save re-stores
        them instead of finding them ALREADY_PRESENT. The copies stay unserved either way."""

        def rpc(sid: str, timeout: float) -> pb.GetReferencesResponse:
            request = pb.GetRequest(session_id=sid)
            for group, key in blocks:
                self._set_block(request.blocks.add(), group, key)
            response: pb.GetReferencesResponse = self._stub.GetReferences(request, timeout=timeout)
            return response

        response = self._call(deadline, rpc)
        if response.lease.lease_id:
            self._release_soon(response.lease.lease_id)

    def _run_beside(self, work: Callable[[_A], _R], argument: _A) -> Future[_R]:
        """work(argument) on the client's digest thread (started at the first large put), or here
        once close() has shut it down."""
        with self._lock:
            if self._digester is None and not self._closed.is_set():
                self._digester = ThreadPoolExecutor(1, thread_name_prefix="kvtag-digest")
            digester = self._digester
        try:
            if digester is not None:
                return digester.submit(work, argument)
        except RuntimeError:  # shut down by close(): take it here
            pass
        done: Future[_R] = Future()
        try:
            done.set_result(work(argument))
        except Exception as error:  # handed to the caller, as the thread would
            done.set_exception(error)
        return done

    def _take_pending_release(self) -> str:
        with self._lock:
            return self._pending_releases.pop() if self._pending_releases else ""

    def _release_soon(self, lease_id: str) -> None:
        """Release a read lease without waiting: the next GetReferences carries it, or after
        _RELEASE_DELAY_S one long-lived thread sends the pending ids in batches (a grpc future per
        release would start a polling thread each time: ~ms per Get here)."""
        with self._lock:
            self._pending_releases.append(lease_id)
            if self._releaser is None:
                self._releaser = threading.Thread(
                    target=self._release_forever, name="kvtag-release", daemon=True
                )
                self._releaser.start()
        self._release_wake.set()

    def _release_forever(self) -> None:
        while True:
            self._release_wake.wait(1.0)
            self._release_wake.clear()
            if self._closed.is_set() or self._closed.wait(_RELEASE_DELAY_S):
                return  # CloseSession releases what is still pending
            with self._lock:
                lease_ids, self._pending_releases = tuple(self._pending_releases), []
            if lease_ids:
                self.release(lease_ids)  # best effort: leases also expire, and die with the session
