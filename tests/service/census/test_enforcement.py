"""Tag enforcement through the real API: policies, modes, conflicts, probes."""

from __future__ import annotations

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb

from tests.descriptors import PROBE, mode, namespace

from ..conftest import ServerFactory
from ..helpers import Store, error_of

VALUE = b"kv-bytes-of-block-k" * 10
OTHER_MODE = mode(lookahead=0)


def _store_block(store: Store) -> str:
    """Engine a stores block `k` in the default mode; returns its session id."""
    session = store.open("engine-a")
    assert store.put(session.session_id, (b"k", VALUE)) == [pb.STORED]
    return session.session_id


@pytest.mark.parametrize("op", ["lookup", "get", "put"])
@pytest.mark.parametrize("policy", [pb.POLICY_ISOLATE, pb.POLICY_STRICT])
def test_same_mode_engines_share_blocks(make_store: ServerFactory, policy: int, op: str) -> None:
    store = make_store(default_policy=policy)
    _store_block(store)
    other = store.open("engine-b").session_id
    if op == "lookup":
        answer = store.lookup(other, b"k")
        assert (answer.prefix_length, list(answer.statuses)) == (1, [pb.HIT])
    elif op == "get":
        [result] = store.get(other, b"k")
        assert (result.status, result.value) == (pb.HIT, VALUE)
    else:
        assert store.put(other, (b"k", b"different bytes")) == [pb.ALREADY_PRESENT]
        [result] = store.get(other, b"k")
        assert result.value == VALUE


@pytest.mark.parametrize("op", ["lookup", "get", "put"])
def test_isolate_other_mode_never_sees_or_overwrites_the_block(make_store: ServerFactory, op: str) -> None:
    store = make_store(default_policy=pb.POLICY_ISOLATE)
    owner = _store_block(store)
    other = store.open("engine-b", hashing=OTHER_MODE).session_id
    if op == "lookup":
        answer = store.lookup(other, b"k")
        assert (answer.prefix_length, list(answer.statuses)) == (0, [pb.MODE_MISMATCH])
        assert answer.lease.lease_id == ""
    elif op == "get":
        [result] = store.get(other, b"k")
        assert result.status == pb.MODE_MISMATCH
        assert result.value == b""
    else:
        assert store.put(other, (b"k", b"other-mode bytes")) == [pb.CONFLICT]
    [original] = store.get(owner, b"k")
    assert original.value == VALUE, "the owner's bytes must survive any other-mode operation"


@pytest.mark.parametrize("op", ["lookup", "get", "put"])
def test_strict_refuses_other_mode_at_open_so_no_operation_happens(
    make_store: ServerFactory, op: str
) -> None:
    store = make_store(default_policy=pb.POLICY_STRICT)
    owner = _store_block(store)
    error = error_of(lambda: store.open("engine-b", hashing=OTHER_MODE))
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert error.reason == "MODE_REFUSED"
    # The refused engine holds no session, so any data call it attempts is SESSION_NOT_FOUND.
    calls = {
        "lookup": lambda: store.lookup("s-refused", b"k"),
        "get": lambda: store.get("s-refused", b"k"),
        "put": lambda: store.put("s-refused", (b"k", b"x")),
    }
    assert error_of(calls[op]).reason == "SESSION_NOT_FOUND"
    [original] = store.get(owner, b"k")
    assert original.value == VALUE


def test_strict_refusal_carries_a_field_diff_and_a_readable_message(make_store: ServerFactory) -> None:
    store = make_store(default_policy=pb.POLICY_STRICT)
    first = store.open("engine-a", hashing=mode(lookahead=1, algorithm="sha256"))
    error = error_of(lambda: store.open("engine-b", hashing=mode(lookahead=0, algorithm="sha256_cbor")))
    refusal = error.mode_refusal
    assert refusal is not None
    assert refusal.namespace_id == first.namespace_id
    assert refusal.established_mode_id == first.mode_id
    diffs = {(d.field, d.established, d.requested) for d in refusal.diffs}
    assert diffs == {("lookahead_tokens", "1", "0"), ("hash_algorithm", "sha256", "sha256_cbor")}
    assert "engine `engine-b`" in error.message
    assert "lookahead_tokens 0" in error.message and "lookahead_tokens 1" in error.message
    assert "separate namespace" in error.message


