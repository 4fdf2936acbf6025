"""The memory backend's disk tier, on real files: more than memory holds, a restart keeps every record,
damaged records are never served, one store per directory, quotas on both tiers, and a full disk
turns the tier off while the store keeps serving from memory."""

from __future__ import annotations

import errno
import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtag_store.backends.base import BlockAddress, BlockKey, KeyStatus, PutOutcome, TierUsage
from kvtag_store.backends.memory import MemoryBackend
from kvtag_store.backends.memory.disk import records
from kvtag_store.backends.memory.disk.errors import DiskDirError
from kvtag_store.backends.memory.disk.tier import DiskTier

HIT, MISS, MISMATCH = KeyStatus.HIT, KeyStatus.MISS, KeyStatus.MODE_MISMATCH
NS = "llama-8b/bf16"
MODE, OTHER_MODE = "mode-lookahead-1", "mode-legacy"


def address(i: int, group: int = 0) -> BlockAddress:
    return group, BlockKey(i.to_bytes(32, "little"))


def values(count: int, size: int, seed: int = 0) -> dict[BlockAddress, bytes]:
    return {address(seed * 1_000_000 + i): os.urandom(size) for i in range(count)}


def open_backend(
    disk: Path,
    capacity: int = 4 << 20,
    disk_capacity: int = 64 << 20,
    segment: int = 1 << 20,
    tenant_quotas: dict[str, int] | None = None,
    shm_groups: dict[str, int] | None = None,
) -> MemoryBackend:
    return MemoryBackend(
        capacity,
        tenant_quotas=tenant_quotas,
        shm_groups=shm_groups,
        prefault="lazy",
        disk_dir=str(disk),
        disk_capacity=disk_capacity,
        disk_segment_bytes=segment,
    )


def tier(backend: MemoryBackend) -> DiskTier:
    disk = backend.disk_tier()
    assert disk is not None
    return disk


def disk_row(backend: MemoryBackend) -> TierUsage:
    tiers = backend.stats().tiers
    assert [t.tier for t in tiers] == ["memory", "disk"]
    return tiers[1]


def put_paced(backend: MemoryBackend, stored: dict[BlockAddress, bytes], batch: int = 8) -> None:
    """Puts in batches, the writer drained between them (a put itself never waits for it)."""
    pairs = list(stored.items())
    for start in range(0, len(pairs), batch):
        results = backend.put_many(NS, MODE, pairs[start : start + batch])
        assert {r.outcome for r in results} == {PutOutcome.STORED}
        assert tier(backend).drain()


def get_in_batches(
    backend: MemoryBackend, addrs: list[BlockAddress], namespace_id: str = NS, batch: int = 4
) -> list[bytes | None]:
    """Values in Gets of a few blocks each (one Get reads back at most what memory holds)."""
    out: list[bytes | None] = []
    for start in range(0, len(addrs), batch):
        for result in backend.get(namespace_id, MODE, addrs[start : start + batch]):
            out.append(bytes(result.value) if result.value is not None else None)
    return out


def segment_files(disk: Path) -> list[Path]:
    return sorted(disk.glob("tenants/*/*.seg"))


@pytest.fixture
def backends() -> Iterator[list[MemoryBackend]]:
    """Backends to close at teardown (close is idempotent enough: a closed one holds nothing)."""
    opened: list[MemoryBackend] = []
    yield opened
    for backend in opened:
        backend.close()


def test_without_a_disk_dir_there_is_one_tier_and_nothing_restored() -> None:
    backend = MemoryBackend(1 << 20, prefault="lazy")
    try:
        assert [t.tier for t in backend.stats().tiers] == ["memory"]
        assert backend.restored() == {}
        assert backend.disk_tier() is None
    finally:
        backend.close()


def test_working_set_four_times_memory_is_readable_byte_exact(
    tmp_path: Path, backends: list[MemoryBackend]
) -> None:
    backend = open_backend(tmp_path / "disk", capacity=4 << 20)
    backends.append(backend)
    stored = values(256, 64 << 10)  # 16 MiB into 4 MiB of memory
    put_paced(backend, stored)
    assert backend.stats().used_bytes <= 4 << 20
    for addr, value in stored.items():
        (result,) = backend.get(NS, MODE, [addr])
        assert result.status == HIT, f"block {addr[1][:2].hex()} was lost"
        assert bytes(result.value or b"") == value, "a block came back with other bytes"
    row = disk_row(backend)
    assert row.keys == 256
    assert row.reads_back >= 256 - 64
    assert row.corrupted_dropped == 0


