"""How a store call fails: the failure already handled, and the status codes that mean an outage, a
refused token or a session the store no longer knows."""

from __future__ import annotations

import grpc
from kvtag_proto.errors import parse_error

# Codes that mean "the store (or the path to it) is not working right now".
OUTAGE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
# The store refused the token (absent, wrong, revoked) or its grant: an outage like any other (logged
# once, retried in the background, so a rotated token file is picked up), but said plainly.
AUTH_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


class CallFailed(Exception):
    """A store call failed and was already handled (state updated, logged); return the fallback."""


def status_code(err: grpc.RpcError) -> grpc.StatusCode:
    return err.code() if isinstance(err, grpc.Call) else grpc.StatusCode.UNKNOWN


def is_session_gone(err: grpc.RpcError) -> bool:
    """The store no longer knows the session (it expired or the store restarted): open a new one."""
    if status_code(err) is not grpc.StatusCode.NOT_FOUND:
        return False
    detail = parse_error(err)
    return detail is None or detail.reason == "SESSION_NOT_FOUND"
