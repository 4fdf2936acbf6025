"""An unreachable, stalled or restarted store degrades to misses; requests never fail."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from kvtag_client.connector.stats import StatsRecorder
from vllm.v1.request import RequestStatus

from tests.store_process import StoreProcess

from .harness import Engine, assert_scheduler_empty
from .test_hit_length import B, fresh_prompt

FAST = {"rpc_timeout_ms": 300, "reconnect_interval_ms": 200}


def serve(engine: Engine, req_id: str, prompt: list[int]) -> tuple[int, float]:
    """Run one request to completion; return its external hit tokens and the first step's duration."""
    request = engine.add(req_id, prompt, max_tokens=2)
    started = time.monotonic()
    engine.step()
    first_step = time.monotonic() - started
    hit = engine.connector.stats.totals["hit_tokens"]
    engine.run()
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED, "the request must finish normally"
    return hit, first_step


def counted(connector: Any, *names: str) -> dict[str, int]:
    """A connector's running totals of `names`, after taking what its client counted."""
    connector.get_kv_connector_stats()
    return {name: connector.stats.totals[name] for name in names}


def test_stats_recorder_refuses_a_counter_it_does_not_know() -> None:
    recorder = StatsRecorder()
    with pytest.raises(KeyError, match="degraded_call"):
        recorder.add("degraded_call")
    recorder.add("degraded_calls", 2)
    assert recorder.totals["degraded_calls"] == 2


@pytest.mark.parametrize("data_path", ["shared_memory", "inline"])
def test_stalled_store_degrades_to_misses_within_the_deadline_and_recovers(
    make_engine: Callable[..., Engine], start_store: Callable[..., StoreProcess], data_path: str
) -> None:
    store = start_store(*(["--shm-dir", ""] if data_path == "inline" else []))
    writer = make_engine(store.endpoint, extra={**FAST, "engine_id": f"degrade-w-{data_path}"})
    assert writer.worker_connector.client().data_path == data_path
    prompt = fresh_prompt(3 * B + 3)
    serve(writer, "w", prompt)
    writer.drain_saves()

    engine = make_engine(store.endpoint, extra={**FAST, "engine_id": f"degrade-r-{data_path}"})
    store.pause()  # SIGSTOP: connections stay open, nothing answers
    try:
        hit, first_step = serve(engine, "stalled", fresh_prompt(2 * B) + prompt)
        assert hit == 0
        assert first_step < 3.0, f"a lookup against a stalled store took {first_step:.2f}s"
        engine.drain_saves(timeout=30)
        # One lookup of 5 blocks failed; one save of the prompt's 5 blocks failed (a Put inline, a
        # ReserveSlots on shared memory): each failed call counts once (in the role that made it,
        # not again in the saver or the connector), each dropped block once.
        assert counted(engine.connector, "lookups", "miss_blocks", "hit_tokens", "degraded_calls") == {
            "lookups": 1,
            "miss_blocks": 5,
            "hit_tokens": 0,
            "degraded_calls": 1,
        }
        assert counted(engine.worker_connector, "saved_blocks", "dropped_saves", "degraded_calls") == {
            "saved_blocks": 0,
            "dropped_saves": 5,
            "degraded_calls": 1,
        }
    finally:
        store.resume()
    assert_scheduler_empty(engine.scheduler)

    # The same engine reconnects on its own once the store answers again.
    deadline = time.monotonic() + 15
    hit = 0
    attempt = 0
    while hit == 0 and time.monotonic() < deadline:
        attempt += 1
        hit = engine.external_hit(f"again-{attempt}", [*prompt, 1, 2])
        time.sleep(0.2)
    assert hit == 3 * B, "after the store answers again, lookups hit"


