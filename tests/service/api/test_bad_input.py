"""Property tests: malformed input gets a documented status + ErrorInfo reason; the server lives on."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_proto.errors import parse_error
from kvtag_store.app.server import RunningServer, start_server
from kvtag_store.backends.memory import MemoryBackend, MemoryCensus
from kvtag_store.config import ServiceConfig, ServiceLimits

from tests.descriptors import PROBE, mode, namespace

MAX_KEY = 32
MAX_BATCH = 8
CAPACITY = 4096

# The table of docs/errors.md: ErrorInfo reason -> canonical code.
DOCUMENTED = {
    "SESSION_NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "INVALID_DESCRIPTOR": grpc.StatusCode.INVALID_ARGUMENT,
    "EMPTY_KEY": grpc.StatusCode.INVALID_ARGUMENT,
    "KEY_TOO_LARGE": grpc.StatusCode.INVALID_ARGUMENT,
    "BATCH_TOO_LARGE": grpc.StatusCode.INVALID_ARGUMENT,
    "MODE_REFUSED": grpc.StatusCode.FAILED_PRECONDITION,
    "PROBE_DISAGREEMENT": grpc.StatusCode.FAILED_PRECONDITION,
    "INVALID_PROBE": grpc.StatusCode.INVALID_ARGUMENT,
    "BACKEND_UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "INVALID_REQUEST": grpc.StatusCode.INVALID_ARGUMENT,
    "MALFORMED_REQUEST": grpc.StatusCode.INVALID_ARGUMENT,
    "SERVER_BUSY": grpc.StatusCode.RESOURCE_EXHAUSTED,
}
EXAMPLES = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


class Target:
    def __init__(self, server: RunningServer) -> None:
        self.server = server
        self.channel = grpc.insecure_channel(server.address)
        self.stub = store_pb2_grpc.KvStoreStub(self.channel)  # type: ignore[no-untyped-call]
        self.session_id = self.stub.OpenSession(
            pb.OpenSessionRequest(engine_id="fuzz", namespace=namespace(), mode=mode(), probe_keys=PROBE)
        ).session_id


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    config = ServiceConfig(limits=ServiceLimits(max_key_bytes=MAX_KEY, max_batch_items=MAX_BATCH))
    server = start_server(MemoryBackend(CAPACITY), MemoryCensus(), config, listen="127.0.0.1:0")
    t = Target(server)
    yield t
    t.channel.close()
    server.stop(grace=0)


def assert_documented(call: Callable[[], object]) -> str:
    """Run the call; if it fails, the failure must be a documented (code, reason) pair. Returns the reason."""
    try:
        call()
    except grpc.RpcError as exc:
        error = parse_error(exc)
        assert error is not None, f"undocumented failure without kvtag details: {exc}"
        assert error.reason in DOCUMENTED, f"undocumented reason {error.reason}"
        assert error.code == DOCUMENTED[error.reason], f"{error.reason} came with {error.code}"
        assert error.message, "every error says what to do"
        return error.reason
    return "OK"


def assert_alive(target: Target) -> None:
    answer = target.stub.Heartbeat(pb.HeartbeatRequest(session_id=target.session_id), timeout=5)
    assert answer.session_ttl_ms > 0


text = st.text(max_size=40)
keys = st.binary(min_size=0, max_size=MAX_KEY + 8)
block_refs = st.builds(
    pb.BlockRef, key=keys, group=st.integers(0, 2**32 - 1), base_key=st.binary(max_size=40)
)


@EXAMPLES
@given(
    engine_id=st.text(max_size=300),
    model=text,
    dtype=text,
    block_size=st.integers(0, 2**32 - 1),
    scheme=text,
    algorithm=text,
    hash_block_size=st.integers(0, 2**32 - 1),
    lookahead=st.integers(0, 2**32 - 1),
    probe=st.lists(keys, max_size=4),
    data_paths=st.lists(st.integers(0, 5), max_size=3),
)
def test_any_open_session_is_accepted_or_refused_with_a_documented_reason(
    target: Target,
    engine_id: str,
    model: str,
    dtype: str,
    block_size: int,
    scheme: str,
    algorithm: str,
    hash_block_size: int,
    lookahead: int,
    probe: list[bytes],
    data_paths: list[int],
) -> None:
    ns = pb.NamespaceDescriptor(
        model_name=model,
        weights_fingerprint="w",
        kv_dtype=dtype,
        kv_layout="l",
        block_size=block_size,
        parallel_sharding="tp=1",
    )
    hashing = pb.HashingMode(
        key_scheme=scheme,
        scheme_version="1",
        hash_algorithm=algorithm,
        hash_block_size=hash_block_size,
        lookahead_tokens=lookahead,
    )
    request = pb.OpenSessionRequest(
        engine_id=engine_id,
        namespace=ns,
        mode=hashing,
        probe_keys=probe,
        data_paths=data_paths,  # type: ignore[arg-type]
    )
    reason = assert_documented(lambda: target.stub.OpenSession(request, timeout=5))
    assert reason in {"OK", "INVALID_DESCRIPTOR", "INVALID_PROBE", "INVALID_REQUEST", "PROBE_DISAGREEMENT"}
    assert_alive(target)


@EXAMPLES
@given(blocks=st.lists(block_refs, max_size=MAX_BATCH + 3), lease_ms=st.integers(0, 2**32 - 1))
def test_any_lookup_is_answered_or_refused_with_a_documented_reason(
    target: Target, blocks: list[pb.BlockRef], lease_ms: int
) -> None:
    request = pb.LookupRequest(session_id=target.session_id, blocks=blocks, lease_ms=lease_ms)
    reason = assert_documented(lambda: target.stub.Lookup(request, timeout=5))
    if len(blocks) > MAX_BATCH:
        assert reason == "BATCH_TOO_LARGE"
    elif any(not b.key for b in blocks):
        assert reason == "EMPTY_KEY"
    elif any(len(b.key) > MAX_KEY for b in blocks):
        assert reason == "KEY_TOO_LARGE"
    else:
        assert reason == "OK"
    assert_alive(target)


put_items = st.builds(
    pb.PutItem,
    block=block_refs,
    value=st.binary(max_size=CAPACITY + 10),
) | st.builds(
    pb.PutItem,
    block=block_refs,
    shared_memory=st.builds(pb.SharedMemoryRef, segment=text, offset=st.integers(0, 2**20)),
)


@EXAMPLES
@given(items=st.lists(put_items, max_size=MAX_BATCH + 2))
def test_any_put_gets_per_item_results_or_a_documented_refusal(
    target: Target, items: list[pb.PutItem]
) -> None:
    request = pb.PutRequest(session_id=target.session_id, items=items)
    answers: list[pb.PutResponse] = []
    reason = assert_documented(lambda: answers.append(target.stub.Put(request, timeout=5)))
    if reason == "OK":
        [response] = answers
        assert len(response.results) == len(items)
        for item, result in zip(items, response.results, strict=True):
            if item.WhichOneof("payload") == "shared_memory":
                assert (result.status, result.reason) == (pb.REJECTED, result.reason)
                assert "data path not negotiated" in result.reason
            elif len(item.value) > CAPACITY:
                assert result.status == pb.REJECTED and "capacity" in result.reason
            else:
                assert result.status in (pb.STORED, pb.ALREADY_PRESENT, pb.CONFLICT, pb.REJECTED)
    else:
        assert reason in {"BATCH_TOO_LARGE", "EMPTY_KEY", "KEY_TOO_LARGE"}
    assert_alive(target)


@EXAMPLES
@given(
    session_id=st.text(max_size=80),
    rpc=st.sampled_from(["Heartbeat", "Lookup", "Get", "GetStream", "Put", "ReleaseLeases"]),
)
def test_unknown_or_empty_session_ids_are_documented_refusals(
    target: Target, session_id: str, rpc: str
) -> None:
    requests = {
        "Heartbeat": pb.HeartbeatRequest(session_id=session_id),
        "Lookup": pb.LookupRequest(session_id=session_id, blocks=[pb.BlockRef(key=b"k")]),
        "Get": pb.GetRequest(session_id=session_id, blocks=[pb.BlockRef(key=b"k")]),
        "Put": pb.PutRequest(session_id=session_id),
        "ReleaseLeases": pb.ReleaseLeasesRequest(session_id=session_id, lease_ids=["l-x"]),
        "GetStream": pb.GetRequest(session_id=session_id, blocks=[pb.BlockRef(key=b"k")]),
    }
    if rpc == "GetStream":
        reason = assert_documented(lambda: list(target.stub.GetStream(requests[rpc], timeout=5)))
    else:
        reason = assert_documented(lambda: getattr(target.stub, rpc)(requests[rpc], timeout=5))
    assert reason == ("INVALID_REQUEST" if not session_id else "SESSION_NOT_FOUND")
    assert_alive(target)


@EXAMPLES
@given(garbage=st.binary(min_size=1, max_size=200))
def test_undecodable_request_bytes_never_take_the_server_down(target: Target, garbage: bytes) -> None:
    call = target.channel.unary_unary(
        "/kvtag.v1.KvStore/Lookup", request_serializer=None, response_deserializer=None
    )
    reason = assert_documented(lambda: call(garbage, timeout=5))
    assert reason in {"OK", "MALFORMED_REQUEST", "SESSION_NOT_FOUND", "INVALID_REQUEST", "BATCH_TOO_LARGE"}
    assert_alive(target)


def test_docs_list_every_reason_with_its_code() -> None:
    table = (Path(__file__).resolve().parents[3] / "docs" / "errors.md").read_text()
    for reason, code in DOCUMENTED.items():
        row = re.search(rf"^\|\s*`{reason}`\s*\|\s*`?{code.name}`?\s*\|", table, re.MULTILINE)
        assert row, f"docs/errors.md has no row for {reason} with {code.name}"


def test_put_stream_with_no_message_or_two_sessions_is_an_invalid_request(target: Target) -> None:
    assert assert_documented(lambda: target.stub.PutStream(iter([]), timeout=5)) == "INVALID_REQUEST"
    two_sessions = [
        pb.PutRequest(
            session_id=target.session_id, items=[pb.PutItem(block=pb.BlockRef(key=b"a"), value=b"1")]
        ),
        pb.PutRequest(
            session_id="s-someone-else", items=[pb.PutItem(block=pb.BlockRef(key=b"b"), value=b"2")]
        ),
    ]
    assert (
        assert_documented(lambda: target.stub.PutStream(iter(two_sessions), timeout=5)) == "INVALID_REQUEST"
    )
    assert_alive(target)
