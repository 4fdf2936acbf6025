"""The finish-time lookahead save job, pinned by delay_free until finished_sending."""

from __future__ import annotations

from collections.abc import Callable

from vllm.v1.request import RequestStatus

from tests.store_process import StoreProcess

from .harness import Engine, assert_scheduler_empty
from .test_hit_length import B, fresh_prompt


def test_finish_job_pins_blocks_until_the_worker_reports_it(
    make_engine: Callable[..., Engine], store: StoreProcess
) -> None:
    engine = make_engine(store.endpoint, eagle=True)
    prompt = fresh_prompt(3 * B)
    engine.add("a", prompt, max_tokens=1)
    engine.track_blocks("a")
    while (
        engine.requests["a"].status == RequestStatus.RUNNING
        or engine.requests["a"].status == RequestStatus.WAITING
    ):
        engine.step()
    # Finished, but delay_free keeps the request and its blocks alive for the job.
    assert engine.requests["a"].is_finished()
    assert "a" in engine.scheduler.requests, "request_finished must return delay_free=True"
    held = engine.scheduler.kv_cache_manager.get_block_ids("a")[0]
    assert len(held) >= 3
    assert engine.connector.stats.totals["finish_jobs"] == 1
    assert engine.connector.has_pending_block_frees(), "pinned blocks free soon: no need to preempt"
    # The job goes out in the next build_connector_meta; the worker reports it in get_finished.
    engine.step()
    finish_jobs = [job for job in engine.step_log[-1]["meta"].saves if job.finish]
    assert [job.req_id for job in finish_jobs] == ["a"]
    last_block = engine.block_index["a"]
    assert any(last_block[t.block_id] == 2 for t in finish_jobs[0].blocks), "the block keyed at finish"
    assert engine.finished_sending_log[-1] == {"a"}
    # Only now are the blocks freed, and nothing leaks.
    assert "a" not in engine.scheduler.requests
    assert not engine.connector.has_pending_block_frees()
    engine.run()
    assert_scheduler_empty(engine.scheduler)
    engine.drain_saves()
    assert engine.worker_connector.stats.totals["saved_blocks"] == 3


def test_abort_creates_no_job_and_frees_blocks_at_once(
    make_engine: Callable[..., Engine], store: StoreProcess
) -> None:
    engine = make_engine(store.endpoint, eagle=True)
    engine.add("a", fresh_prompt(3 * B), max_tokens=8)
    engine.step()
    engine.step()
    engine.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert "a" not in engine.scheduler.requests, "an aborted request must not be pinned"
    engine.run()
    assert not any(job.finish for entry in engine.step_log for job in entry["meta"].saves)
    assert_scheduler_empty(engine.scheduler)


def test_preempted_request_gets_no_saves_that_step_and_nothing_leaks(
    make_engine: Callable[..., Engine], store: StoreProcess
) -> None:
    # 9 blocks (one is vLLM's null block): two 4-block prompts that keep decoding must preempt.
    engine = make_engine(store.endpoint, eagle=True, num_blocks=9)
    engine.add("a", fresh_prompt(4 * B - 2), max_tokens=12)
    engine.add("b", fresh_prompt(4 * B - 2), max_tokens=12)
    preempted_steps = []
    for _ in range(200):
        if not engine.scheduler.has_requests():
            break
        out = engine.step()
        if out.preempted_req_ids:
            preempted_steps.append((set(out.preempted_req_ids), engine.step_log[-1]["meta"]))
    assert preempted_steps, "the scenario must preempt a request"
    for preempted, meta in preempted_steps:
        assert not any(job.req_id in preempted and not job.finish for job in meta.saves)
    assert_scheduler_empty(engine.scheduler)
    engine.drain_saves()
    # Every block that was stored holds the bytes of its final contents (checked in test_round_trip).
    assert engine.worker_connector.stats.totals["saved_blocks"] > 0
