"""Refusals of OpenSessions past a cap on namespaces or live sessions (config.Caps).

A refusal keeps nothing: it is decided before any namespace or session state is created, and
the only trace is the counters (kvtag_sessions_refused_total, kvtag_rpc_errors_total).
"""

from __future__ import annotations

import grpc
from kvtag.v1 import store_pb2 as pb

from kvtag_store.errors import ApiError


def namespace_cap(flag: str, limit: int, tenant: str | None) -> ApiError:
    scope = f"tenant `{tenant or '(shared)'}` has" if tenant is not None else "the store holds"
    return _refusal(
        pb.NAMESPACE_CAP_REACHED,
        flag,
        limit,
        f"{scope} {limit} namespaces, the {flag} cap, each with a live session or stored blocks (those "
        "holding nothing were just forgotten); retry once blocks are evicted or sessions end, reuse an "
        "existing namespace, or raise the cap",
    )


def session_cap(flag: str, limit: int, tenant: str | None) -> ApiError:
    scope = f"tenant `{tenant or '(shared)'}` has" if tenant is not None else "the store has"
    return _refusal(
        pb.SESSION_CAP_REACHED,
        flag,
        limit,
        f"{scope} {limit} live sessions, the {flag} cap; close idle sessions (or let them expire) and "
        "retry, or raise the cap",
    )


def _refusal(reason: int, flag: str, limit: int, message: str) -> ApiError:
    metadata = {"cap": flag.removeprefix("--"), "limit": str(limit)}
    return ApiError(
        grpc.StatusCode.RESOURCE_EXHAUSTED, pb.ErrorReason.Name(reason), message, {"metadata": metadata}
    )
