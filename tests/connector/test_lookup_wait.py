"""A Lookup the store does not answer within lookup_wait_ms leaves the scheduler's step to the other
requests: get_num_new_matched_tokens answers None, and a later step takes the hit once it is there."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from vllm.v1.request import RequestStatus

from tests.net import wait_until
from tests.store_process import StoreProcess

from .harness import Engine, assert_scheduler_empty
from .test_hit_length import B, fresh_prompt

# The default budget; a Lookup may take up to 5 s before it fails, so a step that waited for it
# would take seconds.
WAITING = {"lookup_wait_ms": 20, "rpc_timeout_ms": 5000}


def leased_keys(endpoint: str) -> int:
    with grpc.insecure_channel(endpoint) as channel:
        stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
        response: pb.GetStatsResponse = stub.GetStats(pb.GetStatsRequest(), timeout=10)
        return response.leased_keys


def stored_prompt(make_engine: Callable[..., Engine], store: StoreProcess, tag: str) -> list[int]:
    """A prompt whose first 3 blocks another engine stored."""
    writer = make_engine(store.endpoint, extra={"engine_id": f"{tag}-w"})
    prompt = fresh_prompt(3 * B + 3)
    writer.add("w", prompt, max_tokens=2)
    writer.run()
    writer.drain_saves()
    return prompt


def test_a_lookup_the_store_holds_back_does_not_hold_the_step_and_its_hit_arrives_later(
    make_engine: Callable[..., Engine], start_store: Callable[..., StoreProcess]
) -> None:
    store = start_store()
    prompt = stored_prompt(make_engine, store, "wait")
    engine = make_engine(store.endpoint, extra={**WAITING, "engine_id": "wait-r"})
    engine.external_hit("warm-up", fresh_prompt(B + 1))  # the session is open before the stall
    store.pause()
    try:
        request = engine.add("held", prompt, max_tokens=2)
        for _ in range(3):
            started = time.monotonic()
            out = engine.step()
            assert time.monotonic() - started < 1.0, "a step waited for the held Lookup"
            assert "held" not in out.num_scheduled_tokens
        assert request.status == RequestStatus.WAITING
        assert engine.connector.stats.totals["lookups_waited"] >= 3
        assert engine.connector.stats.totals["lookups"] == 2  # the warm-up's, then one for "held"
    finally:
        store.resume()
    deadline = time.monotonic() + 10
    while request.num_computed_tokens == 0 and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.01)
    assert engine.connector.stats.totals["hit_tokens"] == 3 * B, "the late answer's hit is used"
    engine.run()
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert engine.connector.stats.totals["lookups"] == 2, "the held Lookup was sent once"
    assert_scheduler_empty(engine.scheduler)


def test_a_request_aborted_while_its_lookup_runs_releases_the_lease_the_answer_brings(
    make_engine: Callable[..., Engine], start_store: Callable[..., StoreProcess]
) -> None:
    store = start_store()
    prompt = stored_prompt(make_engine, store, "abort")
    engine = make_engine(store.endpoint, extra={**WAITING, "engine_id": "abort-r", "lease_ms": 600_000})
    engine.external_hit("warm-up", fresh_prompt(B + 1))
    assert leased_keys(store.endpoint) == 0
    store.pause()
    try:
        engine.add("gone", prompt, max_tokens=2)
        out = engine.step()
        assert "gone" not in out.num_scheduled_tokens
        engine.scheduler.finish_requests("gone", RequestStatus.FINISHED_ABORTED)
    finally:
        store.resume()
    # The answer comes after the request has gone: its 3 hits were pinned, then released.
    wait_until(lambda: engine.connector.stats.totals["hit_blocks"] == 3, 10, "the late Lookup answer")
    wait_until(lambda: leased_keys(store.endpoint) == 0, 10, "the abandoned Lookup's lease released")
    engine.step()
    assert_scheduler_empty(engine.scheduler)
