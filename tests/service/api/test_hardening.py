"""Hardening regressions against a real server on loopback: malformed bytes, admission, value limits,
PutStream partial results."""

from __future__ import annotations

import logging

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb

from ..conftest import ServerFactory
from ..helpers import Store, error_of

METHODS = [
    "OpenSession",
    "Heartbeat",
    "CloseSession",
    "Lookup",
    "Put",
    "Get",
    "ReleaseLeases",
    "Diagnose",
    "GetStats",
]
# A field 1 claiming 100 bytes in a 3-byte message: no protobuf parser accepts it.
TRUNCATED = b"\x0a\x64ab"


def raw_unary(store: Store, method: str) -> grpc.UnaryUnaryMultiCallable:
    assert store.channel is not None
    return store.channel.unary_unary(f"/kvtag.v1.KvStore/{method}")


def rpc_errors(store: Store, method: str, reason: str) -> float:
    value = store.server.service.metrics.registry.get_sample_value(
        "kvtag_rpc_errors_total", {"method": method, "reason": reason}
    )
    return value or 0.0


@pytest.mark.parametrize("method", METHODS)
def test_malformed_bytes_are_invalid_argument_with_a_reason_and_counted(store: Store, method: str) -> None:
    error = error_of(lambda: raw_unary(store, method)(TRUNCATED, timeout=5))
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "MALFORMED_REQUEST")
    assert f"kvtag.v1.{method}Request" in error.message
    assert rpc_errors(store, method, "MALFORMED_REQUEST") == 1
    assert store.stats().backend == "memory"  # still serving


def test_malformed_streams_are_refused_the_same_way(store: Store) -> None:
    channel = store.channel
    assert channel is not None
    get_stream = channel.unary_stream("/kvtag.v1.KvStore/GetStream")
    error = error_of(lambda: list(get_stream(TRUNCATED, timeout=5)))
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "MALFORMED_REQUEST")
    put_stream = channel.stream_unary("/kvtag.v1.KvStore/PutStream")
    error = error_of(lambda: put_stream(iter([TRUNCATED]), timeout=5))
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "MALFORMED_REQUEST")
    assert error.put_results is None  # nothing was handled before


def test_rejections_log_one_rate_limited_warning_line_and_no_traceback(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvtag_store"):
        for _ in range(50):
            error_of(lambda: raw_unary(store, "Lookup")(TRUNCATED, timeout=5))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert 1 <= len(warnings) <= 3, [r.getMessage() for r in warnings]  # one a second per reason
    assert warnings[0].__dict__["reason"] == "MALFORMED_REQUEST"
    assert not any(r.exc_info for r in caplog.records), "a rejected request must not log a traceback"
    assert rpc_errors(store, "Lookup", "MALFORMED_REQUEST") == 50


def test_put_stream_failing_part_way_returns_the_results_of_earlier_messages(store: Store) -> None:
    session = store.open().session_id
    first = pb.PutRequest(
        session_id=session,
        items=[pb.PutItem(block=pb.BlockRef(key=k), value=b"v" * 10) for k in (b"a", b"b", b"c")],
    ).SerializeToString()
    second = pb.PutRequest(items=[pb.PutItem(block=pb.BlockRef(key=b"d"), value=b"v")]).SerializeToString()
    assert store.channel is not None
    put_stream = store.channel.stream_unary("/kvtag.v1.KvStore/PutStream")
    error = error_of(lambda: put_stream(iter([first, second, TRUNCATED]), timeout=5))
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "MALFORMED_REQUEST")
    assert error.put_results is not None
    assert [r.status for r in error.put_results.results] == [pb.STORED] * 4
    assert [r.status for r in store.get(session, b"a", b"b", b"c", b"d")] == [pb.HIT] * 4


def test_put_stream_with_a_bad_key_later_keeps_the_earlier_results(store: Store) -> None:
    session = store.open().session_id
    first = pb.PutRequest(session_id=session, items=[pb.PutItem(block=pb.BlockRef(key=b"x"), value=b"1")])
    bad = pb.PutRequest(items=[pb.PutItem(block=pb.BlockRef(key=b""), value=b"2")])
    error = error_of(lambda: store.stub.PutStream(iter([first, bad]), timeout=5))
    assert error.reason == "EMPTY_KEY"
    assert error.put_results is not None
    assert [r.status for r in error.put_results.results] == [pb.STORED]


