"""Read leases between the session table (which tracks them) and the backend (which holds the pins)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtag.v1 import store_pb2 as pb

from kvtag_store.backends.base import BlockAddress, BlockBackend
from kvtag_store.policy.sessions import Session, SessionTable, Unpin


class Leases:
    def __init__(self, sessions: SessionTable, backend: BlockBackend) -> None:
        self.sessions = sessions
        self.backend = backend

    def grant(self, lease: pb.Lease, session: Session, pinned: Sequence[BlockAddress], lease_ms: int) -> None:
        """Hold the pinned blocks under a new lease of the session's namespace, described in `lease`."""
        lease.lease_id = self.sessions.add_lease(session, session.namespace_id, pinned, lease_ms)
        lease.expires_in_ms = lease_ms

    def release(self, session: Session, lease_ids: Sequence[str]) -> None:
        """Release leases of the session's namespace (any session of it may: the id is the capability)."""
        self.unpin(self.sessions.release(session, lease_ids))

    def unpin(self, unpins: Iterable[Unpin]) -> None:
        for namespace_id, addresses in unpins:
            self.backend.unpin(namespace_id, addresses)
