"""Greedy oracle, hit lengths and audit on real engines, per hashing mode.

Each mode gets its own kvtag service: a cold engine process stores, then a warm engine process
(fresh, different seed) loads. All hit figures are vLLM's own: per-request
`num_cached_tokens` and the deltas of its local / external prefix-cache counters.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .harness import StoreService, kv_transfer_config, prompt, run_engine

pytestmark = pytest.mark.slow

BLOCK = 32
ALIGNED = [prompt(1, 3 * BLOCK), prompt(2, 4 * BLOCK)]
UNALIGNED = [prompt(3, 3 * BLOCK + 4), prompt(4, 4 * BLOCK + 22)]
LLAMA_PROMPTS = ALIGNED + UNALIGNED
HYBRID_PROMPTS = [prompt(5, 300), prompt(6, 256), prompt(7, 420)]
MAX_TOKENS = 8

MODES = ("spec_off", "eagle_legacy", "eagle_lookahead", "hybrid")


def _job(mode: str, models: dict[str, Path], endpoint: str, seed: int) -> dict[str, Any]:
    if mode == "hybrid":
        return {
            "model": str(models["qwen3_next"]),
            "dtype": "bfloat16",
            "mamba_cache_mode": "align",
            "seed": seed,
            "kv_transfer_config": kv_transfer_config(endpoint),
            "steps": [{"prompts": HYBRID_PROMPTS, "max_tokens": MAX_TOKENS}],
        }
    job: dict[str, Any] = {
        "model": str(models["llama"]),
        "block_size": BLOCK,
        "seed": seed,
        "kv_transfer_config": kv_transfer_config(
            endpoint, **({"lookahead": "off"} if mode == "eagle_legacy" else {})
        ),
        "steps": [{"prompts": LLAMA_PROMPTS, "max_tokens": MAX_TOKENS}],
    }
    if mode != "spec_off":
        job["speculative_config"] = {
            "method": "eagle",
            "model": str(models["eagle"]),
            "num_speculative_tokens": 2,
        }
    return job


@pytest.fixture(scope="module")
def mode_runs(
    models: dict[str, Path], work_dir: Path, start_store: Callable[..., StoreService]
) -> Callable[[str], dict[str, Any]]:
    """Cold then warm engine per mode, run once per module and shared by the tests below."""
    cache: dict[str, dict[str, Any]] = {}

    def get(mode: str) -> dict[str, Any]:
        if mode not in cache:
            store = start_store()
            cold = run_engine(_job(mode, models, store.endpoint, seed=0), work_dir, f"{mode}-cold")
            warm = run_engine(_job(mode, models, store.endpoint, seed=1234), work_dir, f"{mode}-warm")
            cache[mode] = {"cold": cold, "warm": warm, "store": store}
        return cache[mode]

    return get


def _requests(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [request for step in result["steps"] for request in step["requests"]]


@pytest.mark.parametrize("mode", MODES)
def test_warm_engine_loads_from_kvtag_and_greedy_tokens_match_cold_run(
    mode: str, mode_runs: Callable[[str], dict[str, Any]]
) -> None:
    runs = mode_runs(mode)
    cold, warm = _requests(runs["cold"]), _requests(runs["warm"])
    assert sum(r["external_hit"] for r in cold) == 0, "the cold run found blocks in an empty store"
    assert sum(r["external_hit"] for r in warm) > 0, f"{mode}: the warm engine loaded nothing from kvtag"
    for index, (c, w) in enumerate(zip(cold, warm, strict=True)):
        assert w["external_hit"] > 0, f"{mode}: prompt {index} ({c['prompt_len']} tokens) had no external hit"
        assert w["token_ids"] == c["token_ids"], (
            f"{mode}: prompt {index} greedy output changed after loading {w['external_hit']} tokens "
            f"from kvtag: cold {c['token_ids']} warm {w['token_ids']}"
        )


def _spec_off_hit(prompt_len: int) -> int:
    """vLLM keeps at least one prompt token to compute, and hits whole blocks."""
    return (prompt_len - 1) // BLOCK * BLOCK


def test_lookahead_hit_equals_spec_off_hit_and_legacy_is_one_block_shorter(
    mode_runs: Callable[[str], dict[str, Any]],
) -> None:
    off = _requests(mode_runs("spec_off")["warm"])
    lookahead = _requests(mode_runs("eagle_lookahead")["warm"])
    legacy = _requests(mode_runs("eagle_legacy")["warm"])
    for index, tokens in enumerate(LLAMA_PROMPTS):
        kind = "aligned" if len(tokens) % BLOCK == 0 else "unaligned"
        label = f"{kind} prompt of {len(tokens)} tokens"
        assert off[index]["num_cached_tokens"] == _spec_off_hit(len(tokens)), label
        # A fresh engine has nothing local: the whole hit comes through the connector.
        assert off[index]["external_hit"] == off[index]["num_cached_tokens"], label
        assert lookahead[index]["num_cached_tokens"] == off[index]["num_cached_tokens"], (
            f"{label}: EAGLE lookahead hit {lookahead[index]['num_cached_tokens']} "
            f"!= spec-off hit {off[index]['num_cached_tokens']}"
        )
        assert legacy[index]["num_cached_tokens"] == off[index]["num_cached_tokens"] - BLOCK, (
            f"{label}: EAGLE legacy hit {legacy[index]['num_cached_tokens']} is not one block "
            f"shorter than spec-off {off[index]['num_cached_tokens']}"
        )


@pytest.mark.parametrize("mode", MODES)
def test_audit_rereads_blocks_the_engine_stored_and_finds_no_mismatch(
    mode: str, mode_runs: Callable[[str], dict[str, Any]]
) -> None:
    """The cold engine stores every block first, so the store holds exactly the bytes it sent."""
    cold = mode_runs(mode)["cold"]["connector_totals"]
    assert cold.get("saved_blocks", 0) > 0, f"{mode}: the cold engine saved nothing: {cold}"
    assert cold.get("audit_mismatches", 0) == 0, f"{mode}: audit found mismatches: {cold}"
    if mode == "hybrid":
        # Mamba state blocks are not audited (only attention KV is re-read).
        assert cold.get("audit_checked_blocks", 0) > 0, f"{mode}: audit checked nothing: {cold}"
    else:
        assert cold.get("audit_checked_blocks", 0) == cold["saved_blocks"], (
            f"{mode}: audit re-read {cold.get('audit_checked_blocks', 0)} of {cold['saved_blocks']} saved"
        )


WARM_AUDIT_CASES = [
    "spec_off",
    "eagle_legacy",
    "eagle_lookahead",
    pytest.param(
        "hybrid",
        marks=pytest.mark.xfail(
            strict=True,
            reason="connector audit compares with the copy another engine stored (put ALREADY_PRESENT); "
            "a bf16 GDN block recomputed after a loaded Mamba state differs in low bits from the cold "
            "engine's copy, which is not a save-timing error",
        ),
    ),
]


@pytest.mark.parametrize("mode", WARM_AUDIT_CASES)
def test_audit_finds_no_mismatch_in_the_warm_engine(
    mode: str, mode_runs: Callable[[str], dict[str, Any]]
) -> None:
    warm = mode_runs(mode)["warm"]["connector_totals"]
    assert warm.get("audit_checked_blocks", 0) > 0, f"{mode}: the warm engine audited nothing: {warm}"
    assert warm.get("audit_mismatches", 0) == 0, f"{mode}: audit found mismatches: {warm}"
