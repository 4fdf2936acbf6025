"""Where sessions are opened, found for each call, and ended (closed or expired).

Ending a session gives back what it held: its uncommitted slots, and the pins of its leases.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
from kvtag.v1 import store_pb2 as pb

from kvtag_store import errors
from kvtag_store.api import validation
from kvtag_store.api.counting import Counting
from kvtag_store.api.leases import Leases
from kvtag_store.api.slots import Slots
from kvtag_store.api.tokens import TokenSink
from kvtag_store.backends.base import Forgetting, TenantAware
from kvtag_store.config import ServiceLimits
from kvtag_store.policy.census import Census
from kvtag_store.policy.sessions import Session, SessionTable
from kvtag_store.security.access import Access
from kvtag_store.security.tokens import Principal

log = logging.getLogger("kvtag_store.api.session_desk")


class SessionDesk:
    def __init__(
        self,
        sessions: SessionTable,
        access: Access,
        census: Census,
        counting: Counting,
        tenants: TenantAware | None,
        forgetting: Forgetting | None,
        slots: Slots,
        leases: Leases,
        limits: ServiceLimits,
        limits_message: pb.Limits,
        session_ttl_ms: int,
        reclaim: Callable[[], bool] = lambda: False,
        tokens: TokenSink | None = None,
    ) -> None:
        """`tenants`: the backend when it keeps tenants apart (told each namespace's tenant), else None.
        `forgetting`: the backend when it holds memory per tenant (admit_tenant), else None.
        `reclaim`: forgets the namespaces that hold nothing, before a namespace cap would refuse."""
        self.sessions = sessions
        self.access = access
        self.census = census
        self.counting = counting
        self.tenants = tenants
        self.forgetting = forgetting
        self.slots = slots
        self.leases = leases
        self.limits = limits
        self.limits_message = limits_message
        self.session_ttl_ms = session_ttl_ms
        self.reclaim = reclaim
        self.tokens = tokens or TokenSink()

    def find(self, session_id: str, context: grpc.ServicerContext, rpc: str) -> Session:
        """The caller's live session, its deadline renewed. One of a tenant the caller's token does not
        grant is answered as unknown, so a session id used under another token gets nothing, not even
        its existence."""
        principal = self.access.session_caller(context, rpc)
        session = self.sessions.touch(validation.session_id(session_id), _tenant_check(principal))
        if session is None:
            raise errors.session_not_found(session_id)
        return session

    def open(self, request: pb.OpenSessionRequest, context: grpc.ServicerContext) -> pb.OpenSessionResponse:
        principal = self.access.opener(context, request.namespace.tenant)
        validation.open_session(request, self.limits)
        tenant = request.namespace.tenant
        try:
            self.sessions.check_room(tenant)  # the session caps, before the census keeps anything
            arena = self.access.arena_of(tenant)
            if self.forgetting is not None:
                self.forgetting.admit_tenant(tenant, arena)
            if self.census.short_of_room(request):
                self.reclaim()
            verdict = self.census.admit(request)
            session = self.sessions.open(
                request.engine_id, verdict.namespace_id, verdict.mode_id, dict(request.labels), tenant
            )
        except errors.ApiError as refusal:
            self.counting.session_refused(refusal.reason)
            raise
        self.counting.session_admitted(verdict.warnings)
        if self.tenants is not None:
            self.tenants.assign_tenant(verdict.namespace_id, tenant, arena)
        offer = (
            self.slots.offer(verdict.namespace_id)
            if pb.DATA_PATH_SHARED_MEMORY in request.data_paths
            else None
        )
        self.census.joined(session, request.mode)
        log.info(
            "session opened",
            extra={
                "session_id": session.session_id,
                "engine_id": request.engine_id,
                "principal": principal.name,
                "namespace_id": verdict.namespace_id,
                "mode_id": verdict.mode_id,
                "warnings": [w.kind for w in verdict.warnings],
            },
        )
        return pb.OpenSessionResponse(
            session_id=session.session_id,
            namespace_id=verdict.namespace_id,
            mode_id=verdict.mode_id,
            policy=verdict.policy,  # type: ignore[arg-type]
            warnings=verdict.warnings,
            session_ttl_ms=self.session_ttl_ms,
            data_path=pb.DATA_PATH_INLINE,
            limits=self.limits_message,
            shared_memory_offer=offer,
            wants_token_ids=self.tokens.wanted,
        )

    def close(self, request: pb.CloseSessionRequest, context: grpc.ServicerContext) -> None:
        principal = self.access.session_caller(context, "CloseSession")
        session, unpins = self.sessions.close(
            validation.session_id(request.session_id), _tenant_check(principal)
        )
        self.leases.unpin(unpins)
        if session is not None:
            self._end(session)
            log.info(
                "session closed", extra={"session_id": session.session_id, "engine_id": session.engine_id}
            )

    def expire(self) -> None:
        """End the sessions whose heartbeat stopped, and unpin the leases that ran out."""
        dead, unpins = self.sessions.expire()
        for session in dead:
            self._end(session)
            self.counting.session_expired()
            log.info(
                "session expired without heartbeat",
                extra={"session_id": session.session_id, "engine_id": session.engine_id},
            )
        self.leases.unpin(unpins)

    def _end(self, session: Session) -> None:
        self.slots.cancel_all(session)
        self.census.left(session)


def _tenant_check(principal: Principal) -> Callable[[str], bool] | None:
    """The tenant test for a session lookup; None (no test) for a caller who may use every tenant."""
    return None if principal.sees_everything else principal.may_use
