"""The fleet topology measured: 1, 2 and 3 kvtag replicas over one Mooncake cluster against as many raw
Mooncake clients, in one run.

Each replica gets its own load: a separate process with a StoreClient on the shared-memory path, as an
engine on that replica's host calls it (put, then get of the same 1 MiB values). Beside them, in the
same run and interleaved per repeat, as many separate processes each drive a plain
MooncakeDistributedStore with the same values and batches, two ways: put_batch/get_batch (copying
through its local buffer, the raw column of bench_mooncake) and batch_put_from/get_into of registered,
resident memory (zero-copy, the calls kvtag's shared-memory path makes). The loads of one
phase start together (a barrier through each worker's stdin) so aggregate GB/s = all bytes moved /
(last worker's end - first worker's start). Separate processes, because in one process the loads
would share one GIL, which neither engines on separate hosts nor raw clients do.

Also measured: the cross-replica hit path. A client of replica 0 stores 4,096 blocks; a client of
replica 1, which never saw the namespace, makes its first Lookup of them (p50 ms) beside a raw
`batch_is_exist` of the same object keys, then Gets a sample of them and checks the bytes.

Run as part of bench_mooncake.py (the `topology` key of its results), or alone:

    .venv/bin/python benchmarks/bench_mooncake.py --topology-only --out benchmarks/results/mooncake.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mooncake_raw

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

KiB = 1024
MiB = 1024 * KiB
GB = 1e9
LOOKUP_KEYS = 4096
KINDS = ("raw", "raw_zero_copy", "kvtag")


@dataclass(frozen=True)
class Load:
    """One worker's part of a phase."""

    # "kvtag" (StoreClient over a replica), "raw" (MooncakeDistributedStore's put_batch/get_batch,
    # which copy through its local buffer) or "raw_zero_copy" (its batch_put_from/get_into of
    # registered memory, what kvtag's shared-memory path calls).
    kind: str
    target: str  # replica gRPC address, or the cluster's master address
    metrics: str
    value_bytes: int
    blocks: int
    batch: int
    seed: int


# --- the worker process ------------------------------------------------------------------------


def _values(load: Load) -> list[bytes]:
    """Eight distinct payloads per worker, recognisable by the worker's seed (a wrong byte shows)."""
    return [bytes([(load.seed * 8 + i) % 251]) * 64 + os.urandom(load.value_bytes - 64) for i in range(8)]


