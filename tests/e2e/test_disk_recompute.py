"""A byte flipped in the disk tier's files is never served: the record fails its checksum, is dropped
and counted, and a real vLLM engine recomputes the block with the same greedy output as the cold run.

The store restarts between the runs (SIGTERM: memory is written to the disk tier), so every block the
warm engine loads comes back from disk; the flips are made while the store is down."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc

from tests.store_process import StoreProcess

from .harness import kv_transfer_config, prompt, run_engine

pytestmark = pytest.mark.slow

BLOCK = 32
PROMPTS = [prompt(71, 200), prompt(72, 230), prompt(73, 170)]
# Where the flips land in the largest segment file: values fill nearly all of it.
FLIP_AT = (0.2, 0.45, 0.7, 0.9)


def _job(models: dict[str, Path], endpoint: str, engine_id: str) -> dict[str, Any]:
    return {
        "model": str(models["llama"]),
        "block_size": BLOCK,
        "kv_transfer_config": kv_transfer_config(endpoint, engine_id=engine_id),
        "steps": [{"prompts": PROMPTS, "max_tokens": 8}],
    }


def _disk_stats(endpoint: str) -> pb.TierStats:
    import grpc

    with grpc.insecure_channel(endpoint) as channel:
        stub: Any = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
        stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
    rows = {t.tier: t for t in stats.tiers}
    assert "disk" in rows, stats
    disk: pb.TierStats = rows["disk"]
    return disk


def test_a_flipped_byte_on_disk_is_never_served_and_the_engine_recomputes_identically(
    models: dict[str, Path], work_dir: Path, start_store: Callable[..., StoreProcess]
) -> None:
    disk_dir = work_dir / "disk-recompute"
    store = start_store("--disk-dir", str(disk_dir), "--disk-capacity", "256MiB")
    cold = run_engine(_job(models, store.endpoint, "cold"), work_dir, "disk-cold")
    assert store.proc is not None
    store.proc.terminate()
    assert store.proc.wait(timeout=60) == 0, store.log_tail()
    store.proc = None

    segments = sorted(disk_dir.rglob("*.seg"), key=lambda p: p.stat().st_size)
    assert segments, f"the cold run's blocks never reached the disk tier: {list(disk_dir.rglob('*'))}"
    target = segments[-1]
    with target.open("r+b") as f:
        size = target.stat().st_size
        for share in FLIP_AT:
            f.seek(int(size * share))
            byte = f.read(1)
            f.seek(int(size * share))
            f.write(bytes([byte[0] ^ 0x5A]))
    subprocess.run(["sync"], check=False)

    store.start()
    warm = run_engine(_job(models, store.endpoint, "warm"), work_dir, "disk-warm")
    dropped = _disk_stats(store.endpoint).corrupted_dropped

    cold_requests = cold["steps"][0]["requests"]
    warm_requests = warm["steps"][0]["requests"]
    for index, (c, w) in enumerate(zip(cold_requests, warm_requests, strict=True)):
        assert w["token_ids"] == c["token_ids"], f"prompt {index}: greedy output changed after a flipped byte"
    assert any(r["external_hit"] > 0 for r in warm_requests), f"nothing came back from disk: {warm_requests}"
    assert dropped >= 1, "the flipped records were counted as corrupted_dropped"
    totals = warm["connector_totals"]
    assert totals.get("audit_mismatches", 0) == 0, totals
    print(
        f"\nflipped {len(FLIP_AT)} bytes in {target.name}: {dropped} records dropped, "
        f"load errors {totals.get('load_errors', 0)}, warm hits "
        f"{[r['external_hit'] for r in warm_requests]}, outputs identical"
    )
