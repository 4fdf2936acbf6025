"""StoreClient against a real kvtag-store process: round trips, refusals, and degrading without failing."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_client import keys
from kvtag_client.store import StoreState
from kvtag_proto.ids import probe_tokens

from tests.net import free_port, wait_until
from tests.store_process import StoreProcess

from .conftest import ClientFactory, StoreFactory
from .fault_proxy import FaultProxy

TOKENS = list(range(1000, 1000 + 16 * 6 + 1))


def _blocks(lookahead_tokens: int = 0, tokens: list[int] = TOKENS) -> list[tuple[int, bytes, bytes]]:
    mode_keys = keys.block_keys(tokens, 16, lookahead_tokens)
    base = keys.block_keys(tokens, 16, 0)
    return [(0, key, base[i]) for i, key in enumerate(mode_keys)]


def _values(
    blocks: list[tuple[int, bytes, bytes]], size: int = 4096
) -> list[tuple[int, bytes, bytes, bytes]]:
    return [(g, k, (k * (size // len(k) + 1))[:size], b) for g, k, b in blocks]


def test_open_put_lookup_get_round_trip(shared_store: StoreProcess, make_client: ClientFactory) -> None:
    client = make_client(shared_store.endpoint, tenant="round-trip")
    assert client.open()
    assert client.state is StoreState.CONNECTED and client.session_id
    blocks = _blocks()
    items = _values(blocks)

    before = client.lookup(blocks)
    assert (before.prefix_length, set(before.statuses), before.leases) == (0, {pb.MISS}, ())
    assert client.put(items) == [pb.STORED] * len(items)
    assert client.put(items[:2]) == [pb.ALREADY_PRESENT] * 2

    hit = client.lookup(blocks, lease_ms=5000)
    assert hit.prefix_length == len(blocks)
    assert hit.leases
    assert client.get([(g, k) for g, k, _ in blocks], leases=hit.leases) == [v for _, _, v, _ in items]

    counters = client.counters.snapshot()
    assert counters["put_stored"] == len(items) and counters["put_present"] == 2
    assert counters["hit_blocks"] == len(blocks) and counters["miss_blocks"] == len(blocks)
    assert counters["degraded_calls"] == 0 and counters["put_dropped"] == 0


def test_lookup_prefix_stops_at_first_miss(shared_store: StoreProcess, make_client: ClientFactory) -> None:
    client = make_client(shared_store.endpoint, tenant="prefix")
    assert client.open()
    blocks = _blocks()[:3]
    items = _values(blocks)
    assert client.put([items[0], items[2]]) == [pb.STORED, pb.STORED]
    result = client.lookup(blocks)
    assert result.prefix_length == 1
    assert result.statuses == [pb.HIT, pb.MISS, pb.HIT]
    assert client.get([(0, blocks[1][1]), (0, blocks[2][1])]) == [None, items[2][2]]
    client.release(result.leases)


def test_other_mode_gets_mode_mismatch_and_never_bytes(
    shared_store: StoreProcess, make_client: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    legacy = make_client(shared_store.endpoint, lookahead_tokens=0, tenant="two-modes")
    lookahead = make_client(shared_store.endpoint, lookahead_tokens=1, tenant="two-modes")
    assert legacy.open()
    blocks = _blocks()[:2]
    assert legacy.put(_values(blocks)) == [pb.STORED, pb.STORED]
    with caplog.at_level(logging.WARNING, logger="kvtag_client.store"):
        assert lookahead.open()
    assert lookahead.mode_id != legacy.mode_id
    assert [w.kind for w in lookahead.warnings] == ["MODE_SPLIT"]
    assert sum("MODE_SPLIT" in r.getMessage() for r in caplog.records) == 1
    # Same key bytes, other mode: the store reports the tag mismatch and serves nothing.
    same_keys = [(g, k, b"") for g, k, _ in blocks]
    result = lookahead.lookup(same_keys)
    assert result.prefix_length == 0 and result.statuses == [pb.MODE_MISMATCH] * 2
    assert lookahead.get([(g, k) for g, k, _ in same_keys]) == [None, None]
    assert lookahead.counters.mode_mismatch_blocks == 2 and lookahead.counters.get_failed == 2


def test_strict_store_refuses_second_mode_with_field_diff_and_client_runs_without_it(
    start_store: StoreFactory, make_client: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    store = start_store("--policy", "strict")
    first = make_client(store.endpoint, lookahead_tokens=1)
    assert first.open()
    second = make_client(store.endpoint, lookahead_tokens=0)
    with caplog.at_level(logging.INFO, logger="kvtag_client.store"):
        assert not second.open()
        assert not second.open()  # asking again neither raises nor logs again
    assert second.state is StoreState.REFUSED
    assert second.refusal is not None
    diffs = {d.field: (d.established, d.requested) for d in second.refusal.diffs}
    assert diffs["lookahead_tokens"] == ("1", "0")
    assert second.refusal.established_mode_id == first.mode_id

    refusal_logs = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusal_logs) == 1 and refusal_logs[0].levelno == logging.ERROR
    text = refusal_logs[0].getMessage()
    assert "lookahead_tokens: store has '1', this engine has '0'" in text
    assert "WITHOUT the store" in text

    blocks = _blocks()
    assert second.lookup(blocks).prefix_length == 0
    assert second.put(_values(blocks)) is None
    assert second.get([(0, blocks[0][1])]) == [None]
    second.release(("l-unknown",))
    counters = second.counters.snapshot()
    assert counters["put_dropped"] == len(blocks) and counters["degraded_calls"] == 3
    assert first.put(_values(blocks)[:1]) == [pb.STORED]  # the established engine is unaffected


def test_unreachable_store_at_start_answers_within_deadline_then_connects_when_it_appears(
    start_store: StoreFactory, make_client: ClientFactory
) -> None:
    port = free_port()
    started = time.monotonic()
    client = make_client(f"127.0.0.1:{port}", rpc_timeout_s=1.0, reconnect_interval_s=0.3)
    assert not client.open()
    blocks = _blocks()
    result = client.lookup(blocks)
    dropped = client.put(_values(blocks))
    values = client.get([(0, blocks[0][1])])
    elapsed = time.monotonic() - started
    assert elapsed < 1.0 + 0.5, f"unreachable store held the caller for {elapsed:.2f} s"
    assert client.state is StoreState.DEGRADED
    assert (result.prefix_length, dropped, values) == (0, None, [None])
    assert client.counters.put_dropped == len(blocks)
    assert client.counters.degraded_calls == 3

    start_store(port=port)
    took = wait_until(lambda: client.state is StoreState.CONNECTED, 10.0, "background connect")
    assert took < 5.0
    assert client.put(_values(blocks)[:1]) == [pb.STORED]


def test_store_killed_mid_run_degrades_then_reconnects_after_restart(
    start_store: StoreFactory, make_client: ClientFactory
) -> None:
    store = start_store()
    client = make_client(store.endpoint, rpc_timeout_s=1.0, reconnect_interval_s=0.3)
    assert client.open()
    old_session = client.session_id
    blocks = _blocks()
    assert client.put(_values(blocks)) == [pb.STORED] * len(blocks)

    store.kill()
    started = time.monotonic()
    assert client.lookup(blocks).prefix_length == 0
    assert client.put(_values(blocks)) is None
    assert time.monotonic() - started < 1.5
    assert client.state is StoreState.DEGRADED

    store.start()
    wait_until(lambda: client.state is StoreState.CONNECTED, 10.0, "reconnect after restart")
    assert client.session_id != old_session  # the restarted memory store forgot the old session
    assert client.counters.reconnects >= 1
    assert client.lookup(blocks).prefix_length == 0  # its memory is gone too
    assert client.put(_values(blocks)) == [pb.STORED] * len(blocks)
    assert client.lookup(blocks).prefix_length == len(blocks)


def test_stopped_store_calls_respect_deadline_and_session_survives(
    start_store: StoreFactory, make_client: ClientFactory
) -> None:
    store = start_store()
    client = make_client(store.endpoint, rpc_timeout_s=1.0, reconnect_interval_s=0.3)
    assert client.open()
    session = client.session_id
    blocks = _blocks()
    assert client.put(_values(blocks)[:2]) == [pb.STORED] * 2

    store.pause()  # SIGSTOP: the socket stays open, nothing answers
    try:
        for call in (
            lambda: client.lookup(blocks),
            lambda: client.put(_values(blocks)[2:3]),
            lambda: client.get([(0, blocks[0][1])]),
        ):
            started = time.monotonic()
            call()
            elapsed = time.monotonic() - started
            assert elapsed < 1.0 + 0.5, f"call took {elapsed:.2f} s against a 1.0 s deadline"
        assert client.state is StoreState.DEGRADED
        assert client.lookup(blocks).prefix_length == 0
    finally:
        store.resume()
    wait_until(lambda: client.state is StoreState.CONNECTED, 10.0, "recovery after SIGCONT")
    assert client.session_id == session  # a pause is not an outage the store noticed
    assert client.lookup(blocks).prefix_length == 2


def test_session_unknown_to_the_store_is_reopened_transparently(
    shared_store: StoreProcess, make_client: ClientFactory
) -> None:
    client = make_client(shared_store.endpoint, tenant="expiry")
    assert client.open()
    old = client.session_id
    with grpc.insecure_channel(shared_store.endpoint) as channel:
        store_pb2_grpc.KvStoreStub(channel).CloseSession(  # type: ignore[no-untyped-call]
            pb.CloseSessionRequest(session_id=old), timeout=2
        )
    blocks = _blocks()[:1]
    assert client.put(_values(blocks)) == [pb.STORED]
    assert client.session_id != old and client.state is StoreState.CONNECTED
    assert client.counters.degraded_calls == 0 and client.counters.reconnects == 1


def test_heartbeat_keeps_session_alive_past_its_ttl(
    start_store: StoreFactory, make_client: ClientFactory
) -> None:
    store = start_store("--session-ttl-ms", "600")
    client = make_client(store.endpoint)
    assert client.open()
    assert client.session_ttl_ms == 600
    session = client.session_id
    time.sleep(2.0)
    assert client.put(_values(_blocks()[:1])) == [pb.STORED]
    assert client.session_id == session and client.counters.reconnects == 0


def test_large_put_and_get_are_split_by_server_limits(
    start_store: StoreFactory, make_client: ClientFactory
) -> None:
    store = start_store("--max-message-bytes", "1MiB", "--max-batch-items", "8")
    client = make_client(store.endpoint, data_path="inline")  # message limits bind the inline path only
    assert client.open()
    assert (client.limits.max_message_bytes, client.limits.max_batch_items) == (1 << 20, 8)
    tokens = list(range(16 * 40))
    blocks = [(0, k, b"") for k in keys.block_keys(tokens, 16, 0)]
    items = _values(blocks, size=200_000)  # 40 x 200 kB: 8 MB, 5 batches of several messages each
    oversized = (0, b"too-big", b"x" * (2 << 20), b"")
    assert client.put([*items, oversized]) == [pb.STORED] * len(items) + [pb.REJECTED]
    assert client.lookup(blocks).prefix_length == len(blocks)
    assert client.get([(g, k) for g, k, _ in blocks]) == [v for _, _, v, _ in items]
    assert client.counters.put_rejected == 1 and client.counters.put_dropped == 0


def test_concurrent_callers_share_one_client(shared_store: StoreProcess, make_client: ClientFactory) -> None:
    client = make_client(shared_store.endpoint, tenant="threads")
    assert client.open()
    failures: list[str] = []

    def worker(n: int) -> None:
        tokens = [n * 100_000 + i for i in range(16 * 5)]
        blocks = [(0, k, b"") for k in keys.block_keys(tokens, 16, 0)]
        items = _values(blocks, size=1024)
        for _ in range(5):
            client.put(items)
            if client.lookup(blocks).prefix_length != len(blocks):
                failures.append(f"worker {n}: short prefix")
            if client.get([(g, k) for g, k, _ in blocks]) != [v for _, _, v, _ in items]:
                failures.append(f"worker {n}: wrong bytes")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert failures == []
    assert client.counters.put_stored == 4 * 5 and client.counters.put_present == 4 * 4 * 5


def test_close_ends_the_session_on_the_store(shared_store: StoreProcess, make_client: ClientFactory) -> None:
    client = make_client(shared_store.endpoint, tenant="close")
    assert client.open()
    session = client.session_id
    client.close()
    client.close()
    with grpc.insecure_channel(shared_store.endpoint) as channel:
        stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.RpcError) as err:
            stub.Heartbeat(pb.HeartbeatRequest(session_id=session), timeout=2)
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    assert not client.open()


def test_store_answering_errors_degrades_without_raising_then_recovers(
    shared_store: StoreProcess, make_client: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = FaultProxy(shared_store.endpoint)
    try:
        client = make_client(proxy.endpoint, tenant="erroring", rpc_timeout_s=1.0, reconnect_interval_s=0.3)
        assert client.open()
        session = client.session_id
        blocks = _blocks()
        assert client.put(_values(blocks)[:2]) == [pb.STORED] * 2

        proxy.failing.set()
        with caplog.at_level(logging.WARNING, logger="kvtag_client.store"):
            started = time.monotonic()
            assert client.lookup(blocks).prefix_length == 0
            assert client.put(_values(blocks)[2:]) is None
            assert client.get([(0, blocks[0][1])]) == [None]
            assert time.monotonic() - started < 1.0 + 0.5
            assert client.state is StoreState.DEGRADED
            wait_until(lambda: proxy.failed_calls >= 5, 5.0, "background retries against the failing store")
            proxy.failing.clear()
            wait_until(lambda: client.state is StoreState.CONNECTED, 5.0, "recovery once errors stop")
            # The client logs the recovery just after it flips the state (outside its lock).
            wait_until(
                lambda: any("is back" in r.getMessage() for r in caplog.records),
                5.0,
                "a log line saying the store is back",
            )
        outage_logs = [r.getMessage() for r in caplog.records if "not answering" in r.getMessage()]
        assert len(outage_logs) == 1
        assert "UNAVAILABLE/BACKEND_UNAVAILABLE" in outage_logs[0] and "injected fault" in outage_logs[0]
        assert sum("is back" in r.getMessage() for r in caplog.records) == 1
        assert client.session_id == session
        assert client.lookup(blocks).prefix_length == 2
        assert client.counters.put_dropped == len(blocks) - 2
    finally:
        proxy.close()


_PAUSABLE_CLIENT = """
import json, sys
from kvtag_client import keys
from kvtag_client.store import StoreClient
from tests.descriptors import namespace
client = StoreClient(sys.argv[1], engine_id="paused", namespace=namespace(tenant="ttl"),
                     mode=keys.mode(16, 0), probe_keys=keys.probe_keys(16, 0), rpc_timeout_s=5.0,
                     reconnect_interval_s=0.3)
