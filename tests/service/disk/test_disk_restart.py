"""The disk tier through real `kvtag-store serve` processes: restarts (SIGTERM and SIGKILL), strict
admission across them, a full disk, and the start-up refusals (exit 2, one line naming the path).

Values are derived from their keys (value_of), so a value served after any fault is checked against
what was put without the test remembering which puts landed."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc

from tests.descriptors import PROBE, mode, namespace
from tests.net import free_port, wait_until
from tests.store_process import StoreProcess, store_bin, store_starter

VALUE = 64 << 10
BATCH = 16  # 1 MiB a call: a Get's read-back must fit in memory beside what it evicts
MEMORY = "8MiB"


def value_of(key: bytes, size: int = VALUE) -> bytes:
    seed = hashlib.sha256(key).digest()
    return (seed * (size // len(seed) + 1))[:size]


class Engine:
    """One session over a real channel: puts and gets in batches, statuses and values as lists."""

    def __init__(self, endpoint: str, lookahead: int = 1, engine_id: str = "engine-a") -> None:
        self.channel = grpc.insecure_channel(endpoint)
        self.stub: Any = store_pb2_grpc.KvStoreStub(self.channel)  # type: ignore[no-untyped-call]
        request = pb.OpenSessionRequest(
            engine_id=engine_id, namespace=namespace(), mode=mode(lookahead=lookahead), probe_keys=PROBE
        )
        self.session_id = self.stub.OpenSession(request, timeout=10).session_id

    def put(self, keys: list[bytes]) -> list[int]:
        statuses: list[int] = []
        for i in range(0, len(keys), BATCH):
            items = [pb.PutItem(block=pb.BlockRef(key=k), value=value_of(k)) for k in keys[i : i + BATCH]]
            answer = self.stub.Put(pb.PutRequest(session_id=self.session_id, items=items), timeout=30)
            statuses += [r.status for r in answer.results]
        return statuses

    def get(self, keys: list[bytes]) -> list[tuple[int, bytes]]:
        out: list[tuple[int, bytes]] = []
        for i in range(0, len(keys), BATCH):
            refs = [pb.BlockRef(key=k) for k in keys[i : i + BATCH]]
            answer = self.stub.Get(pb.GetRequest(session_id=self.session_id, blocks=refs), timeout=30)
            out += [(r.status, bytes(r.value)) for r in answer.results]
        return out

    def stats(self) -> pb.GetStatsResponse:
        answer: pb.GetStatsResponse = self.stub.GetStats(pb.GetStatsRequest(), timeout=10)
        return answer

    def close(self) -> None:
        """CloseSession, then the channel: the census sees the engine leave."""
        with contextlib.suppress(grpc.RpcError):  # the store is gone (a kill): the session ends with it
            self.stub.CloseSession(pb.CloseSessionRequest(session_id=self.session_id), timeout=10)
        self.channel.close()


def disk_row(stats: pb.GetStatsResponse) -> pb.TierStats:
    rows = {t.tier: t for t in stats.tiers}
    assert "disk" in rows, f"no disk tier in GetStats: {stats.tiers}"
    return rows["disk"]


def on_disk_at_least(engine: Engine, count: int) -> bool:
    return disk_row(engine.stats()).keys >= count


def put_settled(engine: Engine, written: list[bytes], chunk: int = 4 * BATCH) -> None:
    """Put in chunks of half the memory, each written to the disk tier before the next: a put never
    waits for the disk (write-through in the background), so a writer outrun by a burst larger than
    memory drops what it cannot copy; the disk tier's own tests measure that, these restart it."""
    for i in range(0, len(written), chunk):
        assert set(engine.put(written[i : i + chunk])) == {pb.STORED}
        done = i + len(written[i : i + chunk])
        wait_until(partial(on_disk_at_least, engine, done), 30, f"{done} values on disk")


def keys(prefix: str, count: int) -> list[bytes]:
    return [f"{prefix}-{i:06d}".encode() for i in range(count)]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Any]:
    with store_starter(tmp_path) as starter:
        yield starter


