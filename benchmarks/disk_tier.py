"""The disk tier's targets (issue 28), ratios from one run, through StoreClient against a real server.

- 1 MiB Gets of disk-resident blocks (after a restart, page cache dropped with posix_fadvise
  DONTNEED) vs a plain sequential read of the same segment files, caches dropped the same way;
- put throughput with the disk tier on vs off (same values, interleaved runs): a burst within the
  writer's lag (half the memory capacity: puts run alone), a burst past it (the writer copies beside
  the puts) and a sustained load of 4x memory, each with what reached the disk;
- a restart on 100,000 small records: the index rebuild in us per record, and the time from the
  server process's start to the first Lookup hit served;
- memory per disk-resident key (tracemalloc around opening the backend on those records).

The server runs in its own process (this file with --serve), so client and server do not share a GIL.

    python benchmarks/disk_tier.py [--out benchmarks/results/disk_tier.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from provenance import git_describe

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repository, for tests.*

MiB = 1 << 20
PUT_REPEATS = 5  # interleaved off/on runs: this host is shared, one run alone says little
GET_REPEATS = 3
PER_CALL = 16  # blocks per put and per Get, as a connector batches a request's blocks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def serve(args: argparse.Namespace) -> None:
    """The server process: a memory backend with (or without) the disk tier until SIGTERM, which closes
    it (the flush). Prints one JSON line when serving: the rebuild figures."""
    from kvtag_store.app.server import start_server
    from kvtag_store.backends.memory import MemoryBackend, MemoryCensus
    from kvtag_store.config import ServiceConfig

    backend = MemoryBackend(
        args.capacity,
        shm_dir=args.shm_dir,
        prefault=args.prefault,
        disk_dir=args.disk_dir or None,
        disk_capacity=args.disk_capacity,
    )
    server = start_server(backend, MemoryCensus(), ServiceConfig(), listen=args.listen)
    tier = backend.disk_tier()
    print(
        json.dumps(
            {
                "address": server.address,
                "rebuild_s": tier.rebuild_seconds if tier else 0.0,
                "records": tier.rebuilt_records if tier else 0,
            }
        ),
        flush=True,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=1)


@contextlib.contextmanager
def server(root: Path, capacity: int, disk: bool, prefault: str = "full") -> Iterator[dict[str, Any]]:
    port = _free_port()
    # The arena in a tmpfs, as deployed: on the disk's file system its pages would be written back
    # (and re-dirtied by puts) like any file's.
    shm = tempfile.mkdtemp(prefix="kvtag-disk-bench-", dir="/dev/shm")
    command = [
        sys.executable,
        __file__,
        "--serve",
        "--listen",
        f"127.0.0.1:{port}",
        "--capacity",
        str(capacity),
        "--shm-dir",
        shm,
        "--prefault",
        prefault,
    ]
    if disk:
        command += ["--disk-dir", str(root / "disk"), "--disk-capacity", str(4 << 30)]
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"the server exited with {proc.wait()}")
        info = json.loads(line)
        info["started"] = started
        info["ready_s"] = time.perf_counter() - started
        yield info
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        shutil.rmtree(shm, ignore_errors=True)


def client(address: str, data_path: str = "auto") -> Any:
    from kvtag_client import keys
    from kvtag_client.store import StoreClient

    from tests.descriptors import namespace

    c = StoreClient(
        address,
        engine_id="bench",
        namespace=namespace(tenant="bench"),
        mode=keys.mode(16, 0),
        probe_keys=keys.probe_keys(16, 0),
        rpc_timeout_s=30.0,
        data_path=data_path,
    )
    return c


def drop_cache(directory: Path) -> int:
    """posix_fadvise(DONTNEED) over every file below `directory`; returns the bytes they hold."""
    total = 0
    for path in directory.rglob("*.seg"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def sequential_read(directory: Path) -> tuple[int, float]:
    """Bytes read and seconds: every segment file read in order, 1 MiB at a time into one buffer."""
    buffer = bytearray(MiB)
    view = memoryview(buffer)
    total = 0
    start = time.perf_counter()
    for path in sorted(directory.rglob("*.seg")):
        fd = os.open(path, os.O_RDONLY)
        try:
            offset = 0
            while True:
                n = os.preadv(fd, [view], offset)
                if n <= 0:
                    break
                offset += n
            total += offset
        finally:
            os.close(fd)
    return total, time.perf_counter() - start


def put_runs(root: Path, name: str, blocks: int, capacity: int) -> dict[str, Any]:
    """Puts of `blocks` 1 MiB values into a store of `capacity`, tier off and on in turn (three pairs),
    and what the tier holds 2 s after the puts stop."""
    values = [os.urandom(MiB) for _ in range(16)]  # reused: 16 distinct 1 MiB values, out of cache
    items = [(0, f"block-{i}".encode(), values[i % 16], b"") for i in range(blocks)]
    puts: dict[str, list[float]] = {"off": [], "on": []}
    on_disk: list[int] = []
    for repeat in range(PUT_REPEATS):
        for mode in ("off", "on"):
            run = root / f"{name}-{mode}-{repeat}"
            run.mkdir(parents=True)
            with server(run, capacity, disk=mode == "on") as info:
                c = client(info["address"])
                assert c.open(), "the client could not open a session"
                os.sync()  # the previous run's files written back first: the kernel's flush is not this run's
                time.sleep(1.0)  # let the up-front prefault settle
                start = time.perf_counter()
                for n in range(0, blocks, PER_CALL):
                    c.put(items[n : n + PER_CALL])
                puts[mode].append(blocks * MiB / (time.perf_counter() - start) / 1e9)
                if mode == "on":
                    time.sleep(2.0)  # the writer catches up once puts stop
                    on_disk.append(disk_tier_keys(info["address"]))
                c.close()
    return {
        "blocks": blocks,
        "memory_capacity_bytes": capacity,
        "put_GBps_disk_off": [round(x, 3) for x in puts["off"]],
        "put_GBps_disk_on": [round(x, 3) for x in puts["on"]],
        "put_on_vs_off_median": round(statistics.median(puts["on"]) / statistics.median(puts["off"]), 3),
        "put_on_vs_off_best": round(max(puts["on"]) / max(puts["off"]), 3),
        "disk_keys_2s_after": on_disk,
    }


def puts(root: Path, blocks: int) -> dict[str, Any]:
    """The writer lags behind puts until the unwritten values pass half the memory capacity: a burst
    within that runs alone, one past it shares the cores with the writer, and a sustained load of 4x
    memory writes what the writer can keep up with (the rest is evicted unwritten, counted)."""
    return {
        "burst_within_lag": put_runs(root, "burst", blocks, 2 * blocks * MiB + 64 * MiB),
        "burst_past_lag": put_runs(root, "past", blocks, blocks * MiB + 64 * MiB),
        "sustained_4x_memory": put_runs(root, "sustained", 4 * blocks, blocks * MiB),
    }


def gets(root: Path, blocks: int) -> dict[str, Any]:
    """1 MiB Gets of disk-resident blocks, after a restart with the page cache dropped, against a plain
    sequential read of the same segment files."""
    values = [os.urandom(MiB) for _ in range(16)]
    items = [(0, f"get-{i}".encode(), values[i % 16], b"") for i in range(blocks)]
    run = root / "gets"
    run.mkdir(parents=True)
    with server(run, blocks * MiB + 64 * MiB, disk=True) as info:
        c = client(info["address"])
        assert c.open(), "the client could not open a session"
        for n in range(0, blocks, PER_CALL):
            c.put(items[n : n + PER_CALL])
        c.close()  # SIGTERM on leaving: the close writes every value to the tier
    on_disk = drop_cache(run / "disk")
    sink_buffer = bytearray(MiB)

    def sink(index: int, slot: memoryview) -> bool:
        sink_buffer[: len(slot)] = slot
        return True

    gets: list[float] = []
    reads: list[float] = []
    for _ in range(GET_REPEATS):  # a Get run and a read run in turn: load from other processes hits both
        with server(run, 128 * MiB, disk=True) as info:
            c = client(info["address"])
            assert c.open()
            time.sleep(1.0)
            drop_cache(run / "disk")
            start = time.perf_counter()
            served = 0
            for n in range(0, blocks, PER_CALL):
                served += sum(c.get_into([(g, k) for g, k, _, _ in items[n : n + PER_CALL]], (), sink))
            gets.append(blocks * MiB / (time.perf_counter() - start) / 1e9)
            c.close()
        assert served == blocks, f"only {served} of {blocks} disk-resident blocks were served"
        drop_cache(run / "disk")
        read_bytes, read_s = sequential_read(run / "disk")
        reads.append(read_bytes / read_s / 1e9)
    ratios = [g / r for g, r in zip(gets, reads, strict=True)]
    return {
        "blocks": blocks,
        "bytes_on_disk": on_disk,
        "get_disk_resident_GBps": [round(x, 3) for x in gets],
        "sequential_read_GBps": [round(x, 3) for x in reads],
        "get_vs_read_median": round(statistics.median(ratios), 3),
    }


def disk_tier_keys(address: str) -> int:
    """The disk row's keys, from GetStats (the bench server has no tokens: all admins)."""
    import grpc
    from kvtag.v1 import store_pb2 as pb
    from kvtag.v1 import store_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub: Any = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
        stats = stub.GetStats(pb.GetStatsRequest(), timeout=30)
    for tier in stats.tiers:
        if tier.tier == "disk":
            return int(tier.keys)
    raise SystemExit("no disk tier in GetStats")