def test_strict_first_mode_wins_even_after_its_engines_leave(make_store: ServerFactory) -> None:
    store = make_store(default_policy=pb.POLICY_STRICT)
    first = store.open("engine-a")
    store.stub.CloseSession(pb.CloseSessionRequest(session_id=first.session_id), timeout=5)
    assert error_of(lambda: store.open("engine-b", hashing=OTHER_MODE)).reason == "MODE_REFUSED"


def test_namespace_policy_override_applies_only_to_that_namespace(make_store: ServerFactory) -> None:
    from kvtag_proto import ids

    strict_ns = namespace(tenant="strict-tenant")
    store = make_store(
        default_policy=pb.POLICY_ISOLATE, namespace_policies={ids.namespace_id(strict_ns): pb.POLICY_STRICT}
    )
    assert store.open("a", ns=strict_ns).policy == pb.POLICY_STRICT
    assert error_of(lambda: store.open("b", ns=strict_ns, hashing=OTHER_MODE)).reason == "MODE_REFUSED"
    store.open("c")
    assert store.open("d", hashing=OTHER_MODE).policy == pb.POLICY_ISOLATE


def test_isolate_warns_about_a_mode_split_at_open(make_store: ServerFactory) -> None:
    store = make_store(default_policy=pb.POLICY_ISOLATE)
    first = store.open("engine-a")
    second = store.open("engine-b", hashing=OTHER_MODE)
    [warning] = second.warnings
    assert warning.kind == "MODE_SPLIT"
    assert warning.other_mode_id == first.mode_id
    assert "lookahead_tokens 1 there, 0 here" in warning.message


def test_probe_disagreement_is_flagged_under_isolate_naming_the_seed(make_store: ServerFactory) -> None:
    store = make_store(default_policy=pb.POLICY_ISOLATE)
    vllm_mode = mode(scheme="vllm", algorithm="sha256_cbor", seed="nonehash:1234")
    store.open("engine-a", hashing=vllm_mode, probe=PROBE)
    second = store.open("engine-b", hashing=vllm_mode, probe=[b"drifted-0", b"drifted-1"])
    [warning] = second.warnings
    assert warning.kind == "PROBE_DISAGREEMENT"
    assert "PYTHONHASHSEED" in warning.message
    assert "engine-a" in warning.message
    [record] = store.diagnose().namespaces[0].probe_disagreements
    assert (record.reference_engine_id, record.engine_id) == ("engine-a", "engine-b")


def test_probe_disagreement_is_refused_under_strict_with_the_likely_cause(make_store: ServerFactory) -> None:
    store = make_store(default_policy=pb.POLICY_STRICT)
    store.open("engine-a", labels={"vllm": "0.32.0"})
    error = error_of(lambda: store.open("engine-b", probe=[b"x0", b"x1"], labels={"vllm": "0.33.0"}))
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert error.reason == "PROBE_DISAGREEMENT"
    assert error.probe_disagreement is not None
    assert error.probe_disagreement.reference_engine_id == "engine-a"
    assert "vllm: 0.32.0 vs 0.33.0" in error.probe_disagreement.likely_cause
    assert "hash algorithm" in error.message


def test_same_probe_keys_raise_no_warning(make_store: ServerFactory) -> None:
    store = make_store()
    store.open("engine-a")
    assert list(store.open("engine-b").warnings) == []


def test_different_namespaces_never_share_blocks(store: Store) -> None:
    a = store.open("engine-a", ns=namespace(tenant="t1")).session_id
    b = store.open("engine-b", ns=namespace(tenant="t2")).session_id
    store.put(a, (b"k", b"tenant-1 bytes"))
    assert list(store.lookup(b, b"k").statuses) == [pb.MISS]
    assert store.put(b, (b"k", b"tenant-2 bytes")) == [pb.STORED]
    assert store.get(a, b"k")[0].value == b"tenant-1 bytes"


def test_conflicts_and_mode_mismatches_are_counted_for_the_offending_mode(store: Store) -> None:
    owner = _store_block(store)
    other_session = store.open("engine-b", hashing=OTHER_MODE)
    store.put(other_session.session_id, (b"k", b"x"))
    store.lookup(other_session.session_id, b"k")
    store.get(other_session.session_id, b"k")
    del owner
    [report] = store.diagnose().namespaces
    counters = {m.mode_id: m.counters for m in report.modes}
    assert counters[other_session.mode_id].conflicts == 1
    assert counters[other_session.mode_id].mode_mismatches == 2
