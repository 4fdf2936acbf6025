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

from tests.store_process import StoreProcess

from .harness import EngineRun, kv_transfer_config, prompt, run_engine

pytestmark = pytest.mark.slow

BLOCK = 32
ALIGNED = [prompt(1, 3 * BLOCK), prompt(2, 4 * BLOCK)]
UNALIGNED = [prompt(3, 3 * BLOCK + 4), prompt(4, 4 * BLOCK + 22)]
LLAMA_PROMPTS = ALIGNED + UNALIGNED
HYBRID_PROMPTS = [prompt(5, 300), prompt(6, 256), prompt(7, 420)]
# Warm-only extensions: blocks past what the cold engine stored, so the warm engine stores (and
# audits) blocks of its own, not only re-saves the cold engine's.
LLAMA_EXTENSION = [LLAMA_PROMPTS[0] + prompt(8, 70)]
HYBRID_EXTENSION = [HYBRID_PROMPTS[0] + prompt(9, 200)]
# The hybrid cut-back: the cold engine alone runs CUT_SOURCE and its one-block-and-a-bit prefix, so
# the store holds CUT_SOURCE's attention KV for blocks 0-2 of vLLM's hybrid block (128 tokens) but
# its Mamba state only where a prefill chunk ended: after 128 tokens (the prefix) and 384 (the
# source). The warm engine's CUT_PROBE shares CUT_SOURCE's first 256 tokens: two blocks of KV hit,
# the state after 256 is missing, so the hit must be cut back to 128.
CUT_SOURCE = prompt(10, 420)
HYBRID_COLD_ONLY = [CUT_SOURCE[:140], CUT_SOURCE]
CUT_PROBE = CUT_SOURCE[:256] + prompt(11, 44)
MAX_TOKENS = 8

MODES = ("spec_off", "eagle_legacy", "eagle_lookahead", "eagle3_lookahead", "mtp_lookahead", "hybrid")
# mode -> (speculative method, drafter model); MTP's drafter is the MiMo target's own MTP layer.
DRAFTERS = {
    "eagle_legacy": ("eagle", "eagle"),
    "eagle_lookahead": ("eagle", "eagle"),
    "eagle3_lookahead": ("eagle3", "eagle3"),
    "mtp_lookahead": ("mtp", None),
}


# Hybrid engines over the store the hybrid cold and warm runs filled, each with a fault in the Mamba
# state the store serves them (engine_runner.py): a zeroed state, and a state whose Get fails.
STATE_FAULTS = {"hybrid_state_zeroed": "zero", "hybrid_state_get_fails": "fail"}


def _hybrid_job(models: dict[str, Path], endpoint: str, seed: int, role: str) -> dict[str, Any]:
    steps = [{"prompts": HYBRID_PROMPTS, "max_tokens": MAX_TOKENS}]
    if role == "cold":
        steps.append({"prompts": HYBRID_COLD_ONLY, "max_tokens": MAX_TOKENS})
    elif role in ("warm", "fail"):
        steps.append({"prompts": [*HYBRID_EXTENSION, CUT_PROBE], "max_tokens": MAX_TOKENS})
    job = {
        "model": str(models["qwen3_next"]),
        "dtype": "bfloat16",
        "mamba_cache_mode": "align",
        "seed": seed,
        "kv_transfer_config": kv_transfer_config(endpoint),
        "steps": steps,
    }
    if role in ("zero", "fail"):
        job["mamba_state_fault"] = role
    return job


