"""Worker-side copies on real CPU tensors, drafter timing, load errors, audit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from kvtag_client.connector import KvtagConnector
from kvtag_client.connector.blocks import gather
from kvtag_client.connector.metadata import BlockTransfer, KvtagConnectorMetadata, LoadJob, SaveJob
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from tests.store_process import StoreProcess

from .harness import ATTN_LAYERS, Engine, Setup
from .test_hit_length import B, fresh_prompt


def block_bytes(engine: Engine, block_id: int) -> bytes:
    worker = engine.worker_connector._worker
    assert worker is not None
    return gather(worker._views[0], block_id)


def expected_bytes(engine: Engine, tokens: list[int], block: int) -> bytes:
    final = engine.expected_block(tokens, block)
    return b"".join(final[name].contiguous().view(torch.uint8).numpy().tobytes() for name in ATTN_LAYERS)


def test_saved_blocks_load_into_different_block_ids_with_equal_bytes(
    make_engine: Callable[..., Engine], store: StoreProcess
) -> None:
    prompt = fresh_prompt(3 * B + 4)
    writer = make_engine(store.endpoint, eagle=True)
    writer.add("w", prompt, max_tokens=2)
    writer.track_blocks("w")
    writer.run()
    writer.drain_saves()
    writer_blocks = set(writer.block_index["w"])

    reader = make_engine(store.endpoint, eagle=True)
    reader.add("filler", fresh_prompt(5 * B), max_tokens=40)  # occupies the low block ids
    reader.step()
    reader.add("r", prompt, max_tokens=1)
    reader.step()
    loads = [load for load in reader.step_log[-1]["meta"].loads if load.req_id == "r"]
    assert loads and len(loads[0].blocks) == 3
    loaded_ids = [t.block_id for t in loads[0].blocks]
    assert not set(loaded_ids) & writer_blocks, "the reader must load into other block ids"
    tokens = prompt + writer.step_log_samples("w")
    for j, block_id in enumerate(loaded_ids):
        assert block_bytes(reader, block_id) == expected_bytes(reader, tokens, j), f"block {j} differs"
    assert reader.worker_connector.stats.totals["loaded_blocks"] == 3
    assert reader.worker_connector.get_block_ids_with_load_errors() == set()


def worker_only(models: dict[str, Path], endpoint: str) -> tuple[KvtagConnector, dict[str, torch.Tensor]]:
    setup = Setup(models["llama"], endpoint, num_blocks=12, extra={"engine_id": "worker-only"})
    vc = setup.vllm_config()
    kvc = setup.kv_cache_config(vc)
    kvc.hash_block_size = setup.block_size
    worker = KvtagConnector(vc, KVConnectorRole.WORKER, kvc)
    caches = {name: torch.randn(2, 12, B, 2, 8) for name in ATTN_LAYERS}
    worker.register_kv_caches(dict(caches))
    return worker, caches


def run_step(worker: KvtagConnector, meta: KvtagConnectorMetadata) -> tuple[set[str], set[int]]:
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    sending, _ = worker.get_finished(set())
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return sending or set(), errors


@pytest.mark.parametrize("data_path", ["shared_memory", "inline"])
def test_worker_round_trip_and_missing_blocks_are_reported(
    models: dict[str, Path], start_store: Callable[..., StoreProcess], data_path: str
) -> None:
    """Both data paths: the store's arena (same host, picked automatically) and gRPC messages (a store
    without an arena, as a remote one is)."""
    store = start_store(*(["--shm-dir", ""] if data_path == "inline" else []))
    worker, caches = worker_only(models, store.endpoint)
    try:
        assert worker.client().data_path == data_path
        keys = [b"rt-" + bytes([i]) * 29 for i in range(3)]
        saves = [BlockTransfer(0, source, key) for source, key in zip((3, 5, 6), keys, strict=True)]
        before = {name: tensor.clone() for name, tensor in caches.items()}
        sending, _ = run_step(worker, KvtagConnectorMetadata(saves=[SaveJob("req", saves, finish=True)]))
        assert sending == {"req"}, "a finish job is reported once its bytes are on the host"
        assert worker._worker is not None and worker._worker.saver.wait_idle(10)
        missing = b"rt-missing-" + b"\0" * 21
        loads = [BlockTransfer(0, target, key) for target, key in zip((7, 9, 10), keys, strict=True)]
        loads.append(BlockTransfer(0, 11, missing))
        _, errors = run_step(worker, KvtagConnectorMetadata(loads=[LoadJob("req2", loads)]))
        for name in ATTN_LAYERS:
            for source, target in ((3, 7), (5, 9), (6, 10)):
                assert torch.equal(caches[name][:, target], before[name][:, source]), (name, source, target)
            assert torch.equal(caches[name][:, 11], before[name][:, 11]), "a failed load writes nothing"
        assert errors == {11}, "the block whose key is not stored must be reported for recompute"
    finally:
        worker.shutdown()
    assert worker._worker is not None and not worker._worker.saver._thread.is_alive(), (
        "shutdown stops the saver"
    )


def test_lookahead_saves_hold_the_drafter_kv_of_each_block_last_position(
    make_engine: Callable[..., Engine], store: StoreProcess
) -> None:
    """The drafter writes a block's last position with the successor token after the target forward.

    The engine's order here is the real one: target forward, start_load_kv (no sync loads), drafter
    forward, wait_for_save. A save that read a block in the step that completed it would miss the
    drafter's KV; kvtag emits the save one step later, so the stored bytes equal the final block.
    """
    engine = make_engine(store.endpoint, eagle=True, max_num_batched_tokens=B)  # one block per step
    prompt = fresh_prompt(3 * B)
    engine.add("a", prompt, max_tokens=3)
    engine.track_blocks("a")
    # What a save in the completing step would read: the block between target and drafter forwards.
    same_step: dict[int, bytes] = {}

    def snapshot(out: object) -> None:
        done = engine.requests["a"].num_computed_tokens
        if done % B == 0 and done <= 3 * B:
            block_id = engine.scheduler.kv_cache_manager.get_block_ids("a")[0][done // B - 1]
            same_step[done // B - 1] = block_bytes(engine, block_id)

    engine.between_forwards = snapshot
    engine.run()
    assert len(same_step) == 3
    engine.drain_saves()
    tokens = prompt + engine.step_log_samples("a")
    keys = [t for entry in engine.step_log for job in entry["meta"].saves for t in job.blocks]
    assert len({engine.block_index["a"][t.block_id] for t in keys}) == 3
    stored = engine.connector.client().get([(t.group, t.key) for t in keys])
    for transfer, value in zip(keys, stored, strict=True):
        j = engine.block_index["a"][transfer.block_id]
        assert value == expected_bytes(engine, tokens, j), f"block {j}: stored bytes are not the final block"
    # Control: a save in the completing step would have stored different, incomplete bytes.
    for j, early in same_step.items():
        assert early != expected_bytes(engine, tokens, j), f"block {j}: the hazard did not occur"


def test_audit_counts_a_block_that_changed_after_it_was_saved(
    make_engine: Callable[..., Engine], store: StoreProcess
) -> None:
    engine = make_engine(store.endpoint, eagle=True, extra={"audit": True, "engine_id": "audit"})
    engine.add("a", fresh_prompt(3 * B), max_tokens=6)
    while engine.worker_connector.stats.totals["saved_blocks"] == 0:
        engine.step()
        engine.drain_saves()
    assert engine.requests["a"].status.name == "RUNNING"
    saved = [t for entry in engine.step_log for job in entry["meta"].saves for t in job.blocks]
    # A late writer scribbles on a block after its save: what a wrong save timing looks like.
    engine.kv[ATTN_LAYERS[1]][:, saved[0].block_id, B - 1] += 1.0
    engine.run()
    engine.drain_saves()
    totals = engine.worker_connector.stats.totals
    assert totals["audit_checked_blocks"] >= 3, totals
    assert totals["audit_mismatches"] == 1, totals


def test_audit_only_compares_copies_this_engine_stored(
    make_engine: Callable[..., Engine], store: StoreProcess
) -> None:
    """Another engine's copy of a block may differ in low bits after a recompute: not a timing error."""
    engine = make_engine(store.endpoint, eagle=True, extra={"audit": True, "engine_id": "audit-others"})
    prompt = fresh_prompt(3 * B)
    # Computed here instead of loading the other copy.
    request = engine.make_request("a", prompt, 4, skip_reading_prefix_cache=True)
    keys = engine.connector._sched().track(request).keys
    keys.refresh()
    # "Another engine" stored different bytes first; this engine's puts answer ALREADY_PRESENT.
    size = len(expected_bytes(engine, [*prompt, 0], 0))
    engine.connector.client().put(
        [(0, keys.key(j), b"\7" * size, b"") for j in range(keys.num_keyed_blocks())]
    )
    engine.requests["a"] = request
    engine.scheduler.add_request(request)
    engine.run()
    engine.drain_saves()
    totals = engine.worker_connector.stats.totals
    assert totals["saved_blocks"] >= 3
    assert totals["audit_mismatches"] == 0, totals


