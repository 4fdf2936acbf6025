"""kvtag over Mooncake beside a raw Mooncake client doing the same puts and gets, in one run.

Four columns per value size, interleaved per repeat so machine noise hits them alike:

- raw:      a plain MooncakeDistributedStore, put_batch / get_batch of the same values, and
            batch_get_into a buffer registered once (how vLLM's MooncakeStoreConnector loads: straight
            into registered KV cache);
- backend:  kvtag's MooncakeBackend in process (headers, checksums, put read-back, existence check),
            batched as the service calls it (put_many) and item by item (put) for comparison;
- service:  a real `kvtag-store serve --backend mooncake` subprocess through the generated gRPC stubs,
            and the same service over its memory backend (gRPC + service layer without Mooncake);
- parts:    where the backend's extra time goes, each part timed alone on the same blocks
            (CRC-32 of the values, a header read of each block, which puts no longer do but a
            read-back would cost, and the existence check of a get);
- client:   kvtag_client's StoreClient (what the connector calls: put, get) against the same
            service over Mooncake, on the shared-memory path (values staged in arena slots Mooncake
            reads into and writes from) and on the inline path, and over the memory backend's
            shared-memory path for comparison; and StoreClient.get_into on the shared-memory path, each
            value copied once into a buffer allocated once (how the connector's worker loads into the
            KV cache), against raw batch_get_into;
- lookup:   an ordered 4,096-key StoreClient.lookup_packed (what the connector's scheduler side
            calls) against the service over Mooncake: of blocks the service stored itself, of
            blocks another replica stored (its first Lookup of them), and of absent blocks; beside
            raw Mooncake's batch_is_exist of the same keys (the mode is in the object key, so all
            three are existence checks).

Overhead ratio = kvtag time / raw time for the same bytes (>1 means kvtag is slower), of the medians
over repeats; the StoreClient rows also give the paired ratio, the median of each repeat's own
ratio (the figure to hold against a target on a noisy machine). The results
record the load average before and after each repeat: other work on the machine moves the times. Every
Mooncake process must live in a private network namespace; when run outside one, the script re-runs itself
under `unshare -n` (root) with loopback up.

- topology: 1, 2 and 3 replicas over one cluster, each with its own StoreClient load, against as many
            raw Mooncake clients, and a replica's first Lookup of another's blocks (mooncake_topology.py).

    .venv/bin/python benchmarks/bench_mooncake.py [--quick] [--no-topology | --topology-only]
        [--out benchmarks/results/mooncake.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mooncake_raw
from provenance import git_describe

if TYPE_CHECKING:
    from kvtag_store.backends.mooncake.backend import MooncakeSettings

    from tests.mooncake.mooncake_cluster import MooncakeCluster

REPO = Path(__file__).resolve().parents[1]
# The cluster and replica helpers of the Mooncake tests (the `tests.mooncake` package).
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

KiB = 1024
MiB = 1024 * KiB
GB = 1e9
MODE = "m-0123456789abcdef"


def start_cluster(workdir: Path) -> tuple[MooncakeCluster, MooncakeSettings]:
    """The bench's cluster (one master, one 1 GiB storage node, 1 s leases) and the client settings
    of every raw client and backend over it (128 MiB local buffer)."""
    from kvtag_store.backends.mooncake.backend import MooncakeSettings

    from tests.mooncake.mooncake_cluster import MooncakeCluster

    cluster = MooncakeCluster(workdir, lease_ttl_ms=1000)
    cluster.start_master()
    cluster.start_storage(1024 * MiB)
    settings = MooncakeSettings(
        master=cluster.master_address,
        metrics=cluster.metrics_address,
        local_buffer_bytes=128 * MiB,
        lease_ttl_ms=1000,
    )
    return cluster, settings


def reexec_in_private_netns() -> None:
    """Mooncake's transfer engine listens on all interfaces: run where only loopback exists."""
    from tests.mooncake.mooncake_cluster import in_private_netns

    if in_private_netns():
        return
    if os.environ.get("KVTAG_BENCH_NETNS") == "1":
        raise SystemExit("still not in a private network namespace after unshare -n")
    env = dict(os.environ, KVTAG_BENCH_NETNS="1")
    script = 'ip link set lo up && exec "$0" "$@"'
    raise SystemExit(
        subprocess.call(["unshare", "-n", "--", "bash", "-c", script, sys.executable, *sys.argv], env=env)
    )