def _job(mode: str, models: dict[str, Path], endpoint: str, seed: int, warm: bool) -> dict[str, Any]:
    if mode == "hybrid":
        return _hybrid_job(models, endpoint, seed, "warm" if warm else "cold")
    job: dict[str, Any] = {
        "model": str(models["mimo" if mode == "mtp_lookahead" else "llama"]),
        "block_size": BLOCK,
        "seed": seed,
        "kv_transfer_config": kv_transfer_config(
            endpoint, **({"lookahead": "off"} if mode == "eagle_legacy" else {})
        ),
        "steps": [{"prompts": LLAMA_PROMPTS, "max_tokens": MAX_TOKENS}],
    }
    if warm:
        job["steps"].append({"prompts": LLAMA_EXTENSION, "max_tokens": MAX_TOKENS})
    if mode != "spec_off":
        job["speculative_config"] = {
            "method": "eagle",
            "model": str(models["eagle"]),
            "num_speculative_tokens": 2,
        }
    return job


@pytest.fixture(scope="module")
def mode_runs(
    models: dict[str, Path], work_dir: Path, start_store: Callable[..., StoreProcess]
) -> Callable[[str], dict[str, Any]]:
    """Cold then warm engine per mode, run once per module and shared by the tests below."""
    cache: dict[str, dict[str, Any]] = {}

    def get(mode: str) -> dict[str, Any]:
        if mode in STATE_FAULTS and mode not in cache:
            # Both faulty engines at once (they only read what the hybrid runs stored, and re-put it).
            store = get("hybrid")["store"]
            engines = {
                name: EngineRun(_hybrid_job(models, store.endpoint, 99, fault), work_dir, name).start()
                for name, fault in STATE_FAULTS.items()
            }
            try:
                for name, engine in engines.items():
                    cache[name] = {"warm": engine.result()}
            finally:
                for engine in engines.values():
                    engine.kill()
        if mode not in cache:
            store = start_store()
            cold_job = _job(mode, models, store.endpoint, seed=0, warm=False)
            warm_job = _job(mode, models, store.endpoint, seed=1234, warm=True)
            cold = run_engine(cold_job, work_dir, f"{mode}-cold")
            warm = run_engine(warm_job, work_dir, f"{mode}-warm")
            cache[mode] = {"cold": cold, "warm": warm, "store": store}
        return cache[mode]

    return get


