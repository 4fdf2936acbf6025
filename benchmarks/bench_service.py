"""Throughput and latency of the kvtag store service on loopback, beside the references that bound it.

One run measures, interleaved per repeat so machine noise hits every column alike:

- kvtag Put and Get throughput (GB/s, 1 GB = 1e9 bytes) for 64 KiB, 1 MiB and 4 MiB values, batched
  under the server's Limits.max_message_bytes, against a real `kvtag-store serve` subprocess. Put
  requests are encoded inside the timer by the client library's encoder (kvtag_client.inline.put_encoding,
  what StoreClient sends); at 1 MiB also through the generated stubs, for comparison. Get goes
  through the generated stubs, as in StoreClient;
- the same bytes through a plain gRPC bytes service in its own subprocess with the kvtag server's
  threading model (a sync server on a thread pool): upload (bytes in, empty reply), download (tiny
  request, bytes out) at the kvtag batch size, and echo (bytes in, same bytes out) at the value size;
- a preallocated memcpy of the same bytes;
- an ordered 4,096-key Lookup (p50/p99 ms), with a tiny-RPC and same-size bytes echo beside it.

Server CPU time per byte is read from /proc for both servers: unlike wall-clock throughput it barely
moves when other processes load the machine. `--profile` also samples the kvtag server with py-spy
(if installed) during a 1 MiB put/get loop and names the top costs.

    .venv/bin/python benchmarks/bench_service.py [--quick] [--out benchmarks/results/service.json]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import mmap
import os
import platform
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from bench_processes import ECHO_SERVICE, Server, channel_options, serve_bytes, start_server, wait_ready
from google.protobuf.internal import api_implementation
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_client.inline.put_encoding import PutItemFields, encode_put_request
from provenance import git_describe
from server_profile import find_py_spy, profile_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.descriptors import mode, namespace
from tests.net import free_port

KiB = 1024
MiB = 1024 * KiB
GB = 1e9
VALUE_SIZES = (64 * KiB, 1 * MiB, 4 * MiB)
LOOKUP_KEYS = 4096
KEY_BYTES = 32
# Largest RPC payload the benchmark sends in one message, below the server limit (framing headroom).
TARGET_BATCH_BYTES = 8 * MiB
MESSAGE_HEADROOM = 64 * KiB
TARGETS = {"put_1MiB_GBps": 1.5, "get_1MiB_GBps": 1.5, "lookup_p50_ms": 2.0}


# ---- measurements ---------------------------------------------------------------------------------


@dataclass
class Sample:
    """One timed pass over `nbytes` payload bytes (or one latency)."""

    seconds: float
    nbytes: int = 0
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    # Minor page faults: first touches of fresh memory, which cost microseconds each in this VM.
    server_faults: int = 0
    client_faults: int = 0

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / GB


@dataclass
class Series:
    """All repeats of one measurement."""

    samples: list[Sample] = field(default_factory=list)

    def gbps(self) -> list[float]:
        return [s.gbps for s in self.samples]

    def summary(self) -> dict[str, Any]:
        rates = self.gbps()
        total_bytes = sum(s.nbytes for s in self.samples)
        server_cpu = sum(s.server_cpu_s for s in self.samples)
        client_cpu = sum(s.client_cpu_s for s in self.samples)
        mib = total_bytes / MiB
        med = statistics.median(rates)
        return {
            "GBps_median": round(med, 4),
            "GBps_min": round(min(rates), 4),
            "GBps_max": round(max(rates), 4),
            "spread_pct": round(100 * (max(rates) - min(rates)) / med, 1),
            "GBps_samples": [round(r, 4) for r in rates],
            # CPU per byte is robust to load from other processes (wall-clock rate is not).
            "server_cpu_ns_per_byte": round(1e9 * server_cpu / total_bytes, 4) if total_bytes else None,
            "client_cpu_ns_per_byte": round(1e9 * client_cpu / total_bytes, 4) if total_bytes else None,
            "server_page_faults_per_MiB": round(sum(s.server_faults for s in self.samples) / mib, 1)
            if mib
            else None,
            "client_page_faults_per_MiB": round(sum(s.client_faults for s in self.samples) / mib, 1)
            if mib
            else None,
        }


def timed_calls(calls: Sequence[Callable[[], int]], server: Server | None, in_flight: int = 1) -> Sample:
    """Run calls back to back (or `in_flight` at a time); each returns the payload bytes it moved.

    Only the calls are timed. Two in flight lets client and server work at once on two cores.
    """
    pool = futures.ThreadPoolExecutor(in_flight) if in_flight > 1 else None
    cpu0, faults0 = server.cpu_and_faults() if server else (0.0, 0)
    ccpu0, cfaults0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    results = map(lambda call: call(), calls) if pool is None else pool.map(lambda call: call(), calls)
    nbytes = sum(results)
    elapsed = time.perf_counter() - t0
    ccpu = time.process_time() - ccpu0
    cfaults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - cfaults0
    cpu1, faults1 = server.cpu_and_faults() if server else (0.0, 0)
    if pool is not None:
        pool.shutdown()
    return Sample(elapsed, nbytes, cpu1 - cpu0, ccpu, faults1 - faults0, cfaults)


def block_key(tag: str, index: int) -> bytes:
    return hashlib.sha256(f"{tag}/{index}".encode()).digest()[:KEY_BYTES]


class ValuePool:
    """Distinct random values per size, cycled: enough variety that no cache or checksum shortcut helps."""

    def __init__(self, size: int, pool_bytes: int) -> None:
        self.values = [os.urandom(size) for _ in range(max(2, pool_bytes // size))]

    def __getitem__(self, index: int) -> bytes:
        return self.values[index % len(self.values)]


@dataclass
class Plan:
    value_size: int
    batch_items: int
    batches: int

    @property
    def batch_bytes(self) -> int:
        return self.value_size * self.batch_items

    @property
    def volume(self) -> int:
        return self.batch_bytes * self.batches


def plan_for(value_size: int, volume: int, limits: Any) -> Plan:
    usable = min(TARGET_BATCH_BYTES, int(limits.max_message_bytes) - MESSAGE_HEADROOM)
    if value_size > usable:
        raise SystemExit(f"{value_size} B values do not fit a {limits.max_message_bytes} B message")
    items = max(1, min(int(limits.max_batch_items), usable // value_size))
    return Plan(value_size, items, max(1, volume // (items * value_size)))


class KvtagBench:
    """Put/Get/Lookup through the generated stubs, in one session."""

    def __init__(self, channel: grpc.Channel, server: Server) -> None:
        self.stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
        self.put_raw = channel.unary_unary(
            "/kvtag.v1.KvStore/Put", request_serializer=None, response_deserializer=pb.PutResponse.FromString
        )
        self.server = server
        opened = self.stub.OpenSession(open_session_request())
        self.session_id: str = opened.session_id
        self.limits = opened.limits
        self.session_info = {
            "namespace_id": opened.namespace_id,
            "mode_id": opened.mode_id,
            "session_ttl_ms": opened.session_ttl_ms,
            "limits": {
                "max_key_bytes": opened.limits.max_key_bytes,
                "max_batch_items": opened.limits.max_batch_items,
                "max_value_bytes": opened.limits.max_value_bytes,
                "max_message_bytes": opened.limits.max_message_bytes,
            },
        }

    def put_batches(self, plan: Plan, pool: ValuePool, tag: str) -> list[list[PutItemFields]]:
        """(group, key, value, base_key) items per batch, as StoreClient.put takes them."""
        return [
            [(0, block_key(tag, b * plan.batch_items + i), pool[i + b], b"") for i in range(plan.batch_items)]
            for b in range(plan.batches)
        ]

    def put_generated_batches(self, plan: Plan, pool: ValuePool, tag: str) -> list[pb.PutRequest]:
        """Generated messages built ahead of the timed calls (serialization happens inside the timer)."""
        requests = []
        for b in range(plan.batches):
            items = [
                pb.PutItem(block=pb.BlockRef(key=block_key(tag, b * plan.batch_items + i)), value=pool[i + b])
                for i in range(plan.batch_items)
            ]
            requests.append(pb.PutRequest(session_id=self.session_id, items=items))
        return requests

    def get_batches(self, plan: Plan, tag: str) -> list[pb.GetRequest]:
        return [
            pb.GetRequest(
                session_id=self.session_id,
                blocks=[
                    pb.BlockRef(key=block_key(tag, b * plan.batch_items + i)) for i in range(plan.batch_items)
                ],
            )
            for b in range(plan.batches)
        ]

    def put_call(self, items: Sequence[PutItemFields], expect_bytes: int) -> Callable[[], int]:
        """Put with the request encoded inside the timer by the client library, as StoreClient does."""

        def call() -> int:
            response = self.put_raw(encode_put_request(self.session_id, items))
            self.check_stored(response, len(items))
            return expect_bytes

        return call

    def put_generated_call(self, request: pb.PutRequest, expect_bytes: int) -> Callable[[], int]:
        """Put through the generated stub: upb serializes the prepared message inside the timer."""

        def call() -> int:
            self.check_stored(self.stub.Put(request), len(request.items))
            return expect_bytes

        return call

    @staticmethod
    def check_stored(response: pb.PutResponse, expected: int) -> None:
        stored = sum(1 for r in response.results if r.status == pb.STORED)
        if stored != expected:
            reasons = {
                (pb.PutStatus.Name(r.status), r.reason) for r in response.results if r.status != pb.STORED
            }
            raise SystemExit(f"put stored {stored}/{expected}: {reasons}")

    def get_call(self, request: pb.GetRequest) -> Callable[[], int]:
        def call() -> int:
            response = self.stub.Get(request)
            # Taking the values out is part of what every client pays for a Get.
            values = [r.value for r in response.results if r.status == pb.HIT]
            if len(values) != len(request.blocks):
                raise SystemExit(f"get hit {len(values)}/{len(request.blocks)} blocks")
            return sum(map(len, values))

        return call

    def put_values(self, keys: Sequence[bytes], value: bytes) -> None:
        step = max(1, min(int(self.limits.max_batch_items), TARGET_BATCH_BYTES // (len(value) + 64)))
        for start in range(0, len(keys), step):
            request = pb.PutRequest(
                session_id=self.session_id,
                items=[pb.PutItem(block=pb.BlockRef(key=k), value=value) for k in keys[start : start + step]],
            )
            response = self.stub.Put(request)
            if any(r.status not in (pb.STORED, pb.ALREADY_PRESENT) for r in response.results):
                raise SystemExit("lookup set-up put failed")

    def ensure_present(self, request: pb.LookupRequest, keys: Sequence[bytes], value: bytes) -> None:
        response = self.stub.Lookup(request)
        if response.lease.lease_id:
            self.stub.ReleaseLeases(
                pb.ReleaseLeasesRequest(session_id=self.session_id, lease_ids=[response.lease.lease_id])
            )
        if response.prefix_length != len(keys):
            self.put_values(keys, value)

    def lookup_request(self, keys: Sequence[bytes]) -> pb.LookupRequest:
        return pb.LookupRequest(session_id=self.session_id, blocks=[pb.BlockRef(key=k) for k in keys])

    def lookup_latency(self, request: pb.LookupRequest, expect_prefix: int) -> float:
        t0 = time.perf_counter()
        response = self.stub.Lookup(request)
        elapsed = time.perf_counter() - t0
        if response.prefix_length != expect_prefix:
            raise SystemExit(f"lookup prefix {response.prefix_length}, expected {expect_prefix}")
        if response.lease.lease_id:  # untimed: keep pinned keys from piling up
            self.stub.ReleaseLeases(
                pb.ReleaseLeasesRequest(session_id=self.session_id, lease_ids=[response.lease.lease_id])
            )
        return elapsed

    def close(self) -> None:
        with contextlib.suppress(grpc.RpcError):
            self.stub.CloseSession(pb.CloseSessionRequest(session_id=self.session_id))


def check_put_encoding() -> None:
    """A start-up sanity check of the client encoder (tests/client/test_put_encoding.py proves it)."""
    items: list[PutItemFields] = [(0, b"k" * 32, b"v" * 300, b""), (3, b"q", os.urandom(70000), b"b" * 32)]
    generated = pb.PutRequest(
        session_id="s-1",
        items=[pb.PutItem(block=pb.BlockRef(key=k, group=g, base_key=bk), value=v) for g, k, v, bk in items],
    ).SerializeToString()
    if encode_put_request("s-1", items) != generated:
        raise SystemExit("hand-encoded PutRequest differs from the generated encoding")


def open_session_request() -> pb.OpenSessionRequest:
    return pb.OpenSessionRequest(
        engine_id=f"bench/{socket.gethostname()}/{os.getpid()}",
        namespace=namespace("kvtag-bench/model"),
        mode=mode(lookahead=0),
        probe_keys=[
            hashlib.sha256(b"kvtag-bench probe 0").digest(),
            hashlib.sha256(b"kvtag-bench probe 1").digest(),
        ],
        labels={"tool": "benchmarks/bench_service.py"},
    )


class BytesBench:
    """Calls on the plain gRPC bytes server; no protobuf on either side."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.echo = channel.unary_unary(f"/{ECHO_SERVICE}/Echo")
        self.upload = channel.unary_unary(f"/{ECHO_SERVICE}/Upload")
        self.download = channel.unary_unary(f"/{ECHO_SERVICE}/Download")

    def upload_call(self, payload: bytes) -> Callable[[], int]:
        def call() -> int:
            self.upload(payload)
            return len(payload)

        return call

    def download_call(self, size: int) -> Callable[[], int]:
        request = str(size).encode()

        def call() -> int:
            return len(self.download(request))

        return call

    def echo_call(self, payload: bytes) -> Callable[[], int]:
        def call() -> int:
            if len(self.echo(payload)) != len(payload):
                raise SystemExit("echo returned the wrong size")
            return len(payload)

        return call

    def latency(self, payload: bytes) -> float:
        t0 = time.perf_counter()
        self.echo(payload)
        return time.perf_counter() - t0


