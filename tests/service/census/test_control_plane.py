"""The bounded control plane on a real server on loopback: the census forgets what is gone, caps
refuse with their documented reason, Diagnose pages, the status tells what a split costs, and an
abandoned session holds nothing.

Retention windows and session TTLs are shortened to fractions of a second so the tests need not
wait long; the rules are the same at the defaults."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag_proto import ids
from kvtag_store.config import Caps, ServiceLimits
from kvtag_store.observe.diagnose_pages import _PackedIds
from kvtag_store.observe.history import HitRateHistory
from kvtag_store.observe.status import StatusSource, View, hit_rate_if_aligned

from tests.descriptors import mode, namespace

from ..conftest import ServerFactory
from ..helpers import Store, error_of

RETENTION_MS = 600
TTL_MS = 300


def wait_until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def listed(store: Store) -> list[str]:
    """Every namespace id Diagnose lists, following its pages."""
    seen: list[str] = []
    request = pb.DiagnoseRequest(page_size=1000)
    while True:
        page = store.stub.Diagnose(request, timeout=5)
        seen += [ns.namespace_id for ns in page.namespaces]
        if not page.next_page_token:
            return seen
        request.page_token = page.next_page_token


def short_lived(make_store: ServerFactory, **config: object) -> Store:
    return make_store(census_retention_ms=RETENTION_MS, session_ttl_ms=TTL_MS, **config)


# -- forgetting ----------------------------------------------------------------------------------


def test_abandoned_namespaces_are_forgotten_after_the_retention_window(make_store: ServerFactory) -> None:
    store = short_lived(make_store)
    opened = [store.open(ns=namespace(model=f"model-{i}")) for i in range(20)]
    for session in opened[:10]:  # half closed, the rest left to expire
        store.stub.CloseSession(pb.CloseSessionRequest(session_id=session.session_id), timeout=5)
    assert len(listed(store)) == 20
    wait_until(lambda: not listed(store))
    assert store.server.service.census.namespace_count() == 0
    assert store.server.service.metrics.namespaces_forgotten._value.get() == 20


def test_a_namespace_with_live_sessions_or_blocks_is_not_forgotten(make_store: ServerFactory) -> None:
    store = short_lived(make_store)
    live = store.open(ns=namespace(model="kept-live"))
    holder = store.open(ns=namespace(model="kept-blocks"))
    assert store.put(holder.session_id, (b"k", b"v")) == [pb.STORED]
    store.stub.CloseSession(pb.CloseSessionRequest(session_id=holder.session_id), timeout=5)
    gone = store.open(ns=namespace(model="gone"))
    store.stub.CloseSession(pb.CloseSessionRequest(session_id=gone.session_id), timeout=5)
    deadline = time.monotonic() + 3 * RETENTION_MS / 1000
    while time.monotonic() < deadline:  # heartbeat the live one past several windows
        store.stub.Heartbeat(pb.HeartbeatRequest(session_id=live.session_id), timeout=5)
        time.sleep(0.05)
    assert sorted(listed(store)) == sorted([live.namespace_id, holder.namespace_id])


def test_a_strict_namespace_with_blocks_keeps_its_mode_across_the_window(make_store: ServerFactory) -> None:
    store = short_lived(make_store, default_policy=pb.POLICY_STRICT)
    first = store.open(hashing=mode(lookahead=1))
    assert store.put(first.session_id, (b"k", b"v")) == [pb.STORED]
    store.stub.CloseSession(pb.CloseSessionRequest(session_id=first.session_id), timeout=5)
    time.sleep(3 * RETENTION_MS / 1000)
    (report,) = store.diagnose().namespaces
    assert report.established_mode_id == first.mode_id
    refusal = error_of(lambda: store.open(engine_id="late", hashing=mode(lookahead=0)))
    assert refusal.reason == "MODE_REFUSED"
    assert refusal.mode_refusal is not None and refusal.mode_refusal.established_mode_id == first.mode_id


def test_namespace_policy_namespaces_are_kept(make_store: ServerFactory) -> None:
    ns = namespace(model="pinned")
    store = short_lived(make_store, namespace_policies={ids.namespace_id(ns): pb.POLICY_ISOLATE})
    pinned = store.open(ns=ns)
    other = store.open(ns=namespace(model="unpinned"))
    for session in (pinned, other):
        store.stub.CloseSession(pb.CloseSessionRequest(session_id=session.session_id), timeout=5)
    wait_until(lambda: other.namespace_id not in listed(store))
    time.sleep(2 * RETENTION_MS / 1000)
    assert listed(store) == [pinned.namespace_id]


def test_gone_engines_per_mode_are_bounded_and_the_rest_counted(make_store: ServerFactory) -> None:
    store = make_store()
    for i in range(20):
        session = store.open(engine_id=f"engine-{i}")
        store.stub.CloseSession(pb.CloseSessionRequest(session_id=session.session_id), timeout=5)
    (mode_report,) = store.diagnose().namespaces[0].modes
    assert [e.engine_id for e in mode_report.engines] == [f"engine-{i}" for i in range(19, 3, -1)]
    assert mode_report.engines_forgotten == 4


def test_forgotten_namespaces_leave_the_hit_rate_history_at_the_sweep(make_store: ServerFactory) -> None:
    """Not at the next sample, a minute later: a burst of short-lived namespaces would hold a series
    each until then."""
    store = short_lived(make_store)
    session = store.open()
    store.lookup(session.session_id, b"missing")
    history = store.server.history
    assert history is not None and history.interval_s > 30, "only a sweep can empty the series below"
    history.sample()
    assert history.series(session.namespace_id, session.mode_id)
    store.stub.CloseSession(pb.CloseSessionRequest(session_id=session.session_id), timeout=5)
    wait_until(lambda: history.series(session.namespace_id, session.mode_id) == [])
    assert not listed(store)


def test_a_mode_that_looked_up_nothing_keeps_no_history_until_it_does(make_store: ServerFactory) -> None:
    """20,000 namespaces opened and left idle must not hold a series each (~1 KiB) for an hour."""
    store = short_lived(make_store)
    idle, busy = store.open(ns=namespace(model="idle")), store.open(ns=namespace(model="busy"))
    store.lookup(busy.session_id, b"missing")
    history = HitRateHistory(store.server.service.census.report)
    history.sample()
    assert history.series(idle.namespace_id, idle.mode_id) == []
    assert [p.misses for p in history.series(busy.namespace_id, busy.mode_id)] == [1]
    store.lookup(idle.session_id, b"missing")
    history.sample()
    history.sample()  # a quiet interval after the first key shows as a zero point, not as nothing
    assert [p.misses for p in history.series(idle.namespace_id, idle.mode_id)] == [1, 0]


# -- caps ------------------------------------------------------------------------------------------


def test_the_namespace_cap_per_tenant_refuses_with_its_reason_and_spares_other_tenants(
    make_store: ServerFactory,
) -> None:
    store = make_store(caps=Caps(max_namespaces_per_tenant=2))
    for i in range(2):
        store.open(ns=namespace(model=f"m{i}", tenant="a"))
    refusal = error_of(lambda: store.open(ns=namespace(model="m2", tenant="a")))
    assert refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refusal.reason == "NAMESPACE_CAP_REACHED"
    assert refusal.metadata == {"cap": "max-namespaces-per-tenant", "limit": "2"}
    assert "--max-namespaces-per-tenant" in refusal.message
    # Nothing kept of the refused namespace; the tenant's existing namespaces and other tenants are fine.
    assert ids.namespace_id(namespace(model="m2", tenant="a")) not in listed(store)
    store.open(engine_id="again", ns=namespace(model="m0", tenant="a"))
    store.open(ns=namespace(model="m2", tenant="b"))
    metrics = store.server.service.metrics
    assert metrics.sessions_refused.labels("NAMESPACE_CAP_REACHED")._value.get() == 1
    assert metrics.rpc_errors.labels("OpenSession", "NAMESPACE_CAP_REACHED")._value.get() == 1


def test_the_store_wide_namespace_cap_refuses_every_tenant(make_store: ServerFactory) -> None:
    store = make_store(caps=Caps(max_namespaces=3))
    for tenant in ("a", "b", "c"):
        store.open(ns=namespace(tenant=tenant))
    refusal = error_of(lambda: store.open(ns=namespace(tenant="d")))
    assert (refusal.reason, refusal.metadata["cap"]) == ("NAMESPACE_CAP_REACHED", "max-namespaces")


def test_the_session_caps_refuse_with_their_reason_and_spare_other_tenants(make_store: ServerFactory) -> None:
    store = make_store(caps=Caps(max_sessions_per_tenant=2, max_sessions=3))
    a = [store.open(engine_id=f"a{i}", ns=namespace(tenant="a")) for i in range(2)]
    refusal = error_of(lambda: store.open(engine_id="a2", ns=namespace(tenant="a")))
    assert refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (refusal.reason, refusal.metadata) == (
        "SESSION_CAP_REACHED",
        {"cap": "max-sessions-per-tenant", "limit": "2"},
    )
    store.open(engine_id="b0", ns=namespace(tenant="b"))
    wide = error_of(lambda: store.open(engine_id="b1", ns=namespace(tenant="b")))
    assert (wide.reason, wide.metadata["cap"]) == ("SESSION_CAP_REACHED", "max-sessions")
    # The refused engines left no trace in the census; a closed session frees its place.
    engines = {e.engine_id for ns in store.diagnose().namespaces for m in ns.modes for e in m.engines}
    assert engines == {"a0", "a1", "b0"}
    store.stub.CloseSession(pb.CloseSessionRequest(session_id=a[0].session_id), timeout=5)
    store.open(engine_id="a2", ns=namespace(tenant="a"))


# -- Diagnose pages -----------------------------------------------------------------------------


def test_a_listing_snapshot_keeps_none_of_the_census_id_strings_alive() -> None:
    """A page walk's snapshot lasts minutes; holding the census's own id strings would keep every
    forgotten namespace's id, and the interpreter arenas they sit in, until it expires."""
    listed_ids = [f"ns-{n:016x}" for n in range(1000)]
    references = [sys.getrefcount(ns_id) for ns_id in listed_ids]
    packed = _PackedIds(listed_ids)
    assert [sys.getrefcount(ns_id) for ns_id in listed_ids] == references
    assert len(packed) == 1000 and [packed[n] for n in range(1000)] == listed_ids
    assert len(_PackedIds([])) == 0


