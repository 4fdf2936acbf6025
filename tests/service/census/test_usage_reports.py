"""A companion engine's UsageReport through the real server: stored base keys enter the base-key index,
sampled missed ones count cross-mode misses, and a report past its bounds is refused whole."""

from __future__ import annotations

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag_proto.usage import MAX_USAGE_BASE_KEYS

from tests.descriptors import mode, namespace

from ..helpers import Store, error_of

LEGACY = mode(lookahead=0)


def _blocks(*base_keys: bytes, group: int = 0) -> list[pb.UsageBlock]:
    return [pb.UsageBlock(group=group, base_key=k) for k in base_keys]


def _heartbeat(store: Store, session_id: str, usage: pb.UsageReport) -> pb.HeartbeatResponse:
    response: pb.HeartbeatResponse = store.stub.Heartbeat(
        pb.HeartbeatRequest(session_id=session_id, usage=usage), timeout=5
    )
    return response


def _modes(store: Store) -> dict[str, pb.ModeReport]:
    [ns] = store.diagnose().namespaces
    return {m.mode_id: m for m in ns.modes}


def test_a_companions_sampled_misses_count_against_another_companions_stored_base_keys(store: Store) -> None:
    """Both engines report only through heartbeats (no Put, no Lookup), as companions do."""
    legacy = store.open("companion-legacy", hashing=LEGACY)
    lookahead = store.open("companion-lookahead")
    _heartbeat(
        store,
        legacy.session_id,
        pb.UsageReport(stored_blocks=3, stored_base_keys=_blocks(b"base-1", b"base-2", b"base-3")),
    )
    _heartbeat(
        store,
        lookahead.session_id,
        pb.UsageReport(
            lookups=1,
            missed_blocks=4,
            missed_base_keys=[*_blocks(b"base-1", b"base-2", b"cold"), *_blocks(b"base-3", group=1)],
            base_keys_dropped=5,
        ),
    )
    modes = _modes(store)
    mine, theirs = modes[lookahead.mode_id], modes[legacy.mode_id]
    assert theirs.counters.stored == 3
    assert mine.counters.misses == 4
    # base-3 in group 1 is another block than base-3 in group 0; "cold" nobody stored.
    assert mine.counters.cross_mode_misses == 2
    assert [(x.held_by_mode_id, x.count) for x in mine.cross_mode_misses] == [(legacy.mode_id, 2)]
    registry = store.server.service.metrics.registry
    assert registry.get_sample_value("kvtag_cross_mode_misses_total") == 2
    assert registry.get_sample_value("kvtag_usage_base_keys_dropped_total") == 5
    # The same mode's own stored keys are never its cross-mode misses.
    _heartbeat(store, legacy.session_id, pb.UsageReport(missed_blocks=1, missed_base_keys=_blocks(b"base-1")))
    assert _modes(store)[legacy.mode_id].counters.cross_mode_misses == 0


def test_a_companions_misses_count_against_a_kvtag_engines_puts_and_the_reverse(store: Store) -> None:
    """One index for both data paths: base keys from Put and from a usage report alike."""
    kvtag_engine = store.open("kvtag-engine", hashing=LEGACY)
    companion = store.open("companion")
    store.put(kvtag_engine.session_id, (b"k1", b"v1"), base=[b"shared-1"])
    _heartbeat(
        store,
        companion.session_id,
        pb.UsageReport(
            missed_blocks=1,
            missed_base_keys=_blocks(b"shared-1"),
            stored_blocks=1,
            stored_base_keys=_blocks(b"shared-2"),
        ),
    )
    answer = store.lookup(kvtag_engine.session_id, b"k2", base=[b"shared-2"])
    assert list(answer.statuses) == [pb.MISS]
    modes = _modes(store)
    assert modes[companion.mode_id].counters.cross_mode_misses == 1
    assert modes[kvtag_engine.mode_id].counters.cross_mode_misses == 1


@pytest.mark.parametrize(
    ("usage", "field"),
    [
        (pb.UsageReport(stored_base_keys=_blocks(*[b"k"] * (MAX_USAGE_BASE_KEYS + 1))), "stored_base_keys"),
        (pb.UsageReport(missed_base_keys=_blocks(*[b"k"] * (MAX_USAGE_BASE_KEYS + 1))), "missed_base_keys"),
        (pb.UsageReport(missed_base_keys=_blocks(b"")), "missed_base_keys.base_key"),
        (pb.UsageReport(stored_base_keys=_blocks(b"x" * 10_000)), "stored_base_keys.base_key"),
    ],
)
def test_a_report_past_its_bounds_is_refused_whole_and_the_session_stays(
    store: Store, usage: pb.UsageReport, field: str
) -> None:
    session = store.open("companion-bad")
    usage.lookups, usage.missed_blocks, usage.stored_blocks = 1, 2, 3
    error = error_of(lambda: _heartbeat(store, session.session_id, usage))
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert error.reason == "INVALID_REQUEST"
    assert f"usage.{field}" in {name for name, _ in error.field_violations}, error
    counters = _modes(store)[session.mode_id].counters
    assert (counters.misses, counters.stored) == (0, 0), "nothing of a refused report is counted"
    # The session stays open: a report within the bounds is taken.
    _heartbeat(store, session.session_id, pb.UsageReport(stored_blocks=2, stored_base_keys=_blocks(b"k")))
    assert _modes(store)[session.mode_id].counters.stored == 2


def test_a_report_at_its_bounds_is_taken(store: Store) -> None:
    session = store.open("companion-full")
    keys = [i.to_bytes(4, "big") for i in range(MAX_USAGE_BASE_KEYS)]
    _heartbeat(
        store,
        session.session_id,
        pb.UsageReport(
            stored_blocks=len(keys), stored_base_keys=_blocks(*keys), missed_base_keys=_blocks(*keys)
        ),
    )
    assert _modes(store)[session.mode_id].counters.stored == MAX_USAGE_BASE_KEYS


def test_a_companions_reported_blocks_make_its_layout_a_sibling_that_another_layout_is_told_of(
    store: Store,
) -> None:
    """The memory backend holds none of a companion's blocks (they are in Mooncake, under the peer's
    keys): its report is what says the namespace holds blocks, so a later engine of the same model in
    another KV layout (an EAGLE producer's extra drafter layer) hears LAYOUT_SPLIT, not silence."""
    eagle_layout = namespace()
    eagle_layout.kv_layout = "attn:1x65536+draft:1x65536"
    plain_layout = namespace()
    quiet = store.open("companion-quiet", ns=_other_layout("attn:1x32768"))
    store.stub.CloseSession(pb.CloseSessionRequest(session_id=quiet.session_id), timeout=5)
    producer = store.open("companion-eagle", ns=eagle_layout)
    _heartbeat(store, producer.session_id, pb.UsageReport(stored_blocks=7))
    store.stub.CloseSession(pb.CloseSessionRequest(session_id=producer.session_id), timeout=5)
    consumer = store.open("companion-plain", ns=plain_layout)
    splits = [w for w in consumer.warnings if w.kind == "LAYOUT_SPLIT"]
    assert [w.other_namespace_id for w in splits] == [producer.namespace_id], (
        "told of the layout whose engine reported storing blocks, not of the one that stored none"
    )
    assert "kv_layout" in splits[0].message


def _other_layout(kv_layout: str) -> pb.NamespaceDescriptor:
    ns = namespace()
    ns.kv_layout = kv_layout
    return ns