def restart(root: Path, records: int) -> dict[str, Any]:
    """100,000 small records written by a store of its own, then a server started on them."""
    from kvtag_store.backends.base import BlockKey
    from kvtag_store.backends.memory import MemoryBackend

    disk = root / "restart" / "disk"
    (root / "restart" / "shm").mkdir(parents=True)
    writer = MemoryBackend(64 * MiB, prefault="lazy", disk_dir=str(disk), disk_capacity=4 << 30)
    namespace_id = _namespace_id_of_bench_client()
    mode_id = _mode_id_of_bench_client()
    for start in range(0, records, 4096):
        batch = [
            ((0, BlockKey(f"small-{i}".encode())), i.to_bytes(8, "little") * 32)
            for i in range(start, min(records, start + 4096))
        ]
        writer.put_many(namespace_id, mode_id, batch)
        tier = writer.disk_tier()
        assert tier is not None
        tier.drain(60)
    writer.close()
    drop_cache(disk)

    with server(root / "restart", 64 * MiB, disk=True, prefault="lazy") as info:
        c = client(info["address"])
        first_hit = None
        while first_hit is None and time.perf_counter() - info["started"] < 30:
            if c.open():
                result = c.lookup([(0, b"small-0", b"")])
                if list(result.statuses) == [1]:
                    first_hit = time.perf_counter() - info["started"]
                    break
            time.sleep(0.01)
        c.close()
    rebuild_us = info["rebuild_s"] / max(1, info["records"]) * 1e6

    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    backend = MemoryBackend(1 * MiB, prefault="lazy", disk_dir=str(disk), disk_capacity=4 << 30)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    keys = backend.stats().tiers[1].keys
    backend.close()
    return {
        "records": info["records"],
        "rebuild_s": round(info["rebuild_s"], 3),
        "rebuild_us_per_record": round(rebuild_us, 2),
        "first_hit_s_from_process_start": round(first_hit, 3) if first_hit else None,
        "memory_bytes_per_disk_key": round(grown / max(1, keys), 1),
    }