def worker(load: Load) -> None:
    """Set up, say READY, wait for GO; put everything, say PUT, wait for GO; get everything, verify,
    print one JSON line with the phase timestamps (CLOCK_MONOTONIC is system-wide)."""
    values = _values(load)
    tag = f"{load.seed}-{os.urandom(4).hex()}"
    keys = [f"topo-{tag}-{i:06d}".encode() for i in range(load.blocks)]
    batches = [list(range(i, min(i + load.batch, load.blocks))) for i in range(0, load.blocks, load.batch)]
    got: list[Any] = [None] * load.blocks
    if load.kind == "kvtag":
        from kvtag.v1 import store_pb2 as pb
        from kvtag_client import keys as client_keys
        from kvtag_client.store import StoreClient
        from kvtag_proto import ids
        from kvtag_store.backends.mooncake.format import object_key

        from tests.descriptors import namespace

        desc = namespace(f"topology-{tag}")
        client = StoreClient(
            load.target,
            engine_id=f"topology-{load.seed}",
            namespace=desc,
            mode=client_keys.mode(16, 0),
            probe_keys=client_keys.probe_keys(16, 0),
            rpc_timeout_s=60.0,
            data_path="auto",
        )
        assert client.open(), "the StoreClient could not open a session"
        assert client.data_path == "shared_memory", f"data path {client.data_path}, not shared_memory"

        def put(b: list[int]) -> None:
            statuses = client.put([(0, keys[i], values[i % 8], b"") for i in b])
            assert statuses == [pb.STORED] * len(b), statuses

        def get(b: list[int]) -> None:
            for i, v in zip(b, client.get([(0, keys[i]) for i in b]), strict=True):
                got[i] = v

        # What the parent removes once the read leases lapse (the blocks stay in the cluster).
        stored: list[str] = [object_key(ids.namespace_id(desc), client.mode_id, 0, k) for k in keys]
        close = client.close
    else:
        from kvtag_store.backends.mooncake.client import MooncakeSettings, connect

        raw = connect(
            MooncakeSettings(master=load.target, metrics=load.metrics, local_buffer_bytes=128 * MiB)
        )
        raw_keys = [f"raw/{k.decode()}" for k in keys]
        stored = []

        size = load.value_bytes
        if load.kind == "raw":  # Mooncake's copying calls, as bench_mooncake's raw column

            def put(b: list[int]) -> None:
                rc = raw.put_batch([raw_keys[i] for i in b], [values[i % 8] for i in b])
                assert rc == 0, rc

            def get(b: list[int]) -> None:
                for i, v in zip(b, raw.get_batch([raw_keys[i] for i in b]), strict=True):
                    got[i] = v

        else:  # "raw_zero_copy": from and into registered memory, as kvtag's shared-memory path does
            source, target = mmap.mmap(-1, load.blocks * size), mmap.mmap(-1, load.blocks * size)
            bases = []
            for area in (source, target):
                base = ctypes.addressof(ctypes.c_char.from_buffer(area))
                mooncake_raw.register(raw, base, load.blocks * size)
                bases.append(base)
            zeros = bytes(size)
            for i in range(load.blocks):  # both resident before the clock starts, like an engine's KV cache
                source[i * size : (i + 1) * size] = values[i % 8]
                target[i * size : (i + 1) * size] = zeros

            def put(b: list[int]) -> None:
                codes = raw.batch_put_from_multi_buffers(
                    [raw_keys[i] for i in b], [[bases[0] + i * size] for i in b], [[size] for _ in b]
                )
                assert all(c == 0 for c in codes), codes

            def get(b: list[int]) -> None:
                codes = raw.batch_get_into_multi_buffers(
                    [raw_keys[i] for i in b], [[bases[1] + i * size] for i in b], [[size] for _ in b]
                )
                for i, code in zip(b, codes, strict=True):
                    got[i] = memoryview(target)[i * size : (i + 1) * size] if code == size else None

        def close() -> None:
            raw.batch_remove(raw_keys, True)
            raw.close()

    print("READY", flush=True)
    sys.stdin.readline()
    put_start = time.monotonic()
    for b in batches:
        put(b)
    put_end = time.monotonic()
    print("PUT", flush=True)
    sys.stdin.readline()
    get_start = time.monotonic()
    for b in batches:
        get(b)
    get_end = time.monotonic()
    wrong = sum(1 for i, v in enumerate(got) if v is None or bytes(v) != values[i % 8])
    print(
        json.dumps(
            {
                "put": [put_start, put_end],
                "get": [get_start, get_end],
                "wrong_or_missing": wrong,
                "stored": stored,
            }
        ),
        flush=True,
    )
    close()


# --- the parent ----------------------------------------------------------------------------------


