"""Live sessions and their read leases, both expiring on a clock.

Sessions expire session_ttl after their last call; leases after their own
duration. The table never touches the backend: it returns what to unpin and
the API layer unpins it, so this module stays backend-agnostic and testable.
It also holds the caps on live sessions (store-wide and per tenant), checked
under the same lock that adds a session, so concurrent opens cannot pass them.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtag_store.backends.base import BlockAddress
from kvtag_store.config import Caps
from kvtag_store.policy import caps


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Session:
    session_id: str
    engine_id: str
    namespace_id: str
    mode_id: str
    labels: dict[str, str]
    opened_unix_ms: int
    last_seen_unix_ms: int
    deadline: float  # time.monotonic()
    leases: set[str] = field(default_factory=set)
    # The namespace's tenant: every call naming the session is checked against the caller's token.
    tenant: str = ""
    # Shared-memory slot reservations (their generations) not yet committed; cancelled when the
    # session ends, so a client that dies mid-Put leaks no slot.
    reservations: set[int] = field(default_factory=set)
    # True once AttachSharedMemory proved the client mapped the tenant's arena.
    shared_memory: bool = False


@dataclass
class Lease:
    lease_id: str
    session_id: str
    namespace_id: str
    addresses: Sequence[BlockAddress]
    deadline: float


# (namespace_id, addresses) to unpin in the backend.
Unpin = tuple[str, Sequence[BlockAddress]]


class SessionTable:
    """Thread-safe sessions + leases. `clock` is injectable only so tests need not sleep long."""

    def __init__(
        self, session_ttl_ms: int, clock: Callable[[], float] = time.monotonic, limits: Caps | None = None
    ) -> None:
        self.session_ttl_ms = session_ttl_ms
        self._ttl = session_ttl_ms / 1000.0
        self._clock = clock
        self._caps = limits or Caps()
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._leases: dict[str, Lease] = {}
        self._per_tenant: Counter[str] = Counter()

    def check_room(self, tenant: str) -> None:
        """Raise SESSION_CAP_REACHED if a session of `tenant` would pass a cap now (a cheap early
        check, before the census admits anything; open() checks again atomically)."""
        with self._lock:
            self._check_room_locked(tenant)

    def _check_room_locked(self, tenant: str) -> None:
        if len(self._sessions) >= self._caps.max_sessions:
            raise caps.session_cap("--max-sessions", self._caps.max_sessions, None)
        if self._per_tenant[tenant] >= self._caps.max_sessions_per_tenant:
            raise caps.session_cap("--max-sessions-per-tenant", self._caps.max_sessions_per_tenant, tenant)

    def live_count(self, tenant: str | None = None) -> int:
        with self._lock:
            return len(self._sessions) if tenant is None else self._per_tenant[tenant]

    def open(
        self, engine_id: str, namespace_id: str, mode_id: str, labels: dict[str, str], tenant: str = ""
    ) -> Session:
        wall = now_ms()
        session = Session(
            session_id="s-" + secrets.token_hex(12),
            engine_id=engine_id,
            namespace_id=namespace_id,
            mode_id=mode_id,
            labels=labels,
            opened_unix_ms=wall,
            last_seen_unix_ms=wall,
            deadline=self._clock() + self._ttl,
            tenant=tenant,
        )
        with self._lock:
            self._check_room_locked(tenant)
            self._sessions[session.session_id] = session
            self._per_tenant[tenant] += 1
        return session

    def _remove_locked(self, session: Session) -> None:
        del self._sessions[session.session_id]
        left = self._per_tenant[session.tenant] - 1
        if left > 0:
            self._per_tenant[session.tenant] = left
        else:
            del self._per_tenant[session.tenant]

    def touch(self, session_id: str, may_use: Callable[[str], bool] | None = None) -> Session | None:
        """The live session, its deadline pushed out; None when unknown, expired, or of a tenant
        `may_use` refuses (that case is indistinguishable from the others, and touches nothing)."""
        now = self._clock()
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or session.deadline <= now:
                return None
            if may_use is not None and not may_use(session.tenant):
                return None
            session.deadline = now + self._ttl
            session.last_seen_unix_ms = now_ms()
            return session

    def close(
        self, session_id: str, may_use: Callable[[str], bool] | None = None
    ) -> tuple[Session | None, list[Unpin]]:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or (may_use is not None and not may_use(session.tenant)):
                return None, []
            self._remove_locked(session)
            return session, self._drop_leases(session.leases)

    def add_lease(
        self, session: Session, namespace_id: str, addresses: Sequence[BlockAddress], lease_ms: int
    ) -> str:
        lease = Lease(
            # Any session of the namespace may release a lease by its id (the connector's scheduler
            # looks up, its workers load in their own sessions), so the id is an unguessable token:
            # 128 random bits (about half a microsecond per Lookup).
            lease_id="l-" + secrets.token_hex(16),
            session_id=session.session_id,
            namespace_id=namespace_id,
            addresses=addresses,
            deadline=self._clock() + lease_ms / 1000.0,
        )
        with self._lock:
            self._leases[lease.lease_id] = lease
            session.leases.add(lease.lease_id)
        return lease.lease_id

    def release(self, session: Session, lease_ids: Sequence[str]) -> list[Unpin]:
        """Release leases of the session's namespace, whichever session of it took them: the id is the
        capability. Unknown, expired and other namespaces' ids are ignored (idempotent)."""
        namespace_id = session.namespace_id
        with self._lock:
            leases = self._leases
            ours = [
                lid
                for lid in lease_ids
                if (lease := leases.get(lid)) is not None and lease.namespace_id == namespace_id
            ]
            return self._drop_leases(ours)

    def _drop_leases(self, lease_ids: Sequence[str] | set[str]) -> list[Unpin]:
        unpins: list[Unpin] = []
        for lease_id in list(lease_ids):
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                continue
            owner = self._sessions.get(lease.session_id)
            if owner is not None:
                owner.leases.discard(lease_id)
            unpins.append((lease.namespace_id, lease.addresses))
        return unpins

    def add_reservations(self, session: Session, generations: Sequence[int]) -> bool:
        """False when the session ended meanwhile: the caller cancels them, as nothing else would."""
        with self._lock:
            if self._sessions.get(session.session_id) is not session:
                return False
            session.reservations.update(generations)
            return True

    def take_reservations(self, session: Session, generations: Sequence[int]) -> list[bool]:
        """Remove the given reservations from the session; True for each that it held (so exactly one
        commit can claim a reservation, and a session never commits another's)."""
        with self._lock:
            held = session.reservations
            taken: list[bool] = []
            for generation in generations:
                taken.append(generation in held)
                held.discard(generation)
            return taken

    def drain_reservations(self, session: Session) -> list[int]:
        """The ended session's uncommitted reservations, emptied (to cancel in the backend)."""
        with self._lock:
            generations = list(session.reservations)
            session.reservations.clear()
            return generations

    def expire(self) -> tuple[list[Session], list[Unpin]]:
        """Remove expired sessions (with their leases) and expired leases; return what to report and unpin."""
        now = self._clock()
        with self._lock:
            dead = [s for s in self._sessions.values() if s.deadline <= now]
            unpins: list[Unpin] = []
            for session in dead:
                self._remove_locked(session)
                unpins.extend(self._drop_leases(session.leases))
            stale = [lid for lid, lease in self._leases.items() if lease.deadline <= now]
            unpins.extend(self._drop_leases(stale))
            return dead, unpins