def _mode_id_of_bench_client() -> str:
    """The mode_id the service stamps for the benchmark client's hashing mode."""
    from kvtag_client import keys
    from kvtag_proto import ids

    return ids.mode_id(keys.mode(16, 0))


def _namespace_id_of_bench_client() -> str:
    from kvtag_proto import ids

    from tests.descriptors import namespace

    return ids.namespace_id(namespace(tenant="bench"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--listen", default="127.0.0.1:0", help=argparse.SUPPRESS)
    parser.add_argument("--capacity", type=int, default=256 * MiB, help=argparse.SUPPRESS)
    parser.add_argument("--shm-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--prefault", default="full", help=argparse.SUPPRESS)
    parser.add_argument("--disk-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--disk-capacity", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, default=256, help="1 MiB blocks put and read back")
    parser.add_argument("--records", type=int, default=100_000, help="small records for the restart")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "disk_tier.json")
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kvtag-disk-bench-", dir="/var/tmp") as tmp:
        root = Path(tmp)
        report: dict[str, Any] = {"commit": git_describe(), "load_average_before": load_before}
        report["get"] = gets(root, args.blocks)
        report["put"] = puts(root, args.blocks)
        report["restart"] = restart(root, args.records)
        report["load_average_after"] = os.getloadavg()
        report["file_system"] = subprocess.run(
            ["df", "--output=fstype", "/var/tmp"], capture_output=True, text=True, check=False
        ).stdout.split()[-1]
    targets = {
        "get_vs_read (median) >= 0.5": report["get"]["get_vs_read_median"] >= 0.5,
        "put_on_vs_off, burst within the lag (median) >= 0.9": report["put"]["burst_within_lag"][
            "put_on_vs_off_median"
        ]
        >= 0.9,
        "put_on_vs_off, burst past the lag (median) >= 0.9": report["put"]["burst_past_lag"][
            "put_on_vs_off_median"
        ]
        >= 0.9,
        "put_on_vs_off, sustained 4x memory (median) >= 0.9": report["put"]["sustained_4x_memory"][
            "put_on_vs_off_median"
        ]
        >= 0.9,
        "rebuild_us_per_record <= 10": report["restart"]["rebuild_us_per_record"] <= 10,
        "first hit <= 2 s": (report["restart"]["first_hit_s_from_process_start"] or 99) <= 2,
        "memory per key <= 200 B": report["restart"]["memory_bytes_per_disk_key"] <= 200,
    }
    report["targets_met"] = targets
    print(json.dumps(report, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
