"""Sleep mode (vLLM 0.33's unregister_kv_caches / restore_kv_caches) on CPU tensors standing in for
the KV caches: cuMem sleep keeps the runner's tensor objects and gives them new memory at wake-up,
which `set_` reproduces here."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from kvtag_client.connector import KvtagConnector, compat
from kvtag_client.connector.metadata import BlockTransfer, KvtagConnectorMetadata, LoadJob, SaveJob
from vllm.config import KVTransferConfig

from tests.store_process import StoreProcess

from .harness import ATTN_LAYERS
from .test_worker import run_step, worker_only


def block_bytes(caches: dict[str, torch.Tensor], block_id: int) -> bytes:
    return b"".join(
        caches[name][:, block_id].contiguous().view(torch.uint8).numpy().tobytes() for name in ATTN_LAYERS
    )


def test_supports_sleep_mode_only_where_vllm_calls_the_hooks() -> None:
    config = KVTransferConfig(
        kv_connector="KvtagConnector", kv_connector_module_path="kvtag_client.connector", kv_role="kv_both"
    )
    assert KvtagConnector.supports_sleep_mode(config) is (compat.series() >= (0, 33))
    if compat.series() >= (0, 33):
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

        child = {
            "kv_connector": "KvtagConnector",
            "kv_connector_module_path": "kvtag_client.connector",
            "kv_role": "kv_both",
        }
        multi = KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"connectors": [child]},
        )
        assert MultiConnector.supports_sleep_mode(multi), "0.33's MultiConnector asks each child"


@pytest.mark.parametrize("data_path", ["shared_memory", "inline"])
def test_asleep_saves_write_nothing_and_after_wake_a_round_trip_is_byte_exact(
    models: dict[str, Path], start_store: Callable[..., StoreProcess], data_path: str
) -> None:
    store = start_store(*(["--shm-dir", ""] if data_path == "inline" else []))
    worker, caches = worker_only(models, store.endpoint)
    side = worker._worker
    assert side is not None
    try:
        assert worker.client().data_path == data_path
        worker.unregister_kv_caches()
        worker.unregister_kv_caches()  # idempotent, as vLLM's contract asks
        assert not side.registered
        asleep_key = b"sleep-asleep-" + b"\0" * 19
        dropped = side._stats.totals.get("dropped_saves", 0)
        sending, _ = run_step(
            worker,
            KvtagConnectorMetadata(saves=[SaveJob("s", [BlockTransfer(0, 3, asleep_key)], finish=True)]),
        )
        assert sending == {"s"}, "a finish job is still reported, so vLLM frees the pinned blocks"
        assert side.saver.wait_idle(10)
        assert worker.client().get([(0, asleep_key)]) == [None], "a save while asleep wrote bytes"
        assert side._stats.totals["dropped_saves"] == dropped + 1
        _, errors = run_step(
            worker, KvtagConnectorMetadata(loads=[LoadJob("l0", [BlockTransfer(0, 4, asleep_key)])])
        )
        assert errors == {4}, "a load while asleep fails, so vLLM recomputes"

        # Wake-up: the same tensor objects over new memory, with new contents.
        old_memory = {name: tensor.clone() for name, tensor in caches.items()}
        for tensor in caches.values():
            tensor.set_(torch.randn_like(tensor))
        worker.restore_kv_caches()
        worker.restore_kv_caches()
        assert side.registered

        key = b"sleep-awake-" + b"\0" * 20
        source = block_bytes(caches, 3)
        assert source != block_bytes(old_memory, 3)
        run_step(worker, KvtagConnectorMetadata(saves=[SaveJob("s2", [BlockTransfer(0, 3, key)])]))
        assert side.saver.wait_idle(10)
        (stored,) = worker.client().get([(0, key)])
        assert stored is not None and bytes(stored) == source, "the save read the new memory"
        _, errors = run_step(
            worker, KvtagConnectorMetadata(loads=[LoadJob("l1", [BlockTransfer(0, 9, key)])])
        )
        assert errors == set()
        assert block_bytes(caches, 9) == source, "the load wrote the new memory, byte for byte"
    finally:
        worker.shutdown()


def test_after_unregister_the_worker_holds_no_reference_to_the_kv_tensors(
    models: dict[str, Path], store: StoreProcess
) -> None:
    """If the runner lets its tensors go while asleep, they are freed (the worker held none), and
    restore leaves the worker unregistered: saves write nothing instead of reading freed memory."""
    worker, caches = worker_only(models, store.endpoint)
    side = worker._worker
    assert side is not None
    try:
        refs = [weakref.ref(tensor) for tensor in caches.values()]
        worker.unregister_kv_caches()
        del caches
        gc.collect()
        assert all(ref() is None for ref in refs), "the worker still references a KV tensor"
        worker.restore_kv_caches()
        assert not side.registered
        key = b"sleep-gone-" + b"\0" * 21
        run_step(worker, KvtagConnectorMetadata(saves=[SaveJob("s", [BlockTransfer(0, 3, key)])]))
        assert side.saver.wait_idle(10)
        assert worker.client().get([(0, key)]) == [None]
    finally:
        worker.shutdown()