def _requests(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The requests of the shared first step (cold and warm send the same prompts there)."""
    return list(result["steps"][0]["requests"])


@pytest.mark.parametrize("mode", MODES)
def test_warm_engine_loads_from_kvtag_and_greedy_tokens_match_cold_run(
    mode: str, mode_runs: Callable[[str], dict[str, Any]]
) -> None:
    runs = mode_runs(mode)
    cold, warm = _requests(runs["cold"]), _requests(runs["warm"])
    assert runs["warm"]["worker_data_path"] == runs["cold"]["worker_data_path"] == "shared_memory", (
        "engine and store share this host: blocks must move through the store's shared-memory arena"
    )
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


def test_eagle_family_lookahead_hits_equal_spec_off_and_legacy_is_one_block_shorter(
    mode_runs: Callable[[str], dict[str, Any]],
) -> None:
    off = _requests(mode_runs("spec_off")["warm"])
    lookahead = _requests(mode_runs("eagle_lookahead")["warm"])
    eagle3 = _requests(mode_runs("eagle3_lookahead")["warm"])
    mtp = _requests(mode_runs("mtp_lookahead")["warm"])
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
        assert eagle3[index]["num_cached_tokens"] == off[index]["num_cached_tokens"], (
            f"{label}: EAGLE3 lookahead hit {eagle3[index]['num_cached_tokens']} "
            f"!= spec-off hit {off[index]['num_cached_tokens']}"
        )
        assert mtp[index]["num_cached_tokens"] == off[index]["num_cached_tokens"], (
            f"{label}: MTP (MiMo) lookahead hit {mtp[index]['num_cached_tokens']} "
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


@pytest.mark.parametrize("mode", MODES)
def test_audit_finds_no_mismatch_in_the_warm_engine(
    mode: str, mode_runs: Callable[[str], dict[str, Any]]
) -> None:
    """The warm engine's own blocks (the extension past the cold prompts) are re-read and compared."""
    warm = mode_runs(mode)["warm"]["connector_totals"]
    assert warm.get("audit_checked_blocks", 0) > 0, f"{mode}: the warm engine audited nothing: {warm}"
    assert warm.get("audit_mismatches", 0) == 0, f"{mode}: audit found mismatches: {warm}"


def test_hybrid_oracle_sees_the_mamba_state_a_zeroed_state_changes_the_greedy_tokens(
    mode_runs: Callable[[str], dict[str, Any]],
) -> None:
    """The control that proves the hybrid warm==cold oracle can fail: same hits and attention KV, but
    the loaded GDN state replaced by zeros. The test model's slow decay makes the state matter."""
    cold = _requests(mode_runs("hybrid")["cold"])
    warm = _requests(mode_runs("hybrid")["warm"])
    zeroed = _requests(mode_runs("hybrid_state_zeroed")["warm"])
    for index, (c, w, z) in enumerate(zip(cold, warm, zeroed, strict=True)):
        assert z["external_hit"] == w["external_hit"] > 0, f"prompt {index}: {z} {w}"
        assert z["token_ids"] != c["token_ids"], (
            f"prompt {index}: greedy tokens did not change with a zeroed Mamba state after a "
            f"{z['external_hit']}-token hit, so the warm==cold oracle cannot see the state"
        )


def test_hybrid_hits_end_on_exact_block_boundaries(mode_runs: Callable[[str], dict[str, Any]]) -> None:
    """Every state the cold engine stored is at the prompt's last full block short of its last token."""
    runs = mode_runs("hybrid")
    block = int(runs["warm"]["block_size"])
    assert block == 128, f"the hybrid prompts are sized for vLLM's 128-token hybrid block, got {block}"
    for index, request in enumerate(_requests(runs["warm"])):
        expected = (request["prompt_len"] - 1) // block * block
        assert request["num_cached_tokens"] == request["external_hit"] == expected, (index, request)


def test_hybrid_hit_is_cut_back_to_the_last_boundary_whose_state_is_stored(
    mode_runs: Callable[[str], dict[str, Any]],
) -> None:
    """CUT_PROBE finds two blocks of attention KV but the Mamba state only after the first block."""
    runs = mode_runs("hybrid")
    block = int(runs["warm"]["block_size"])
    probe = runs["warm"]["steps"][1]["requests"][-1]
    assert probe["prompt_len"] == len(CUT_PROBE)
    assert probe["num_cached_tokens"] == probe["external_hit"] == block, (
        f"CUT_PROBE shares {2 * block} tokens of stored KV with CUT_SOURCE, whose state is stored "
        f"after {block} and {3 * block} tokens only: the hit must stop at {block}: {probe}"
    )
    # Its greedy tokens equal those of an engine that recomputed the whole prompt (every state Get
    # failed there), so the state loaded at the cut boundary was the right one.
    recomputed = mode_runs("hybrid_state_get_fails")["warm"]["steps"][1]["requests"][-1]
    assert probe["token_ids"] == recomputed["token_ids"], (probe, recomputed)


def test_hybrid_state_get_failure_recomputes_with_identical_tokens(
    mode_runs: Callable[[str], dict[str, Any]],
) -> None:
    """Every state block's Get fails: the connector reports the loads failed and vLLM recomputes."""
    cold = _requests(mode_runs("hybrid")["cold"])
    failed = mode_runs("hybrid_state_get_fails")["warm"]
    for index, (c, f) in enumerate(zip(cold, _requests(failed), strict=True)):
        assert f["token_ids"] == c["token_ids"], f"prompt {index}: output changed when the state Get failed"
    totals = failed["connector_totals"]
    requests = [r for step in failed["steps"] for r in step["requests"]]
    # One state block per hit request fails; the attention blocks of the same loads still arrive.
    assert totals.get("load_errors", 0) == len(requests), totals
    assert totals.get("loaded_blocks", 0) > 0, totals
