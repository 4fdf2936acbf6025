"""Put throughput of the memory backend at full capacity, where every put evicts: what giving freed
slots' pages back (backends/shm/arena.py) may cost the data path.

Three streams against a 64 MiB shared pool in /dev/shm, in process (no gRPC, so the arena's part is
not hidden in the RPC's): one tenant's 256 KiB blocks (evicted slots reused at once: nothing should
be given back); two tenants' 256 KiB blocks in turn (eviction moves blocks between their arenas,
the case that gives pages back); one tenant's mixed 1-64 KiB blocks (the coalescing path). Prints
one JSON line: GB/s per stream (median of the repeats) and the bytes given back.
Run it twice, against each version, e.g. with farm-bench --vs (docs: benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

from kvtag_store.backends.base import BlockAddress, BlockKey
from kvtag_store.backends.memory import MemoryBackend

MiB = 1 << 20


def stream(backend: MemoryBackend, namespaces: list[str], sizes: list[int], rounds: int, seed: int) -> float:
    """Puts of batches of 16 blocks, the namespaces in turn; GB/s over the whole stream."""
    rng = random.Random(seed)
    payloads = {size: rng.randbytes(size) for size in set(sizes)}
    moved = 0
    started = time.perf_counter()
    for n in range(rounds):
        ns = namespaces[n % len(namespaces)]
        items: list[tuple[BlockAddress, bytes]] = []
        for i in range(16):
            size = sizes[(n * 16 + i) % len(sizes)]
            key = BlockKey(f"{seed}-{n}-{i}".encode().ljust(32, b"."))
            items.append(((0, key), payloads[size]))
            moved += size
        backend.put_many(ns, "mode", items)
    return moved / (time.perf_counter() - started) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    backend = MemoryBackend(args.capacity_mib * MiB, shm_dir="/dev/shm")
    try:
        backend.assign_tenant("a", "tenant-a")
        backend.assign_tenant("b", "tenant-b")
        progress = backend.prefault_progress
        deadline = time.monotonic() + 60
        while progress()[0] < progress()[1] and time.monotonic() < deadline:
            time.sleep(0.05)
        rng = random.Random(5)
        mixed = [rng.randrange(1024, 64 * 1024) for _ in range(997)]
        streams = {
            "one_tenant_256k": (["a"], [256 << 10]),
            "two_tenants_256k": (["a", "b"], [256 << 10]),
            "mixed_1_64k": (["a"], mixed),
        }
        # Fill first, so every measured put evicts.
        stream(backend, ["a", "b"], [256 << 10], args.capacity_mib // 2, 0)
        result: dict[str, Any] = {}
        for name, (namespaces, sizes) in streams.items():
            rounds = args.rounds * 8 if sizes is mixed else args.rounds
            samples = [
                stream(backend, namespaces, sizes, rounds, seed) for seed in range(1, args.repeats + 1)
            ]
            result[name + "_gbps"] = round(statistics.median(samples), 3)
        arenas = list(getattr(backend, "_arenas", {}).values())
        result["given_back_mib"] = round(sum(getattr(a, "given_back_bytes", 0) for a in arenas) / MiB, 1)
        print(json.dumps(result))
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
