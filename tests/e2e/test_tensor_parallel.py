"""Tensor parallelism on real vLLM CPU engines (TP=2, multiprocessing executor, one process per rank).

Each rank stores its own KV shard under its own namespace (parallel_sharding `tp=2/rank=r`). The
scheduler reports a hit only as far as every rank's namespace holds it, and a rank whose blocks
vanish after the lookup reports load errors, so vLLM recomputes them and the rank stores them again.
Rank 1's blocks go missing by pointing rank 1's worker at another store (tests/e2e/tp_connector.py).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.store_process import REPO, StoreProcess, store_bin

from .harness import kv_transfer_config, prompt, run_engine

pytestmark = pytest.mark.slow

BLOCK = 32
MAX_TOKENS = 8
PROMPTS = [prompt(61, 3 * BLOCK + 5), prompt(62, 4 * BLOCK)]
# Every prompt's hit: whole blocks, at least one token left to compute.
HITS = [(len(p) - 1) // BLOCK * BLOCK for p in PROMPTS]
# Blocks a request stores by its finish: the whole blocks of its computed tokens (the last sampled
# token is never computed).
STORED = sum((len(p) + MAX_TOKENS - 1) // BLOCK for p in PROMPTS)


def _job(models: dict[str, Path], endpoint: str, engine_id: str, rank1_endpoint: str = "") -> dict[str, Any]:
    transfer = kv_transfer_config(endpoint, engine_id=engine_id)
    if rank1_endpoint:
        transfer["kv_connector"] = "SplitStoreConnector"
        transfer["kv_connector_module_path"] = "tests.e2e.tp_connector"
        transfer["kv_connector_extra_config"]["rank1_endpoint"] = rank1_endpoint
    return {
        "model": str(models["llama"]),
        "block_size": BLOCK,
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "mp",
        "kv_transfer_config": transfer,
        "steps": [{"prompts": PROMPTS, "max_tokens": MAX_TOKENS}],
    }


def _requests(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [request for step in result["steps"] for request in step["requests"]]


def _keys_by_rank(store: StoreProcess) -> dict[str, int]:
    """Stored keys per namespace, named by the namespace's parallel_sharding."""
    stats = subprocess.run(
        [store_bin(), "stats", "--target", store.endpoint, "--json"],
        capture_output=True,
        check=True,
        timeout=30,
    )
    keys = {ns["namespace_id"]: int(ns["keys"]) for ns in json.loads(stats.stdout).get("namespaces", [])}
    return {
        ns["namespace"]["parallel_sharding"]: keys.get(ns["namespace_id"], 0)
        for ns in store.diagnose().get("namespaces", [])
    }


RANK0, RANK1 = "tp=2/rank=0,pp=1/rank=0,dcp=1", "tp=2/rank=1,pp=1/rank=0,dcp=1"


def test_tp2_both_ranks_store_hits_need_every_rank_and_a_missing_rank_is_recomputed(
    models: dict[str, Path],
    work_dir: Path,
    start_store: Callable[..., StoreProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vLLM imports the test connector by module path in its spawned worker processes.
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    store, elsewhere, empty = start_store(), start_store(), start_store()

    # A: rank 1 stores elsewhere, so `store` holds rank 0's blocks only.
    cold = _requests(run_engine(_job(models, store.endpoint, "tp-a", elsewhere.endpoint), work_dir, "tp-a"))
    assert all(r["external_hit"] == 0 for r in cold), cold
    assert _keys_by_rank(store) == {RANK0: STORED, RANK1: 0}
    assert _keys_by_rank(elsewhere) == {RANK1: STORED}, "rank 1 did not store its own shard"

    # B: rank 0 holds every block, rank 1 none: no hit, the same greedy tokens, and rank 1 stores now.
    partial = _requests(run_engine(_job(models, store.endpoint, "tp-b"), work_dir, "tp-b"))
    for index, request in enumerate(partial):
        assert request["external_hit"] == 0, f"a hit rank 1 cannot load was reported: {request}"
        assert request["token_ids"] == cold[index]["token_ids"]
    assert _keys_by_rank(store) == {RANK0: STORED, RANK1: STORED}

    # C: a fresh engine gets every prompt's full hit from both ranks, with the cold tokens.
    warm = _requests(run_engine(_job(models, store.endpoint, "tp-c"), work_dir, "tp-c"))
    for index, request in enumerate(warm):
        assert request["external_hit"] == HITS[index], f"prompt {index}: {request}"
        assert request["num_cached_tokens"] == HITS[index]
        assert request["token_ids"] == cold[index]["token_ids"], f"prompt {index} changed its output"

    # D: the scheduler sees both ranks' blocks in `store`, but rank 1 loads from an empty store: its
    # load errors make vLLM recompute, the tokens stay the same and rank 1 stores what it recomputed.
    run = run_engine(_job(models, store.endpoint, "tp-d", empty.endpoint), work_dir, "tp-d")
    for index, request in enumerate(_requests(run)):
        assert request["token_ids"] == cold[index]["token_ids"], f"prompt {index} changed its output"
    log = (work_dir / "tp-d.log").read_text(errors="replace")
    assert "Recovered from KV load failure" in log, "vLLM did not recompute rank 1's missing blocks"
    assert "Traceback" not in log
    assert _keys_by_rank(empty) == {RANK1: STORED}, "rank 1 did not store the blocks it recomputed"
