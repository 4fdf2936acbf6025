"""Degrade, never fail: the store dies mid-workload, requests still complete; it returns, hits resume."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.store_process import StoreProcess

from .harness import EngineRun, kv_transfer_config, prompt, run_engine

pytestmark = pytest.mark.slow

BLOCK = 32
BEFORE = [prompt(41, 100), prompt(42, 130)]
DURING = [prompt(43, 100), prompt(44, 130), prompt(45, 70)]
AFTER = [prompt(46, 100), prompt(47, 130)]
LATER = [prompt(48, 100), prompt(49, 130)]


def _engine(
    models: dict[str, Path], endpoint: str, steps: list[dict[str, Any]], engine_id: str
) -> dict[str, Any]:
    return {
        "model": str(models["llama"]),
        "block_size": BLOCK,
        "speculative_config": {"method": "eagle", "model": str(models["eagle"]), "num_speculative_tokens": 2},
        "kv_transfer_config": kv_transfer_config(
            endpoint, engine_id=engine_id, rpc_timeout_ms=500, reconnect_interval_ms=300
        ),
        "steps": steps,
    }


def _step(prompts: list[list[int]], barrier: Path | None = None) -> dict[str, Any]:
    step: dict[str, Any] = {"prompts": prompts, "max_tokens": 6}
    if barrier is not None:
        step["wait_for"] = str(barrier)
    return step


def test_store_killed_mid_workload_requests_complete_identically_and_hits_resume_after_restart(
    models: dict[str, Path], work_dir: Path, start_store: Callable[..., StoreProcess]
) -> None:
    store = start_store()
    killed, restarted, peer_done = (work_dir / name for name in ("killed", "restarted", "peer-done"))
    steps = [_step(BEFORE), _step(DURING, killed), _step(AFTER, restarted), _step(LATER, peer_done)]
    engine = EngineRun(_engine(models, store.endpoint, steps, "degrading"), work_dir, "degrade-main").start()
    try:
        engine.wait_ready(str(killed))
        store.kill()
        killed.touch()

        engine.wait_ready(str(restarted))
        store.start()
        time.sleep(1.0)  # a few reconnect intervals
        restarted.touch()

        # A peer engine, started after the restart: it must hit what the main engine stored after
        # reconnecting, and it stores LATER for the main engine to hit.
        engine.wait_ready(str(peer_done))
        peer_steps = [_step(DURING), _step(AFTER), _step(LATER)]
        peer = run_engine(_engine(models, store.endpoint, peer_steps, "peer"), work_dir, "degrade-peer")
        peer_done.touch()
        main = engine.result()
    finally:
        engine.kill()

    before, during, after, later = ([r for r in step["requests"]] for step in main["steps"])
    peer_during, peer_after, peer_later = ([r for r in step["requests"]] for step in peer["steps"])
    assert all(r["external_hit"] == 0 for r in during)
    for index, request in enumerate(during):
        assert request["token_ids"] == peer_during[index]["token_ids"], (
            f"prompt {index} served while the store was down changed its greedy output"
        )
    assert all(r["external_hit"] > 0 for r in peer_after), (
        f"the main engine stored nothing after the store came back (no reconnect?): {peer_after}"
    )
    assert all(r["external_hit"] > 0 for r in later), f"hits did not resume in the main engine: {later}"
    for index, request in enumerate(later):
        assert request["token_ids"] == peer_later[index]["token_ids"]
    totals = main["connector_totals"]
    assert totals.get("degraded_calls", 0) + totals.get("dropped_saves", 0) > 0, (
        f"the connector counted no degraded call while the store was down: {totals}"
    )
    assert totals.get("audit_mismatches", 0) == 0
    assert len(before) == len(BEFORE) and len(after) == len(AFTER)