def test_pending_save_memory_is_bounded_and_overflow_is_dropped_and_counted(
    make_engine: Callable[..., Engine], store: StoreProcess
) -> None:
    engine = make_engine(store.endpoint, extra={"max_pending_save_bytes": 1024, "engine_id": "bounded"})
    request = engine.add("a", fresh_prompt(3 * B + 1), max_tokens=2)
    engine.run()
    engine.drain_saves()
    totals = engine.worker_connector.stats.totals
    assert request.is_finished()
    assert totals["saved_blocks"] == 0 and totals["dropped_saves"] == 3, "4 KiB blocks exceed a 1 KiB bound"


def test_connector_stats_reach_the_scheduler_stats_through_vllm_hooks(
    make_engine: Callable[..., Engine], store: StoreProcess
) -> None:
    prompt = fresh_prompt(2 * B + 3)
    writer = make_engine(store.endpoint, extra={"engine_id": "stats-w"})
    writer.add("w", prompt, max_tokens=2)
    writer.run()
    writer.drain_saves()
    reader = make_engine(store.endpoint, extra={"engine_id": "stats-r"})
    reader.add("r", prompt, max_tokens=2)
    reader.run()
    payloads = [
        out.scheduler_stats.kv_connector_stats
        for outputs in reader.outputs
        for out in outputs.values()
        if out.scheduler_stats is not None and out.scheduler_stats.kv_connector_stats
    ]
    merged = KvtagConnector.build_kv_connector_stats()
    assert merged is not None
    for payload in payloads:
        rebuilt = KvtagConnector.build_kv_connector_stats(data=payload)
        assert rebuilt is not None
        merged = merged.aggregate(rebuilt)
    reduced = merged.reduce()
    assert reduced["hit_blocks"] == 2 and reduced["loaded_blocks"] == 2, reduced
    assert reduced["lookups"] == 1
