"""Request-level failures of the API layer, raised as ApiError and sent as rich gRPC statuses.

The table of codes and reasons is docs/errors.md; every constructor here is one row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag_proto.errors import build_status


class ApiError(Exception):
    """A failure the caller can act on: canonical code, ErrorReason name, message and details."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str, details: dict[str, Any]) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    @property
    def status(self) -> grpc.Status:
        return build_status(self.code, self.reason, self.message, **self.details)


def _error(
    code: grpc.StatusCode,
    reason: int,
    message: str,
    *,
    field_violations: Sequence[tuple[str, str]] = (),
    metadata: dict[str, str] | None = None,
    mode_refusal: pb.ModeRefusal | None = None,
    probe_disagreement: pb.ProbeDisagreement | None = None,
    retry_delay_ms: int = 0,
) -> ApiError:
    details = {
        "metadata": metadata,
        "field_violations": field_violations,
        "mode_refusal": mode_refusal,
        "probe_disagreement": probe_disagreement,
        "retry_delay_ms": retry_delay_ms,
    }
    return ApiError(code, pb.ErrorReason.Name(reason), message, details)


def session_not_found(session_id: str) -> ApiError:
    shown = session_id[:64]
    return _error(
        grpc.StatusCode.NOT_FOUND,
        pb.SESSION_NOT_FOUND,
        f"session {shown!r} is unknown or expired (sessions expire without a call or Heartbeat "
        "within session_ttl_ms); open a new session with OpenSession",
        metadata={"session_id": shown},
    )


def invalid_request(message: str, field: str) -> ApiError:
    return _error(
        grpc.StatusCode.INVALID_ARGUMENT,
        pb.INVALID_REQUEST,
        message,
        field_violations=[(field, message)],
    )


def data_path_not_negotiated(rpc: str) -> ApiError:
    return _error(
        grpc.StatusCode.FAILED_PRECONDITION,
        pb.DATA_PATH_NOT_NEGOTIATED,
        f"{rpc} needs the shared-memory data path, and this session uses DATA_PATH_INLINE; attach "
        "the arena first (AttachSharedMemory) or use the inline calls",
    )


def invalid_descriptor(violations: Sequence[tuple[str, str]]) -> ApiError:
    fields = ", ".join(f for f, _ in violations)
    return _error(
        grpc.StatusCode.INVALID_ARGUMENT,
        pb.INVALID_DESCRIPTOR,
        f"the session descriptor is incomplete or out of range ({fields}); "
        "fill in every required namespace and mode field (see kvtag.v1 NamespaceDescriptor/HashingMode)",
        field_violations=violations,
    )


def invalid_probe(message: str) -> ApiError:
    return _error(
        grpc.StatusCode.INVALID_ARGUMENT,
        pb.INVALID_PROBE,
        f"{message}; send exactly two probe keys: the keys your mode produces for the probe tokens "
        "(kvtag_proto.ids.probe_tokens)",
        field_violations=[("probe_keys", message)],
    )


def empty_key(field: str) -> ApiError:
    return _error(
        grpc.StatusCode.INVALID_ARGUMENT,
        pb.EMPTY_KEY,
        f"{field} is an empty key; every block needs a key of 1 or more bytes",
        field_violations=[(field, "empty key")],
    )


def key_too_large(field: str, size: int, limit: int) -> ApiError:
    return _error(
        grpc.StatusCode.INVALID_ARGUMENT,
        pb.KEY_TOO_LARGE,
        f"{field} is {size} bytes, longer than the limit of {limit} bytes (Limits.max_key_bytes); "
        "send the block hash digest, not the tokens",
        field_violations=[(field, f"{size} bytes > {limit}")],
        metadata={"limit": str(limit)},
    )


def batch_too_large(field: str, count: int | None, limit: int) -> ApiError:
    """`count` is None when counting stopped at the limit (the request was refused unread)."""
    shown = f"{count} items" if count is not None else "more items"
    return _error(
        grpc.StatusCode.INVALID_ARGUMENT,
        pb.BATCH_TOO_LARGE,
        f"{field} has {shown} than the limit of {limit} (Limits.max_batch_items); split the batch"
        if count is None
        else f"{field} has {shown}, more than the limit of {limit} (Limits.max_batch_items); split the batch",
        field_violations=[(field, f"{count if count is not None else 'more'} items > {limit}")],
        metadata={"limit": str(limit)},
    )


def mode_refused(message: str, refusal: pb.ModeRefusal) -> ApiError:
    return _error(
        grpc.StatusCode.FAILED_PRECONDITION,
        pb.MODE_REFUSED,
        message,
        mode_refusal=refusal,
        metadata={
            "namespace_id": refusal.namespace_id,
            "established_mode_id": refusal.established_mode_id,
            "requested_mode_id": refusal.requested_mode_id,
        },
    )


def probe_disagreement(message: str, record: pb.ProbeDisagreement) -> ApiError:
    return _error(
        grpc.StatusCode.FAILED_PRECONDITION,
        pb.PROBE_DISAGREEMENT,
        message,
        probe_disagreement=record,
        metadata={"namespace_id": record.namespace_id, "mode_id": record.mode_id},
    )


def backend_unavailable(detail: str) -> ApiError:
    return _error(
        grpc.StatusCode.UNAVAILABLE,
        pb.BACKEND_UNAVAILABLE,
        f"the storage backend cannot be reached ({detail}); retry with backoff",
    )


def unauthenticated() -> ApiError:
    # Says nothing about why the token failed (absent, malformed, unknown, revoked): a prober learns nothing.
    return _error(
        grpc.StatusCode.UNAUTHENTICATED,
        pb.UNAUTHENTICATED,
        "this store requires a token: send `authorization: Bearer <token>` with a token from its "
        "tokens file (connector: `token_file` or KVTAG_TOKEN; CLI: --token-file)",
    )


def tenant_not_granted(principal: str, tenant: str) -> ApiError:
    # Names only what the caller itself sent (its tenant) and its own token's name.
    return _error(
        grpc.StatusCode.PERMISSION_DENIED,
        pb.TENANT_NOT_GRANTED,
        f"token {principal!r} does not grant tenant {tenant!r}; use a token of that tenant or ask the "
        "store operator to add the tenant to this token's entry",
        metadata={"principal": principal, "tenant": tenant},
    )


def role_not_allowed(principal: str, role: str, rpc: str) -> ApiError:
    return _error(
        grpc.StatusCode.PERMISSION_DENIED,
        pb.ROLE_NOT_ALLOWED,
        f"token {principal!r} has role {role!r}, which may not call {rpc} (engine: sessions and data; "
        "viewer: Diagnose and GetStats; admin: both)",
        metadata={"principal": principal, "role": role, "rpc": rpc},
    )


def malformed_request(message_type: str, detail: str) -> ApiError:
    return _error(
        grpc.StatusCode.INVALID_ARGUMENT,
        pb.MALFORMED_REQUEST,
        f"the request is not a valid kvtag.v1.{message_type} ({detail}); nothing in it was acted on. "
        "Send messages built from kvtag.v1 store.proto",
        metadata={"message_type": f"kvtag.v1.{message_type}"},
    )


def server_busy(held: int, asked: int, limit: int, retry_delay_ms: int) -> ApiError:
    return _error(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        pb.SERVER_BUSY,
        f"the server holds {held} bytes of requests and replies in flight; {asked} more would pass its "
        f"admission limit of {limit} bytes (--max-inflight-bytes). Nothing was done; retry after "
        f"{retry_delay_ms} ms",
        metadata={"limit": str(limit), "asked": str(asked)},
        retry_delay_ms=retry_delay_ms,
    )
