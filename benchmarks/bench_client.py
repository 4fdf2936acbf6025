"""What an engine gets from kvtag, beside the bounds that limit it, all in one run.

The headline rows go through the client library, as the connector does:

- `StoreClient.put` / `StoreClient.get` over the inline path (and the shared-memory path when the
  store offers it: rows appear when a client opened with data_path="auto" reports
  `data_path == "shared_memory"`);
- the connector's worker path with torch tensors (when torch and vLLM import): a `WorkerSide`
  gathers blocks from KV tensors and saves them through its Saver, then loads them back and
  scatters them into the tensors;
- `StoreClient.lookup_packed` / `StoreClient.lookup` of 4,096 and 65,536 ordered keys (interleaved with the
  other ways to ask, and the packed call again back to back).

Beside them, in the same run and interleaved per repeat so machine noise hits every column alike:

- memcpy of the same values into a pre-touched buffer (values out of cache: 64 MiB per size);
- plain gRPC bytes on a raw channel to a bytes-only server with the store's threading model, both
  one value per message and in the client's own shape (same message size, same calls in flight);
- Redis 7 (redis-server, started here on 127.0.0.1) with pinned redis-py: pipelined SET / GET of
  the same values, and EXISTS of the same keys;
- the v1 Lookup form through the generated stub (an A/B of the packed form).

Each row reports GB/s (1 GB = 1e9 B) or latency, client and server CPU ns per byte (robust to load
from other processes, unlike wall-clock rates) and the load average while it ran. Ratios to the
bounds are computed from medians of the same run.

    python benchmarks/bench_client.py [--quick] [--out benchmarks/results/client.json]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib
import inspect
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from bench_processes import Server, start_server, wait_ready
from kvtag.v1 import store_pb2 as pb
from kvtag_client import keys as kvkeys
from kvtag_client.store import PackedKeys, StoreClient
from provenance import git_describe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for tests.*
from tests.descriptors import namespace
from tests.net import free_port

KiB, MiB, GB = 1024, 1024 * 1024, 1e9
SET_BYTES = 64 * MiB  # distinct values per size: well beyond the CPU caches
BATCH_BYTES = 16 * MiB  # one put/get call
VALUE_SIZES = (1 * MiB, 64 * KiB)
LOOKUP_SIZES = (4096, 65536)
KEY_BYTES = 32
BYTES_SERVICE = "kvtagbench.Bytes"
REPO = Path(__file__).resolve().parent.parent
TARGETS = {
    "put_and_get_1MiB_shm_vs_memcpy": 0.5,
    "put_and_get_1MiB_shm_vs_best_redis": 1.0,
    "put_and_get_64KiB_shm_vs_memcpy": 0.3,
    "inline_put_vs_grpc_upload": 0.8,
    "inline_get_vs_grpc_download": 0.8,
    "lookup_4096_p50_ms": 0.75,
    "lookup_4096_vs_redis_exists": 0.25,
}


# ---- measurement ----------------------------------------------------------------------------------


@dataclass
class Row:
    """All repeats of one measured thing."""

    name: str
    kind: str  # "throughput" or "latency"
    seconds: list[float] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    client_cpu: list[float] = field(default_factory=list)
    server_cpu: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "load_avg_1m": round(statistics.median(self.load), 2)}
        total = sum(self.nbytes)
        if self.kind == "throughput":
            rates = [b / s / GB for b, s in zip(self.nbytes, self.seconds, strict=True)]
            out |= {
                "GBps_median": round(statistics.median(rates), 3),
                "GBps_samples": [round(r, 3) for r in rates],
            }
        else:
            ms = sorted(s * 1e3 for s in self.seconds)
            out |= {
                "p50_ms": round(statistics.median(ms), 3),
                "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 3),
                "min_ms": round(ms[0], 3),
                "samples": len(ms),
            }
        if total:
            out["client_cpu_ns_per_byte"] = round(1e9 * sum(self.client_cpu) / total, 3)
            out["server_cpu_ns_per_byte"] = round(1e9 * sum(self.server_cpu) / total, 3)
        else:
            out["client_cpu_ms_per_call"] = round(1e3 * sum(self.client_cpu) / len(self.seconds), 3)
            out["server_cpu_ms_per_call"] = round(1e3 * sum(self.server_cpu) / len(self.seconds), 3)
        return out


class Bench:
    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}

    def measure(
        self, name: str, call: Callable[[], int], server: Server | Any | None, kind: str = "throughput"
    ) -> None:
        """Time one call (returns the payload bytes it moved) with client and server CPU."""
        row = self.rows.setdefault(name, Row(name, kind))
        cpu0 = server.cpu_and_faults()[0] if server is not None else 0.0
        c0 = time.process_time()
        t0 = time.perf_counter()
        nbytes = call()
        elapsed = time.perf_counter() - t0
        row.client_cpu.append(time.process_time() - c0)
        row.server_cpu.append((server.cpu_and_faults()[0] - cpu0) if server is not None else 0.0)
        row.seconds.append(elapsed)
        row.nbytes.append(nbytes if kind == "throughput" else 0)
        row.load.append(os.getloadavg()[0])

    def median(self, name: str, what: str = "GBps_median") -> float | None:
        row = self.rows.get(name)
        if row is None or not row.seconds:
            return None
        value: float = row.summary()[what]
        return value


@dataclass
class ProcessCpu:
    """CPU of a process that is not a bench_service.Server (redis-server)."""

    pid: int

    def cpu_and_faults(self) -> tuple[float, int]:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


# ---- subjects -------------------------------------------------------------------------------------


def block_key(tag: str, index: int) -> bytes:
    return hashlib.sha256(f"{tag}/{index}".encode()).digest()[:KEY_BYTES]


# Every client of the run is an engine of one tenant, so all values share that tenant's arena: the one
# the store prefaults up front (a deployment's tenants each get an arena; the first one of a pool is
# prefaulted to the pool's capacity).
TENANT = "bench"


def make_client(endpoint: str, engine: str, data_path: str) -> StoreClient | None:
    """A StoreClient on the given data path; None when this client version has no such path."""
    kwargs: dict[str, Any] = {}
    if "data_path" in inspect.signature(StoreClient.__init__).parameters:
        kwargs["data_path"] = data_path
    elif data_path != "inline":
        return None
    client = StoreClient(
        endpoint,
        engine_id=f"bench-{engine}",
        namespace=namespace("bench", TENANT),
        mode=kvkeys.mode(16, 0),
        probe_keys=kvkeys.probe_keys(16, 0),
        rpc_timeout_s=30.0,
        **kwargs,
    )
    if not client.open():
        raise SystemExit(f"StoreClient could not open a session at {endpoint}")
    return client


def client_data_path(client: StoreClient) -> str:
    return str(getattr(client, "data_path", "inline"))


def batches(count: int, per_batch: int) -> list[range]:
    return [range(i, min(count, i + per_batch)) for i in range(0, count, per_batch)]


def put_all(client: StoreClient, keys: Sequence[bytes], values: Sequence[bytes], per_batch: int) -> int:
    moved = 0
    for batch in batches(len(keys), per_batch):
        statuses = client.put([(0, keys[i], values[i], b"") for i in batch])
        if statuses is None or any(s not in (pb.STORED, pb.ALREADY_PRESENT) for s in statuses):
            raise SystemExit(f"StoreClient.put failed: {statuses}")
        moved += sum(len(values[i]) for i in batch)
    return moved


def get_into_all(
    client: StoreClient, keys: Sequence[bytes], dst: memoryview, size: int, per_batch: int
) -> int:
    """StoreClient.get_into, as the connector's worker loads: each value copied once, into a
    pre-touched destination (a KV cache stands in)."""
    moved = 0
    for batch in batches(len(keys), per_batch):

        def sink(n: int, source: memoryview, start: int = batch.start) -> bool:
            offset = (start + n) * size
            dst[offset : offset + size] = source
            return True

        served = client.get_into([(0, keys[i]) for i in batch], (), sink)
        if not all(served):
            raise SystemExit("StoreClient.get_into missed a value it had just stored (capacity too small?)")
        moved += size * len(batch)
    return moved


def wait_prefaulted(
    pid: int, directory: str = "/dev/shm", settle_s: float = 1.5, limit_s: float = 120.0
) -> float:
    """Wait until the store's arena files stop growing (the up-front prefault is done), as an engine
    meets a store that has been up for a while; returns the seconds waited."""
    started = time.monotonic()
    last, since = -1, time.monotonic()
    while time.monotonic() - started < limit_s:
        allocated = sum(p.stat().st_blocks * 512 for p in Path(directory).glob(f"kvtag-{pid}-*"))
        if allocated != last:
            last, since = allocated, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            break
        time.sleep(0.1)
    return round(time.monotonic() - started, 1)


def get_all(client: StoreClient, keys: Sequence[bytes], values: Sequence[bytes], per_batch: int) -> int:
    moved = 0
    for batch in batches(len(keys), per_batch):
        got = client.get([(0, keys[i]) for i in batch])
        for i, value in zip(batch, got, strict=True):
            if value is None or len(value) != len(values[i]):
                raise SystemExit("StoreClient.get missed a value it had just stored (capacity too small?)")
        moved += sum(len(v) for v in got if v is not None)
    return moved


def grpc_shape(value_size: int, per_batch: int) -> tuple[int, int]:
    """(values per message, calls in flight) the client uses for a batch of this shape."""
    from kvtag_client.inline import transfer

    share = -(-value_size * per_batch // transfer.IN_FLIGHT)
    target = min(transfer.MAX_MESSAGE, max(transfer.MIN_MESSAGE, share))
    return max(1, target // (value_size + transfer.ITEM_OVERHEAD)), transfer.IN_FLIGHT


class RawGrpc:
    """Plain gRPC bytes on a raw channel: no protobuf, no store, the bound for the inline path."""

    def __init__(self, address: str) -> None:
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        self.channel = grpc.insecure_channel(address, options=options)
        self.upload = self.channel.unary_unary(f"/{BYTES_SERVICE}/Upload")
        self.download = self.channel.unary_unary(f"/{BYTES_SERVICE}/Download")
        self.echo = self.channel.unary_unary(f"/{BYTES_SERVICE}/Echo")

    @staticmethod
    def each(call: Any, requests: Sequence[bytes], sent: int) -> int:
        """One message per value, back to back; the bytes moved (sent, or else received)."""
        received = sum(len(call(request)) for request in requests)
        return sent or received

    @staticmethod
    def windowed(call: Any, requests: Sequence[bytes], in_flight: int, sent: int) -> int:
        """The client's shape: up to in_flight calls outstanding; the bytes moved."""
        pending: list[Any] = []
        received = 0
        for request in requests:
            pending.append(call.future(request))
            if len(pending) >= in_flight:
                received += len(pending.pop(0).result())
        for future in pending:
            received += len(future.result())
        return sent or received


