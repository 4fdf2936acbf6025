"""Tokens bound to tenants, against a real server on loopback: who gets in, what each token may touch,
and that a refusal never tells one tenant anything about another."""

from __future__ import annotations

import string
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtag.v1 import store_pb2 as pb
from kvtag_store.app.server import RunningServer, start_server
from kvtag_store.backends.memory import MemoryBackend, MemoryCensus
from kvtag_store.config import ServiceConfig
from kvtag_store.security.options import Security
from kvtag_store.security.tokens import TokenRegistry

from ..security_harness import Caller, Grant, bearer, failure, write_tokens

GRANTS: list[Grant] = [
    ("engine-a", "engine", ["tenant-a"]),
    ("engine-b", "engine", ["tenant-b"]),
    ("viewer-a", "viewer", ["tenant-a"]),
    ("admin", "admin", ["*"]),
]
KEYS_B = [b"b-key-0", b"b-key-1", b"b-key-2"]
VALUES_B = [bytes([i]) * 1000 for i in range(1, 4)]


@dataclass
class SecureStore:
    server: RunningServer
    channel: grpc.Channel
    tokens: dict[str, str]
    tokens_path: Path

    def caller(self, name: str | None) -> Caller:
        return Caller(self.channel, self.tokens[name] if name is not None else None)

    def as_token(self, token: str) -> Caller:
        return Caller(self.channel, token)


@pytest.fixture
def secure(tmp_path: Path) -> Iterator[SecureStore]:
    tokens_path = tmp_path / "tokens.toml"
    tokens = write_tokens(tokens_path, GRANTS)
    security = Security(tokens=TokenRegistry.from_file(tokens_path))
    server = start_server(
        MemoryBackend(64 << 20), MemoryCensus(), ServiceConfig(), listen="127.0.0.1:0", security=security
    )
    channel = grpc.insecure_channel(server.address)
    yield SecureStore(server, channel, tokens, tokens_path)
    channel.close()
    server.stop(grace=0)


@pytest.fixture
def tenant_b(secure: SecureStore) -> tuple[str, str]:
    """Tenant B's session holding KEYS_B, and a live lease on them: (session_id, lease_id)."""
    b = secure.caller("engine-b")
    session = b.open("tenant-b", engine_id="engine-of-tenant-b").session_id
    assert b.put(session, list(zip(KEYS_B, VALUES_B, strict=True))) == [pb.STORED] * 3
    lease = b.lookup(session, KEYS_B).lease.lease_id
    assert lease
    return session, lease


def _requests(session_id: str) -> dict[str, object]:
    block = pb.BlockRef(key=b"k")
    return {
        "Heartbeat": pb.HeartbeatRequest(session_id=session_id),
        "Lookup": pb.LookupRequest(session_id=session_id, blocks=[block]),
        "Put": pb.PutRequest(session_id=session_id, items=[pb.PutItem(block=block, value=b"v")]),
        "Get": pb.GetRequest(session_id=session_id, blocks=[block]),
        "ReleaseLeases": pb.ReleaseLeasesRequest(session_id=session_id, lease_ids=["l-x"]),
    }


def test_every_store_call_without_a_valid_token_is_unauthenticated(secure: SecureStore) -> None:
    callers = {"no token": secure.caller(None), "unknown token": secure.as_token("kvt_not-a-real-token")}
    for label, caller in callers.items():
        requests = {
            **_requests("s-0"),
            "OpenSession": pb.OpenSessionRequest(engine_id="e"),
            "CloseSession": pb.CloseSessionRequest(session_id="s-0"),
            "Diagnose": pb.DiagnoseRequest(),
            "GetStats": pb.GetStatsRequest(),
            "GetStream": pb.GetRequest(session_id="s-0", blocks=[pb.BlockRef(key=b"k")]),
        }
        for method, request in requests.items():
            error = failure(lambda c=caller, m=method, r=request: c.call(m, r))
            assert (error.code, error.reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED"), (
                label,
                method,
            )
        error = failure(lambda c=caller: c.call("PutStream", iter([pb.PutRequest(session_id="s-0")])))
        assert error.code is grpc.StatusCode.UNAUTHENTICATED, label


def test_health_stays_open_without_a_token(secure: SecureStore) -> None:
    stub = health_pb2_grpc.HealthStub(secure.channel)
    answer = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_open_session_in_an_ungranted_tenant_is_permission_denied_and_says_nothing_of_that_tenant(
    secure: SecureStore, tenant_b: tuple[str, str]
) -> None:
    a = secure.caller("engine-a")
    in_b = failure(lambda: a.open("tenant-b"))
    in_unused = failure(lambda: a.open("tenant-b2"))
    assert (in_b.code, in_b.reason) == (grpc.StatusCode.PERMISSION_DENIED, "TENANT_NOT_GRANTED")
    # A tenant with live sessions and blocks is refused in exactly the words of one that never existed.
    assert in_b.message.replace("tenant-b", "T") == in_unused.message.replace("tenant-b2", "T")
    assert "engine-of-tenant-b" not in in_b.message and secure.tokens["engine-a"] not in in_b.message


