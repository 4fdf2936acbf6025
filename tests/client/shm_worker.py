"""A client process for the shared-memory tests: `race` puts and gets content-derived values under
eviction and checks every byte it is served; `reserve-and-hang` reserves slots, half-writes one and
waits to be killed. Run as `python -m tests.client.shm_worker MODE ENDPOINT ...`."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvtag.v1 import store_pb2 as pb
from kvtag_client import keys
from kvtag_client.store import StoreClient

from tests.descriptors import namespace


def value_of(key: bytes) -> bytes:
    """Every byte derives from the key, so a value served for the wrong key or from reused memory shows."""
    size = 8192 + int.from_bytes(hashlib.sha256(key).digest()[:2], "big") % (24 << 10)
    return hashlib.shake_128(key).digest(size)


def client(endpoint: str, engine: str) -> StoreClient:
    store = StoreClient(
        endpoint,
        engine_id=engine,
        namespace=namespace("shm-tests"),
        mode=keys.mode(16, 0),
        probe_keys=keys.probe_keys(16, 0),
        rpc_timeout_s=10.0,
    )
    if not store.open() or store.data_path != "shared_memory":
        raise SystemExit(f"{engine}: not on the shared-memory path ({store.state}, {store.data_path})")
    return store


def race(endpoint: str, seed: int, rounds: int) -> None:
    rng = random.Random(seed)
    store = client(endpoint, f"race-{seed}")
    served = stored = 0
    names = [f"k{i}".encode() for i in range(256)]
    for _ in range(rounds):
        batch = rng.sample(names, 4)
        statuses = store.put([(0, k, value_of(k), b"") for k in batch]) or []
        stored += statuses.count(pb.STORED)
        wanted = rng.sample(names, 8)
        for key, value in zip(wanted, store.get([(0, k) for k in wanted]), strict=True):
            if value is None:
                continue
            served += 1
            if value != value_of(key):
                print(json.dumps({"error": f"key {key!r} served {len(value)} wrong bytes"}), flush=True)
                raise SystemExit(1)
    store.close()
    print(json.dumps({"served": served, "stored": stored}), flush=True)


def run_races(endpoint: str, processes: int, rounds: int) -> list[dict[str, Any]]:
    """`race` in that many client processes at once (seeds 0..processes-1); each one's report, after
    checking that every process exited cleanly (a wrong byte served makes it exit 1)."""
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.client.shm_worker", "race", endpoint, str(seed), str(rounds)],
            cwd=Path(__file__).resolve().parents[2],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for seed in range(processes)
    ]
    reports = []
    for worker in workers:
        out, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, (out + err).decode(errors="replace")[-2000:]
        reports.append(json.loads(out.decode().strip().splitlines()[-1]))
    return reports


def reserve_and_hang(endpoint: str) -> None:
    store = client(endpoint, "doomed-writer")
    items = [(0, f"doomed-{i}".encode(), 64 << 10, b"") for i in range(4)]
    reservation = store.reserve(items)
    assert reservation is not None and all(slot is not None for slot in reservation.slots)
    first = reservation.slots[0]
    assert first is not None
    first[: len(first) // 2] = b"\xab" * (len(first) // 2)  # killed mid-write: half a value
    print("reserved", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    mode, endpoint = sys.argv[1], sys.argv[2]
    if mode == "race":
        race(endpoint, int(sys.argv[3]), int(sys.argv[4]))
    else:
        reserve_and_hang(endpoint)