def memcpy_into(dst: memoryview, values: Sequence[bytes]) -> int:
    offset = 0
    for v in values:
        dst[offset : offset + len(v)] = v
        offset += len(v)
    return offset


# ---- Redis ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def redis_server(log_dir: Path) -> Iterator[tuple[Any, ProcessCpu] | None]:
    exe = shutil.which("redis-server")
    redis: Any = None
    with contextlib.suppress(ImportError):
        redis = importlib.import_module("redis")
    if exe is None or redis is None:
        print("redis-server or redis-py missing: no Redis column (make bench installs both)", file=sys.stderr)
        yield None
        return
    port = free_port()
    argv = [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
            "--protected-mode", "yes", "--maxmemory", "2gb", "--dir", str(log_dir)]  # fmt: skip
    with (log_dir / "redis.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("redis-server did not start") from None
                time.sleep(0.05)
        yield client, ProcessCpu(proc.pid)
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def redis_set(r: Any, keys: Sequence[bytes], values: Sequence[bytes], per_batch: int) -> int:
    for batch in batches(len(keys), per_batch):
        pipe = r.pipeline(transaction=False)
        for i in batch:
            pipe.set(keys[i], values[i])
        pipe.execute()
    return sum(map(len, values))


def redis_get(r: Any, keys: Sequence[bytes], per_batch: int) -> int:
    moved = 0
    for batch in batches(len(keys), per_batch):
        pipe = r.pipeline(transaction=False)
        for i in batch:
            pipe.get(keys[i])
        moved += sum(len(v) for v in pipe.execute() if v is not None)
    return moved


# ---- the connector's worker path --------------------------------------------------------------------


class WorkerPath:
    """WorkerSide over real torch KV tensors: gather -> Saver put, then get -> scatter."""

    LAYERS, BLOCK, HEADS, HEAD_DIM = 16, 16, 8, 128  # bf16: 64 KiB per layer, 1 MiB per block

    def __init__(self, client: StoreClient, blocks: int) -> None:
        import torch
        from kvtag_client.connector.stats import StatsRecorder
        from kvtag_client.connector.worker_side import WorkerSide

        self.torch = torch
        self.num_blocks = blocks
        names = [f"model.layers.{i}.self_attn" for i in range(self.LAYERS)]
        shape = (2, blocks, self.BLOCK, self.HEADS, self.HEAD_DIM)
        self.kv = {n: torch.randn(shape, dtype=torch.float32).to(torch.bfloat16) for n in names}
        config = _Namespace(kv_cache_groups=[_Namespace(layer_names=names)], num_blocks=blocks)
        self.worker = WorkerSide(config, lambda: client, StatsRecorder(), 1 << 34, 64)
        self.worker.register(self.kv)
        self.block_bytes = 2 * self.LAYERS * self.BLOCK * self.HEADS * self.HEAD_DIM * 2

    def save(self, tag: str, per_batch: int) -> int:
        from kvtag_client.connector.metadata import BlockTransfer, KvtagConnectorMetadata, SaveJob

        for n, batch in enumerate(batches(self.num_blocks, per_batch)):
            jobs = [SaveJob(f"{tag}-{n}", [BlockTransfer(0, b, block_key(tag, b)) for b in batch])]
            self.worker.start(KvtagConnectorMetadata(saves=jobs))
        if not self.worker.saver.wait_idle(120):
            raise SystemExit("the connector's saver did not drain")
        return self.num_blocks * self.block_bytes

    def load(self, tag: str, per_batch: int) -> int:
        from kvtag_client.connector.metadata import BlockTransfer, KvtagConnectorMetadata, LoadJob

        for n, batch in enumerate(batches(self.num_blocks, per_batch)):
            # Blocks load into the other half of the cache's block ids, as a new request would.
            target = [(b + self.num_blocks // 2) % self.num_blocks for b in batch]
            transfers = [BlockTransfer(0, t, block_key(tag, b)) for b, t in zip(batch, target, strict=True)]
            self.worker.start(KvtagConnectorMetadata(loads=[LoadJob(f"{tag}-load-{n}", transfers)]))
        if self.worker.take_load_errors():
            raise SystemExit("the connector failed to load blocks it had just saved")
        return self.num_blocks * self.block_bytes

    def check_exact(self, per_batch: int) -> None:
        """A save + load cycle swaps the halves of the cache (block b loads into b + n/2): byte-exact."""
        before = {name: tensor.clone() for name, tensor in self.kv.items()}
        self.save("exact", per_batch)
        self.load("exact", per_batch)
        half = self.num_blocks // 2
        for name, tensor in self.kv.items():
            old = before[name]
            if not (
                self.torch.equal(tensor[:, half:], old[:, :half])
                and self.torch.equal(tensor[:, :half], old[:, half:])
            ):
                raise SystemExit("the connector's load did not restore the saved bytes exactly")

    def close(self) -> None:
        self.worker.close()


class _Namespace:
    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


# ---- the run --------------------------------------------------------------------------------------


def kvtag_store_exe(explicit: str | None) -> str:
    for candidate in (
        explicit,
        str(Path(sys.executable).parent / "kvtag-store"),
        str(REPO / ".venv/bin/kvtag-store"),
    ):
        if candidate and Path(candidate).exists():
            return candidate
    raise SystemExit("kvtag-store not found: run `make .stamps/service` or pass --kvtag-store")


def lookup_calls(
    client: StoreClient, keys: list[bytes], redis: tuple[Any, ProcessCpu] | None
) -> dict[str, tuple[Callable[[], int], Any]]:
    """The ways to ask for an ordered prefix of `keys` (all present), each checked."""
    count = len(keys)
    joined = b"".join(keys)
    blocks = [(0, k, b"") for k in keys]
    v1_request = pb.LookupRequest(
        session_id=client.session_id, blocks=[pb.BlockRef(key=k) for k in keys], lease_ms=200
    ).SerializeToString()
    v1_call = client.session.channel.unary_unary(
        "/kvtag.v1.KvStore/Lookup",
        request_serializer=None,
        response_deserializer=pb.LookupResponse.FromString,
    )

    def packed() -> int:
        result = client.lookup_packed([PackedKeys(0, joined, KEY_BYTES)], lease_ms=200)
        assert result.prefix_length == count, result.prefix_length
        return 0

    def packed_and_release() -> int:
        result = client.lookup_packed([PackedKeys(0, joined, KEY_BYTES)])
        assert result.prefix_length == count
        client.release(result.leases)
        return 0

    def tuples() -> int:
        assert client.lookup(blocks, lease_ms=200).prefix_length == count
        return 0

    def v1() -> int:
        # The v1 form as a generated stub sends it (BlockRef per key), built inside the timer.
        request = pb.LookupRequest(session_id=client.session_id, blocks=[pb.BlockRef(key=k) for k in keys])
        request.lease_ms = 200
        assert v1_call(request.SerializeToString()).prefix_length == count
        return 0

    def v1_prebuilt() -> int:
        assert v1_call(v1_request).prefix_length == count
        return 0

    calls: dict[str, tuple[Callable[[], int], Any]] = {
        "storeclient_packed": (packed, None),
        "storeclient_packed_then_release": (packed_and_release, None),
        "storeclient_tuples": (tuples, None),
        "v1_generated_stub": (v1, None),
        "v1_prebuilt_request": (v1_prebuilt, None),
    }
    if redis is not None:
        r, redis_cpu = redis

        def exists_pipelined() -> int:
            pipe = r.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            assert sum(pipe.execute()) == count
            return 0

        def exists_one_command() -> int:
            assert r.exists(*keys) == count
            return 0

        calls["redis_exists_pipelined"] = (exists_pipelined, redis_cpu)
        calls["redis_exists_one_command"] = (exists_one_command, redis_cpu)
    return calls


def lookup_rows(
    bench: Bench, client: StoreClient, kv: Server, redis: tuple[Any, ProcessCpu] | None, repeats: int
) -> None:
    for count in LOOKUP_SIZES:
        keys = [block_key(f"lookup-{count}", i) for i in range(count)]
        put_all(client, keys, [b"v" * 64] * count, 4096)
        if redis is not None:
            for start in range(0, count, 4096):
                pipe = redis[0].pipeline(transaction=False)
                for k in keys[start : start + 4096]:
                    pipe.set(k, b"v" * 64)
                pipe.execute()
        calls = lookup_calls(client, keys, redis)
        per_repeat = 30 if count <= 4096 else 6
        for _ in range(repeats):
            for _ in range(per_repeat):
                for name, (call, server) in calls.items():
                    bench.measure(f"lookup_{count}_{name}", call, server or kv, "latency")
            time.sleep(0.25)  # let the 200 ms leases lapse so pins do not pile up
            # Beside the interleaved figure (each packed call after the v1 calls churned the caches of
            # both processes): the packed call alone, back to back, as a scheduler loop would send it.
            packed, _ = calls["storeclient_packed"]
            for _ in range(per_repeat):
                bench.measure(f"lookup_{count}_storeclient_packed_in_a_row", packed, kv, "latency")
            time.sleep(0.25)


def transfer_rows(
    bench: Bench,
    args: argparse.Namespace,
    paths: Sequence[str],
    open_client: Callable[[str, str], StoreClient],
    kv: Server,
    raw: RawGrpc,
    raw_server: Server,
    redis: tuple[Any, ProcessCpu] | None,
    worker: WorkerPath | None,
) -> None:
    repeats = args.repeats
    for size in VALUE_SIZES:
        count = SET_BYTES // size
        per_batch = BATCH_BYTES // size
        label = f"{size // KiB}KiB" if size < MiB else f"{size // MiB}MiB"
        values = [os.urandom(size) for _ in range(count)]
        dst = memoryview(bytearray(SET_BYTES))
        dst[:] = bytes(SET_BYTES)  # pre-touched
        per_message, in_flight = grpc_shape(size, per_batch)
        joined = [b"".join(values[i : i + per_message]) for i in range(0, count, per_message)]
        download_sizes = [str(len(j)).encode() for j in joined]
        raw.download(download_sizes[0])  # the server builds each blob size once
        raw.download(str(size).encode())

        memcpy = functools.partial(memcpy_into, dst, values)
        upload_each = functools.partial(raw.each, raw.upload, values, SET_BYTES)
        upload_shaped = functools.partial(raw.windowed, raw.upload, joined, in_flight, SET_BYTES)
        download_each = functools.partial(raw.each, raw.download, [str(size).encode()] * count, 0)
        download_shaped = functools.partial(raw.windowed, raw.download, download_sizes, in_flight, 0)

        # One client per value size, as an engine has (its block size is fixed): a client sizes its Get
        # messages by the largest value it has seen.
        clients = {path: open_client(path, label) for path in paths}
        for repeat in range(repeats + 1):  # repeat 0 warms up and is dropped
            rows: list[tuple[str, Callable[[], int], Any]] = [
                (f"memcpy_{label}", memcpy, None),
                (f"grpc_upload_{label}_per_value", upload_each, raw_server),
                (f"grpc_upload_{label}_client_shape", upload_shaped, raw_server),
                (f"grpc_download_{label}_per_value", download_each, raw_server),
                (f"grpc_download_{label}_client_shape", download_shaped, raw_server),
            ]
            for path, client in clients.items():
                keys = [block_key(f"{path}-{label}-{repeat}", i) for i in range(count)]
                rows.append(
                    (
                        f"storeclient_put_{label}_{path}",
                        functools.partial(put_all, client, keys, values, per_batch),
                        kv,
                    )
                )
                rows.append(
                    (
                        f"storeclient_get_{label}_{path}",
                        functools.partial(get_all, client, keys, values, per_batch),
                        kv,
                    )
                )
                rows.append(
                    (
                        f"storeclient_get_into_{label}_{path}",
                        functools.partial(get_into_all, client, keys, dst, size, per_batch),
                        kv,
                    )
                )
            if redis is not None:
                r, redis_cpu = redis
                rkeys = [block_key(f"redis-{label}-{repeat}", i) for i in range(count)]
                rows.append(
                    (
                        f"redis_set_{label}",
                        functools.partial(redis_set, r, rkeys, values, per_batch),
                        redis_cpu,
                    )
                )
                rows.append(
                    (f"redis_get_{label}", functools.partial(redis_get, r, rkeys, per_batch), redis_cpu)
                )
            if worker is not None and size == MiB:
                tag = f"worker-{repeat}"
                rows.append(
                    ("connector_worker_save_1MiB_blocks", functools.partial(worker.save, tag, per_batch), kv)
                )
                rows.append(
                    ("connector_worker_load_1MiB_blocks", functools.partial(worker.load, tag, per_batch), kv)
                )
            for name, call, server in rows:
                if repeat == 0:
                    call()
                else:
                    bench.measure(name, call, server)
            if redis is not None:
                redis[0].flushall()
        for client in clients.values():
            client.close()
        if worker is not None and size == MiB:
            worker.check_exact(per_batch)


def ratios(bench: Bench, paths: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def best(*names: str) -> float | None:
        found = [v for v in (bench.median(n) for n in names) if v is not None]
        return max(found) if found else None

    for size in VALUE_SIZES:
        label = f"{size // KiB}KiB" if size < MiB else f"{size // MiB}MiB"
        upload = best(f"grpc_upload_{label}_per_value", f"grpc_upload_{label}_client_shape")
        download = best(f"grpc_download_{label}_per_value", f"grpc_download_{label}_client_shape")
        memcpy = bench.median(f"memcpy_{label}")
        redis_best = best(f"redis_set_{label}", f"redis_get_{label}")
        for path in paths:
            put = bench.median(f"storeclient_put_{label}_{path}")
            get = bench.median(f"storeclient_get_{label}_{path}")
            get_into = bench.median(f"storeclient_get_into_{label}_{path}")
            for what, value in (("put", put), ("get", get), ("get_into", get_into)):
                if value is None:
                    continue
                bound = upload if what == "put" else download
                if bound:
                    out[f"{what}_{label}_{path}_vs_best_plain_grpc"] = round(value / bound, 3)
                if memcpy:
                    out[f"{what}_{label}_{path}_vs_memcpy"] = round(value / memcpy, 3)
                if redis_best:
                    out[f"{what}_{label}_{path}_vs_best_redis"] = round(value / redis_best, 3)
    for count in LOOKUP_SIZES:
        ours = bench.median(f"lookup_{count}_storeclient_packed", "p50_ms")
        found = [
            bench.median(f"lookup_{count}_redis_exists_{how}", "p50_ms")
            for how in ("pipelined", "one_command")
        ]
        redis_p50 = min((f for f in found if f), default=None)  # Redis's best way to ask
        v1 = bench.median(f"lookup_{count}_v1_generated_stub", "p50_ms")
        in_a_row = bench.median(f"lookup_{count}_storeclient_packed_in_a_row", "p50_ms")
        if ours and redis_p50:
            out[f"lookup_{count}_packed_vs_best_redis_exists"] = round(ours / redis_p50, 3)
        if in_a_row and redis_p50:
            out[f"lookup_{count}_packed_in_a_row_vs_best_redis_exists"] = round(in_a_row / redis_p50, 3)
        if ours and v1:
            out[f"lookup_{count}_packed_vs_v1_form"] = round(ours / v1, 3)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.time()
    log_dir = Path(tempfile.mkdtemp(prefix="kvtag-bench-client-"))
    bench = Bench()
    kv_port, raw_port = free_port(), free_port()
    kv_argv = [kvtag_store_exe(args.kvtag_store), "serve", "--listen", f"127.0.0.1:{kv_port}",
               "--metrics-listen", "", "--capacity", args.capacity, "--log-level", "warning"]  # fmt: skip
    raw_argv = [sys.executable, str(Path(__file__).with_name("bench_service.py")), "--serve-bytes",
                f"127.0.0.1:{raw_port}", "--workers", "16", "--max-message-bytes", str(64 * MiB)]  # fmt: skip
    load_before = os.getloadavg()
    with (
        start_server("kvtag-store", kv_argv, kv_port, log_dir) as kv,
        start_server("grpc-bytes", raw_argv, raw_port, log_dir) as raw_server,
        redis_server(log_dir) as redis,
    ):
        for server in (kv, raw_server):
            channel = grpc.insecure_channel(server.address)
            wait_ready(server, channel)
            channel.close()
        raw = RawGrpc(raw_server.address)
        clients: dict[str, StoreClient] = {}
        inline = make_client(kv.address, "inline", "inline")
        assert inline is not None
        clients["inline"] = inline
        shm = make_client(kv.address, "shm", "auto")
        if shm is not None and client_data_path(shm) == "shared_memory":
            clients["shm"] = shm
        elif shm is not None:
            shm.close()

        def open_client(path: str, label: str) -> StoreClient:
            client = make_client(kv.address, f"{path}-{label}", "inline" if path == "inline" else "auto")
            assert client is not None and client_data_path(client) == client_data_path(clients[path])
            return client

        prefault_wait_s = wait_prefaulted(kv.proc.pid)
        worker: WorkerPath | None = None
        try:
            worker = WorkerPath(clients.get("shm", inline), SET_BYTES // MiB)
        except ImportError as exc:
            print(f"no connector worker rows ({exc}): run under the vLLM environment", file=sys.stderr)
        try:
            transfer_rows(bench, args, sorted(clients), open_client, kv, raw, raw_server, redis, worker)
            lookup_rows(bench, inline, kv, redis, args.repeats)
        finally:
            if worker is not None:
                worker.close()
            for client in clients.values():
                client.close()
    return {
        "benchmark": "bench_client",
        "commit": git_describe(),
        "started_unix": int(started),
        "duration_s": round(time.time() - started, 1),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_before": [round(x, 2) for x in load_before],
            "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "data_paths": sorted(clients),
        "prefault_wait_s": prefault_wait_s,
        "value_set_bytes": SET_BYTES,
        "batch_bytes": BATCH_BYTES,
        "targets": TARGETS,
        "rows": {name: row.summary() for name, row in bench.rows.items()},
        "ratios": ratios(bench, sorted(clients)),
    }


def print_table(report: dict[str, Any]) -> None:
    print(f"kvtag client benchmark @ {report['commit']}: load avg {report['machine']['load_avg_before']} -> "
          f"{report['machine']['load_avg_after']}, data paths {report['data_paths']}")  # fmt: skip
    print(f"{'row':<52} {'figure':>12} {'client ns/B':>12} {'server ns/B':>12} {'load':>6}")
    for name, row in report["rows"].items():
        if row["kind"] == "throughput":
            figure = f"{row['GBps_median']:.3f} GB/s"
            client, server = row.get("client_cpu_ns_per_byte", ""), row.get("server_cpu_ns_per_byte", "")
        else:
            figure = f"{row['p50_ms']:.2f} ms p50"
            client, server = row.get("client_cpu_ms_per_call", ""), row.get("server_cpu_ms_per_call", "")
        print(f"{name:<52} {figure:>12} {client!s:>12} {server!s:>12} {row['load_avg_1m']:>6}")
    print("\nratios (same run):")
    for name, value in report["ratios"].items():
        print(f"  {name:<56} {value}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="one repeat (a smoke run)")
    parser.add_argument("--repeats", type=int, default=0, help="repeats (default 5, --quick 1)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    parser.add_argument("--capacity", default="3GiB", help="kvtag-store --capacity")
    parser.add_argument("--kvtag-store", default=None, help="kvtag-store executable")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 5)
    report = run(args)
    print_table(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