@dataclass
class Rig:
    """Everything one run talks to."""

    raw: Any
    backend: Any
    kvtag: Any
    memory: Any
    kvtag_session: str
    memory_session: str
    service_ns: str
    service_mode: str
    # StoreClients: (client, namespace id) per path.
    clients: dict[str, tuple[Any, str]]
    # Address of one batch's bytes, registered with the raw client: raw batch_get_into's destination.
    landing: int


ROWS = (
    "raw_put",
    "raw_get",
    "raw_get_into",
    "backend_put",
    "backend_put_many",
    "backend_get",
    "service_put",
    "service_get",
    "memory_service_put",
    "memory_service_get",
    "crc32",
    "put_readback",
    "get_exist_check",
    "client_shm_put",
    "client_shm_get",
    "client_inline_put",
    "client_inline_get",
    "memory_client_shm_put",
    "memory_client_shm_get",
    "client_shm_get_into",
)
CLIENT_PATHS = ("client_shm", "client_inline", "memory_client_shm")


def shape(size: int, volume: int) -> tuple[int, int]:
    """(values, values per Get or put) for one value size: the volume in batches of ~8 MiB."""
    count = max(volume // size, 4)
    return count, max(1, min(count, (8 * MiB) // size))


def measure_once(rig: Rig, values: list[bytes], count: int, batch: int) -> dict[str, float]:
    """One repeat for one value size: every column on fresh keys, seconds per column."""
    from kvtag.v1 import store_pb2 as pb
    from kvtag_store.backends.base import BlockKey, PutOutcome
    from kvtag_store.backends.mooncake.format import object_key

    tag = os.urandom(4).hex()
    keys = [f"{tag}-{i}".encode() for i in range(count)]
    batches = [list(range(i, min(i + batch, count))) for i in range(0, count, batch)]
    value = [values[i % len(values)] for i in range(count)]
    raw_keys = [f"raw/{k.decode()}" for k in keys]
    ns, ns_many = f"ns-bench-{tag}", f"ns-bench-many-{tag}"
    mkeys = [object_key(ns, MODE, 0, k) for k in keys]
    skeys = [b"svc-" + k for k in keys]
    out = dict.fromkeys(ROWS, 0.0)

    def clock(row: str, call: Callable[..., object], *args: Any) -> None:
        started = time.perf_counter()
        call(*args)
        out[row] += time.perf_counter() - started

    def raw_put(b: list[int]) -> None:
        rig.raw.put_batch([raw_keys[i] for i in b], [value[i] for i in b])

    def raw_get(b: list[int]) -> None:
        rig.raw.get_batch([raw_keys[i] for i in b])

    size = len(value[0])

    def raw_get_into(b: list[int]) -> None:
        mooncake_raw.get_into(rig.raw, [raw_keys[i] for i in b], rig.landing, size)

    def backend_get(b: list[int]) -> None:
        rig.backend.get(ns, MODE, [(0, BlockKey(keys[i])) for i in b])

    def exist_check(b: list[int]) -> None:
        rig.raw.batch_is_exist([mkeys[i] for i in b])

    def backend_put(b: list[int]) -> None:
        for i in b:
            outcome = rig.backend.put(ns, MODE, (0, BlockKey(keys[i])), value[i]).outcome
            assert outcome is PutOutcome.STORED, outcome

    def backend_put_many(b: list[int]) -> None:
        outcomes = rig.backend.put_many(ns_many, MODE, [((0, BlockKey(keys[i])), value[i]) for i in b])
        assert all(r.outcome is PutOutcome.STORED for r in outcomes), outcomes

    def service_put(server: Any, session: str, b: list[int]) -> None:
        items = [pb.PutItem(block=pb.BlockRef(key=skeys[i]), value=value[i]) for i in b]
        response = server.stub.Put(pb.PutRequest(session_id=session, items=items), timeout=60)
        assert all(r.status == pb.STORED for r in response.results), response

    def service_get(server: Any, session: str, b: list[int]) -> None:
        blocks = [pb.BlockRef(key=skeys[i]) for i in b]
        response = server.stub.Get(pb.GetRequest(session_id=session, blocks=blocks), timeout=60)
        assert all(r.status == pb.HIT for r in response.results)

    for row, call in (
        ("raw_put", raw_put),
        ("raw_get", raw_get),
        ("raw_get_into", raw_get_into),
        ("backend_put", backend_put),
        ("backend_put_many", backend_put_many),
        ("backend_get", backend_get),
        ("get_exist_check", exist_check),
    ):
        for b in batches:
            clock(row, call, b)
    # The parts of the backend's extra work, each alone on the blocks just stored.
    for i in range(count):
        clock("crc32", zlib.crc32, value[i])
        clock("put_readback", rig.backend._cluster.headers.read, [mkeys[i]])
    for row, server, session in (
        ("service", rig.kvtag, rig.kvtag_session),
        ("memory_service", rig.memory, rig.memory_session),
    ):
        for b in batches:
            clock(row + "_put", service_put, server, session, b)
        for b in batches:
            clock(row + "_get", service_get, server, session, b)
    ckeys = [b"cli-" + k for k in keys]

    def client_put(client: Any, b: list[int]) -> None:
        statuses = client.put([(0, ckeys[i], value[i], b"") for i in b])
        assert statuses == [pb.STORED] * len(b), statuses

    def client_get(client: Any, b: list[int]) -> None:
        got = client.get([(0, ckeys[i]) for i in b])
        assert all(v is not None and len(v) == len(value[i]) for i, v in zip(b, got, strict=True))

    destination = memoryview(bytearray(batch * size))

    def client_get_into(client: Any, b: list[int]) -> None:
        def sink(n: int, source: memoryview) -> bool:
            if len(source) != size:
                return False
            destination[n * size : (n + 1) * size] = source
            return True

        served = client.get_into([(0, ckeys[i]) for i in b], (), sink)
        assert all(served), served

    for row in CLIENT_PATHS:
        client, _ = rig.clients[row]
        for b in batches:
            clock(row + "_put", client_put, client, b)
        for b in batches:
            clock(row + "_get", client_get, client, b)
        if row == "client_shm":  # right after its get, on the same blocks: the two compare
            for b in batches:
                clock("client_shm_get_into", client_get_into, client, b)
    # Free the room for the next repeat once the reads' leases (1 s here) lapse.
    time.sleep(1.1)
    stored = raw_keys + mkeys + [object_key(ns_many, MODE, 0, k) for k in keys]
    stored += [object_key(rig.service_ns, rig.service_mode, 0, k) for k in skeys]
    stored += [object_key(ns_id, c.mode_id, 0, k) for c, ns_id in rig.clients.values() for k in ckeys]
    rig.raw.batch_remove(stored, True)
    return out


LOOKUP_KEYS = 4096
LOOKUP_ROWS = ("lookup_seen", "lookup_unseen_first", "lookup_absent", "raw_batch_is_exist")


def measure_lookups(rig: Rig, repeats: int) -> dict[str, Any]:
    """p50 ms of 4,096-key packed Lookups through the client over Mooncake, per LOOKUP_ROWS."""
    from kvtag.v1 import store_pb2 as pb
    from kvtag_client.store import PackedKeys
    from kvtag_store.backends.base import BlockKey, PutOutcome
    from kvtag_store.backends.mooncake.format import object_key

    client, ns_id = rig.clients["client_shm"]
    value = os.urandom(4 * KiB)
    samples: dict[str, list[float]] = {row: [] for row in LOOKUP_ROWS}
    for _ in range(repeats):
        tag = os.urandom(4).hex()
        ours = [f"{tag}-ours-{i:08d}".encode().ljust(32, b".") for i in range(LOOKUP_KEYS)]
        theirs = [f"{tag}-theirs-{i:06d}".encode().ljust(32, b".") for i in range(LOOKUP_KEYS)]
        absent = [f"{tag}-absent-{i:06d}".encode().ljust(32, b".") for i in range(LOOKUP_KEYS)]
        for start in range(0, LOOKUP_KEYS, 512):
            statuses = client.put([(0, k, value, b"") for k in ours[start : start + 512]])
            assert statuses == [pb.STORED] * len(statuses), statuses
            outcomes = rig.backend.put_many(
                ns_id, client.mode_id, [((0, BlockKey(k)), value) for k in theirs[start : start + 512]]
            )
            assert all(r.outcome is PutOutcome.STORED for r in outcomes), outcomes
        for row, keys in (("lookup_seen", ours), ("lookup_unseen_first", theirs), ("lookup_absent", absent)):
            started = time.perf_counter()
            result = client.lookup_packed([PackedKeys(0, b"".join(keys), 32)], lease_ms=1000)
            samples[row].append(time.perf_counter() - started)
            assert result.prefix_length == (0 if row == "lookup_absent" else LOOKUP_KEYS), (row, result)
            client.release(result.leases)
        mkeys = [object_key(ns_id, client.mode_id, 0, k) for k in ours]
        started = time.perf_counter()
        rig.raw.batch_is_exist(mkeys)
        samples["raw_batch_is_exist"].append(time.perf_counter() - started)
        time.sleep(1.1)  # the leases lapse, so the blocks can go
        stored = mkeys + [object_key(ns_id, client.mode_id, 0, k) for k in theirs]
        rig.raw.batch_remove(stored, True)
    return {
        "keys": LOOKUP_KEYS,
        "p50_ms": {row: statistics.median(v) * 1000 for row, v in samples.items()},
        "samples_ms": {row: [x * 1000 for x in v] for row, v in samples.items()},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvtag_client import keys as client_keys
    from kvtag_client.store import StoreClient
    from kvtag_proto import ids
    from kvtag_store.backends.mooncake.backend import MooncakeBackend, connect

    from tests.descriptors import mode, namespace
    from tests.mooncake.mooncake_replicas import Replica

    sizes = [64 * KiB, 1 * MiB] if args.quick else [64 * KiB, 1 * MiB, 4 * MiB]
    repeats = 2 if args.quick else 5  # the raw column moves between repeats on a shared machine
    volume = (16 if args.quick else 32) * MiB
    workdir = Path(tempfile.mkdtemp(prefix="bench-mooncake-"))
    cluster, settings = start_cluster(workdir)
    raw = connect(settings)
    backend = MooncakeBackend(connect(settings), settings)
    kvtag = Replica(cluster, workdir, "replica", ["--mooncake-local-buffer=128MB"])
    # The same service over its memory backend: what gRPC and the service layer cost without Mooncake.
    memory = Replica(cluster, workdir, "memory", ["--backend=memory", "--capacity=2GiB"])
    results: dict[str, Any] = {"sizes": {}}
    loadavg: list[tuple[float, float, float]] = [os.getloadavg()]
    clients: dict[str, tuple[Any, str]] = {}
    # Raw batch_get_into's destination: the largest Get's bytes, registered once, as a KV cache is.
    landing = mooncake_raw.landing(raw, max(size * shape(size, volume)[1] for size in sizes))
    try:
        kvtag.start()
        memory.start()
        for row, replica, data_path in (
            ("client_shm", kvtag, "auto"),
            ("client_inline", kvtag, "inline"),
            ("memory_client_shm", memory, "auto"),
        ):
            client_ns = namespace(f"bench-{row}-" + os.urandom(4).hex())
            client = StoreClient(
                f"127.0.0.1:{replica.port}",
                engine_id=f"bench-{row}",
                namespace=client_ns,
                mode=client_keys.mode(16, 0),
                probe_keys=client_keys.probe_keys(16, 0),
                rpc_timeout_s=60.0,
                data_path=data_path,
            )
            clients[row] = (client, ids.namespace_id(client_ns))
            assert client.open(), f"{row}: the client could not open a session"
            expected = "inline" if data_path == "inline" else "shared_memory"
            assert client.data_path == expected, f"{row}: data path {client.data_path}, not {expected}"
        ns_desc = namespace("bench-" + os.urandom(4).hex())
        rig = Rig(
            raw,
            backend,
            kvtag,
            memory,
            kvtag.open(ns_desc, mode(), "bench").session_id,
            memory.open(ns_desc, mode(), "bench").session_id,
            ids.namespace_id(ns_desc),
            ids.mode_id(mode()),
            clients,
            landing.base,
        )
        for size in sizes:
            count, batch = shape(size, volume)
            values = [os.urandom(size) for _ in range(min(count, 8))]
            rows: dict[str, list[float]] = {k: [] for k in ROWS}
            for _ in range(repeats):
                for row, seconds in measure_once(rig, values, count, batch).items():
                    rows[row].append(seconds)
                loadavg.append(os.getloadavg())
            median = {k: statistics.median(v) for k, v in rows.items()}
            total = count * size
            results["sizes"][str(size)] = {
                "blocks": count,
                "batch": batch,
                "bytes": total,
                "seconds_median": median,
                "seconds_all": rows,
                "gbps": {k: total / v / GB for k, v in median.items() if k.endswith(("_put", "_get")) and v},
                "overhead_ratio": {
                    "backend_put": median["backend_put"] / median["raw_put"],
                    "backend_put_many": median["backend_put_many"] / median["raw_put"],
                    "backend_get": median["backend_get"] / median["raw_get"],
                    "service_put": median["service_put"] / median["raw_put"],
                    "service_get": median["service_get"] / median["raw_get"],
                    "memory_service_put": median["memory_service_put"] / median["raw_put"],
                    "memory_service_get": median["memory_service_get"] / median["raw_get"],
                    **{
                        f"{path}_{op}": median[f"{path}_{op}"] / median[f"raw_{op}"]
                        for path in CLIENT_PATHS
                        for op in ("put", "get")
                    },
                    "client_shm_get_into": median["client_shm_get_into"] / median["raw_get_into"],
                },
                # Each repeat's kvtag time over the raw time of the same repeat, the median of those:
                # noise that moves one repeat moves both columns, so this holds where the ratio of
                # medians above can pair a quiet raw repeat with a busy kvtag one.
                "paired_ratio": {
                    f"{path}_{op}": statistics.median(
                        k / r for k, r in zip(rows[f"{path}_{op}"], rows[f"raw_{op}"], strict=True)
                    )
                    for path in CLIENT_PATHS
                    for op in ("put", "get")
                }
                | {
                    "client_shm_get_into": statistics.median(
                        k / r for k, r in zip(rows["client_shm_get_into"], rows["raw_get_into"], strict=True)
                    )
                },
            }
        results["lookup"] = measure_lookups(rig, repeats)
    finally:
        for client, _ in clients.values():
            client.close()
        memory.stop()
        kvtag.stop()
        backend.close()
        raw.unregister_buffer(landing.base)
        raw.close()
        cluster.stop()
    results["machine"] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kvtag_commit": git_describe(),
        "loadavg_per_repeat": loadavg,
    }
    results["repeats"] = repeats
    return results


def table(results: dict[str, Any]) -> str:
    head = f"{'value':>8} {'op':>4} {'raw ms':>8} {'backend':>8} {'service':>8} {'svc/mem':>8}"
    lines = [head + "   ratio to raw: backend  service  svc/mem   where the backend's extra time goes (ms)"]
    for size, row in results["sizes"].items():
        med = {k: v * 1000 for k, v in row["seconds_median"].items()}
        ratio = row["overhead_ratio"]
        label = f"{int(size) // KiB}KiB" if int(size) < MiB else f"{int(size) // MiB}MiB"
        for op, backend, parts in (
            ("put", "backend_put", f"crc32 {med['crc32']:.1f}, a header read each {med['put_readback']:.1f}"),
            ("putN", "backend_put_many", "put_many: existence checks + one put_batch per chunk"),
            ("get", "backend_get", f"crc32 {med['crc32']:.1f}, existence check {med['get_exist_check']:.1f}"),
        ):
            kind = "get" if op == "get" else "put"
            service = f"{med['service_' + kind]:8.1f}" if op != "putN" else f"{'':>8}"
            memory = f"{med['memory_service_' + kind]:8.1f}" if op != "putN" else f"{'':>8}"
            if op == "putN":
                ratios = f"{ratio[backend]:8.2f} {'':>8} {'':>8}"
            else:
                ratios = f"{ratio[backend]:8.2f} {ratio['service_' + kind]:8.2f} "
                ratios += f"{ratio['memory_service_' + kind]:8.2f}"
            lines.append(
                f"{label:>8} {op:>4} {med['raw_' + kind]:8.1f} {med[backend]:8.1f} {service} {memory}"
                f"                 {ratios}   {parts}"
            )
    lines.append("")
    lines.append(
        f"{'value':>8} {'op':>4} {'raw ms':>8} {'shm':>8} {'inline':>8} {'mem shm':>8}"
        "   StoreClient; ratio to raw: shm  inline  mem shm   GB/s: shm  inline   paired: shm"
    )
    for size, row in results["sizes"].items():
        med = {k: v * 1000 for k, v in row["seconds_median"].items()}
        ratio = row["overhead_ratio"]
        gbps = row["gbps"]
        label = f"{int(size) // KiB}KiB" if int(size) < MiB else f"{int(size) // MiB}MiB"
        for op in ("put", "get"):
            times = " ".join(f"{med[f'{path}_{op}']:8.1f}" for path in CLIENT_PATHS)
            ratios = " ".join(f"{ratio[f'{path}_{op}']:6.2f}" for path in CLIENT_PATHS)
            rates = f"{gbps[f'client_shm_{op}']:6.2f} {gbps[f'client_inline_{op}']:6.2f}"
            paired = row.get("paired_ratio", {}).get(f"client_shm_{op}", float("nan"))
            lines.append(
                f"{label:>8} {op:>4} {med['raw_' + op]:8.1f} {times}   {' ' * 24}{ratios}   {rates}"
                f"   {paired:11.2f}"
            )
        if "client_shm_get_into" in med:
            lines.append(
                f"{label:>8} {'into':>4} {med['raw_get_into']:8.1f} {med['client_shm_get_into']:8.1f}"
                f"   get_into vs raw batch_get_into{' ' * 24}{ratio['client_shm_get_into']:6.2f}"
                f"{' ' * 45}{row['paired_ratio']['client_shm_get_into']:6.2f}"
            )
    if "lookup" in results:
        p50 = results["lookup"]["p50_ms"]
        lines.append("")
        lines.append(
            f"Lookup of {results['lookup']['keys']} keys through StoreClient, p50 ms: "
            + ", ".join(f"{row} {p50[row]:.1f}" for row in LOOKUP_ROWS)
            + f"; seen / raw batch_is_exist {p50['lookup_seen'] / p50['raw_batch_is_exist']:.2f}x"
            + ", another replica's (first) / raw "
            + f"{p50['lookup_unseen_first'] / p50['raw_batch_is_exist']:.2f}x"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer sizes, less volume, two repeats")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON results here")
    parser.add_argument("--no-topology", action="store_true", help="skip the fleet topology part")
    parser.add_argument(
        "--topology-only",
        action="store_true",
        help="only the fleet topology part (mooncake_topology.py), merged into an existing --out file",
    )
    args = parser.parse_args()
    reexec_in_private_netns()
    os.environ.setdefault("GLOG_minloglevel", "2")
    from mooncake_topology import run_topology
    from mooncake_topology import table as topology_table

    if args.topology_only:
        results = json.loads(args.out.read_text()) if args.out and args.out.exists() else {}
    else:
        results = run(args)
        print(table(results))
        print(f"load average per repeat: {results['machine']['loadavg_per_repeat']}")
    if not args.no_topology:
        results["topology"] = run_topology(Path(tempfile.mkdtemp(prefix="bench-topology-")), quick=args.quick)
        results["topology"]["kvtag_commit"] = git_describe()
        print(topology_table(results["topology"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