def _phase(loads: list[Load], workdir: Path) -> dict[str, Any]:
    """Run one worker process per load, together; aggregate figures of the phase."""
    env = dict(os.environ)
    env.setdefault("GLOG_minloglevel", "2")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", json.dumps(load.__dict__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=(workdir / f"worker-{load.kind}-{load.seed}.log").open("ab"),
            text=True,
            env=env,
        )
        for load in loads
    ]
    try:
        for step in ("READY", "PUT"):
            for p, load in zip(procs, loads, strict=True):
                line = p.stdout.readline().strip() if p.stdout else ""
                if line != step:
                    log = workdir / f"worker-{load.kind}-{load.seed}.log"
                    tail = log.read_text(errors="replace")[-1500:]
                    raise RuntimeError(
                        f"a {load.kind} worker said {line!r}, not {step} (rc {p.poll()}):\n{tail}"
                    )
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("GO\n")
                p.stdin.flush()
        reports = []
        for p in procs:
            assert p.stdout is not None
            reports.append(json.loads(p.stdout.readline()))
            p.wait(60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    total = sum(load.blocks * load.value_bytes for load in loads)
    out: dict[str, Any] = {
        "bytes": total,
        "wrong_or_missing": sum(r["wrong_or_missing"] for r in reports),
        "stored": [k for r in reports for k in r["stored"]],
    }
    for op in ("put", "get"):
        span = max(r[op][1] for r in reports) - min(r[op][0] for r in reports)
        out[f"{op}_seconds"] = span
        out[f"{op}_gbps"] = total / span / GB
        out[f"{op}_per_worker_seconds"] = [r[op][1] - r[op][0] for r in reports]
    return out


def _cross_replica_lookup(replicas: list[Any], raw: Any, repeats: int) -> dict[str, Any]:
    """Replica 1's first Lookup of 4,096 blocks a client of replica 0 stored, beside raw batch_is_exist."""
    from kvtag.v1 import store_pb2 as pb
    from kvtag_client import keys as client_keys
    from kvtag_client.store import PackedKeys, StoreClient
    from kvtag_proto import ids
    from kvtag_store.backends.mooncake.format import object_key

    from tests.descriptors import namespace

    value = os.urandom(4 * KiB)
    samples: dict[str, list[float]] = {"first_lookup_other_replica": [], "raw_batch_is_exist": []}
    wrong = 0
    for _ in range(repeats):
        desc = namespace("topology-xr-" + os.urandom(4).hex())
        clients = [
            StoreClient(
                f"127.0.0.1:{r.port}",
                engine_id=f"xr-{n}",
                namespace=desc,
                mode=client_keys.mode(16, 0),
                probe_keys=client_keys.probe_keys(16, 0),
                rpc_timeout_s=60.0,
            )
            for n, r in enumerate(replicas[:2])
        ]
        try:
            for c in clients:
                assert c.open(), "a cross-replica client could not open"
            writer, reader = clients
            keys = [f"xr-{i:08d}".encode().ljust(32, b".") for i in range(LOOKUP_KEYS)]
            for start in range(0, LOOKUP_KEYS, 512):
                chunk = keys[start : start + 512]
                statuses = writer.put([(0, k, value, b"") for k in chunk])
                assert statuses == [pb.STORED] * len(chunk), statuses
            started = time.perf_counter()
            result = reader.lookup_packed([PackedKeys(0, b"".join(keys), 32)], lease_ms=1000)
            samples["first_lookup_other_replica"].append(time.perf_counter() - started)
            assert result.prefix_length == LOOKUP_KEYS, result.prefix_length
            reader.release(result.leases)
            got = reader.get([(0, k) for k in keys[:64]])
            wrong += sum(1 for v in got if v is None or bytes(v) != value)
            mkeys = [object_key(ids.namespace_id(desc), reader.mode_id, 0, k) for k in keys]
            started = time.perf_counter()
            raw.batch_is_exist(mkeys)
            samples["raw_batch_is_exist"].append(time.perf_counter() - started)
            time.sleep(1.1)  # the read leases lapse, so the blocks can go
            raw.batch_remove(mkeys, True)
        finally:
            for c in clients:
                c.close()
    p50 = {k: statistics.median(v) * 1000 for k, v in samples.items()}
    return {
        "keys": LOOKUP_KEYS,
        "p50_ms": p50,
        "samples_ms": {k: [x * 1000 for x in v] for k, v in samples.items()},
        "ratio_to_raw": p50["first_lookup_other_replica"] / p50["raw_batch_is_exist"],
        "get_wrong_or_missing_of_64": wrong,
    }


def run_topology(workdir: Path, quick: bool = False) -> dict[str, Any]:
    """One cluster (a master, three storage nodes: one per "host"), three replicas; 1..3 of each load."""
    from kvtag_store.backends.mooncake.client import MooncakeSettings, connect

    from tests.mooncake.mooncake_cluster import MooncakeCluster
    from tests.mooncake.mooncake_replicas import Replica

    value_bytes = 1 * MiB
    per_worker = (32 if quick else 64) * MiB
    repeats = 2 if quick else 5  # the phases are short and the machine shared: a median of 5
    blocks = per_worker // value_bytes
    batch = 8
    cluster = MooncakeCluster(workdir, lease_ttl_ms=1000)
    replicas: list[Any] = []
    raw: Any = None
    loadavg: list[tuple[float, float, float]] = [os.getloadavg()]
    phases: dict[str, dict[str, list[dict[str, Any]]]] = {}
    retried: list[str] = []
    started = time.monotonic()
    try:
        cluster.start_master()
        for _ in range(3):
            cluster.start_storage(512 * MiB)
        for n in range(3):
            replica = Replica(cluster, workdir, f"topology-replica{n}", ["--mooncake-local-buffer=128MB"])
            replica.start()
            replicas.append(replica)
        raw = connect(
            MooncakeSettings(
                master=cluster.master_address, metrics=cluster.metrics_address, lease_ttl_ms=1000
            )
        )
        for repeat in range(repeats):
            for n in (1, 2, 3):
                for kind in KINDS if repeat % 2 == 0 else KINDS[::-1]:
                    loads = [
                        Load(
                            kind,
                            f"127.0.0.1:{replicas[i].port}" if kind == "kvtag" else cluster.master_address,
                            cluster.metrics_address,
                            value_bytes,
                            blocks,
                            batch,
                            seed=repeat * 10 + i,
                        )
                        for i in range(n)
                    ]
                    try:
                        result = _phase(loads, workdir)
                    except RuntimeError as exc:  # a worker that failed to start (logged, counted)
                        print(f"retrying the {kind} x{n} phase once: {exc}", file=sys.stderr)
                        retried.append(f"{kind} x{n}: {str(exc)[:300]}")
                        result = _phase(loads, workdir)
                    assert result["wrong_or_missing"] == 0, f"{kind} x{n}: {result['wrong_or_missing']} bad"
                    stored = result.pop("stored")
                    phases.setdefault(str(n), {}).setdefault(kind, []).append(result)
                    if stored:  # kvtag's blocks hold 1 s read leases: free the room once they lapse
                        time.sleep(1.1)
                        raw.batch_remove(stored, True)
            loadavg.append(os.getloadavg())
        lookup = _cross_replica_lookup(replicas, raw, repeats)
        loadavg.append(os.getloadavg())
    finally:
        for replica in replicas:
            replica.stop()
        if raw is not None:
            raw.close()
        cluster.stop()
    summary: dict[str, Any] = {}
    for label, kinds in phases.items():
        row: dict[str, Any] = {}
        for op in ("put", "get"):
            for kind in KINDS:
                row[f"{kind}_{op}_gbps"] = statistics.median(r[f"{op}_gbps"] for r in kinds[kind])
            row[f"ratio_{op}"] = row[f"kvtag_{op}_gbps"] / row[f"raw_{op}_gbps"]
            row[f"ratio_zero_copy_{op}"] = row[f"kvtag_{op}_gbps"] / row[f"raw_zero_copy_{op}_gbps"]
        summary[label] = row
    return {
        "value_bytes": value_bytes,
        "bytes_per_worker": per_worker,
        "batch": batch,
        "repeats": repeats,
        "storage_nodes": 3,
        "aggregate": summary,
        "phases": phases,
        "cross_replica_lookup": lookup,
        "retried_phases": retried,
        "loadavg": loadavg,
        "seconds": time.monotonic() - started,
    }


def table(topology: dict[str, Any]) -> str:
    size, volume = topology["value_bytes"] // MiB, topology["bytes_per_worker"] // MiB
    head = ("loads", "raw", "raw 0-copy", "kvtag", "kvtag/raw", "kvtag/0cp")
    lines = [
        f"Fleet topology: {size} MiB values, {volume} MiB per load, median of {topology['repeats']}; "
        "aggregate GB/s (kvtag = StoreClient, shared memory; raw = put_batch/get_batch, "
        "0-copy = batch_put_from/get_into registered memory)",
        "      " + " ".join(f"{h:>10}" for h in head),
    ]
    for n, row in topology["aggregate"].items():
        for op in ("put", "get"):
            keys = (f"raw_{op}_gbps", f"raw_zero_copy_{op}_gbps", f"kvtag_{op}_gbps")
            figures = [row[k] for k in keys] + [row[f"ratio_{op}"], row[f"ratio_zero_copy_{op}"]]
            lines.append(f"{op:>5} {n:>10} " + " ".join(f"{x:10.2f}" for x in figures))
    xr = topology["cross_replica_lookup"]
    p50 = xr["p50_ms"]
    lines.append(
        f"Cross-replica first Lookup of {xr['keys']} blocks: {p50['first_lookup_other_replica']:.1f} ms "
        f"p50 vs raw batch_is_exist {p50['raw_batch_is_exist']:.1f} ms ({xr['ratio_to_raw']:.2f}x); "
        f"wrong or missing bytes of 64 read back: {xr['get_wrong_or_missing_of_64']}"
    )
    lines.append(f"load average: {topology['loadavg']}; {topology['seconds']:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True, help="a Load as JSON (internal: run by run_topology)")
    worker(Load(**json.loads(parser.parse_args().worker)))
