"""Shared-memory gets: GetReferences pins the hits and names their slots; each slot is copied out
while it holds its generation and the copy is checked against the committed digest."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtag.v1 import store_pb2 as pb

from kvtag_client.calls import Caller, Leases
from kvtag_client.deadlines import Deadline
from kvtag_client.errors import CallFailed
from kvtag_client.packed_keys import add_runs, pack_blocks
from kvtag_client.shm.digest_thread import DigestThread
from kvtag_client.shm.mapping import ArenaMapping, value_digest
from kvtag_client.shm.releaser import LeaseReleaser

# (hit, block, offset, slot, generation) of a reference inside the arena.
_Found = tuple[int, int, int, memoryview, int]
# Passes a Get makes again for blocks the store answered MISS beside hits (reads around a full memory).
MAX_RETRY_PASSES = 16


class SharedGets:
    """StoreClient's reads of arena slots."""

    def __init__(self, caller: Caller, releaser: LeaseReleaser, digest_thread: DigestThread) -> None:
        self.caller = caller
        self.session = caller.session
        self._releaser = releaser
        self._digest_thread = digest_thread

    def get_into(
        self,
        arena: ArenaMapping,
        blocks: Sequence[tuple[int, bytes]],
        leases: Leases,
        sink: Callable[[int, memoryview], bool],
    ) -> list[bool]:
        """get_into() over the arena (see StoreClient.get_into)."""
        caller = self.caller
        releaser = self._releaser
        served = [False] * len(blocks)
        if not blocks:
            if leases:
                caller.release(leases)
            return served
        valid_key = caller.valid_key
        valid = [n for n, (_, key) in enumerate(blocks) if valid_key(key)]
        size = caller.batch_size()
        chunks = [valid[i : i + size] for i in range(0, len(valid), size)] or [[]]
        planned = len(chunks)  # retries are appended past these
        deadline = caller.deadline()
        stub = self.session.stub
        # One lease goes with the last message; several are released after it. Without one, the
        # first message carries the release of an earlier get's read lease (saves a ReleaseLeases).
        attached = leases[0] if len(leases) == 1 else ""
        carried = "" if attached else releaser.take_pending()
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
                    response: pb.GetReferencesResponse = stub.GetReferences(request, timeout=timeout)
                    return response

                try:
                    response = caller.call(deadline, rpc)
                except CallFailed:
                    if c == 0 and carried:
                        releaser.release_soon(carried)  # not delivered: the releaser sends it
                    raise
                corrupted: list[int] = []
                again: list[int] = []
                try:
                    packed = response.packed
                    hits = [n for n, status in zip(chunk, packed.statuses, strict=False) if status == pb.HIT]
                    segment = packed.segment
                    found: list[_Found] = []
                    for h, (n, offset, length, generation) in enumerate(
                        zip(hits, packed.offsets, packed.lengths, packed.generations, strict=False)
                    ):
                        try:
                            found.append((h, n, offset, arena.slot(segment, offset, length), generation))
                        except ValueError:
                            continue

                    corrupted = self._copy_out(arena, found, list(packed.xxh3_64), sink, served)
                    if hits and len(chunks) - planned < MAX_RETRY_PASSES:
                        again = [n for n, st in zip(chunk, packed.statuses, strict=False) if st == pb.MISS]
                finally:
                    if response.lease.lease_id and again:
                        caller.release((response.lease.lease_id,))  # frees this part's slots now
                    elif response.lease.lease_id:
                        releaser.release_soon(response.lease.lease_id)
                if again:
                    # A Get of disk-resident blocks larger than twice the store's memory comes back in part:
                    # what is read around a full memory takes slots up to the pool's size. The rest is
                    # asked for again once this part's slots are freed, while a pass makes progress.
                    chunks.append(again)
                if corrupted:
                    self._report_corrupted(deadline, [blocks[n] for n in corrupted])
            if len(leases) > 1:
                caller.release(leases)
        except CallFailed:
            if leases:
                caller.release(leases)
        with self.session.counting() as counters:
            counters.get_failed += served.count(False)
        return served

    def _copy_out(
        self,
        arena: ArenaMapping,
        found: list[_Found],
        digests: list[int],
        sink: Callable[[int, memoryview], bool],
        served: list[bool],
    ) -> list[int]:
        """sink() each found reference's slot while it holds its generation, and check the copy
        against the committed digest, from the cache the copy just warmed (the one read of the
        value): `served[block]` for each copy that stands; returns the blocks whose copy failed its
        digest. Large slots go in halves on two threads (DigestThread.in_halves)."""

        def serve(part: list[_Found]) -> list[int]:
            corrupted: list[int] = []
            current = arena.current
            for h, n, offset, source, generation in part:
                if not (current(offset, generation) and sink(n, source) and current(offset, generation)):
                    continue
                if digests and (h >= len(digests) or value_digest(source) != digests[h]):
                    corrupted.append(n)
                    continue
                served[n] = True
            return corrupted

        halves = self._digest_thread.in_halves(serve, found, [f[3] for f in found])
        return [n for part in halves for n in part]

    def _report_corrupted(self, deadline: Deadline, blocks: list[tuple[int, bytes]]) -> None:
        """Ask again, unverified, for blocks whose copy failed its digest: the service then checks them
        itself and drops the corrupted values (MISS, corrupted_dropped), so the next save re-stores
        them instead of finding them ALREADY_PRESENT. The copies stay unserved either way."""
        set_block = self.caller.set_block
        stub = self.session.stub

        def rpc(sid: str, timeout: float) -> pb.GetReferencesResponse:
            request = pb.GetRequest(session_id=sid)
            for group, key in blocks:
                set_block(request.blocks.add(), group, key)
            response: pb.GetReferencesResponse = stub.GetReferences(request, timeout=timeout)
            return response

        response = self.caller.call(deadline, rpc)
        if response.lease.lease_id:
            self._releaser.release_soon(response.lease.lease_id)