def test_max_value_bytes_is_enforced_as_announced(make_store: ServerFactory) -> None:
    from kvtag_store.config import ServiceLimits

    store = make_store(capacity=64 << 20, limits=ServiceLimits(max_message_bytes=3 << 20))
    opened = store.open()
    limit = opened.limits.max_value_bytes
    assert limit == (3 << 20) - (3 << 20) // 16  # the message bound less framing, below the capacity
    over = store.stub.Put(
        pb.PutRequest(
            session_id=opened.session_id,
            items=[pb.PutItem(block=pb.BlockRef(key=b"over"), value=bytes(limit + 1))],
        ),
        timeout=10,
    )
    at = store.put(opened.session_id, (b"at", bytes(limit)))
    assert (over.results[0].status, at) == (pb.REJECTED, [pb.STORED])
    assert f"exceeds Limits.max_value_bytes of {limit} bytes" in over.results[0].reason
    assert [r.status for r in store.get(opened.session_id, b"over", b"at")] == [pb.MISS, pb.HIT]


def test_batch_over_the_limit_is_refused_by_count_for_every_batch_method(make_store: ServerFactory) -> None:
    from kvtag_store.config import ServiceLimits

    store = make_store(limits=ServiceLimits(max_batch_items=8))
    session = store.open().session_id
    blocks = b"".join(b"\x12\x04\x0a\x02k%d" % (i % 10) for i in range(40))
    heads: dict[str, bytes] = {
        "Lookup": pb.LookupRequest(session_id=session).SerializeToString(),
        "Get": pb.GetRequest(session_id=session).SerializeToString(),
        "ReleaseLeases": pb.ReleaseLeasesRequest(session_id=session).SerializeToString(),
        "Put": pb.PutRequest(session_id=session).SerializeToString(),
    }
    for method, head in heads.items():
        call = raw_unary(store, method)
        error = error_of(lambda: call(head + blocks, timeout=5))  # noqa: B023
        assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "BATCH_TOO_LARGE"), method


def test_admission_limit_answers_server_busy_with_a_retry_hint(make_store: ServerFactory) -> None:
    store = make_store(max_inflight_bytes=1 << 20)
    session = store.open().session_id
    admission = store.server.service.admission
    # Injected fault: another call holds almost the whole budget.
    with admission.hold((1 << 20) - 100):
        error = error_of(lambda: store.put(session, (b"k", bytes(1000))))
    assert (error.code, error.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "SERVER_BUSY")
    assert error.retry_delay_ms > 0
    assert error.metadata["limit"] == str(1 << 20)
    assert admission.held == 0
    assert store.put(session, (b"k", bytes(1000))) == [pb.STORED]  # nothing was done before


def test_admission_releases_what_every_call_held(store: Store) -> None:
    session = store.open().session_id
    store.put(session, (b"k", bytes(5000)))
    store.get(session, b"k")
    list(store.stub.GetStream(pb.GetRequest(session_id=session, blocks=[pb.BlockRef(key=b"k")]), timeout=5))
    error_of(lambda: raw_unary(store, "Put")(TRUNCATED, timeout=5))
    with pytest.raises(grpc.RpcError):
        store.stub.Heartbeat(pb.HeartbeatRequest(session_id="nope"), timeout=5)
    assert store.server.service.admission.held == 0


def test_error_details_carry_retry_info_and_put_results_both_ways() -> None:
    from google.rpc import status_pb2
    from kvtag_proto.errors import build_status, parse_status

    status = build_status(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "SERVER_BUSY",
        "busy",
        retry_delay_ms=50,
        put_results=pb.PutResponse(results=[pb.PutResult(status=pb.STORED)]),
    )
    [(_, details)] = [kv for kv in status.trailing_metadata if kv[0] == "grpc-status-details-bin"]
    decoded = parse_status(status_pb2.Status.FromString(details))
    assert decoded is not None and decoded.retry_delay_ms == 50
    assert decoded.put_results is not None and [r.status for r in decoded.put_results.results] == [pb.STORED]