def test_a_tenant_b_session_id_under_a_tenant_a_token_gets_what_an_unknown_id_gets(
    secure: SecureStore, tenant_b: tuple[str, str]
) -> None:
    session_b, _ = tenant_b
    a = secure.caller("engine-a")
    a.open("tenant-a")
    unknown = "s-" + "0" * 24
    for method in _requests(session_b):
        stolen = failure(lambda m=method: a.call(m, _requests(session_b)[m]))
        absent = failure(lambda m=method: a.call(m, _requests(unknown)[m]))
        assert (stolen.code, stolen.reason) == (grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND"), method
        assert stolen.message.replace(session_b, "S") == absent.message.replace(unknown, "S"), method
    stream = failure(lambda: a.call("GetStream", _requests(session_b)["Get"]))
    assert stream.reason == "SESSION_NOT_FOUND"
    put_stream = failure(lambda: a.call("PutStream", iter([_requests(session_b)["Put"]])))
    assert put_stream.reason == "SESSION_NOT_FOUND"
    # CloseSession is idempotent (OK for an unknown id): under the wrong token it must close nothing.
    a.call("CloseSession", pb.CloseSessionRequest(session_id=session_b))
    b = secure.caller("engine-b")
    b.call("Heartbeat", pb.HeartbeatRequest(session_id=session_b))
    assert b.get(session_b, KEYS_B) == VALUES_B


def test_tenant_a_in_its_own_session_cannot_reach_tenant_b_blocks_or_leases(
    secure: SecureStore, tenant_b: tuple[str, str]
) -> None:
    session_b, lease_b = tenant_b
    a = secure.caller("engine-a")
    session_a = a.open("tenant-a").session_id  # same model, layout and mode as B: only the tenant differs
    looked = a.lookup(session_a, KEYS_B)
    assert list(looked.statuses) == [pb.MISS] * 3 and not looked.lease.lease_id
    assert a.get(session_a, KEYS_B, lease_id=lease_b) == [None] * 3
    a.call("ReleaseLeases", pb.ReleaseLeasesRequest(session_id=session_a, lease_ids=[lease_b]))
    assert secure.server.service.backend.stats().leased_keys == 3  # B's lease still holds its blocks
    # A stores its own bytes under the same keys: a different namespace, B's values untouched.
    assert a.put(session_a, [(k, b"A" * 10) for k in KEYS_B]) == [pb.STORED] * 3
    b = secure.caller("engine-b")
    assert b.get(session_b, KEYS_B, lease_id=lease_b) == VALUES_B
    assert a.get(session_a, KEYS_B) == [b"A" * 10] * 3


def test_diagnose_and_stats_show_only_the_callers_tenants(
    secure: SecureStore, tenant_b: tuple[str, str]
) -> None:
    a = secure.caller("engine-a")
    session_a = a.open("tenant-a", engine_id="engine-of-tenant-a").session_id
    a.put(session_a, [(b"a-key", b"x" * 100)])
    viewer = secure.caller("viewer-a")
    report = viewer.call("Diagnose", pb.DiagnoseRequest())
    assert [ns.namespace.tenant for ns in report.namespaces] == ["tenant-a"]
    assert b"engine-of-tenant-b" not in report.SerializeToString()
    # Asking for B's namespace by id answers exactly like an unknown id: nothing.
    admin = secure.caller("admin")
    everything = admin.call("Diagnose", pb.DiagnoseRequest())
    assert sorted(ns.namespace.tenant for ns in everything.namespaces) == ["tenant-a", "tenant-b"]
    ns_b = next(ns.namespace_id for ns in everything.namespaces if ns.namespace.tenant == "tenant-b")
    assert viewer.call("Diagnose", pb.DiagnoseRequest(namespace_id=ns_b)) == pb.DiagnoseResponse()
    stats = viewer.call("GetStats", pb.GetStatsRequest())
    assert [t.tenant for t in stats.tenants] == ["tenant-a"]
    assert [n.tenant for n in stats.namespaces] == ["tenant-a"]
    assert (stats.keys, stats.used_bytes, stats.leased_keys) == (1, 100, 0)
    full = admin.call("GetStats", pb.GetStatsRequest())
    assert (full.keys, full.used_bytes) == (4, 100 + sum(map(len, VALUES_B)))
    assert sorted(t.tenant for t in full.tenants) == ["tenant-a", "tenant-b"]


def test_roles_limit_what_a_token_may_call(secure: SecureStore) -> None:
    engine = secure.caller("engine-a")
    session = engine.open("tenant-a").session_id
    for method, request in (("Diagnose", pb.DiagnoseRequest()), ("GetStats", pb.GetStatsRequest())):
        error = failure(lambda m=method, r=request: engine.call(m, r))
        assert (error.code, error.reason) == (grpc.StatusCode.PERMISSION_DENIED, "ROLE_NOT_ALLOWED")
    viewer = secure.caller("viewer-a")
    assert failure(lambda: viewer.open("tenant-a")).reason == "ROLE_NOT_ALLOWED"
    assert failure(lambda: viewer.lookup(session, [b"k"])).reason == "ROLE_NOT_ALLOWED"
    assert secure.caller("admin").open("tenant-b").session_id


def test_a_token_removed_by_reload_is_refused_while_sessions_of_its_tenant_live_on(
    secure: SecureStore,
) -> None:
    a = secure.caller("engine-a")
    session = a.open("tenant-a").session_id
    a.put(session, [(b"k", b"v" * 64)])
    rotated = write_tokens(
        secure.tokens_path,
        [("engine-a-2", "engine", ["tenant-a"]), *GRANTS[1:]],
        tokens={k: v for k, v in secure.tokens.items() if k != "engine-a"},
    )
    assert secure.server.service.access.tokens.reload()
    assert failure(lambda: a.lookup(session, [b"k"])).code is grpc.StatusCode.UNAUTHENTICATED
    successor = secure.as_token(rotated["engine-a-2"])
    assert successor.get(session, [b"k"]) == [b"v" * 64]  # the session outlived the token that opened it


def test_a_broken_tokens_file_on_reload_keeps_the_previous_tokens(secure: SecureStore) -> None:
    secure.tokens_path.write_text('[[tokens]]\nname = "x"\nrole = "root"\n')
    assert not secure.server.service.access.tokens.reload()
    assert secure.caller("engine-a").open("tenant-a").session_id


# Crafted values first, then generated ones: none is a valid token, and none may crash or stall the server.
CRAFTED = [
    "",
    "Bearer",
    "Bearer ",
    "Basic dXNlcjpwYXNz",
    "bearer",
    "Bearer kvt_x kvt_y",
    "Bearer\tkvt_x",
    "Token kvt_x",
    "Bearer " + "A" * 1023,
    "Bearer " + "A" * 5000,
    "Bearer " + "é" * 100,
    "Bearer " + "\x00" * 4,
]


def _refused_or_rejected(caller_channel: grpc.Channel, metadata: list[tuple[str, str]]) -> grpc.StatusCode:
    stub = Caller(caller_channel, None).stub
    try:
        stub.GetStats(pb.GetStatsRequest(), metadata=metadata, timeout=10)
    except grpc.RpcError as err:
        if err.code() is grpc.StatusCode.INTERNAL and err.details() == "Invalid metadata":
            return grpc.StatusCode.INVALID_ARGUMENT  # gRPC core refused to send it: never reached the server
        return err.code()
    except ValueError:  # the client library itself refuses metadata that is not valid on the wire
        return grpc.StatusCode.INVALID_ARGUMENT
    raise AssertionError(f"accepted authorization metadata {metadata!r:.80}")


def test_bad_and_oversized_authorization_metadata_is_refused(secure: SecureStore) -> None:
    valid = secure.tokens["admin"]
    for value in CRAFTED:
        code = _refused_or_rejected(secure.channel, [("authorization", value)])
        assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT), value[:40]
    # Two authorization headers, one of them valid: ambiguous, refused.
    both = [("authorization", f"Bearer {valid}"), ("authorization", "Bearer kvt_other")]
    assert _refused_or_rejected(secure.channel, both) is grpc.StatusCode.UNAUTHENTICATED
    # Beyond gRPC's header-size limit (8 KiB by default) the transport refuses the call before kvtag sees it.
    huge = _refused_or_rejected(secure.channel, [("authorization", "Bearer " + "A" * 65536)])
    assert huge is not grpc.StatusCode.OK
    # A valid token with a different scheme case is still the token: the server is alive and answering.
    answer = Caller(secure.channel, None).stub.GetStats(
        pb.GetStatsRequest(), metadata=[("authorization", f"bearer {valid}")], timeout=10
    )
    assert answer.backend == "memory"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.text(alphabet=string.printable, max_size=300))
def test_generated_authorization_values_never_get_in(secure: SecureStore, value: str) -> None:
    code = _refused_or_rejected(secure.channel, [("authorization", value)])
    assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT)


def test_a_valid_token_in_the_wrong_metadata_key_does_not_count(secure: SecureStore) -> None:
    token = secure.tokens["admin"]
    for metadata in ([("x-authorization", f"Bearer {token}")], [("token", token)], bearer(token)[:0]):
        assert _refused_or_rejected(secure.channel, metadata) is grpc.StatusCode.UNAUTHENTICATED
