"""Two engines, one store: lookahead engines share blocks; a legacy engine is isolated or refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.store_process import StoreProcess

from .harness import EngineRun, kv_transfer_config, prompt, run_engine

pytestmark = pytest.mark.slow

BLOCK = 32
PROMPTS = [prompt(31, 3 * BLOCK + 5), prompt(32, 4 * BLOCK)]


def _job(
    models: dict[str, Path], endpoint: str, lookahead: str, engine_id: str, seed: int = 0
) -> dict[str, Any]:
    return {
        "model": str(models["llama"]),
        "block_size": BLOCK,
        "seed": seed,
        "speculative_config": {"method": "eagle", "model": str(models["eagle"]), "num_speculative_tokens": 2},
        "kv_transfer_config": kv_transfer_config(endpoint, lookahead=lookahead, engine_id=engine_id),
        "steps": [{"prompts": PROMPTS, "max_tokens": 6}],
    }


def _requests(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [request for step in result["steps"] for request in step["requests"]]


def _mode_reports(diagnosis: dict[str, Any]) -> list[dict[str, Any]]:
    return [mode for namespace in diagnosis.get("namespaces", []) for mode in namespace.get("modes", [])]


def test_isolate_lookahead_engines_share_blocks_and_legacy_engine_never_reads_them(
    models: dict[str, Path], work_dir: Path, start_store: Callable[..., StoreProcess]
) -> None:
    store = start_store("--policy", "isolate")
    # A stays alive (parked at a barrier) while B and C run, so C meets a live engine in another mode.
    release = work_dir / "release-a"
    a_job = _job(models, store.endpoint, "auto", "engine-a")
    a_job["steps"].append({"prompts": [], "wait_for": str(release)})
    a_run = EngineRun(a_job, work_dir, "iso-a").start()
    try:
        a_run.wait_ready(str(release))
        b = _requests(run_engine(_job(models, store.endpoint, "auto", "engine-b", seed=7), work_dir, "iso-b"))
        c_result = run_engine(_job(models, store.endpoint, "off", "engine-c"), work_dir, "iso-c")
        release.touch()
        a = _requests(a_run.result())
    finally:
        a_run.kill()
    for index, tokens in enumerate(PROMPTS):
        assert b[index]["external_hit"] == (len(tokens) - 1) // BLOCK * BLOCK, (
            f"B missed A's blocks: {b[index]}"
        )
        assert b[index]["token_ids"] == a[index]["token_ids"]

    c = _requests(c_result)
    for index in range(len(PROMPTS)):
        assert c[index]["external_hit"] == 0, f"legacy engine C read lookahead blocks: {c[index]}"
        assert c[index]["token_ids"] == a[index]["token_ids"]
    assert c_result["connector_totals"].get("audit_mismatches", 0) == 0
    c_log = (work_dir / "iso-c.log").read_text(errors="replace")
    assert "MODE_SPLIT" in c_log, (
        "engine C opened a session beside a live engine in another mode and logged no MODE_SPLIT warning"
    )
    # The lookahead decision is an INFO record; it must reach vLLM's own log output.
    assert "kvtag connector (SCHEDULER): lookahead 0" in c_log, "C's log does not show its lookahead decision"
    a_log = (work_dir / "iso-a.log").read_text(errors="replace")
    assert "kvtag connector (SCHEDULER): lookahead 1" in a_log, "A's log does not show its lookahead decision"

    modes = _mode_reports(store.diagnose())
    by_lookahead = {int(m.get("mode", {}).get("lookahead_tokens", 0)): m for m in modes}
    assert set(by_lookahead) == {0, 1}, f"diagnose does not show the split: {modes}"
    legacy_counters = by_lookahead[0].get("counters", {})
    assert int(legacy_counters.get("cross_mode_misses", 0)) > 0, (
        f"no cross-mode misses for C: {by_lookahead[0]}"
    )
    held_by = {x["held_by_mode_id"] for x in by_lookahead[0].get("cross_mode_misses", [])}
    assert by_lookahead[1]["mode_id"] in held_by


def test_strict_refuses_legacy_engine_which_runs_without_the_store_and_logs_the_diff(
    models: dict[str, Path], work_dir: Path, start_store: Callable[..., StoreProcess]
) -> None:
    store = start_store("--policy", "strict")
    a = _requests(run_engine(_job(models, store.endpoint, "auto", "engine-a"), work_dir, "strict-a"))
    c_run = _job(models, store.endpoint, "off", "engine-c")
    c_result = run_engine(c_run, work_dir, "strict-c")
    c = _requests(c_result)
    for index in range(len(PROMPTS)):
        assert c[index]["external_hit"] == 0
        assert c[index]["token_ids"] == a[index]["token_ids"], "the refused engine must still serve normally"
    log = (work_dir / "strict-c.log").read_text(errors="replace")
    assert "lookahead_tokens" in log, "the refused engine did not log the field diff"

    namespaces = store.diagnose().get("namespaces", [])
    refused = [r for ns in namespaces for r in ns.get("refused", [])]
    # The connector opens one session per role (scheduler, worker); every refused one is C's.
    refused_ids = [r["engine_id"] for r in refused]
    assert refused_ids and all(i.split("/")[0] == "engine-c" for i in refused_ids), f"refused: {refused}"
    diffs = {d["field"] for r in refused for d in r.get("refusal", {}).get("diffs", [])}
    assert "lookahead_tokens" in diffs
