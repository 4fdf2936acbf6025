"""A hit larger than the store's memory loads in full from the disk tier (issue 42).

A real vLLM engine stores a long prompt; the store is restarted on its disk tier with a memory a
third the size of that prompt's blocks; a fresh engine then asks for the same prompt. Its lookup
finds every block (on disk) and leases them; every block it was told of must load while the lease
holds, although the blocks do not fit in memory together: the Gets read around memory. Greedy output
equals the cold run's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.store_process import StoreProcess

from .harness import kv_transfer_config, prompt, run_engine

pytestmark = pytest.mark.slow

BLOCK = 32
# The tiny llama's KV: 2 layers x 2 KV heads x 32 dims x (K, V) x 4 bytes = 1 KiB a token, 32 KiB a block.
PROMPT = prompt(91, 1530)  # 47 full blocks: ~1.5 MiB of KV
FULL_BLOCKS = (len(PROMPT) - 1) // BLOCK


def _job(models: dict[str, Path], endpoint: str, engine_id: str) -> dict[str, Any]:
    return {
        "model": str(models["llama"]),
        "block_size": BLOCK,
        "max_model_len": 2048,
        "kv_transfer_config": kv_transfer_config(endpoint, engine_id=engine_id),
        "steps": [{"prompts": [PROMPT], "max_tokens": 8}],
    }


def test_a_hit_larger_than_memory_loads_in_full_from_disk_and_output_equals_cold(
    models: dict[str, Path], work_dir: Path, start_store: Callable[..., StoreProcess]
) -> None:
    disk_dir = work_dir / "disk-larger-than-memory"
    store = start_store("--capacity", "16MiB", "--disk-dir", str(disk_dir), "--disk-capacity", "64MiB")
    cold = run_engine(_job(models, store.endpoint, "cold-long"), work_dir, "disk-long-cold")
    assert store.proc is not None
    store.proc.terminate()  # SIGTERM writes memory to the disk tier
    assert store.proc.wait(timeout=60) == 0, store.log_tail()
    store.proc = None

    small = start_store("--capacity", "512KiB", "--disk-dir", str(disk_dir), "--disk-capacity", "64MiB")
    warm = run_engine(_job(models, small.endpoint, "warm-long"), work_dir, "disk-long-warm")

    [c] = cold["steps"][0]["requests"]
    [w] = warm["steps"][0]["requests"]
    assert w["external_hit"] == FULL_BLOCKS * BLOCK, (
        f"every block the lookup reported loads: {w['external_hit']} of {FULL_BLOCKS * BLOCK} tokens"
    )
    assert w["token_ids"] == c["token_ids"], "greedy output equals the cold run's"
    totals = warm["connector_totals"]
    assert totals.get("load_errors", 0) == 0, totals
