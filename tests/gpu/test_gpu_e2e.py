"""vLLM 0.34 on CUDA with kvtag over the shared-memory path: greedy output of a warm engine (its
prefix loaded from the store) equals the cold engine's, and sleep/wake keeps it so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.e2e.harness import kv_transfer_config, prompt, run_engine
from tests.store_process import StoreProcess

BLOCK = 16
PROMPTS = [prompt(61, 6 * BLOCK + 5), prompt(62, 8 * BLOCK)]


def _job(model: Path, endpoint: str, engine_id: str) -> dict[str, Any]:
    return {
        "model": str(model),
        "block_size": BLOCK,
        "kv_transfer_config": kv_transfer_config(endpoint, engine_id=engine_id),
        "steps": [{"prompts": PROMPTS, "max_tokens": 12}],
    }


def _requests(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [request for step in result["steps"] for request in step["requests"]]


def test_warm_engine_output_is_the_cold_engines_over_shared_memory(
    models: dict[str, Path], work_dir: Path, start_store: Callable[..., StoreProcess]
) -> None:
    store = start_store()
    cold = run_engine(_job(models["llama"], store.endpoint, "gpu-cold"), work_dir, "gpu-cold")
    warm = run_engine(_job(models["llama"], store.endpoint, "gpu-warm"), work_dir, "gpu-warm")
    assert cold["worker_data_path"] == warm["worker_data_path"] == "shared_memory"
    for index, (c, w) in enumerate(zip(_requests(cold), _requests(warm), strict=True)):
        assert c["external_hit"] == 0
        assert w["external_hit"] == (len(PROMPTS[index]) - 1) // BLOCK * BLOCK, (index, w)
        assert w["token_ids"] == c["token_ids"], f"prompt {index}: warm output differs from cold"
    totals = warm["connector_totals"]
    assert totals.get("audit_mismatches", 0) == 0 and cold["connector_totals"].get("audit_mismatches", 0) == 0


def test_sleep_and_wake_keep_greedy_output_and_load_from_the_store(
    models: dict[str, Path], work_dir: Path, start_store: Callable[..., StoreProcess]
) -> None:
    store = start_store()
    job = {
        "model": str(models["llama"]),
        "block_size": BLOCK,
        "prompts": PROMPTS,
        "max_tokens": 12,
        "kv_transfer_config": kv_transfer_config(store.endpoint, engine_id="gpu-sleep"),
    }
    job_path, result_path = work_dir / "sleep.job.json", work_dir / "sleep.result.json"
    job_path.write_text(json.dumps(job))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    runner = Path(__file__).with_name("sleep_runner.py")
    done = subprocess.run(
        [sys.executable, str(runner), str(job_path), str(result_path)],
        env=env,
        capture_output=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout.decode(errors="replace")[-4000:]
    result = json.loads(result_path.read_text())
    for index, (before, after) in enumerate(zip(result["before"], result["after"], strict=True)):
        assert after["token_ids"] == before["token_ids"], f"prompt {index}: output changed across sleep"
        # Sleep reset the local prefix cache: the hit after wake-up came from the store.
        assert after["num_cached_tokens"] == (len(PROMPTS[index]) - 1) // BLOCK * BLOCK, (index, after)
