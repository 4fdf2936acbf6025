"""The shared-memory path over Mooncake: values staged in arena slots Mooncake reads into and writes
from (mooncake.staging). In process against the backend (exact bytes, tags, corruption, no slot
leaked), and through StoreClient against a real `kvtag-store serve --backend mooncake`, with a second
replica reading the same blocks inline."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import xxhash
from kvtag.v1 import store_pb2 as pb
from kvtag_client import keys
from kvtag_client.store import StoreClient
from kvtag_store.backends.base import (
    BlockAddress,
    BlockKey,
    KeyStatus,
    PutOutcome,
    SharedMemoryBackend,
    SlotReference,
)
from kvtag_store.backends.mooncake.backend import MooncakeBackend
from kvtag_store.backends.mooncake.client import MooncakeClient, MooncakeSettings, connect
from kvtag_store.backends.mooncake.format import object_key
from kvtag_store.backends.mooncake.shared_memory import SPARE_SHARE
from kvtag_store.backends.mooncake.staging import StagedAddress

from tests.client.shm_worker import run_races
from tests.descriptors import namespace
from tests.net import wait_until
from tests.store_process import REPO

from .mooncake_cluster import MooncakeCluster, settings_for
from .mooncake_replicas import Replica

MODE = "m-0123456789abcdef"
OTHER = "m-fedcba9876543210"
SIZES = [0, 1, 63, 64, 65, 4095, 4096, (64 << 10) + 7, 1 << 20]


def addr(name: str) -> BlockAddress:
    return (0, BlockKey(name.encode()))


def staged_settings(cluster: MooncakeCluster, shm_dir: Path, staging: int = 16 << 20) -> MooncakeSettings:
    base = settings_for(cluster)
    return MooncakeSettings(
        master=base.master,
        metrics=base.metrics,
        local_buffer_bytes=base.local_buffer_bytes,
        lease_ttl_ms=base.lease_ttl_ms,
        shm_dir=str(shm_dir),
        shm_staging_bytes=staging,
    )


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    path = Path("/dev/shm") / f"kvtag-test-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o700)
    yield path
    for leftover in path.iterdir():
        leftover.unlink()
    path.rmdir()


@pytest.fixture
def staged(cluster: MooncakeCluster, shm_dir: Path) -> Iterator[MooncakeBackend]:
    backend = MooncakeBackend(connect(settings_for(cluster)), staged_settings(cluster, shm_dir))
    yield backend
    backend.close()


def write(
    backend: MooncakeBackend, ns: str, mode: str, items: list[tuple[BlockAddress, bytes]]
) -> list[object]:
    """Reserve, write each value into its slot through the arena file, commit: what a client does."""
    arena = backend.shared_arena(ns)
    assert arena is not None and arena.path is not None
    grants = backend.reserve(ns, mode, [(a, len(v)) for a, v in items])
    with open(arena.path, "r+b") as mapped:
        for grant, (_, value) in zip(grants, items, strict=True):
            if isinstance(grant, SlotReference):
                mapped.seek(grant.offset)
                mapped.write(value)
    generations = [g.generation for g in grants if isinstance(g, SlotReference)]
    committed = iter(backend.commit(ns, mode, generations)[0])
    return [next(committed).outcome if isinstance(g, SlotReference) else g.outcome for g in grants]


def read(backend: MooncakeBackend, ns: str, mode: str, addresses: list[BlockAddress]) -> list[bytes | None]:
    """GetReferences, copy each referenced slot out of the arena file, release: what a client does."""
    arena = backend.shared_arena(ns)
    assert arena is not None and arena.path is not None
    statuses, references, pinned = backend.get_references(ns, mode, addresses)
    out: list[bytes | None] = []
    with open(arena.path, "rb") as mapped:
        for status, reference in zip(statuses, references, strict=True):
            if reference is None:
                assert status is not KeyStatus.HIT
                out.append(None)
                continue
            assert status is KeyStatus.HIT
            mapped.seek(reference.offset)
            out.append(mapped.read(reference.length))
    assert all(isinstance(a, StagedAddress) for a in pinned)
    backend.unpin(ns, pinned)
    return out


def test_the_mooncake_backend_offers_the_shared_memory_path_only_with_a_directory(
    mooncake_backend: MooncakeBackend, staged: MooncakeBackend
) -> None:
    assert isinstance(staged, SharedMemoryBackend)
    assert mooncake_backend.shared_arena("ns") is None
    arena = staged.shared_arena("ns-" + uuid.uuid4().hex[:8])
    assert arena is not None and arena.path is not None
    assert os.stat(arena.path).st_mode & 0o777 == 0o600


def test_shm_groups_give_each_tenants_staging_arena_to_its_group(
    cluster: MooncakeCluster, shm_dir: Path
) -> None:
    """`--shm-group` over Mooncake: the tenant's staging file gets its group and mode 0660, as the
    memory backend's arenas do; other tenants' stay 0600."""
    settings = dataclasses.replace(staged_settings(cluster, shm_dir), shm_groups={"acme": 40001})
    backend = MooncakeBackend(connect(settings_for(cluster)), settings)
    try:
        backend.assign_tenant("ns-acme", "acme")
        backend.assign_tenant("ns-globex", "globex")
        acme, globex = backend.shared_arena("ns-acme"), backend.shared_arena("ns-globex")
        assert acme is not None and acme.path is not None and globex is not None and globex.path is not None
        assert (os.stat(acme.path).st_gid, os.stat(acme.path).st_mode & 0o777) == (40001, 0o660)
        assert os.stat(globex.path).st_mode & 0o777 == 0o600
    finally:
        backend.close()


def write_into(backend: MooncakeBackend, ns: str, grants: Sequence[object], values: list[bytes]) -> None:
    arena = backend.shared_arena(ns)
    assert arena is not None and arena.path is not None
    with open(arena.path, "r+b") as mapped:
        for grant, value in zip(grants, values, strict=True):
            assert isinstance(grant, SlotReference)
            mapped.seek(grant.offset)
            mapped.write(value)


def test_spare_slots_make_a_put_one_commit_bound_to_its_keys_with_the_clients_digests(
    staged: MooncakeBackend, mooncake_backend: MooncakeBackend
) -> None:
    ns = "ns-" + uuid.uuid4().hex[:16]
    assert mooncake_backend.put(ns, MODE, addr("present"), b"p" * 64).outcome is PutOutcome.STORED
    assert mooncake_backend.put(ns, OTHER, addr("theirs"), b"t" * 64).outcome is PutOutcome.STORED
    values = [os.urandom(64) for _ in range(4)]
    grants = staged.reserve_spare(ns, [64] * 4)
    assert all(isinstance(g, SlotReference) for g in grants)
    assert staged.stats().spare_bytes == 4 * 64
    write_into(staged, ns, grants, values)
    keys = [addr("new"), addr("present"), addr("theirs"), addr("new2")]
    generations = [g.generation for g in grants if isinstance(g, SlotReference)]
    results, stored = staged.commit(
        ns, MODE, generations, [xxhash.xxh3_64_intdigest(v) for v in values], keys
    )
    assert [r.outcome for r in results] == [
        PutOutcome.STORED,
        PutOutcome.ALREADY_PRESENT,
        PutOutcome.CONFLICT,
        PutOutcome.STORED,
    ]
    assert stored == 2 * 64
    assert [r.value for r in mooncake_backend.get(ns, MODE, [addr("new"), addr("new2")])] == [
        values[0],
        values[3],
    ]
    assert read(staged, ns, MODE, [addr("new")]) == [values[0]]
    assert staged.stats().reserved_bytes == staged.stats().spare_bytes == 0


def test_spare_slots_stay_within_their_share_and_keyed_and_keyless_commits_are_refused(
    staged: MooncakeBackend,
) -> None:
    ns = "ns-" + uuid.uuid4().hex[:16]
    share = (16 << 20) // SPARE_SHARE  # the fixture's staging arena
    granted = staged.reserve_spare(ns, [share // 2, share // 2, 4096])
    assert [isinstance(g, SlotReference) for g in granted] == [True, True, False]
    spare = [g for g in granted if isinstance(g, SlotReference)]
    refused = granted[2]
    assert not isinstance(refused, SlotReference) and "share" in refused.reason
    [keyed] = staged.reserve(ns, MODE, [(addr("k"), 64)])
    assert isinstance(keyed, SlotReference)
    results, stored = staged.commit(ns, MODE, [keyed.generation], None, [addr("k")])
    assert [r.outcome for r in results] == [PutOutcome.REJECTED] and stored == 0
    results, stored = staged.commit(ns, MODE, [spare[0].generation])  # a spare slot without its key
    assert [r.outcome for r in results] == [PutOutcome.REJECTED] and "key" in results[0].reason
    staged.cancel([spare[1].generation])
    assert staged.stats().reserved_bytes == staged.stats().spare_bytes == 0
    assert staged.staging_slots_in_use == 0


def test_a_wrong_client_digest_is_never_served_and_a_reader_that_verifies_gets_the_digest(
    staged: MooncakeBackend,
) -> None:
    ns = "ns-" + uuid.uuid4().hex[:16]
    good, bad = os.urandom(4096), os.urandom(4096)
    grants = staged.reserve(ns, MODE, [(addr("good"), 4096), (addr("bad"), 4096)])
    write_into(staged, ns, grants, [good, bad])
    generations = [g.generation for g in grants if isinstance(g, SlotReference)]
    digests = [xxhash.xxh3_64_intdigest(good), xxhash.xxh3_64_intdigest(bad) ^ 1]
    results, _ = staged.commit(ns, MODE, generations, digests)
    assert [r.outcome for r in results] == [PutOutcome.STORED] * 2
    # A reader that verifies its own copy gets the stored digest and no check here.
    statuses, references, pinned = staged.get_references(ns, MODE, [addr("good")], verify=False)
    assert statuses == [KeyStatus.HIT] and references[0] is not None
    assert references[0].digest == xxhash.xxh3_64_intdigest(good)
    staged.unpin(ns, pinned)
    # Verified here, the value under the wrong digest is a miss and dropped.
    before = staged.stats().corrupted_dropped
    assert read(staged, ns, MODE, [addr("good"), addr("bad")]) == [good, None]
    assert staged.stats().corrupted_dropped == before + 1


def test_staged_round_trip_is_byte_exact_and_readable_by_the_inline_path(staged: MooncakeBackend) -> None:
    ns = "ns-" + uuid.uuid4().hex[:16]
    items = [(addr(f"size-{n}"), os.urandom(n)) for n in SIZES]
    assert write(staged, ns, MODE, items) == [PutOutcome.STORED] * len(items)
    addresses = [a for a, _ in items]
    assert read(staged, ns, MODE, addresses) == [v for _, v in items]
    # The same Mooncake objects as an inline put makes: the inline Get reads them, and back.
    assert [r.value for r in staged.get(ns, MODE, addresses)] == [v for _, v in items]
    inline = [(addr(f"inline-{n}"), os.urandom(n)) for n in SIZES]
    assert {r.outcome for r in staged.put_many(ns, MODE, inline)} == {PutOutcome.STORED}
    assert read(staged, ns, MODE, [a for a, _ in inline]) == [v for _, v in inline]
    assert staged.staging_slots_in_use == 0


def test_stored_blocks_are_answered_at_reserve_and_a_wrong_mode_gets_no_reference(
    staged: MooncakeBackend,
) -> None:
    ns = "ns-" + uuid.uuid4().hex[:16]
    assert write(staged, ns, MODE, [(addr("held"), b"first mode's bytes")]) == [PutOutcome.STORED]
    grants = staged.reserve(ns, MODE, [(addr("held"), 18)]) + staged.reserve(ns, OTHER, [(addr("held"), 18)])
    assert [g.outcome for g in grants if not isinstance(g, SlotReference)] == [
        PutOutcome.ALREADY_PRESENT,
        PutOutcome.CONFLICT,
    ]
    statuses, references, pinned = staged.get_references(ns, OTHER, [addr("held"), addr("absent")])
    assert statuses == [KeyStatus.MODE_MISMATCH, KeyStatus.MISS]
    assert references == [None, None] and pinned == []
    assert staged.staging_slots_in_use == 0


def test_a_corrupted_value_is_a_miss_and_dropped(staged: MooncakeBackend, raw_client: MooncakeClient) -> None:
    ns = "ns-" + uuid.uuid4().hex[:16]
    assert write(staged, ns, MODE, [(addr("k"), bytes(4096))]) == [PutOutcome.STORED]
    mkey = object_key(ns, MODE, *addr("k"))
    damaged = bytearray(raw_client.get(mkey))
    damaged[-1] ^= 0x01  # a payload byte: only the CRC tells
    raw_client.batch_remove([mkey], True)
    assert raw_client.put(mkey, bytes(damaged)) == 0
    before = staged.stats().corrupted_dropped
    assert read(staged, ns, MODE, [addr("k")]) == [None]
    assert staged.stats().corrupted_dropped == before + 1
    assert raw_client.batch_is_exist([mkey]) == [0]


def test_no_slot_outlives_its_reservation_or_lease(staged: MooncakeBackend) -> None:
    """A writer that dies before committing (its session's reservations cancelled), a lease released
    twice, and a staging arena too small for a Get: every slot comes back, nothing half-stored."""
    assert staged.staging_slots_in_use is not None
    ns = "ns-" + uuid.uuid4().hex[:16]
    grants = staged.reserve(ns, MODE, [(addr("dead"), 4096)])
    assert isinstance(grants[0], SlotReference) and staged.stats().reserved_bytes == 4096
    staged.cancel([grants[0].generation])
    assert staged.staging_slots_in_use == 0 and staged.stats().reserved_bytes == 0
    assert staged.lookup(ns, MODE, [addr("dead")]) == [KeyStatus.MISS]
    # Committing a cancelled reservation stores nothing.
    [late], stored = staged.commit(ns, MODE, [grants[0].generation])
    assert late.outcome is PutOutcome.REJECTED and stored == 0
    big = [(addr(f"big{i}"), os.urandom(6 << 20)) for i in range(4)]
    assert {r.outcome for r in staged.put_many(ns, MODE, big)} == {PutOutcome.STORED}
    statuses, _, pinned = staged.get_references(ns, MODE, [a for a, _ in big])
    # 16 MiB of staging holds two 6 MiB values at once: the others are misses, never wrong bytes.
    assert statuses.count(KeyStatus.HIT) == len(pinned) == 2
    assert staged.staging_slots_in_use == 2
    staged.unpin(ns, pinned)
    staged.unpin(ns, pinned)
    assert staged.staging_slots_in_use == 0
    assert read(staged, ns, MODE, [a for a, _ in big[:2]]) == [v for _, v in big[:2]]


def test_shared_memory_get_of_blocks_on_a_killed_storage_process_waits_one_transfer_timeout(
    tmp_path: Path, shm_dir: Path
) -> None:
    """As for the inline Get (test_mooncake_faults): 16 blocks on a dead storage process cost one read
    call and at most about one transfer timeout, the next Get none, and every slot comes back."""
    own = MooncakeCluster(tmp_path)
    own.start_master()
    own.start_storage(32 << 20)
    backend = MooncakeBackend(connect(settings_for(own)), staged_settings(own, shm_dir))
    try:
        ns = "ns-" + uuid.uuid4().hex[:16]
        blocks = [addr(f"k{i}") for i in range(16)]
        assert (
            write(backend, ns, MODE, [(a, bytes([i]) * 4096) for i, a in enumerate(blocks)])
            == [PutOutcome.STORED] * 16
        )
        own.kill_storage()
        started = time.monotonic()
        statuses, references, pinned = backend.get_references(ns, MODE, blocks)
        elapsed = time.monotonic() - started
        assert statuses == [KeyStatus.MISS] * 16 and references == [None] * 16 and pinned == []
        assert elapsed < 3.0, (
            f"a shared-memory Get of 16 blocks on a dead storage process took {elapsed:.1f} s"
        )
        assert backend.errors.snapshot().get("transfer") == 16
        started = time.monotonic()
        assert backend.get_references(ns, MODE, blocks)[0] == [KeyStatus.MISS] * 16
        assert time.monotonic() - started < 0.5
        assert backend.staging_slots_in_use == 0
    finally:
        backend.close()
        own.stop()


@pytest.fixture
def replicas(cluster: MooncakeCluster, tmp_path: Path, shm_dir: Path) -> Iterator[tuple[Replica, Replica]]:
    pair = (
        Replica(cluster, tmp_path, "shm", [f"--shm-dir={shm_dir}", "--mooncake-shm-staging=64MiB"]),
        Replica(cluster, tmp_path, "inline", ["--shm-dir="]),
    )
    for replica in pair:
        replica.start()
    yield pair
    for replica in pair:
        replica.stop()


def client_of(replica: Replica, tenant: str) -> StoreClient:
    client = StoreClient(
        f"127.0.0.1:{replica.port}",
        engine_id=f"engine-{replica.name}",
        namespace=namespace(tenant=tenant),
        mode=keys.mode(16, 0),
        probe_keys=keys.probe_keys(16, 0),
        rpc_timeout_s=10.0,
    )
    assert client.open()
    return client


def test_store_client_uses_the_shared_memory_path_over_mooncake_and_the_other_replica_reads_inline(
    replicas: tuple[Replica, Replica],
) -> None:
    shm_replica, inline_replica = replicas
    tenant = "t-" + uuid.uuid4().hex[:8]
    near = client_of(shm_replica, tenant)
    far = client_of(inline_replica, tenant)
    try:
        assert near.data_path == "shared_memory"
        assert far.data_path == "inline"
        items = [(0, f"size-{n}".encode(), os.urandom(n), b"") for n in SIZES]
        assert near.put(items) == [pb.STORED] * len(items)
        blocks = [(g, k) for g, k, _, _ in items]
        assert [bytes(v) if v is not None else None for v in far.get(blocks)] == [v for _, _, v, _ in items]
        more = [(1, f"far-{n}".encode(), os.urandom(n), b"") for n in SIZES]
        assert far.put(more) == [pb.STORED] * len(more)
        got = near.get([(g, k) for g, k, _, _ in more])
        assert [bytes(v) if v is not None else None for v in got] == [v for _, _, v, _ in more]
        assert near.put(items[:2]) == [pb.ALREADY_PRESENT] * 2
    finally:
        near.close()
        far.close()


@pytest.fixture
def small_staging(cluster: MooncakeCluster, tmp_path: Path, shm_dir: Path) -> Iterator[Replica]:
    """A replica whose staging arena is small (slots are reused all the time) and whose sessions
    expire 1 s after their last call."""
    replica = Replica(
        cluster,
        tmp_path,
        "small-staging",
        [f"--shm-dir={shm_dir}", "--mooncake-shm-staging=2MiB", "--session-ttl-ms=1000"],
    )
    replica.start()
    yield replica
    replica.stop()


def _reserved(replica: Replica) -> int:
    stats: pb.GetStatsResponse = replica.stub.GetStats(pb.GetStatsRequest(), timeout=10)
    return int(stats.reserved_bytes)


def test_racing_processes_over_a_small_staging_arena_are_served_only_exact_bytes(
    small_staging: Replica,
) -> None:
    """Three client processes put and get content-derived values through a 2 MiB staging arena, so
    slots are freed and handed out again under their feet; each checks every byte it is served."""
    reports = run_races(f"127.0.0.1:{small_staging.port}", processes=3, rounds=100)
    assert all(r["served"] > 0 and r["stored"] > 0 for r in reports), reports
    assert _reserved(small_staging) == 0


def test_a_writer_killed_mid_put_leaves_no_value_and_no_reserved_slot(small_staging: Replica) -> None:
    endpoint = f"127.0.0.1:{small_staging.port}"
    doomed = subprocess.Popen(
        [sys.executable, "-m", "tests.client.shm_worker", "reserve-and-hang", endpoint],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert doomed.stdout is not None
        line = doomed.stdout.readline()
        assert line == b"reserved\n", doomed.stderr.read().decode() if doomed.stderr else line
        assert _reserved(small_staging) == 4 * (64 << 10)
    finally:
        doomed.kill()
        doomed.wait(timeout=10)
    wait_until(lambda: _reserved(small_staging) == 0, 20, "the dead writer's slots to be freed")
    reader = StoreClient(
        endpoint,
        engine_id="reader",
        namespace=namespace("shm-tests"),
        mode=keys.mode(16, 0),
        probe_keys=keys.probe_keys(16, 0),
        rpc_timeout_s=10.0,
    )
    try:
        assert reader.open() and reader.data_path == "shared_memory"
        assert reader.get([(0, f"doomed-{i}".encode()) for i in range(4)]) == [None] * 4
    finally:
        reader.close()


def test_one_round_trip_puts_are_byte_exact_while_the_cluster_evicts(tmp_path: Path, shm_dir: Path) -> None:
    """StoreClient's puts over Mooncake go into spare slots (one CommitSlots each) while a 32 MiB
    cluster is written past its size, so Mooncake evicts under them: every value served is
    exact, the rest are misses."""
    own = MooncakeCluster(tmp_path, lease_ttl_ms=1000)
    own.start_master()
    own.start_storage(32 << 20)
    replica = Replica(own, tmp_path, "evicting", [f"--shm-dir={shm_dir}", "--mooncake-shm-staging=64MiB"])
    replica.start()
    client = client_of(replica, "t-" + uuid.uuid4().hex[:8])
    try:
        assert client.data_path == "shared_memory"
        written: list[tuple[tuple[int, bytes], bytes]] = []
        spared_puts = 0
        for round_ in range(24):
            items = [(0, f"r{round_}-b{i}".encode(), os.urandom(512 << 10), b"") for i in range(8)]
            if client.shm.spares.held().get(512 << 10, 0) >= len(items):
                spared_puts += 1  # this put needs no ReserveSlots
            statuses = client.put(items)
            assert statuses is not None, "the put degraded (the store was unreachable)"
            assert set(statuses) <= {pb.STORED, pb.REJECTED}, statuses  # REJECTED: full while evicting
            written += [
                ((g, k), v)
                for (g, k, v, _), status in zip(items, statuses, strict=True)
                if status == pb.STORED
            ]
            time.sleep(0.05)
            sample = written[-8:] + written[:8]
            got = client.get([address for address, _ in sample])
            for (address, value), served in zip(sample, got, strict=True):
                assert served is None or bytes(served) == value, address
        assert spared_puts >= 12, spared_puts
        stats: pb.GetStatsResponse = replica.stub.GetStats(pb.GetStatsRequest(), timeout=10)
        assert stats.evictions > 0
        assert len(written) * (512 << 10) > (32 << 20)  # more than the cluster holds
    finally:
        client.close()
        replica.stop()
        own.stop()


def test_a_replica_tells_each_block_it_stores_by_put_or_commit_as_mooncake(staged: MooncakeBackend) -> None:
    """KV events (docs/kv-events.md): what this replica stored, once; nothing for a block already there."""
    told: list[tuple[str, str, str, bytes, str]] = []

    class Recorder:
        def stored(self, namespace_id: str, mode_id: str, address: BlockAddress, tier: str) -> None:
            told.append(("stored", namespace_id, mode_id, address[1], tier))

        def removed(self, namespace_id: str, mode_id: str, address: BlockAddress, tier: str) -> None:
            told.append(("removed", namespace_id, mode_id, address[1], tier))

    staged.observe_blocks(Recorder())
    ns = "ns-" + uuid.uuid4().hex[:8]
    assert [r.outcome for r in staged.put_many(ns, MODE, [(addr("put-0"), b"a"), (addr("put-1"), b"b")])] == [
        PutOutcome.STORED
    ] * 2
    assert staged.put(ns, MODE, addr("put-0"), b"a").outcome is PutOutcome.ALREADY_PRESENT
    assert write(staged, ns, MODE, [(addr("commit-0"), b"c" * 4096)]) == [PutOutcome.STORED]
    assert told == [
        ("stored", ns, MODE, b"put-0", "mooncake"),
        ("stored", ns, MODE, b"put-1", "mooncake"),
        ("stored", ns, MODE, b"commit-0", "mooncake"),
    ]