def serve_args(disk_dir: Path, *more: str) -> tuple[str, ...]:
    """8 MiB of memory; 256 MiB of disk unless `more` says otherwise (the later flag wins)."""
    return ("--capacity", MEMORY, "--disk-dir", str(disk_dir), "--disk-capacity", "256MiB", *more)


def test_sigterm_then_restart_serves_every_value_byte_exact_and_nothing_to_another_mode(
    start: Any, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    written = keys("sigterm", 4 * 8 * 16)  # 32 MiB: four times the memory capacity
    store: StoreProcess = start(*serve_args(disk))
    engine = Engine(store.endpoint)
    put_settled(engine, written)
    before = engine.get(written)
    engine.close()
    assert all(status == pb.HIT for status, _ in before), "a working set 4x memory is readable"
    assert all(v == value_of(k) for k, (_, v) in zip(written, before, strict=True))
    assert store.proc is not None
    store.proc.terminate()
    assert store.proc.wait(timeout=60) == 0, store.log_tail()
    store.proc = None

    store.start()
    engine = Engine(store.endpoint)
    after = engine.get(written)
    missing = [k for k, (status, _) in zip(written, after, strict=True) if status != pb.HIT]
    assert not missing, f"{len(missing)} of {len(written)} values lost by a SIGTERM restart: {missing[:4]}"
    assert all(v == value_of(k) for k, (_, v) in zip(written, after, strict=True))
    assert disk_row(engine.stats()).reads_back >= len(written) - 8 * 16
    other = Engine(store.endpoint, lookahead=0, engine_id="legacy")
    assert all(not value for _, value in other.get(written)), "a wrong-mode read returns no bytes"
    engine.close()
    other.close()


def test_sigkill_under_put_load_then_restart_serves_only_verified_values(start: Any, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    store: StoreProcess = start(*serve_args(disk))
    attempted: list[bytes] = []
    stop = threading.Event()

    def load() -> None:
        engine = Engine(store.endpoint)
        batch = 0
        try:
            while not stop.is_set():
                chunk = keys(f"kill{batch}", BATCH)
                attempted.extend(chunk)
                engine.put(chunk)
                batch += 1
        except grpc.RpcError:
            pass  # the store was killed under the load
        finally:
            engine.close()

    loader = threading.Thread(target=load)
    loader.start()
    time.sleep(3.0)
    store.kill()
    stop.set()
    loader.join(timeout=30)
    assert len(attempted) >= 4 * BATCH, "the load put something before the kill"
    # Tear the newest record of every segment file as a crash mid-write would: the tail cut short.
    segments = sorted(
        (p for p in disk.rglob("*.seg") if p.stat().st_size > VALUE), key=lambda p: p.stat().st_mtime
    )
    assert segments, f"nothing reached the disk tier in 3 s of puts: {list(disk.rglob('*'))}"
    torn = segments[-1]
    os.truncate(torn, max(0, torn.stat().st_size - VALUE // 2))

    store.start()
    engine = Engine(store.endpoint)
    served = engine.get(attempted)
    hits = [(k, v) for k, (status, v) in zip(attempted, served, strict=True) if status == pb.HIT]
    wrong = [k for k, v in hits if v != value_of(k)]
    assert not wrong, f"served values that do not verify after a SIGKILL: {wrong[:4]}"
    assert hits, "a SIGKILL loses only the unwritten tail, not every value"
    stats = engine.stats()
    engine.close()
    assert disk_row(stats).corrupted_dropped >= 1, "the torn record is counted"
    print(f"\nSIGKILL after 3 s: {len(hits)} of {len(attempted)} values served, all verified; torn counted")


def test_a_strict_refusal_survives_a_restart_even_without_the_snapshot(start: Any, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    store: StoreProcess = start(*serve_args(disk, "--policy", "strict"))
    first = Engine(store.endpoint)
    assert set(first.put(keys("strict", BATCH))) == {pb.STORED}
    first.close()
    for snapshot_kept in (True, False):
        store.stop()
        if not snapshot_kept:
            (disk / "census.json").unlink()
        store.start()
        with pytest.raises(grpc.RpcError) as refused:
            Engine(store.endpoint, lookahead=0, engine_id="legacy")
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "strict" in str(refused.value.details())
        again = Engine(store.endpoint)
        assert [s for s, _ in again.get(keys("strict", BATCH))] == [pb.HIT] * BATCH
        again.close()


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "tmpfs"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_degrades_to_memory_only_visibly_and_the_store_keeps_serving(
    start: Any, small_tmpfs: Path
) -> None:
    http = free_port()
    store: StoreProcess = start(
        *serve_args(small_tmpfs / "disk"),
        "--metrics-listen",
        f"127.0.0.1:{http}",
    )
    engine = Engine(store.endpoint)
    written = keys("full", 24 * 16)  # 24 MiB into an 8 MiB file system
    assert set(engine.put(written)) == {pb.STORED}
    wait_until(lambda: disk_row(engine.stats()).degraded, 30, "the disk tier to degrade on ENOSPC")
    row = disk_row(engine.stats())
    assert row.failures >= 1 and row.degraded_reason, row
    # Still serving: new puts, and the newest values (memory) read back byte-exact.
    fresh = keys("after", BATCH)
    assert set(engine.put(fresh)) == {pb.STORED}
    assert engine.get(fresh) == [(pb.HIT, value_of(k)) for k in fresh]
    served = engine.get(written)
    assert all(v == value_of(k) for k, (s, v) in zip(written, served, strict=True) if s == pb.HIT)
    engine.close()
    assert "disk tier degraded" in store.cli("diagnose")
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/", timeout=10) as page:
        html = page.read().decode()
    assert "disk tier degraded:" in html
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10) as scrape:
        metrics = scrape.read().decode()
    assert 'kvtag_tier_degraded{tier="disk"} 1.0' in metrics
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/api/v1/status", timeout=10) as answer:
        degraded = json.loads(answer.read())["store"]["degraded"]
    assert [d["tier"] for d in degraded] == ["disk"]
    assert store.health()


def serve_exit(*args: str) -> tuple[int, str]:
    done = subprocess.run(
        [store_bin(), "serve", "--listen", f"127.0.0.1:{free_port()}", "--metrics-listen", "", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


def test_a_second_store_on_the_same_dir_exits_2_saying_another_store_holds_it(
    start: Any, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    first: StoreProcess = start(*serve_args(disk))
    code, output = serve_exit(*serve_args(disk))
    assert code == 2, output
    assert "another kvtag store holds it" in output and str(disk) in output
    assert "Traceback" not in output
    assert first.health(), "the first store is untouched"


@pytest.mark.parametrize("kind", ["a file", "unwritable", "mooncake"])
def test_a_disk_dir_that_cannot_be_used_exits_2_naming_the_path(kind: str, tmp_path: Path) -> None:
    if kind == "a file":
        bad = tmp_path / "not-a-dir"
        bad.write_bytes(b"x")
        code, output = serve_exit(*serve_args(bad))
        assert str(bad) in output
    elif kind == "unwritable":
        bad = Path("/proc/kvtag-disk")
        code, output = serve_exit(*serve_args(bad))
        assert str(bad) in output
    else:
        code, output = serve_exit("--backend", "mooncake", "--disk-dir", str(tmp_path))
        assert "Mooncake has its own offload" in output
    assert code == 2, output
    assert "Traceback" not in output and len(output.strip().splitlines()) == 1, output


def test_a_strict_namespace_whose_blocks_are_only_on_disk_is_not_forgotten(
    start: Any, tmp_path: Path
) -> None:
    """The census forgets a namespace without blocks after --census-retention; blocks on the disk
    tier are blocks, so a strict namespace holding only those keeps its mode past the window."""
    disk = tmp_path / "disk"
    store: StoreProcess = start(*serve_args(disk, "--policy", "strict", "--census-retention", "500ms"))
    first = Engine(store.endpoint)
    put_settled(first, keys("forget", BATCH))
    first.close()
    store.stop()
    store.start()
    Engine(store.endpoint).close()  # admitted in its mode; its blocks stay on disk, none read back
    time.sleep(3.0)  # several retention windows and sweeps
    with pytest.raises(grpc.RpcError) as refused:
        Engine(store.endpoint, lookahead=0, engine_id="legacy")
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