def test_diagnose_pages_cover_every_namespace_exactly_once_within_the_message_limit(
    make_store: ServerFactory,
) -> None:
    limit = 1 << 20
    store = make_store(limits=ServiceLimits(max_message_bytes=limit))
    labels = {f"label-{i:02d}": "x" * 1000 for i in range(64)}  # ~66 KB per engine: pages end by bytes
    expected = [store.open(ns=namespace(model=f"m{i}"), labels=labels).namespace_id for i in range(60)]
    seen: list[str] = []
    pages = 0
    request = pb.DiagnoseRequest(page_size=25)
    while True:
        page = store.stub.Diagnose(request, timeout=5)
        assert page.ByteSize() <= limit
        assert page.total_namespaces == 60
        pages += 1
        seen += [ns.namespace_id for ns in page.namespaces]
        # The census changes while we page: new namespaces, new activity reordering the rest.
        store.open(ns=namespace(model=f"late-{pages}"))
        if not page.next_page_token:
            break
        request.page_token = page.next_page_token
    assert pages > 60 // 25 + 1, "pages should have ended by bytes before 25 namespaces"
    assert sorted(seen) == sorted(expected)


def test_diagnose_orders_splits_then_refusals_then_activity_and_filters(make_store: ServerFactory) -> None:
    strict = namespace(model="strict-one")
    store = make_store(namespace_policies={ids.namespace_id(strict): pb.POLICY_STRICT})
    quiet = store.open(ns=namespace(model="quiet"))
    refused = store.open(ns=strict, hashing=mode(lookahead=1))
    error_of(lambda: store.open(ns=strict, hashing=mode(lookahead=0)))
    split_a = store.open(ns=namespace(model="split"), hashing=mode(lookahead=1))
    store.put(split_a.session_id, (b"k", b"v"))
    split_b = store.open(ns=namespace(model="split"), hashing=mode(lookahead=0))
    assert store.lookup(split_b.session_id, b"k").statuses == [pb.MODE_MISMATCH]
    busy = store.open(ns=namespace(model="busy"))
    store.lookup(busy.session_id, b"x")
    order = [ns.namespace_id for ns in store.diagnose().namespaces]
    assert order == [split_a.namespace_id, refused.namespace_id, busy.namespace_id, quiet.namespace_id]
    filtered = store.stub.Diagnose(pb.DiagnoseRequest(filter="QUIET"), timeout=5)
    assert [ns.namespace_id for ns in filtered.namespaces] == [quiet.namespace_id]