assert client.open()
print(client.session_id, flush=True)
sys.stdin.readline()
statuses = client.put([(0, b"k" * 32, b"value", b"")])
report = {"session": client.session_id, "statuses": statuses, **client.counters.snapshot()}
print(json.dumps(report), flush=True)
client.close()
"""


def test_session_expired_while_client_was_frozen_is_reopened_transparently(start_store: StoreFactory) -> None:
    """A real TTL expiry: the whole client process is SIGSTOPped past the session TTL."""
    store = start_store("--session-ttl-ms", "500")
    root = Path(__file__).resolve().parents[2]
    client = subprocess.Popen(
        [sys.executable, "-c", _PAUSABLE_CLIENT, store.endpoint],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
    )
    try:
        assert client.stdin is not None and client.stdout is not None
        first_session = client.stdout.readline().strip()
        assert first_session
        os.kill(client.pid, signal.SIGSTOP)
        with grpc.insecure_channel(store.endpoint) as channel:
            stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]

            def expired() -> bool:
                try:
                    stub.Heartbeat(pb.HeartbeatRequest(session_id=first_session), timeout=2)
                except grpc.RpcError as err:
                    return bool(err.code() is grpc.StatusCode.NOT_FOUND)
                return False

            # Probing with Heartbeat would itself keep the session alive: wait out the TTL first.
            time.sleep(1.2)
            assert expired()
        os.kill(client.pid, signal.SIGCONT)
        client.stdin.write("go\n")
        client.stdin.flush()
        report = json.loads(client.stdout.readline())
        assert report["statuses"] == [pb.STORED]
        assert report["session"] != first_session
        assert report["reconnects"] == 1 and report["degraded_calls"] == 0 and report["put_dropped"] == 0
        assert client.wait(timeout=10) == 0
    finally:
        if client.poll() is None:
            os.kill(client.pid, signal.SIGCONT)
            client.kill()
            client.wait(timeout=10)


def test_strict_store_refuses_same_mode_with_different_probe_keys_naming_the_cause(
    start_store: StoreFactory, make_client: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    store = start_store("--policy", "strict")
    assert make_client(store.endpoint).open()
    # Same declared mode, but this "engine" hashes differently (as a different seed would).
    drifted = keys.block_keys(probe_tokens(16, 0), 16, 0, keys.ExtraKeys(cache_salt="drift"))
    second = make_client(store.endpoint, probe_keys=drifted)
    with caplog.at_level(logging.ERROR, logger="kvtag_client.store"):
        assert not second.open()
    assert second.state is StoreState.REFUSED
    assert second.refusal_error is not None and second.refusal_error.reason == "PROBE_DISAGREEMENT"
    assert second.refusal_error.probe_disagreement is not None
    [record] = [r for r in caplog.records if "refused" in r.getMessage()]
    assert "different probe keys" in record.getMessage()
    assert second.refusal_error.probe_disagreement.likely_cause in record.getMessage()
    assert second.lookup(_blocks()).prefix_length == 0