def test_values_evicted_before_the_writer_ran_are_spilled_from_a_copy(
    tmp_path: Path, backends: list[MemoryBackend]
) -> None:
    backend = open_backend(tmp_path / "disk", capacity=1 << 20)
    backends.append(backend)
    stored = values(280, 4 << 10)  # 24 more than memory holds, well within 1/8 of it pending
    pairs = list(stored.items())
    for part in (pairs[:200], pairs[200:]):  # no drain between: the writer may not have run yet
        assert {r.outcome for r in backend.put_many(NS, MODE, part)} == {PutOutcome.STORED}
    assert tier(backend).drain()
    assert tier(backend).spill_dropped == 0
    assert backend.stats().errors == {"disk_spill_dropped": 0}
    statuses = backend.lookup(NS, MODE, list(stored))
    assert statuses == [HIT] * len(stored)
    assert get_in_batches(backend, list(stored)) == list(stored.values())


def test_restart_serves_every_record_and_a_wrong_mode_gets_no_bytes(
    tmp_path: Path, backends: list[MemoryBackend]
) -> None:
    disk = tmp_path / "disk"
    first = open_backend(disk)
    stored = values(40, 32 << 10)
    first.put_many(NS, MODE, list(stored.items()))
    first.put_many("other-ns", OTHER_MODE, [(address(7), b"other")])
    first.close()  # flushes: nothing was drained before

    again = open_backend(disk)
    backends.append(again)
    assert again.restored() == {NS: (None, frozenset({MODE})), "other-ns": (None, frozenset({OTHER_MODE}))}
    assert again.lookup(NS, MODE, list(stored)) == [HIT] * 40
    assert [bytes(r.value or b"") for r in again.get(NS, MODE, list(stored))] == list(stored.values())
    assert again.lookup(NS, OTHER_MODE, list(stored)[:3]) == [MISMATCH] * 3
    wrong = again.get(NS, OTHER_MODE, list(stored)[:3])
    assert all(r.value is None and r.status != HIT for r in wrong), "a wrong-mode read returned bytes"


