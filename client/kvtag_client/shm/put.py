"""Shared-memory puts: slots reserved in the store's arena (or spare ones already held), written in
place, digested while in cache, and committed; the messages carry only slot references."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtag.v1 import store_pb2 as pb

from kvtag_client.calls import Caller
from kvtag_client.errors import CallFailed
from kvtag_client.items import SizedItemFields
from kvtag_client.packed_keys import add_runs, pack_blocks
from kvtag_client.shm.digest_thread import DigestThread
from kvtag_client.shm.mapping import ArenaMapping, value_digest
from kvtag_client.shm.spares import SpareSlots


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
    token_ids: Sequence[bytes] = ()  # one per item, or none (sent with the keys, for KV events)

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


class SharedPuts:
    """StoreClient's reservations, writes and commits of arena slots."""

    def __init__(self, caller: Caller, spares: SpareSlots, digest_thread: DigestThread) -> None:
        self.caller = caller
        self.session = caller.session
        self.spares = spares
        self._digest_thread = digest_thread

    def reserve(
        self, arena: ArenaMapping, items: Sequence[SizedItemFields], token_ids: Sequence[bytes] = ()
    ) -> SharedPut | None:
        """Slots for a put of `items` (at least one) in `arena`, or None when the store failed (the
        items are then counted as dropped)."""
        caller = self.caller
        statuses: list[int] = [pb.PUT_STATUS_UNSPECIFIED] * len(items)
        slots: list[memoryview | None] = [None] * len(items)
        generations: list[int | None] = [None] * len(items)
        sendable: list[int] = []
        valid_key = caller.valid_key
        for n, item in enumerate(items):
            if valid_key(item[1]):
                sendable.append(n)
            else:
                statuses[n] = pb.REJECTED
        spared = self._reserve_spare(arena, items, sendable, statuses, token_ids)
        if spared is not None:
            return spared
        deadline = caller.deadline()
        size = caller.batch_size()
        base_key = caller.base_key
        stub = self.session.stub
        session_id = ""
        try:
            for start in range(0, len(sendable), size):
                chunk = sendable[start : start + size]
                reserve_request = pb.ReserveSlotsRequest(packed_lengths=[items[n][2] for n in chunk])
                add_runs(
                    reserve_request.packed_items,
                    pack_blocks(
                        [(items[n][0], items[n][1], base_key(items[n][3])) for n in chunk],
                        [token_ids[n] for n in chunk] if token_ids else (),
                    ),
                )

                def rpc(
                    sid: str, timeout: float, request: pb.ReserveSlotsRequest = reserve_request
                ) -> tuple[str, pb.ReserveSlotsResponse]:
                    request.session_id = sid
                    return sid, stub.ReserveSlots(request, timeout=timeout)

                session_id, response = caller.call(deadline, rpc)
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
        except CallFailed:
            with self.session.counting() as counters:
                counters.put_dropped += len(items)
            return None
        return SharedPut(session_id, list(items), statuses, slots, generations, [None] * len(items), False)

    def _reserve_spare(
        self,
        arena: ArenaMapping,
        items: Sequence[SizedItemFields],
        sendable: list[int],
        statuses: list[int],
        token_ids: Sequence[bytes],
    ) -> SharedPut | None:
        """The put in spare slots an earlier commit was granted, with no round trip: only when there
        is a fresh one of the right length for every item (and they fit one commit). Items already
        stored are then written anyway, and their commit answers ALREADY_PRESENT."""
        if not sendable or len(sendable) > self.caller.batch_size():
            return None
        taken = self.spares.take([items[n][2] for n in sendable])
        if taken is None:
            return None
        session_id, segment, picked = taken
        slots: list[memoryview | None] = [None] * len(items)
        generations: list[int | None] = [None] * len(items)
        try:
            for n, (offset, generation) in zip(sendable, picked, strict=True):
                slots[n] = arena.slot(segment, offset, items[n][2])
                generations[n] = generation
        except ValueError:  # not this mapping's: the session ended and left them behind
            self.spares.clear()
            return None
        return SharedPut(
            session_id, list(items), statuses, slots, generations, [None] * len(items), True, token_ids
        )

    def write_slots(self, reservation: SharedPut, fill: Callable[[int, memoryview], None]) -> None:
        """fill(index, slot) for each granted slot of a reservation, each digested right after, from
        cache; large slots in halves on two threads (DigestThread.in_halves). `fill` must then be safe
        to call from two threads for distinct slots (a memmove or a torch copy: both release the GIL,
        so the halves do run at once)."""
        written = [(index, slot) for index, slot in enumerate(reservation.slots) if slot is not None]

        def write(part: list[tuple[int, memoryview]]) -> None:
            digest = reservation.digest
            for index, slot in part:
                fill(index, slot)
                digest(index)

        self._digest_thread.in_halves(write, written, [slot for _, slot in written])

    def commit(self, reservation: SharedPut) -> list[int] | None:
        """Make the written slots of a reservation visible; a PutStatus per item, or None when the
        store could not be reached (the slots are freed when the session ends). The last message
        also asks for spare slots for a next put like this one (see SpareSlots)."""
        caller = self.caller
        results = list(reservation.statuses)
        chunk_size = caller.batch_size()
        pending = [n for n, generation in enumerate(reservation.generations) if generation is not None]
        ask: list[int] = []
        cancel: list[int] = []
        if len(pending) <= chunk_size:
            ask, cancel = self.spares.request([reservation.items[n][2] for n in pending])
        deadline = caller.deadline()
        stub = self.session.stub
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
                    tokens = reservation.token_ids
                    add_runs(
                        request.packed_items,
                        pack_blocks(
                            [(g, key, caller.base_key(base)) for g, key, _, base in keyed],
                            [tokens[n] for n in chunk] if tokens else (),
                        ),
                    )
                if last:
                    request.spare_lengths.extend(ask)
                    request.cancel_generations.extend(cancel)

                def rpc(
                    sid: str, timeout: float, request: pb.CommitSlotsRequest = request
                ) -> tuple[str, float, pb.CommitSlotsResponse]:
                    request.session_id = sid
                    sent_at = time.monotonic()
                    return sid, sent_at, stub.CommitSlots(request, timeout=timeout)

                session_id, sent_at, response = caller.call(deadline, rpc)
                answered = (
                    response.packed_statuses if reservation.spare else [r.status for r in response.results]
                )
                for n, status in zip(chunk, answered, strict=False):
                    results[n] = status
                if last and ask:
                    self.spares.keep(session_id, sent_at, ask, response.spare)
                sent_any = True
        except CallFailed:
            pass
        caller.count_put_results(results)
        if pending and not sent_any and all(r == pb.PUT_STATUS_UNSPECIFIED for r in results):
            return None
        return [int(r) for r in results]