def memcpy_pass(values: Sequence[bytes], dst: memoryview) -> Sample:
    """Copy each value into its slot of a preallocated, pre-touched buffer (one memcpy per value)."""
    t0 = time.perf_counter()
    offset = 0
    for value in values:
        end = offset + len(value)
        dst[offset:end] = value
        offset = end
    return Sample(time.perf_counter() - t0, offset)


def memcpy_fresh_pass(values: Sequence[bytes]) -> Sample:
    """The same copies into freshly mapped memory: every 4 KiB page faults on first touch, as a stored
    value's new memory does. In this VM a fault costs microseconds, so this bounds any put path."""
    total = sum(map(len, values))
    t0 = time.perf_counter()
    with mmap.mmap(-1, total) as region:
        dst = memoryview(region)
        offset = 0
        for value in values:
            end = offset + len(value)
            dst[offset:end] = value
            offset = end
        elapsed = time.perf_counter() - t0
        dst.release()
    return Sample(elapsed, total)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def latency_summary(seconds: Sequence[float], per_repeat: Sequence[Sequence[float]]) -> dict[str, Any]:
    ms = [1e3 * s for s in seconds]
    p50s = [percentile([1e3 * s for s in rep], 50) for rep in per_repeat if rep]
    return {
        "p50_ms": round(percentile(ms, 50), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "min_ms": round(min(ms), 3),
        "max_ms": round(max(ms), 3),
        "count": len(ms),
        "p50_ms_per_repeat": [round(p, 3) for p in p50s],
    }


# ---- the run --------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError):
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split(":", 1)[1].strip()
    return {
        "platform": platform.platform(),
        "cpu_model": cpu,
        "nproc": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "mem_total": mem,
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "protobuf_implementation": api_implementation.Type(),
        "loadavg_start": os.getloadavg(),
        "kvtag_commit": git_describe(),
    }


def kvtag_store_argv(port: int, args: argparse.Namespace) -> list[str]:
    exe = args.kvtag_store or str(Path(sys.executable).parent / "kvtag-store")
    return [
        exe, "serve", "--listen", f"127.0.0.1:{port}", "--metrics-listen", "",
        "--capacity", args.capacity, "--workers", str(args.workers), "--log-level", "warning",
        *args.kvtag_arg,
    ]  # fmt: skip


@dataclass
class LookupSets:
    """4,096 ordered keys present with small values, the same count with 64 KiB values, and misses.
    Lookup is a key query (no checksum pass over hit values), so the first two should match."""

    keys: list[bytes]
    request: pb.LookupRequest
    big_keys: list[bytes]
    big_value: bytes
    big_request: pb.LookupRequest
    miss_request: pb.LookupRequest
    # Random bytes as long as `request`, for the raw-gRPC echo of the same bytes.
    echo_payload: bytes

    @classmethod
    def create(cls, kv: KvtagBench) -> LookupSets:
        keys = [block_key("lookup-small", i) for i in range(LOOKUP_KEYS)]
        kv.put_values(keys, b"v" * 64)
        request = kv.lookup_request(keys)
        big_keys = [block_key("lookup-64KiB", i) for i in range(LOOKUP_KEYS)]
        big_value = os.urandom(64 * KiB)
        kv.put_values(big_keys, big_value)
        return cls(
            keys,
            request,
            big_keys,
            big_value,
            kv.lookup_request(big_keys),
            kv.lookup_request([block_key("lookup-miss", i) for i in range(LOOKUP_KEYS)]),
            os.urandom(request.ByteSize()),
        )

    def ensure_present(self, kv: KvtagBench) -> None:
        """A small --capacity may have evicted the sets: put them back (untimed)."""
        kv.ensure_present(self.request, self.keys, b"v" * 64)
        kv.ensure_present(self.big_request, self.big_keys, self.big_value)


@dataclass
class Subjects:
    """What one run measures: the store, the raw-bytes server, the value plans and the lookup sets."""

    kv: KvtagBench
    kv_server: Server
    ref: BytesBench
    echo_server: Server
    plans: list[Plan]
    pools: dict[int, ValuePool]
    dst: memoryview  # pre-touched memcpy destination
    lookups: LookupSets


def warm_up(t: Subjects) -> None:
    """Connections, thread pools, allocator, every download size."""
    kv, ref = t.kv, t.ref
    for p in t.plans:
        one = Plan(p.value_size, p.batch_items, 1)
        for items in kv.put_batches(one, t.pools[p.value_size], f"warm/{p.value_size}"):
            kv.put_call(items, p.batch_bytes)()
        for greq in kv.get_batches(one, f"warm/{p.value_size}"):
            kv.get_call(greq)()
        ref.download_call(p.batch_bytes)()
        ref.upload_call(t.pools[p.value_size][0] * p.batch_items)()
        ref.echo_call(t.pools[p.value_size][0])()
    for _ in range(3):
        kv.lookup_latency(t.lookups.request, LOOKUP_KEYS)
        ref.latency(t.lookups.echo_payload)


def transfer_pass(t: Subjects, p: Plan, tag: str, series: dict[str, Series]) -> None:
    """One repeat of every throughput column at one value size, interleaved."""
    kv, ref, kv_server, echo_server = t.kv, t.ref, t.kv_server, t.echo_server
    pool = t.pools[p.value_size]
    values = [pool[i] for i in range(p.batch_items * p.batches)]
    series["memcpy"].samples.append(memcpy_pass(values, t.dst))
    series["memcpy_fresh"].samples.append(memcpy_fresh_pass(values))
    payload = b"".join(values[: p.batch_items])
    series["grpc_upload"].samples.append(timed_calls([ref.upload_call(payload)] * p.batches, echo_server))
    del payload
    puts = kv.put_batches(p, pool, tag)
    series["kvtag_put"].samples.append(
        timed_calls([kv.put_call(items, p.batch_bytes) for items in puts], kv_server)
    )
    del puts
    series["grpc_download"].samples.append(
        timed_calls([ref.download_call(p.batch_bytes)] * p.batches, echo_server)
    )
    gets = kv.get_batches(p, tag)
    series["kvtag_get"].samples.append(timed_calls([kv.get_call(r) for r in gets], kv_server))
    if p.value_size == MiB:  # the target size: also with two RPCs in flight
        two_in_flight_pass(t, p, values, tag, series)
    # Echo at the value size: one value per message, both ways (the plain gRPC baseline).
    echo_n = max(1, p.volume // p.value_size // 2)
    series["grpc_echo"].samples.append(
        timed_calls([ref.echo_call(pool[i]) for i in range(echo_n)], echo_server)
    )


def two_in_flight_pass(
    t: Subjects, p: Plan, values: list[bytes], tag: str, series: dict[str, Series]
) -> None:
    """The 1 MiB extras: two RPCs in flight both ways, and the generated-stub Put."""
    kv, ref, kv_server, echo_server = t.kv, t.ref, t.kv_server, t.echo_server
    payload = b"".join(values[: p.batch_items])
    series["grpc_upload_2inflight"].samples.append(
        timed_calls([ref.upload_call(payload)] * p.batches, echo_server, 2)
    )
    del payload
    generated = kv.put_generated_batches(p, t.pools[p.value_size], tag + "/generated")
    series["kvtag_put_generated"].samples.append(
        timed_calls([kv.put_generated_call(r, p.batch_bytes) for r in generated], kv_server)
    )
    del generated
    puts = kv.put_batches(p, t.pools[p.value_size], tag + "/2inflight")
    series["kvtag_put_2inflight"].samples.append(
        timed_calls([kv.put_call(items, p.batch_bytes) for items in puts], kv_server, 2)
    )
    del puts
    series["grpc_download_2inflight"].samples.append(
        timed_calls([ref.download_call(p.batch_bytes)] * p.batches, echo_server, 2)
    )
    gets = kv.get_batches(p, tag + "/2inflight")
    series["kvtag_get_2inflight"].samples.append(timed_calls([kv.get_call(r) for r in gets], kv_server, 2))


def lookup_pass(t: Subjects, count: int, lat: dict[str, list[list[float]]]) -> None:
    """One repeat of the Lookup latencies and their raw-gRPC echo bounds."""
    kv, ref, sets = t.kv, t.ref, t.lookups
    sets.ensure_present(kv)
    lat["kvtag_lookup_4096_hit"].append([kv.lookup_latency(sets.request, LOOKUP_KEYS) for _ in range(count)])
    lat["kvtag_lookup_4096_hit_64KiB_values"].append(
        [kv.lookup_latency(sets.big_request, LOOKUP_KEYS) for _ in range(max(5, count // 4))]
    )
    lat["kvtag_lookup_4096_miss"].append([kv.lookup_latency(sets.miss_request, 0) for _ in range(count)])
    lat["grpc_echo_same_bytes"].append([ref.latency(sets.echo_payload) for _ in range(count)])
    lat["grpc_echo_1_byte"].append([ref.latency(b"x") for _ in range(count)])


def profile_phases(t: Subjects, args: argparse.Namespace, log_dir: Path) -> dict[str, dict[str, Any]]:
    """py-spy profiles of the server under back-to-back 1 MiB Puts, 1 MiB Gets and Lookups."""
    py_spy = find_py_spy(args.py_spy)
    if py_spy is None:
        return {"error": {"error": "py-spy not found (pip install py-spy==0.4.3, or pass --py-spy PATH)"}}
    kv, sets = t.kv, t.lookups
    p1 = next(p for p in t.plans if p.value_size == MiB)
    one = Plan(p1.value_size, p1.batch_items, 1)
    counter = iter(range(10**9))
    recent: collections.deque[str] = collections.deque(maxlen=8)

    def put_work() -> None:
        recent.append(f"profile/{next(counter)}")
        for items in kv.put_batches(one, t.pools[MiB], recent[-1]):
            kv.put_call(items, one.batch_bytes)()

    def get_work() -> None:  # reads the latest profile puts: older ones may be evicted
        recent.rotate(1)
        for g in kv.get_batches(one, recent[0]):
            kv.get_call(g)()

    def lookup_work() -> None:
        kv.lookup_latency(sets.request, LOOKUP_KEYS)

    profile: dict[str, dict[str, Any]] = {}
    for name, work, what in (
        ("put_1MiB", put_work, "1 MiB Put batches, back to back"),
        ("get_1MiB", get_work, "1 MiB Get batches, back to back"),
        ("lookup_4096", lookup_work, "4,096-key Lookup, all hits, back to back"),
    ):
        kv.ensure_present(sets.request, sets.keys, b"v" * 64)  # the put phase may evict it
        raw = log_dir / f"kvtag-server-{name}.pyspy.txt"
        profile[name] = profile_server(py_spy, t.kv_server, work, args.profile, raw)
        profile[name]["workload"] = what
        profile[name]["raw_stacks"] = str(raw)
    return profile


def throughput_summary(series: dict[str, dict[str, Series]]) -> dict[str, Any]:
    """Per value size: each column's summary and the ratios between them (medians of the same run)."""
    results: dict[str, Any] = {}
    for label, by_kind in series.items():
        summary = {kind: s.summary() for kind, s in by_kind.items()}
        med = {kind: summary[kind]["GBps_median"] for kind in summary}
        ratios = {
            "put/grpc_upload": round(med["kvtag_put"] / med["grpc_upload"], 3),
            "get/grpc_download": round(med["kvtag_get"] / med["grpc_download"], 3),
            "put/grpc_echo": round(med["kvtag_put"] / med["grpc_echo"], 3),
            "get/grpc_echo": round(med["kvtag_get"] / med["grpc_echo"], 3),
            "put/memcpy": round(med["kvtag_put"] / med["memcpy"], 4),
            "put/memcpy_fresh": round(med["kvtag_put"] / med["memcpy_fresh"], 4),
            "get/memcpy": round(med["kvtag_get"] / med["memcpy"], 4),
        }
        if "kvtag_put_generated" in med:
            ratios["put_generated/grpc_upload"] = round(med["kvtag_put_generated"] / med["grpc_upload"], 3)
        if "kvtag_put_2inflight" in med:
            ratios["put_2inflight/grpc_upload_2inflight"] = round(
                med["kvtag_put_2inflight"] / med["grpc_upload_2inflight"], 3
            )
            ratios["get_2inflight/grpc_download_2inflight"] = round(
                med["kvtag_get_2inflight"] / med["grpc_download_2inflight"], 3
            )
        summary["ratios"] = ratios
        results[label] = summary
    return results


def run(args: argparse.Namespace) -> dict[str, Any]:
    quick: bool = args.quick
    repeats: int = args.repeats or (3 if quick else 7)
    volume = (48 if quick else 128) * MiB
    lookups_per_repeat = 20 if quick else 60
    started = time.time()
    info = machine_info()
    log_dir = Path(tempfile.mkdtemp(prefix="kvtag-bench-"))

    kv_port, echo_port = free_port(), free_port()
    kv_argv = kvtag_store_argv(kv_port, args)
    max_msg = 64 * MiB
    server_env = dict(item.split("=", 1) for item in args.server_env)
    with start_server("kvtag-store", kv_argv, kv_port, log_dir, server_env) as kv_server:
        kv_channel = grpc.insecure_channel(kv_server.address, options=channel_options(max_msg))
        wait_ready(kv_server, kv_channel)
        kv = KvtagBench(kv_channel, kv_server)
        max_msg = int(kv.limits.max_message_bytes)
        kv_channel.close()  # reopen with the server's own limit
        kv_channel = grpc.insecure_channel(kv_server.address, options=channel_options(max_msg))
        kv = KvtagBench(kv_channel, kv_server)
        echo_argv = [
            sys.executable, __file__, "--serve-bytes", f"127.0.0.1:{echo_port}",
            "--workers", str(args.workers), "--max-message-bytes", str(max_msg),
        ]  # fmt: skip
        with start_server("grpc-bytes", echo_argv, echo_port, log_dir, server_env) as echo_server:
            echo_channel = grpc.insecure_channel(echo_server.address, options=channel_options(max_msg))
            wait_ready(echo_server, echo_channel)
            plans = [plan_for(size, volume, kv.limits) for size in VALUE_SIZES]
            dst = memoryview(bytearray(max(p.volume for p in plans)))
            dst[:] = bytes(len(dst))  # touch every page before timing
            t = Subjects(
                kv,
                kv_server,
                BytesBench(echo_channel),
                echo_server,
                plans,
                {p.value_size: ValuePool(p.value_size, max(p.batch_bytes, 32 * MiB)) for p in plans},
                dst,
                LookupSets.create(kv),
            )
            warm_up(t)
            series: dict[str, dict[str, Series]] = {
                f"{p.value_size // KiB}KiB": collections.defaultdict(Series) for p in plans
            }
            lat: dict[str, list[list[float]]] = collections.defaultdict(list)
            loadavg: list[tuple[float, float, float]] = []
            for rep in range(repeats):
                loadavg.append(os.getloadavg())
                for p in plans:
                    label = f"{p.value_size // KiB}KiB"
                    transfer_pass(t, p, f"r{rep}/{label}", series[label])
                lookup_pass(t, lookups_per_repeat, lat)
            loadavg.append(os.getloadavg())
            profile = profile_phases(t, args, log_dir) if args.profile else None
            stats = kv.stub.GetStats(pb.GetStatsRequest())
            server_state = {
                "kvtag_rss_bytes": kv_server.rss_bytes(),
                "used_bytes": stats.used_bytes,
                "keys": stats.keys,
                "evictions": stats.evictions,
            }
            kv.close()
            echo_channel.close()
        kv_channel.close()

    if not args.profile:  # server logs are only kept when a run fails (or holds profiles)
        shutil.rmtree(log_dir, ignore_errors=True)
    results = throughput_summary(series)
    latency = {name: latency_summary([s for rep in reps for s in rep], reps) for name, reps in lat.items()}
    put1 = results["1024KiB"]["kvtag_put"]["GBps_median"]
    get1 = results["1024KiB"]["kvtag_get"]["GBps_median"]
    p50 = latency["kvtag_lookup_4096_hit"]["p50_ms"]
    info["loadavg_per_repeat"] = loadavg
    return {
        "benchmark": "kvtag store service, loopback",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started_unix": round(started),
        "duration_s": round(time.time() - started, 1),
        "machine": info,
        "config": {
            "quick": quick,
            "repeats": repeats,
            "volume_bytes_per_measurement": volume,
            "plans": [asdict(p) | {"batch_bytes": p.batch_bytes} for p in plans],
            "lookup_keys": LOOKUP_KEYS,
            "key_bytes": KEY_BYTES,
            "lookups_per_repeat": lookups_per_repeat,
            "lookup_request_bytes": len(t.lookups.echo_payload),
            "kvtag_server_argv": kv_argv,
            "server_env": server_env,
            "server_threading": f"both servers: grpc sync server, ThreadPoolExecutor({args.workers})",
            "session": kv.session_info,
            "GB": "1e9 bytes",
            "timed": "the RPC calls (client encoding of Put requests by kvtag_client.inline.put_encoding, "
            "or upb "
            "serialization of prepared messages for kvtag_put_generated and Get, transport, server, client "
            "parse, Get value extraction); building item lists and Get/generated Put messages is outside",
        },
        "server_state_after": server_state,
        "throughput": results,
        "lookup_latency": latency,
        "targets": {
            "put_1MiB_GBps": {"target": TARGETS["put_1MiB_GBps"], "measured": put1, "met": put1 >= 1.5},
            "get_1MiB_GBps": {"target": TARGETS["get_1MiB_GBps"], "measured": get1, "met": get1 >= 1.5},
            "lookup_p50_ms": {"target": TARGETS["lookup_p50_ms"], "measured": p50, "met": p50 <= 2.0},
        },
        "profile": profile,
    }


def print_table(report: dict[str, Any]) -> None:
    kinds = ("kvtag_put", "kvtag_get", "grpc_upload", "grpc_download", "grpc_echo", "memcpy", "memcpy_fresh")
    print(f"\nthroughput, GB/s (median of {report['config']['repeats']}; [min-max])")
    print(f"{'value':>8} " + " ".join(f"{k:>20}" for k in kinds))
    for label, row in report["throughput"].items():
        cells = [
            f"{row[k]['GBps_median']:7.3f} [{row[k]['GBps_min']:.2f}-{row[k]['GBps_max']:.2f}]" for k in kinds
        ]
        print(f"{label:>8} " + " ".join(f"{c:>20}" for c in cells))
    extra = ("kvtag_put_generated", "kvtag_put_2inflight", "kvtag_get_2inflight", "grpc_upload_2inflight")
    for label, row in report["throughput"].items():
        for kind in (k for k in (*extra, "grpc_download_2inflight") if k in row):
            cell = (
                f"{row[kind]['GBps_median']:7.3f} [{row[kind]['GBps_min']:.2f}-{row[kind]['GBps_max']:.2f}]"
            )
            print(f"{label:>8} {kind:>24} {cell}")
    print("\nratios (medians)")
    for label, row in report["throughput"].items():
        print(f"{label:>8} " + "  ".join(f"{k} {v}" for k, v in row["ratios"].items()))
    print("\nserver CPU ns/byte (kvtag put, get | bytes upload, download)")
    for label, row in report["throughput"].items():
        vals = [
            row[k]["server_cpu_ns_per_byte"]
            for k in ("kvtag_put", "kvtag_get", "grpc_upload", "grpc_download")
        ]
        print(f"{label:>8} {vals[0]}, {vals[1]} | {vals[2]}, {vals[3]}")
    print("\nlatency, ms")
    for name, lat in report["lookup_latency"].items():
        print(f"{name:>36}  p50 {lat['p50_ms']:8.3f}  p99 {lat['p99_ms']:8.3f}  (n={lat['count']})")
    print("\ntargets")
    for name, t in report["targets"].items():
        print(
            f"{name:>16}  target {t['target']}  measured {t['measured']}  {'MET' if t['met'] else 'NOT MET'}"
        )
    for name, prof in (report.get("profile") or {}).items():
        print(f"\nkvtag server profile, {prof.get('workload', name)} (busy samples by bucket, %)")
        for k, v in list(prof.get("busy_by_bucket_pct", {}).items())[:8]:
            print(f"  {v:5.1f}  {k}")
        if "error" in prof:
            print("  " + prof["error"])
    print(f"\nload average per repeat: {report['machine']['loadavg_per_repeat']}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller volumes and 3 repeats (under ~30 s)")
    parser.add_argument("--repeats", type=int, default=0, help="repeats (default 7, --quick 3)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    parser.add_argument("--capacity", default="4GiB", help="kvtag-store --capacity")
    parser.add_argument("--workers", type=int, default=16, help="gRPC worker threads of both servers")
    parser.add_argument(
        "--profile",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="also sample the kvtag server with py-spy",
    )
    parser.add_argument("--py-spy", default=None, help="py-spy executable (default: beside python, or PATH)")
    parser.add_argument("--kvtag-store", default=None, help="kvtag-store executable (default: beside python)")
    parser.add_argument(
        "--kvtag-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra kvtag-store serve argument, e.g. --kvtag-arg=--lease-ms=500 (repeatable)",
    )
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for both servers, e.g. GLIBC_TUNABLES=... (repeatable)",
    )
    parser.add_argument("--serve-bytes", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--max-message-bytes", type=int, default=64 * MiB, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_bytes:
        serve_bytes(args.serve_bytes, args.workers, args.max_message_bytes)
        return
    check_put_encoding()
    report = run(args)
    print_table(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