def test_a_page_token_is_bound_to_its_query(make_store: ServerFactory) -> None:
    store = make_store()
    for i in range(3):
        store.open(ns=namespace(model=f"m{i}"))
    first = store.stub.Diagnose(pb.DiagnoseRequest(page_size=1), timeout=5)
    assert first.next_page_token
    wrong = error_of(
        lambda: store.stub.Diagnose(
            pb.DiagnoseRequest(page_token=first.next_page_token, filter="m"), timeout=5
        )
    )
    assert (wrong.code, wrong.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")
    unknown = error_of(lambda: store.stub.Diagnose(pb.DiagnoseRequest(page_token="nope.1"), timeout=5))
    assert unknown.reason == "INVALID_REQUEST"


def test_cli_diagnose_follows_the_pages(
    make_store: ServerFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from kvtag_store.app import cli

    store = make_store()
    expected = {store.open(ns=namespace(model=f"m{i}")).namespace_id for i in range(7)}
    code = cli.main(["diagnose", "--target", store.server.address, "--page-size", "2", "--json"])
    assert code == 0
    answer = json.loads(capsys.readouterr().out)
    assert {ns["namespace_id"] for ns in answer["namespaces"]} == expected
    assert len(answer["namespaces"]) == 7


# -- what a split costs, and who is told ----------------------------------------------------------


def test_hit_rate_if_aligned_counts_mode_mismatches_and_cross_mode_misses(make_store: ServerFactory) -> None:
    """Defined in docs/status-api.md: (hits + cross_mode_misses + mode_mismatches) / keys."""
    store = make_store()
    producer = store.open(engine_id="eagle", hashing=mode(lookahead=1))
    stored = [(b"same-%d" % i, b"v") for i in range(4)] + [(b"l1-%d" % i, b"v") for i in range(2)]
    store.put(producer.session_id, *stored, base=[b"base-%d" % i for i in range(6)])
    consumer = store.open(engine_id="plain", hashing=mode(lookahead=0))
    # 4 keys the producer holds under the same bytes (MODE_MISMATCH), 2 whose base keys it holds
    # (cross-mode misses), 1 nobody holds.
    store.lookup(consumer.session_id, *[k for k, _ in stored[:4]])
    store.lookup(consumer.session_id, b"l0-0", b"l0-1", b"nowhere", base=[b"base-4", b"base-5", b"base-x"])
    report = store.diagnose().namespaces[0]
    (counters,) = [m.counters for m in report.modes if m.mode_id == consumer.mode_id]
    assert (counters.hits, counters.mode_mismatches, counters.cross_mode_misses, counters.misses) == (
        0,
        4,
        2,
        3,
    )
    assert hit_rate_if_aligned(counters) == pytest.approx(6 / 7)
    source = StatusSource(
        store.server.service.census.report,
        store.backend.stats,
        HitRateHistory(store.server.service.census.report),
    )
    (ns_doc,) = source.document(View.everything())["namespaces"]
    (mode_doc,) = [m for m in ns_doc["modes"] if m["mode_id"] == consumer.mode_id]
    assert (mode_doc["hit_rate"], mode_doc["hit_rate_if_aligned"]) == (0.0, pytest.approx(6 / 7))


def test_open_session_warns_of_blocks_another_mode_stored_however_long_ago(make_store: ServerFactory) -> None:
    store = make_store()
    producer = store.open(engine_id="eagle", hashing=mode(lookahead=1))
    store.put(producer.session_id, (b"k", b"v"))
    store.stub.CloseSession(pb.CloseSessionRequest(session_id=producer.session_id), timeout=5)
    consumer = store.open(engine_id="plain", hashing=mode(lookahead=0))
    (warning,) = consumer.warnings
    assert (warning.kind, warning.other_mode_id) == ("MODE_SPLIT", producer.mode_id)
    assert "stored in mode" in warning.message and "lookahead_tokens 1 there, 0 here" in warning.message
    # A mode that never stored anything is no split to warn of.
    idle = store.open(engine_id="idle", ns=namespace(model="other"), hashing=mode(lookahead=1))
    store.stub.CloseSession(pb.CloseSessionRequest(session_id=idle.session_id), timeout=5)
    assert (
        list(store.open(engine_id="next", ns=namespace(model="other"), hashing=mode(lookahead=0)).warnings)
        == []
    )


def test_an_abandoned_sessions_leases_are_released(make_store: ServerFactory) -> None:
    store = make_store(session_ttl_ms=TTL_MS)
    writer = store.open(engine_id="writer")
    store.put(writer.session_id, (b"a", b"1"), (b"b", b"2"))
    reader = store.open(engine_id="reader")
    looked = store.stub.Lookup(
        pb.LookupRequest(
            session_id=reader.session_id,
            blocks=[pb.BlockRef(key=b"a"), pb.BlockRef(key=b"b")],
            lease_ms=600_000,
        ),
        timeout=5,
    )
    assert looked.lease.lease_id and store.stats().leased_keys == 2
    deadline = time.monotonic() + 10
    while store.stats().leased_keys:  # the reader never heartbeats again; the writer does
        store.stub.Heartbeat(pb.HeartbeatRequest(session_id=writer.session_id), timeout=5)
        assert time.monotonic() < deadline, "the abandoned session's lease was not released"
        time.sleep(0.05)
    assert store.server.service.metrics.sessions_expired._value.get() == 1
