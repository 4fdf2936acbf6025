"""Finish-time lookahead save on a real engine: the last prompt block becomes keyable only at finish."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.store_process import StoreProcess

from .harness import kv_transfer_config, prompt, run_engine

pytestmark = pytest.mark.slow

BLOCK = 32


def _job(models: dict[str, Path], endpoint: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    return {
        "model": str(models["llama"]),
        "block_size": BLOCK,
        "speculative_config": {"method": "eagle", "model": str(models["eagle"]), "num_speculative_tokens": 2},
        "kv_transfer_config": kv_transfer_config(endpoint),
        "steps": [{"prompts": prompts, "max_tokens": max_tokens}],
    }


def test_block_keyed_by_last_sampled_token_is_stored_at_finish_and_nothing_leaks(
    models: dict[str, Path], work_dir: Path, start_store: Callable[..., StoreProcess]
) -> None:
    store = start_store()
    aligned = prompt(21, 3 * BLOCK)
    first = run_engine(_job(models, store.endpoint, [aligned], max_tokens=1), work_dir, "finish-first")
    sampled = first["steps"][0]["requests"][0]["token_ids"]
    assert len(sampled) == 1
    blocks = first["blocks"]
    assert blocks["requests_left"] == 0 and not blocks["has_requests"], f"scheduler not empty: {blocks}"
    assert blocks["free_blocks"] == blocks["total_blocks"], (
        f"blocks leaked after the finish-time save: {blocks}"
    )
    assert first["connector_totals"].get("audit_mismatches", 0) == 0

    # The last block [64, 96) has a lookahead key only once token 96 (the sampled one) exists:
    # a fresh engine can hit all three blocks only if that key was stored at finish.
    follow_up = aligned + sampled
    second = run_engine(_job(models, store.endpoint, [follow_up], max_tokens=4), work_dir, "finish-second")
    request = second["steps"][0]["requests"][0]
    assert request["external_hit"] == 3 * BLOCK, (
        f"follow-up hit {request['external_hit']} external tokens; 96 needs the finish-time save of the "
        f"block keyed by the sampled token (64 means it was not stored)"
    )
    assert request["num_cached_tokens"] == 3 * BLOCK
