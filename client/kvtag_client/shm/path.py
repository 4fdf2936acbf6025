"""The shared-memory data path: the session's arena mapping, and the puts, gets, spare slots, lease
releaser and digest thread that use it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import grpc
from kvtag.v1 import store_pb2 as pb

from kvtag_client.calls import Caller, Leases
from kvtag_client.deadlines import Deadline
from kvtag_client.errors import CallFailed
from kvtag_client.items import SizedItemFields
from kvtag_client.logs import log
from kvtag_client.shm.digest_thread import DigestThread
from kvtag_client.shm.get import SharedGets
from kvtag_client.shm.mapping import ArenaMapping, UnusableOffer
from kvtag_client.shm.put import SharedPut, SharedPuts
from kvtag_client.shm.releaser import LeaseReleaser
from kvtag_client.shm.spares import SpareSlots


class SharedMemoryPath:
    """Values written into and read from the store's arena slots while the session has a mapping of
    it (see arena()); the session's open and close hooks attach and close it."""

    def __init__(self, caller: Caller) -> None:
        self.session = caller.session
        self._lock = threading.Lock()
        # The mapping and the session it was attached in: a later session has none until it attaches.
        self._attached: tuple[str, ArenaMapping] | None = None
        self._unavailable_logged = False
        self.spares = SpareSlots(self.session)
        self.releaser = LeaseReleaser(caller, self.session.closed)
        self.digest_thread = DigestThread(self.session.closed)
        self.puts = SharedPuts(caller, self.spares, self.digest_thread)
        self.gets = SharedGets(caller, self.releaser, self.digest_thread)

    def arena(self) -> ArenaMapping | None:
        """The arena mapping while the session is connected and attached to it, else None (inline)."""
        session_id = self.session.connected_id()
        attached = self._attached
        return attached[1] if attached is not None and attached[0] == session_id else None

    def reserve(self, items: Sequence[SizedItemFields], token_ids: Sequence[bytes] = ()) -> SharedPut | None:
        """See StoreClient.reserve."""
        arena = self.arena()
        if arena is None or not items:
            return None
        return self.puts.reserve(arena, items, token_ids)

    def get_into(
        self,
        arena: ArenaMapping,
        blocks: Sequence[tuple[int, bytes]],
        leases: Leases,
        sink: Callable[[int, memoryview], bool],
    ) -> list[bool]:
        return self.gets.get_into(arena, blocks, leases, sink)

    def attach(self, response: pb.OpenSessionResponse, deadline: Deadline) -> None:
        """Map the arena a new session was offered and prove it with its nonce; on any failure stay
        inline (logged once). The mapping of an earlier session is closed first."""
        with self._lock:
            earlier, self._attached = self._attached, None
        if earlier is not None:
            earlier[1].close()
        if not response.HasField("shared_memory_offer"):
            self._inline_fallback(
                "the store offers no shared-memory arena (another backend, or --shm-dir is off)"
            )
            return
        offer = response.shared_memory_offer
        try:
            arena = ArenaMapping(offer)
        except UnusableOffer as exc:
            self._inline_fallback(f"{exc} (another host, or no shared /dev/shm)")
            return
        try:
            attached: pb.AttachSharedMemoryResponse = self.session.stub.AttachSharedMemory(
                pb.AttachSharedMemoryRequest(session_id=response.session_id, nonce=arena.nonce),
                timeout=deadline.remaining(),
            )
        except (grpc.RpcError, CallFailed) as exc:
            self._inline_fallback(f"AttachSharedMemory failed: {exc}")
            return
        if attached.data_path != pb.DATA_PATH_SHARED_MEMORY:
            self._inline_fallback(f"the store did not accept this mapping of {offer.path}")
            return
        with self._lock:
            self._attached = (response.session_id, arena)
        log.info("kvtag store %s: values move through shared memory (%s)", self.session.endpoint, offer.path)

    def _inline_fallback(self, why: str) -> None:
        with self._lock:
            first, self._unavailable_logged = not self._unavailable_logged, True
        if first:
            log.warning(
                "kvtag store %s: shared-memory path unavailable, using the inline path: %s",
                self.session.endpoint,
                why,
            )

    def close(self) -> None:
        """End the releaser (its call in flight before the channel closes), stop the mapping's
        background work and the digest thread. The session is already closed."""
        self.releaser.stop()
        with self._lock:
            attached = self._attached
        if attached is not None:
            attached[1].close()
        self.digest_thread.shutdown()
