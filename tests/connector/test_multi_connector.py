"""kvtag as a child of vLLM's MultiConnector, lookahead only if every child supports it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvtag_client.connector import compat
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

from tests.store_process import StoreProcess

from .harness import Engine, assert_scheduler_empty
from .test_hit_length import B, fresh_prompt


def example_child(path: Path) -> dict[str, object]:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def kvtag_child(endpoint: str, engine_id: str) -> dict[str, object]:
    return {
        "kv_connector": "KvtagConnector",
        "kv_connector_module_path": "kvtag_client.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"endpoint": endpoint, "engine_id": engine_id},
    }


def test_beside_a_connector_without_lookahead_kvtag_uses_legacy_keys_and_still_serves_hits(
    make_engine: Callable[..., Engine], store: StoreProcess, tmp_path: Path
) -> None:
    engine = make_engine(store.endpoint, eagle=True, multi_with=[example_child(tmp_path / "example")])
    assert isinstance(engine.scheduler.connector, MultiConnector)
    assert engine.connector.lookahead_tokens == 0, engine.connector.lookahead.reason
    assert "sibling" in engine.connector.lookahead.reason
    assert getattr(engine.vc, "num_hash_lookahead_tokens", 0) == 0, "the core hashes without lookahead too"
    assert engine.worker_connector.lookahead_tokens == 0
    prompt = fresh_prompt(3 * B + 5)
    engine.add("a", prompt, max_tokens=2)
    engine.run()
    engine.drain_saves()
    assert engine.worker_connector.stats.totals["saved_blocks"] == 3
    assert_scheduler_empty(engine.scheduler)
    reader = make_engine(store.endpoint, eagle=True, multi_with=[example_child(tmp_path / "example2")])
    # Legacy keys with the EAGLE drop: one block short of the three stored.
    assert reader.external_hit("b", prompt) == 2 * B


def test_when_every_child_supports_lookahead_it_stays_on(
    make_engine: Callable[..., Engine], store: StoreProcess
) -> None:
    engine = make_engine(store.endpoint, eagle=True, multi_with=[kvtag_child(store.endpoint, "second-child")])
    children = engine.scheduler.connector._connectors
    assert len(children) == 2
    assert all(child.lookahead_tokens == 1 for child in children)
    # 0.34+: MultiConnector asked both children's classmethods, and the core hashes with L=1 as well.
    assert getattr(engine.vc, "num_hash_lookahead_tokens", 0) == (1 if compat.core_decides_lookahead() else 0)