def test_restarted_store_is_reconnected_and_used_again(
    make_engine: Callable[..., Engine], start_store: Callable[..., StoreProcess]
) -> None:
    store = start_store()
    port = store.port
    engine = make_engine(store.endpoint, extra={**FAST, "engine_id": "restart"})
    serve(engine, "first", fresh_prompt(2 * B + 1))
    engine.drain_saves()
    engine.drain_saves()
    assert counted(engine.worker_connector, "saved_blocks", "dropped_saves", "degraded_calls") == {
        "saved_blocks": 2,
        "dropped_saves": 0,
        "degraded_calls": 0,
    }
    store.stop()
    hit, first_step = serve(engine, "down", fresh_prompt(2 * B + 1))
    assert hit == 0 and first_step < 3.0
    engine.drain_saves()
    # While the store is down: one lookup and one put (2 blocks) fail, each counted once.
    assert counted(engine.connector, "lookups", "degraded_calls") == {"lookups": 2, "degraded_calls": 1}
    assert counted(engine.worker_connector, "saved_blocks", "dropped_saves", "degraded_calls") == {
        "saved_blocks": 2,
        "dropped_saves": 2,
        "degraded_calls": 1,
    }
    store2 = start_store(port=port)  # empty: a restart without persistence loses everything
    assert store2.endpoint == store.endpoint
    prompt = fresh_prompt(2 * B + 1)
    deadline = time.monotonic() + 15
    saved_before = engine.worker_connector.stats.totals["saved_blocks"]
    while time.monotonic() < deadline:
        serve(engine, f"up-{time.monotonic()}", prompt)
        engine.drain_saves()
        if engine.worker_connector.stats.totals["saved_blocks"] > saved_before:
            break
        time.sleep(0.2)
    assert engine.worker_connector.stats.totals["saved_blocks"] > saved_before, "saves resume after restart"
    assert engine.external_hit("hit-after-restart", prompt) == 2 * B


def plant_unloadable_blocks(engine: Engine, request: Any, groups: tuple[int, ...]) -> int:
    """Store values of the wrong size under a request's keys: lookups hit, every load fails."""
    keys = engine.connector._sched().track(request).keys
    keys.refresh()
    n = keys.num_keyed_blocks()
    engine.connector.client().put([(g, keys.key(j), b"\1" * 24, b"") for g in groups for j in range(n)])
    return n


@pytest.mark.parametrize("hybrid", [False, True], ids=["sync-load", "hybrid-async-load"])
def test_blocks_that_fail_to_load_are_recomputed_and_the_request_finishes(
    make_engine: Callable[..., Engine], store: StoreProcess, hybrid: bool
) -> None:
    engine = make_engine(store.endpoint, hybrid=hybrid, extra={"engine_id": f"bad-load-{hybrid}"})
    block = engine.block_size
    prompt = fresh_prompt(2 * block + 5)
    request = engine.make_request("bad", prompt, 2)
    assert plant_unloadable_blocks(engine, request, (0, 1) if hybrid else (0,)) == 2
    assert engine.scheduler.recompute_kv_load_failures, "kvtag asks vLLM to recompute, not fail"
    engine.requests["bad"] = request
    engine.scheduler.add_request(request)
    engine.run()
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    # One load of the 2 hit blocks (and, hybrid, the state at the hit's end), each failing once;
    # the recomputed request is not looked up again, so the hit is counted once.
    assert engine.worker_connector.stats.totals["load_errors"] == (3 if hybrid else 2)
    assert engine.connector.stats.totals["hit_tokens"] == 2 * block
    assert_scheduler_empty(engine.scheduler)


def test_rejected_puts_are_counted_as_dropped_and_the_request_finishes(
    make_engine: Callable[..., Engine], start_store: Callable[..., StoreProcess]
) -> None:
    store = start_store("--capacity", "1KiB")  # every block (4 KiB) is larger than the whole store
    engine = make_engine(store.endpoint, extra={"engine_id": "tiny-store"})
    hit, _ = serve(engine, "a", fresh_prompt(3 * B + 1))
    engine.drain_saves()
    totals = engine.worker_connector.stats.totals
    assert hit == 0
    assert totals["saved_blocks"] == 0
    assert totals["dropped_saves"] == 3
    assert counted(engine.worker_connector, "degraded_calls") == {"degraded_calls": 0}, (
        "a put the store answered (REJECTED) is a dropped save, not a degraded call"
    )
    assert_scheduler_empty(engine.scheduler)
