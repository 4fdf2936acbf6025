"""PendingUsage: a companion's unacknowledged usage stays bounded, and an acknowledged report leaves
only what was added after it."""

from __future__ import annotations

from kvtag_client.usage import PendingUsage
from kvtag_proto.usage import MAX_USAGE_BASE_KEYS

from tests.store_process import StoreProcess

from .conftest import ClientFactory


def test_base_keys_past_the_bound_are_dropped_and_counted_never_kept() -> None:
    pending = PendingUsage(max_base_keys=3)
    pending.add(stored=5, stored_base_keys=[(0, bytes([i])) for i in range(5)], max_key_bytes=64)
    pending.add(missed_base_keys=[(0, b""), (0, b"x" * 65), (1, b"m")], max_key_bytes=64)
    report = pending.report()
    assert [b.base_key for b in report.stored_base_keys] == [b"\x00", b"\x01", b"\x02"]
    assert [(b.group, b.base_key) for b in report.missed_base_keys] == [(1, b"m")]
    assert report.stored_blocks == 5, "counts are sums: never dropped"
    assert report.base_keys_dropped == 2 + 2 == pending.dropped_total


def test_an_acknowledged_report_leaves_what_came_after_it() -> None:
    pending = PendingUsage(max_base_keys=4)
    pending.add(lookups=1, misses=2, missed_base_keys=[(0, b"a"), (0, b"b")])
    sent = pending.report()
    pending.add(lookups=1, hits=1, missed_base_keys=[(0, b"c")])  # while `sent` is on the wire
    pending.acknowledge(sent)
    left = pending.report()
    assert (left.lookups, left.hit_blocks, left.missed_blocks) == (1, 1, 0)
    assert [b.base_key for b in left.missed_base_keys] == [b"c"]
    pending.acknowledge(left)
    assert pending.empty()


def test_a_report_past_the_bound_reaches_the_real_store_within_it(
    shared_store: StoreProcess, make_client: ClientFactory
) -> None:
    """More stored base keys than one report may carry: the client keeps MAX_USAGE_BASE_KEYS, the
    store takes the report (no INVALID_ARGUMENT) and counts every stored block."""
    legacy = make_client(shared_store.endpoint, lookahead_tokens=0)
    client = make_client(shared_store.endpoint, lookahead_tokens=1)
    assert legacy.open() and client.open()
    keys = [(0, i.to_bytes(8, "big")) for i in range(MAX_USAGE_BASE_KEYS + 10)]
    legacy.report_usage(stored=len(keys), stored_base_keys=keys)
    assert legacy.session.usage.dropped_total == 10
    assert legacy.flush_usage(), "the store took the bounded report"
    client.report_usage(misses=2, missed_base_keys=[keys[0], keys[-1]])  # the last one was dropped
    assert client.flush_usage()
    modes = {m["mode_id"]: m for ns in shared_store.diagnose()["namespaces"] for m in ns["modes"]}
    assert int(modes[legacy.mode_id]["counters"]["stored"]) == len(keys)
    held = [(x["held_by_mode_id"], int(x["count"])) for x in modes[client.mode_id]["cross_mode_misses"]]
    assert held == [(legacy.mode_id, 1)]
