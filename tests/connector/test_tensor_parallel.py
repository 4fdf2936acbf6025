"""Tensor parallelism on the real Scheduler: a hit is what every rank's namespace holds, and blocks a
worker fails to load are stored again once vLLM recomputes them.

The harness runs one worker half (rank 0: no process group in this process); rank 1's namespace is
filled through a StoreClient of its own. tests/e2e/test_tensor_parallel.py runs real TP=2 engines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag_client.connector.tracking import RequestKeys
from kvtag_client.items import PutItem
from kvtag_client.store import StoreClient
from vllm.config import VllmConfig

from tests.store_process import StoreProcess

from .harness import Engine, Setup
from .test_hit_length import B, fresh_prompt

H = 64  # block size of the hybrid recipe


@dataclass
class TensorParallelSetup(Setup):
    tensor_parallel_size: int = 2

    def vllm_config(self) -> VllmConfig:
        config = super().vllm_config()
        config.parallel_config.tensor_parallel_size = self.tensor_parallel_size
        return config


@pytest.fixture
def tp_engine(models: dict[str, Path]) -> Iterator[Callable[..., Engine]]:
    engines: list[Engine] = []

    def factory(endpoint: str, hybrid: bool = False, **fields: Any) -> Engine:
        if hybrid:
            fields.update(block_size=H, prefix_match_unit=16)
        model = models["qwen3_next" if hybrid else "llama"]
        engine = TensorParallelSetup(model, endpoint, hybrid=hybrid, **fields).build()
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.shutdown()


def store_for_rank(
    engine: Engine, endpoint: str, rank: int, prompt: list[int], blocks: int, states: tuple[int, ...] = ()
) -> None:
    """Store the first `blocks` blocks of `prompt` in TP rank `rank`'s namespace, as that rank would,
    and (hybrid) the Mamba state at each boundary in `states` (after that many blocks)."""
    connector = engine.connector
    keys = RequestKeys(
        engine.make_request("keys", prompt), connector.geometry, connector.lookahead_tokens, "canonical"
    )
    keys.refresh()
    value = bytes(engine.kvc.kv_cache_groups[0].kv_cache_spec.page_size_bytes * 2)
    items = [PutItem(0, keys.key(j), value, keys.base_key(j)) for j in range(blocks)]
    items += [PutItem(1, keys.key(n - 1), value, keys.base_key(n - 1)) for n in states]
    with StoreClient(
        endpoint,
        engine_id=f"rank{rank}-writer",
        namespace=connector.namespace_descriptor(rank),
        mode=connector.hashing_mode(),
        probe_keys=connector.probe_keys(),
    ) as client:
        assert client.open()
        statuses = client.put(items)
    assert statuses is not None and set(statuses) <= {pb.STORED, pb.ALREADY_PRESENT}, statuses


def test_tp2_scheduler_reports_only_the_prefix_every_rank_holds(
    tp_engine: Callable[..., Engine], store: StoreProcess
) -> None:
    prompt = fresh_prompt(4 * B + 3)
    writer = tp_engine(store.endpoint)
    writer.add("w", prompt, max_tokens=2)
    writer.run()
    writer.drain_saves()  # rank 0's namespace now holds the prompt's 4 blocks

    reader = tp_engine(store.endpoint)
    assert reader.external_hit("none", prompt) == 0, "rank 1 holds none of the blocks"
    store_for_rank(reader, store.endpoint, 1, prompt, 2)
    assert reader.external_hit("two", prompt) == 2 * B
    store_for_rank(reader, store.endpoint, 1, prompt, 4)
    assert reader.external_hit("four", prompt) == 4 * B

    only_rank1 = fresh_prompt(4 * B + 3)
    store_for_rank(reader, store.endpoint, 1, only_rank1, 4)
    assert reader.external_hit("rank1-only", only_rank1) == 0, "rank 0 holds none of these blocks"

    reader.add("r", prompt, max_tokens=1)
    reader.step()
    [load] = [job for job in reader.step_log[-1]["meta"].loads if job.req_id == "r"]
    assert len(load.blocks) == 4
    assert len(load.leases) == 2 and all(load.leases), f"each rank's lookup lease travels: {load.leases}"
    assert load.leases_of(0) != load.leases_of(1)


def test_tp2_hybrid_hit_ends_where_every_rank_holds_the_state(
    tp_engine: Callable[..., Engine], store: StoreProcess
) -> None:
    engine = tp_engine(store.endpoint, hybrid=True)
    prompt = fresh_prompt(3 * H + 5)
    store_for_rank(engine, store.endpoint, 0, prompt, 3, states=(1, 2, 3))
    store_for_rank(engine, store.endpoint, 1, prompt, 3, states=(2,))
    assert engine.external_hit("rank1-state-at-2", prompt) == 2 * H
    store_for_rank(engine, store.endpoint, 1, prompt, 3, states=(3,))
    assert engine.external_hit("both-at-3", prompt) == 3 * H

    other = fresh_prompt(3 * H + 5)
    store_for_rank(engine, store.endpoint, 0, other, 3, states=(1, 3))
    store_for_rank(engine, store.endpoint, 1, other, 3, states=(2,))
    assert engine.external_hit("no-common-boundary", other) == 0


def test_blocks_a_worker_fails_to_load_are_saved_again_once_recomputed(
    make_engine: Callable[..., Engine], store: StoreProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = fresh_prompt(3 * B + 5)
    writer = make_engine(store.endpoint)
    writer.add("w", prompt, max_tokens=3)
    writer.run()
    writer.drain_saves()

    reader = make_engine(store.endpoint)
    client = reader.worker_connector.client()
    # The fault: every Get of the reader's worker fails, as for a rank whose blocks were evicted
    # after the scheduler's lookup.
    monkeypatch.setattr(client, "get", lambda blocks, leases=(): [None] * len(blocks))
    monkeypatch.setattr(client, "get_into", lambda blocks, leases, sink: [False] * len(blocks))
    reader.add("r", prompt, max_tokens=3)
    reader.run()
    reader.drain_saves()

    totals = reader.worker_connector.stats.totals
    assert totals["load_errors"] == 3
    scheduled = sum(entry["scheduled"].get("r", 0) for entry in reader.step_log)
    # 5 tokens after the 3-block hit, then the whole prompt again and the 2 decoded tokens.
    assert scheduled == 5 + len(prompt) + 2, scheduled
    # The 3 recomputed blocks are stored again (the store answers ALREADY_PRESENT): a rank that lacked
    # them would hold them now. The request has no whole block past them.
    assert totals["saved_blocks"] == 3, totals