def test_a_put_at_a_key_held_on_disk_only_is_refused_in_another_mode(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    first = open_backend(disk)
    first.put_many(NS, MODE, [(address(1), b"lookahead")])
    first.close()
    again = open_backend(disk)
    try:
        (conflict,) = again.put_many(NS, OTHER_MODE, [(address(1), b"legacy")])
        assert conflict.outcome == PutOutcome.CONFLICT and MODE in conflict.reason
        (present,) = again.put_many(NS, MODE, [(address(1), b"lookahead")])
        assert present.outcome == PutOutcome.ALREADY_PRESENT
        assert bytes(again.get(NS, MODE, [address(1)])[0].value or b"") == b"lookahead"
    finally:
        again.close()


def test_packed_lookup_answers_and_pins_disk_hits(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    first = open_backend(disk)
    first.put_many(NS, MODE, [(address(i), b"v%d" % i) for i in range(4)])
    first.close()
    again = open_backend(disk)
    try:
        packed = b"".join(address(i)[1] for i in range(6))
        statuses, lease = again.lookup_packed_and_pin(NS, MODE, [(0, packed, 32)])
        assert list(statuses) == [HIT] * 4 + [MISS] * 2
        assert lease is not None and list(lease) == [address(i) for i in range(4)]
        assert again.stats().leased_keys == 4  # leases on disk-only blocks count as leases
        again.unpin(NS, lease)
        assert again.stats().leased_keys == 0
        statuses, lease = again.lookup_packed_and_pin(NS, OTHER_MODE, [(0, packed, 32)])
        assert list(statuses) == [MISMATCH] * 4 + [MISS] * 2 and lease is None
        assert disk_row(again).hits == 4
    finally:
        again.close()


def _record_offsets(path: Path) -> list[tuple[int, int, int]]:
    """(record start, value start, value end) of each record in a segment file."""
    data = path.read_bytes()
    out, offset = [], 0
    while offset < len(data):
        record = records.decode_meta(data[offset : offset + records.MAX_META])
        start = offset + record.meta_length
        out.append((offset, start, start + record.value_length))
        offset = start + record.value_length
    return out


def test_a_flipped_value_byte_is_never_served_and_is_counted(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    first = open_backend(disk)
    stored = values(8, 4096)
    first.put_many(NS, MODE, list(stored.items()))
    first.close()
    (segment,) = segment_files(disk)
    _, value_start, _ = _record_offsets(segment)[3]
    with open(segment, "r+b") as f:
        f.seek(value_start + 100)
        byte = f.read(1)
        f.seek(value_start + 100)
        f.write(bytes([byte[0] ^ 0x01]))
    again = open_backend(disk)
    try:
        results = again.get(NS, MODE, list(stored))
        damaged = list(stored)[3]
        for (addr, value), result in zip(stored.items(), results, strict=True):
            if addr == damaged:
                assert result.status == MISS and result.value is None, "a damaged record was served"
            else:
                assert bytes(result.value or b"") == value
        assert disk_row(again).corrupted_dropped == 1
        assert again.lookup(NS, MODE, [damaged]) == [MISS]  # dropped: the engine recomputes it
    finally:
        again.close()


def test_a_torn_tail_is_cut_off_and_the_records_before_it_are_served(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    first = open_backend(disk)
    stored = values(6, 8192)
    first.put_many(NS, MODE, list(stored.items()))
    first.close()
    (segment,) = segment_files(disk)
    last_start, value_start, _ = _record_offsets(segment)[-1]
    os.truncate(segment, value_start + 10)  # the last value written only in part, as a crash leaves it
    again = open_backend(disk)
    try:
        assert segment.stat().st_size == last_start
        addrs = list(stored)
        assert again.lookup(NS, MODE, addrs) == [HIT] * 5 + [MISS]
        assert [bytes(r.value or b"") for r in again.get(NS, MODE, addrs[:5])] == list(stored.values())[:5]
        assert disk_row(again).corrupted_dropped == 1
    finally:
        again.close()


def test_a_damaged_header_ends_the_scan_of_its_segment_there(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    first = open_backend(disk)
    stored = values(5, 1000)
    first.put_many(NS, MODE, list(stored.items()))
    first.close()
    (segment,) = segment_files(disk)
    start, _, _ = _record_offsets(segment)[2]
    with open(segment, "r+b") as f:
        f.seek(start + 20)  # inside the fixed header: its checksum fails
        f.write(b"\xff")
    again = open_backend(disk)
    try:
        assert again.lookup(NS, MODE, list(stored)) == [HIT, HIT, MISS, MISS, MISS]
        assert disk_row(again).corrupted_dropped == 1
    finally:
        again.close()


def test_a_second_store_on_the_same_dir_is_refused_naming_the_holder(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    first = open_backend(disk)
    try:
        with pytest.raises(
            DiskDirError, match=rf"another kvtag store holds it \(pid {os.getpid()}\)"
        ) as caught:
            open_backend(disk)
        assert str(disk) in str(caught.value) and isinstance(caught.value, ValueError)
    finally:
        first.close()
    open_backend(disk).close()  # released at close


def test_unusable_dirs_are_refused_with_the_reason(tmp_path: Path) -> None:
    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    with pytest.raises(DiskDirError, match="not a directory"):
        open_backend(not_dir)
    future = tmp_path / "future"
    future.mkdir()
    (future / "format").write_text("kvtag-disk 9\n")
    with pytest.raises(DiskDirError, match="kvtag-disk 9"):
        open_backend(future)
    with pytest.raises(DiskDirError, match="disk capacity must be positive"):
        open_backend(tmp_path / "no-capacity", disk_capacity=0)
    # The refused dir's lock was released: a fixed format line makes it usable.
    (future / "format").write_text("kvtag-disk 1\n")
    open_backend(future).close()


def test_tenant_files_are_private_or_group_owned(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    gid = os.getgid() if os.getgid() != 0 else 1
    backend = open_backend(disk, shm_groups={"team-b": gid})
    try:
        backend.assign_tenant("ns-a", "team-a")
        backend.assign_tenant("ns-b", "team-b")
        backend.put_many("ns-a", MODE, [(address(1), b"a")])
        backend.put_many("ns-b", MODE, [(address(1), b"b")])
        backend.put_many("ns-shared", MODE, [(address(1), b"s")])
        assert tier(backend).drain()
    finally:
        backend.close()
    tenants = disk / "tenants"
    assert sorted(p.name for p in tenants.iterdir()) == ["shared", "t-team-a", "t-team-b"]
    a_dir, b_dir = tenants / "t-team-a", tenants / "t-team-b"
    assert stat.S_IMODE(a_dir.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in a_dir.iterdir())
    assert stat.S_IMODE(b_dir.stat().st_mode) == 0o750 and b_dir.stat().st_gid == gid
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o640 and p.stat().st_gid == gid for p in b_dir.iterdir())
    again = open_backend(disk)
    try:
        assert again.restored()["ns-a"] == ("team-a", frozenset({MODE}))
        assert bytes(again.get("ns-b", MODE, [address(1)])[0].value or b"") == b"b"
    finally:
        again.close()


def test_quotas_bound_both_tiers(tmp_path: Path, backends: list[MemoryBackend]) -> None:
    disk = tmp_path / "disk"
    backend = open_backend(
        disk, capacity=2 << 20, disk_capacity=8 << 20, tenant_quotas={"small": 512 << 10}, segment=256 << 10
    )
    backends.append(backend)
    backend.assign_tenant("ns-small", "small")
    small = {address(i): os.urandom(32 << 10) for i in range(200)}  # 6.4 MiB, budget 2 MiB on disk
    pairs = list(small.items())
    for start in range(0, len(pairs), 4):
        backend.put_many("ns-small", MODE, pairs[start : start + 4])
        assert tier(backend).drain()
    shared = values(20, 32 << 10, seed=9)
    put_paced(backend, shared)
    small_pool_budget = (8 << 20) * (512 << 10) // (2 << 20)
    on_disk = sum(p.stat().st_size for p in (disk / "tenants" / "t-small").iterdir())
    assert on_disk <= small_pool_budget, (
        f"tenant small holds {on_disk} bytes on disk, budget {small_pool_budget}"
    )
    assert backend.stats().per_tenant["small"].used_bytes <= 512 << 10
    assert disk_row(backend).evictions > 0
    # The shared pool's records were not evicted to make room for the small tenant's.
    assert backend.lookup(NS, MODE, list(shared)) == [HIT] * 20
    # Whatever the small tenant still has is byte-exact; its most recent blocks are all there.
    got = get_in_batches(backend, list(small), "ns-small")
    assert all(v is None or v == small[a] for a, v in zip(small, got, strict=True)), "wrong bytes served"
    assert None not in got[-16:], "the tenant's most recent blocks were dropped"


def test_disk_lru_keeps_the_tier_within_its_capacity(tmp_path: Path, backends: list[MemoryBackend]) -> None:
    disk = tmp_path / "disk"
    backend = open_backend(disk, capacity=1 << 20, disk_capacity=4 << 20, segment=256 << 10)
    backends.append(backend)
    stored = values(300, 32 << 10)  # 9.4 MiB through 1 MiB of memory and 4 MiB of disk
    put_paced(backend, stored, batch=4)
    row = disk_row(backend)
    assert row.used_bytes <= 4 << 20
    assert sum(p.stat().st_size for p in segment_files(disk)) <= 4 << 20
    assert row.evictions > 0
    got = get_in_batches(backend, list(stored))
    assert all(v is None or v == stored[a] for a, v in zip(stored, got, strict=True)), "wrong bytes served"
    assert None not in got[-32:], "the most recent blocks were dropped"


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (we run as root here); skipped where mounting is not allowed."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_full_disk_turns_the_tier_off_and_the_store_keeps_serving(
    small_tmpfs: Path, backends: list[MemoryBackend], caplog: pytest.LogCaptureFixture
) -> None:
    backend = open_backend(small_tmpfs / "disk", capacity=4 << 20, disk_capacity=64 << 20, segment=8 << 20)
    backends.append(backend)
    stored = values(48, 64 << 10)  # 3 MiB: fits in memory, not on the 1 MiB disk
    pairs = list(stored.items())
    for start in range(0, len(pairs), 8):
        assert {r.outcome for r in backend.put_many(NS, MODE, pairs[start : start + 8])} == {
            PutOutcome.STORED
        }
        tier(backend).drain()
    row = disk_row(backend)
    assert row.degraded and row.failures == 1
    assert "No space left" in row.degraded_reason and str(small_tmpfs) in row.degraded_reason
    warnings = [r for r in caplog.records if "disk tier turned off" in r.getMessage()]
    assert len(warnings) == 1
    # Memory still serves every value, and new puts still work.
    assert [bytes(r.value or b"") for r in backend.get(NS, MODE, list(stored))] == list(stored.values())
    assert backend.put_many(NS, MODE, [(address(999), b"after")])[0].outcome == PutOutcome.STORED
    assert bytes(backend.get(NS, MODE, [address(999)])[0].value or b"") == b"after"
    assert disk_row(backend).keys == 0


def test_memory_per_disk_resident_key_is_within_200_bytes(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    first = open_backend(disk, capacity=1 << 20, disk_capacity=256 << 20, segment=64 << 20)
    count = 20_000
    for start in range(0, count, 1000):
        first.put_many(NS, MODE, [(address(i), b"x" * 16) for i in range(start, start + 1000)])
    first.close()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        again = open_backend(disk, capacity=1 << 20, disk_capacity=256 << 20)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    try:
        grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
        per_key = grown / count
        assert disk_row(again).keys == count
        assert per_key <= 200, f"{per_key:.0f} bytes of memory per disk-resident key"
    finally:
        again.close()


def test_concurrent_puts_gets_and_lookups_never_serve_wrong_bytes(
    tmp_path: Path, backends: list[MemoryBackend]
) -> None:
    """Readers race the writer, eviction, read-back and the disk LRU (small memory, small disk)."""
    backend = open_backend(tmp_path / "disk", capacity=1 << 20, disk_capacity=2 << 20, segment=128 << 10)
    backends.append(backend)
    stored = values(240, 16 << 10)  # 3.75 MiB: through 1 MiB of memory and 2 MiB of disk
    addrs = list(stored)
    wrong: list[str] = []
    stop = threading.Event()

    def writer(part: int) -> None:
        for start in range(part * 120, part * 120 + 120, 4):
            backend.put_many(NS, MODE, [(a, stored[a]) for a in addrs[start : start + 4]])
            tier(backend).drain()  # paced as the writer goes: this test is about races, not overruns

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            chosen = rng.sample(addrs, 4)
            if rng.random() < 0.3:
                _, pinned = backend.lookup_and_pin(NS, MODE, chosen)
                backend.unpin(NS, pinned)
                continue
            for a, result in zip(chosen, backend.get(NS, MODE, chosen), strict=True):
                if result.value is not None and bytes(result.value) != stored[a]:
                    wrong.append(a[1][:4].hex())

    readers = [threading.Thread(target=reader, args=(n,)) for n in range(2)]
    writers = [threading.Thread(target=writer, args=(n,)) for n in range(2)]
    for thread in readers + writers:
        thread.start()
    for thread in writers:
        thread.join()
    assert tier(backend).drain()
    stop.set()
    for thread in readers:
        thread.join()
    assert not wrong, f"wrong bytes served for {wrong[:5]}"
    got = get_in_batches(backend, addrs)
    assert all(v is None or v == stored[a] for a, v in zip(addrs, got, strict=True))
    assert backend.slots_in_use() == backend.stats().keys, "a slot leaked"
    row = disk_row(backend)
    assert row.reads_back > 0 and row.evictions > 0 and row.used_bytes <= 2 << 20, (
        row,
        tier(backend).spill_dropped,
    )


def test_an_io_error_reading_the_tier_turns_it_off_and_memory_still_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    disk = tmp_path / "disk"
    first = open_backend(disk)
    first.put_many(NS, MODE, [(address(1), b"on disk")])
    first.close()
    again = open_backend(disk)
    try:
        again.put_many(NS, MODE, [(address(2), b"in memory")])

        def failing_read(*_: object) -> int:  # the injected fault: a disk that fails reads
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "preadv", failing_read)
        (result,) = again.get(NS, MODE, [address(1)])
        monkeypatch.undo()
        assert result.status == MISS and result.value is None
        row = disk_row(again)
        assert row.degraded and row.failures == 1 and "Input/output error" in row.degraded_reason
        assert row.corrupted_dropped == 0  # a failing disk is not a damaged record
        assert len([r for r in caplog.records if "disk tier turned off" in r.getMessage()]) == 1
        assert again.lookup(NS, MODE, [address(1), address(2)]) == [MISS, HIT]
        assert bytes(again.get(NS, MODE, [address(2)])[0].value or b"") == b"in memory"
    finally:
        again.close()


_CRASHING_WRITER = """
import hashlib, sys
from kvtag_store.backends.base import BlockKey
from kvtag_store.backends.memory import MemoryBackend
backend = MemoryBackend(2 << 20, prefault="lazy", disk_dir=sys.argv[1], disk_capacity=256 << 20,
                        disk_segment_bytes=1 << 20)
i = 0
while i < 60_000:
    batch = []
    for _ in range(8):
        key = i.to_bytes(32, "little")
        batch.append(((0, BlockKey(key)), hashlib.blake2b(key, digest_size=64).digest() * 128))
        i += 1
    backend.put_many(sys.argv[2], sys.argv[3], batch)
    if i == 800:
        print("ready", flush=True)
import time
time.sleep(60)
"""


def test_after_a_sigkill_during_puts_every_value_served_verifies(tmp_path: Path) -> None:
    """A store killed while putting and writing: on restart nothing torn is served, every value
    served is the one put, and a torn tail is counted, not served."""
    import hashlib

    disk = tmp_path / "disk"
    child = subprocess.Popen(
        [sys.executable, "-c", _CRASHING_WRITER, str(disk), NS, MODE], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # puts and writes under way
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    again = open_backend(disk)
    try:
        restored = again.restored()
        assert restored == {NS: (None, frozenset({MODE}))}
        held = disk_row(again).keys
        assert held >= 100, f"only {held} records survived"
        keys = [address(i) for i in range(60_000)]
        statuses = again.lookup(NS, MODE, keys)
        hits = [a for a, s in zip(keys, statuses, strict=True) if s == HIT]
        assert len(hits) == held
        for start in range(0, len(hits), 8):
            chunk = hits[start : start + 8]
            for a, result in zip(chunk, again.get(NS, MODE, chunk), strict=True):
                expected = hashlib.blake2b(a[1], digest_size=64).digest() * 128
                assert result.value is None or bytes(result.value) == expected, (
                    "a torn or wrong value was served"
                )
        assert disk_row(again).corrupted_dropped <= 2  # at most the torn tail (and one bad read)
    finally:
        again.close()


def test_a_burst_past_the_spill_queue_drops_values_counted_and_never_serves_wrong_bytes(
    tmp_path: Path, backends: list[MemoryBackend]
) -> None:
    backend = open_backend(tmp_path / "disk", capacity=1 << 20)
    backends.append(backend)
    stored = values(1024, 4 << 10)  # 4x memory in bursts, the spill queue 1/8 of memory
    pairs = list(stored.items())
    for start in range(0, len(pairs), 128):
        assert {r.outcome for r in backend.put_many(NS, MODE, pairs[start : start + 128])} == {
            PutOutcome.STORED
        }
    assert tier(backend).drain()
    dropped = tier(backend).spill_dropped
    assert backend.stats().errors["disk_spill_dropped"] == dropped
    got = get_in_batches(backend, list(stored), batch=32)
    assert all(v is None or v == stored[a] for a, v in zip(stored, got, strict=True)), "wrong bytes served"
    assert got.count(None) <= dropped, "a value was lost that was not counted as dropped"


def test_per_namespace_counts_blocks_held_on_disk_only(tmp_path: Path) -> None:
    """The census sweeps namespaces that hold nothing: one whose blocks are only on disk holds them."""
    disk = tmp_path / "disk"
    first = open_backend(disk)
    first.put_many(NS, MODE, [(address(i), b"v") for i in range(5)])
    first.close()
    again = open_backend(disk)
    try:
        assert again.stats().per_namespace == {NS: (5, 0)}
        again.get(NS, MODE, [address(0), address(1)])  # read back: in both tiers now
        again.put_many(NS, MODE, [(address(9), b"new")])
        assert again.stats().per_namespace[NS][0] == 6
    finally:
        again.close()


def test_records_with_long_names_and_many_small_records_survive_a_restart(tmp_path: Path) -> None:
    """The start-up scan reads headers in chunks: records straddling a chunk, and names longer than
    a first read, come back whole."""
    disk = tmp_path / "disk"
    long_ns = "n" * 700  # a header plus names longer than the scan's first read
    first = open_backend(disk, capacity=1 << 20, segment=4 << 20)
    small = {address(i): os.urandom(100 + i % 300) for i in range(3000)}
    first.put_many(long_ns, "m" * 300, [(address(1), b"long names")])
    pairs = list(small.items())
    for start in range(0, len(pairs), 500):
        first.put_many(NS, MODE, pairs[start : start + 500])
        assert tier(first).drain()
    first.close()
    again = open_backend(disk, capacity=1 << 20, segment=4 << 20)
    try:
        assert disk_row(again).corrupted_dropped == 0
        assert bytes(again.get(long_ns, "m" * 300, [address(1)])[0].value or b"") == b"long names"
        assert again.lookup(NS, MODE, list(small)) == [HIT] * len(small)
        assert get_in_batches(again, list(small), batch=64) == list(small.values())
    finally:
        again.close()


def test_the_writer_lags_behind_puts_up_to_half_the_memory_then_writes(
    tmp_path: Path, backends: list[MemoryBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Write-behind: puts that keep coming run alone until the unwritten values pass half the memory
    capacity; a drain, a pause or the lag's age bound writes them. Puts are made to look continuous
    (a long quiet period), so what starts the writer here is the bound under test, not timing."""
    from kvtag_store.backends.memory.disk import writer as tier_module

    monkeypatch.setattr(tier_module, "QUIET_S", 60.0)
    monkeypatch.setattr(tier_module, "MAX_LAG_S", 60.0)
    backend = open_backend(tmp_path / "disk", capacity=4 << 20)
    backends.append(backend)
    disk = tier(backend)
    first, second = values(12, 128 << 10, seed=1), values(8, 128 << 10, seed=2)  # 1.5 MiB, then 2.5
    assert {r.outcome for r in backend.put_many(NS, MODE, list(first.items()))} == {PutOutcome.STORED}
    assert disk.queue.unwritten == 12 * (128 << 10)
    time.sleep(0.3)  # the writer woke (every put wakes it) and left the queue to the puts
    assert disk_row(backend).keys == 0, "the writer copied beside puts within the lag"
    assert {r.outcome for r in backend.put_many(NS, MODE, list(second.items()))} == {PutOutcome.STORED}
    deadline = time.monotonic() + 10
    while disk_row(backend).keys < 20:  # past half of the 4 MiB: written without waiting for a pause
        assert time.monotonic() < deadline, f"only {disk_row(backend).keys} of 20 written past the lag"
        time.sleep(0.02)
    assert disk.queue.unwritten == 0
    # The age bound: an unwritten value waits at most MAX_LAG_S, puts or not.
    third = values(4, 128 << 10, seed=3)
    assert {r.outcome for r in backend.put_many(NS, MODE, list(third.items()))} == {PutOutcome.STORED}
    time.sleep(0.3)
    assert disk_row(backend).keys == 20
    monkeypatch.setattr(tier_module, "MAX_LAG_S", 0.1)
    deadline = time.monotonic() + 10
    while disk_row(backend).keys < 24:
        assert time.monotonic() < deadline, "a value waited past the lag's age bound"
        time.sleep(0.02)
    # drain() (and so close) never waits for a pause.
    monkeypatch.setattr(tier_module, "MAX_LAG_S", 60.0)
    fourth = values(2, 128 << 10, seed=4)
    assert {r.outcome for r in backend.put_many(NS, MODE, list(fourth.items()))} == {PutOutcome.STORED}
    assert disk.drain()
    assert disk_row(backend).keys == 26
    every = first | second | third | fourth
    assert get_in_batches(backend, list(every)) == list(every.values())
