"""Who may call what: the gRPC gate that authenticates every KvStore call, and the checks the API
layer makes against a session's tenant.

Two layers, on purpose. The interceptor refuses an unauthenticated call before its request is even
parsed, for every KvStore method, including ones added later. The API layer then asks `principal()`
for the caller of the call it is serving and checks the tenant of the session it names; a session
of a tenant the token does not grant is answered exactly like an unknown session, so a refusal
never tells a caller that another tenant's session, lease or key exists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc

from kvtag_store import errors
from kvtag_store.security.tokens import ALL_TENANTS, Principal, TokenRegistry

log = logging.getLogger("kvtag_store.security.access")

# Only the store's own API is gated: the health service stays open for probes and HEALTHCHECKs,
# reflection only describes the public schema.
GATED_PREFIX = "/kvtag.v1.KvStore/"
AUTHORIZATION = "authorization"
# The arenas of tenants that get none of their own (Access.arena_of): the shared pool's, and with
# tokens the one of tenants only a "*" grant reaches (whoever reaches one reaches them all).
SHARED_ARENA = ""
WILDCARD_ARENA = ALL_TENANTS


def authorization_header(metadata: Any) -> str | None:
    """The single `authorization` value of a call's metadata; None when absent, repeated or not text."""
    values = [value for key, value in metadata or () if key == AUTHORIZATION]
    if len(values) != 1 or not isinstance(values[0], str):
        return None
    value: str = values[0]
    return value


class Access:
    """The token registry as the API layer sees it: the caller of a call, and role checks."""

    def __init__(self, tokens: TokenRegistry) -> None:
        self.tokens = tokens

    @property
    def enabled(self) -> bool:
        return self.tokens.enabled

    def principal(self, context: grpc.ServicerContext) -> Principal:
        """The caller of this call (ANONYMOUS with authentication off). Re-checked here, not carried over
        from the interceptor: a token revoked by a reload in between is refused, and the lookup costs a
        SHA-256 of a short string."""
        principal = self.tokens.authenticate(authorization_header(context.invocation_metadata()))
        if principal is None:
            raise errors.unauthenticated()
        return principal

    def session_caller(self, context: grpc.ServicerContext, rpc: str) -> Principal:
        """The caller of a session call (Lookup, Put, Get, ...): a role that opens sessions."""
        principal = self.principal(context)
        if not principal.opens_sessions:
            raise errors.role_not_allowed(principal.name, principal.role.value, rpc)
        return principal

    def opener(self, context: grpc.ServicerContext, tenant: str) -> Principal:
        """The caller of OpenSession in `tenant`, refused when its role or grant does not allow it."""
        principal = self.session_caller(context, "OpenSession")
        if not principal.may_use(tenant):
            raise errors.tenant_not_granted(principal.name, tenant)
        return principal

    def arena_of(self, tenant: str) -> str:
        """Whose arena (shared-memory values) a session of `tenant` uses. Without tokens a tenant is a
        label any client picks, so an arena of its own would isolate nothing and let clients add
        arenas without bound: every tenant shares its pool's. With tokens, a tenant the tokens file
        names has its own (the file bounds how many); the rest are reached only through "*" grants
        and share one. The backend still gives quota and --shm-group tenants their own."""
        if not self.tokens.enabled:
            return SHARED_ARENA
        return tenant if self.tokens.names(tenant) else WILDCARD_ARENA

    def viewer(self, context: grpc.ServicerContext, rpc: str) -> Principal:
        """The caller of Diagnose or GetStats: a viewer or an admin (what it sees is filtered)."""
        principal = self.principal(context)
        if not principal.views:
            raise errors.role_not_allowed(principal.name, principal.role.value, rpc)
        return principal


class AuthInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Refuses KvStore calls without a valid bearer token with UNAUTHENTICATED, before parsing them."""

    def __init__(self, tokens: TokenRegistry, on_refusal: Callable[[str], None] | None = None) -> None:
        self.tokens = tokens
        self.on_refusal = on_refusal
        self._refusal = errors.unauthenticated().status

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        method: str = details.method
        if handler is None or not self.tokens.enabled or not method.startswith(GATED_PREFIX):
            return handler
        header = authorization_header(details.invocation_metadata)
        if self.tokens.authenticate(header) is not None:
            return handler
        name = method.removeprefix(GATED_PREFIX)
        if self.on_refusal is not None:
            self.on_refusal(name)
        log.info("%s refused: no valid token", name, extra={"rpc": name, "reason": "UNAUTHENTICATED"})
        return self._refuse(handler)

    def _refuse(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """A handler of the same shape that aborts; request bytes are never deserialized."""
        status = self._refusal

        def abort(_request: object, context: grpc.ServicerContext) -> None:
            context.abort_with_status(status)

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(abort)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(abort)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(abort)
        return grpc.unary_unary_rpc_method_handler(abort)
