"""Rich gRPC errors of kvtag.v1 (AIP-193): building them on the server, reading them on the client.

Every request-level failure carries a google.rpc.Status whose details hold a
google.rpc.ErrorInfo (domain "kvtag.dev", reason = an ErrorReason name) and,
where relevant, a google.rpc.BadRequest, a google.rpc.RetryInfo, a
kvtag.v1.ModeRefusal, a kvtag.v1.ProbeDisagreement or, for a PutStream that failed
part way, a kvtag.v1.PutResponse with the results of the items handled before.
Both sides import this module so the packing and unpacking can never drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from kvtag.v1 import store_pb2 as pb

ERROR_DOMAIN = "kvtag.dev"


@dataclass(frozen=True)
class KvtagError:
    """A decoded kvtag error: the canonical code, the ErrorInfo reason and the structured details."""

    code: grpc.StatusCode
    reason: str
    message: str
    metadata: dict[str, str] = field(default_factory=dict)
    mode_refusal: pb.ModeRefusal | None = None
    probe_disagreement: pb.ProbeDisagreement | None = None
    # (field, description) pairs from google.rpc.BadRequest.
    field_violations: list[tuple[str, str]] = field(default_factory=list)
    # google.rpc.RetryInfo.retry_delay in milliseconds; 0 when the server gave no hint.
    retry_delay_ms: int = 0
    # PutStream failed part way: the results of the items of the messages handled before the failure.
    put_results: pb.PutResponse | None = None


_CODE_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def _pack(message: object) -> any_pb2.Any:
    detail = any_pb2.Any()
    detail.Pack(message)  # type: ignore[arg-type]
    return detail


def build_status(
    code: grpc.StatusCode,
    reason: str,
    message: str,
    *,
    metadata: Mapping[str, str] | None = None,
    field_violations: Sequence[tuple[str, str]] = (),
    mode_refusal: pb.ModeRefusal | None = None,
    probe_disagreement: pb.ProbeDisagreement | None = None,
    retry_delay_ms: int = 0,
    put_results: pb.PutResponse | None = None,
) -> grpc.Status:
    """A grpc.Status for `context.abort_with_status`, carrying ErrorInfo and the given details."""
    status = status_pb2.Status(code=code.value[0], message=message)
    info = error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=dict(metadata or {}))
    status.details.append(_pack(info))
    if field_violations:
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=f, description=d)
                for f, d in field_violations
            ]
        )
        status.details.append(_pack(bad))
    if mode_refusal is not None:
        status.details.append(_pack(mode_refusal))
    if probe_disagreement is not None:
        status.details.append(_pack(probe_disagreement))
    if retry_delay_ms:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromMilliseconds(retry_delay_ms)
        status.details.append(_pack(retry))
    if put_results is not None:
        status.details.append(_pack(put_results))
    return rpc_status.to_status(status)


def parse_status(status: status_pb2.Status) -> KvtagError | None:
    """Decode a google.rpc.Status; None when it carries no kvtag ErrorInfo."""
    reason = ""
    metadata: dict[str, str] = {}
    refusal: pb.ModeRefusal | None = None
    disagreement: pb.ProbeDisagreement | None = None
    violations: list[tuple[str, str]] = []
    retry_delay_ms = 0
    put_results: pb.PutResponse | None = None
    found = False
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == ERROR_DOMAIN:
                found = True
                reason = info.reason
                metadata = dict(info.metadata)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations.extend((v.field, v.description) for v in bad.field_violations)
        elif detail.Is(pb.ModeRefusal.DESCRIPTOR):
            refusal = pb.ModeRefusal()
            detail.Unpack(refusal)
        elif detail.Is(pb.ProbeDisagreement.DESCRIPTOR):
            disagreement = pb.ProbeDisagreement()
            detail.Unpack(disagreement)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_delay_ms = retry.retry_delay.ToMilliseconds()
        elif detail.Is(pb.PutResponse.DESCRIPTOR):
            put_results = pb.PutResponse()
            detail.Unpack(put_results)
    if not found:
        return None
    return KvtagError(
        code=_CODE_BY_VALUE.get(status.code, grpc.StatusCode.UNKNOWN),
        reason=reason,
        message=status.message,
        metadata=metadata,
        mode_refusal=refusal,
        probe_disagreement=disagreement,
        field_violations=violations,
        retry_delay_ms=retry_delay_ms,
        put_results=put_results,
    )


def parse_error(err: grpc.RpcError) -> KvtagError | None:
    """Decode the rich status of a failed call; None when the server sent no kvtag details
    (e.g. UNAVAILABLE from the channel itself)."""
    if not isinstance(err, grpc.Call):
        return None
    status = rpc_status.from_call(err)
    if status is None:
        return None
    return parse_status(status)


__all__ = ["ERROR_DOMAIN", "KvtagError", "build_status", "parse_error", "parse_status"]
