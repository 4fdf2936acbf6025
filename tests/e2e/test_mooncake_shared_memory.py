"""Real vLLM CPU engines over kvtag on the Mooncake backend, on the same host: the connector's saves
and loads take the shared-memory path (values staged in arena slots Mooncake reads into and writes
from), the warm engine hits, and its greedy tokens equal the cold run's.

The Mooncake cluster, the kvtag replica and both engines run inside one private network namespace
(mooncake_driver.py under `unshare -n`): Mooncake's transfer engine listens on every interface.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.store_process import REPO

from .harness import kv_transfer_config, prompt

pytestmark = pytest.mark.slow

BLOCK = 32
PROMPTS = [prompt(21, 3 * BLOCK), prompt(22, 4 * BLOCK + 22), prompt(23, 6 * BLOCK + 5)]
SERVICE_PYTHON = REPO / ".venv" / "bin" / "python"
PORT = 50051  # inside the private namespace every port is free


# Warm only: blocks past what the cold engine stored, so the warm engine stores (and audits) its own.
EXTENSION = [PROMPTS[0] + prompt(24, 70)]


def _job(model: Path, seed: int, warm: bool) -> dict[str, Any]:
    steps = [{"prompts": PROMPTS, "max_tokens": 8}]
    if warm:
        steps.append({"prompts": EXTENSION, "max_tokens": 8})
    return {
        "model": str(model),
        "block_size": BLOCK,
        "seed": seed,
        "kv_transfer_config": kv_transfer_config(f"127.0.0.1:{PORT}"),
        "steps": steps,
    }


def test_warm_engine_over_mooncake_loads_through_shared_memory_and_matches_the_cold_run(
    models: dict[str, Path], tmp_path: Path
) -> None:
    if not (REPO / ".venv" / "bin" / "mooncake_master").exists():
        pytest.fail("the Mooncake wheel is not installed in .venv: run scripts/install_mooncake.sh")
    jobs = []
    for name, seed in (("cold", 0), ("warm", 1234)):
        path = tmp_path / f"{name}.job.json"
        path.write_text(json.dumps(_job(models["llama"], seed, warm=name == "warm")))
        jobs.append(f"{name}={path}")
    script = 'ip link set lo up && exec "$0" -m tests.e2e.mooncake_driver "$@"'
    command = ["unshare", "-n", "--", "bash", "-c", script, str(SERVICE_PYTHON), str(tmp_path), str(PORT)]
    done = subprocess.run(
        [*command, sys.executable, *jobs],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    cold, warm = (json.loads((tmp_path / f"{n}.result.json").read_text()) for n in ("cold", "warm"))
    assert cold["worker_data_path"] == warm["worker_data_path"] == "shared_memory"
    cold_requests, warm_requests = cold["steps"][0]["requests"], warm["steps"][0]["requests"]
    assert sum(r["external_hit"] for r in cold_requests) == 0
    for index, (c, w) in enumerate(zip(cold_requests, warm_requests, strict=True)):
        assert w["external_hit"] == (c["prompt_len"] - 1) // BLOCK * BLOCK > 0, (index, w)
        assert w["token_ids"] == c["token_ids"], f"prompt {index}: greedy output changed: {c} {w}"
    # The audit re-reads what each engine stored (over Mooncake, through the staging arena) and compares.
    saved = cold["connector_totals"]
    assert saved.get("saved_blocks", 0) > 0, saved
    assert saved.get("audit_checked_blocks", 0) == saved["saved_blocks"], saved
    for totals in (saved, warm["connector_totals"]):
        assert totals.get("audit_mismatches", 0) == 0, totals
    assert warm["connector_totals"].get("audit_checked_blocks", 0) > 0, warm["connector_totals"]
