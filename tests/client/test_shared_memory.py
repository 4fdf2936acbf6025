"""The same-host shared-memory data path, through StoreClient against a real kvtag-store process:
byte-exact, tag-enforced, exactly accounted, safe under racing processes and dying writers, and
falling back to the inline path (logged once) whenever the arena cannot be mapped."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import xxhash
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_client.shm.mapping import LARGE_SLOT_BYTES
from kvtag_client.store import StoreClient
from kvtag_proto import pages

from tests.net import wait_until
from tests.store_process import REPO, StoreProcess

from .conftest import ClientFactory, StoreFactory
from .shm_worker import run_races

SIZES = [0, 1, 63, 64, 65, 4095, 4096, (64 << 10) + 7, 1 << 20]


def _stats(endpoint: str) -> pb.GetStatsResponse:
    with grpc.insecure_channel(endpoint) as channel:
        stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
        response: pb.GetStatsResponse = stub.GetStats(pb.GetStatsRequest(), timeout=10)
        return response


def _shm_client(make_client: ClientFactory, endpoint: str, **kwargs: object) -> StoreClient:
    client = make_client(endpoint, **kwargs)
    assert client.open()
    assert client.data_path == "shared_memory"
    return client


def test_round_trip_is_byte_exact_for_every_size(
    shared_store: StoreProcess, make_client: ClientFactory
) -> None:
    client = _shm_client(make_client, shared_store.endpoint, tenant="exact")
    items = [(0, f"size-{n}".encode(), os.urandom(n), b"") for n in SIZES]
    assert client.put(items) == [pb.STORED] * len(items)
    assert client.put(items[:3]) == [pb.ALREADY_PRESENT] * 3
    assert client.get([(g, k) for g, k, _, _ in items]) == [v for _, _, v, _ in items]

    # The zero-copy calls the connector uses: fill slots in place, copy out of pinned slots.
    sized = [(1, f"zc-{n}".encode(), n, b"") for n in SIZES]
    sources = [os.urandom(n) for n in SIZES]

    def fill(index: int, slot: memoryview) -> None:
        slot[:] = sources[index]

    assert client.put_from(sized, fill) == [pb.STORED] * len(sized)
    copies: dict[int, bytes] = {}

    def sink(index: int, slot: memoryview) -> bool:
        copies[index] = bytes(slot)
        return True

    assert client.get_into([(1, k) for _, k, _, _ in sized], (), sink) == [True] * len(sized)
    assert [copies[i] for i in range(len(SIZES))] == sources
    assert client.counters.put_stored == 2 * len(SIZES)


def test_wrong_mode_get_gets_no_reference_and_no_bytes(
    shared_store: StoreProcess, make_client: ClientFactory
) -> None:
    legacy = _shm_client(make_client, shared_store.endpoint, tenant="modes")
    lookahead = _shm_client(make_client, shared_store.endpoint, tenant="modes", lookahead_tokens=1)
    assert legacy.put([(0, b"block", b"legacy-bytes", b"")]) == [pb.STORED]
    assert lookahead.put([(0, b"block", b"lookahead-bytes", b"")]) == [pb.CONFLICT]
    assert lookahead.get([(0, b"block")]) == [None]
    reply = lookahead.session.stub.GetReferences(
        pb.GetRequest(session_id=lookahead.session_id, blocks=[pb.BlockRef(key=b"block")]), timeout=10
    )
    assert [(r.status, r.HasField("slot")) for r in reply.results] == [(pb.MODE_MISMATCH, False)]
    assert not reply.lease.lease_id
    # No slot may be reserved for a key another mode holds either.
    reservation = lookahead.reserve([(0, b"block", 12, b"")])
    assert reservation is not None
    assert (reservation.statuses, reservation.slots) == ([pb.CONFLICT], [None])
    assert legacy.get([(0, b"block")]) == [b"legacy-bytes"]


def test_capacity_accounting_is_exact_and_eviction_frees_slots(
    start_store: StoreFactory, make_client: ClientFactory
) -> None:
    store = start_store("--capacity", "1000000")
    client = _shm_client(make_client, store.endpoint)
    values = [(0, f"v{i}".encode(), os.urandom(100_000), b"") for i in range(25)]
    for start in range(0, 25, 5):
        assert client.put(values[start : start + 5]) == [pb.STORED] * 5
        stats = _stats(store.endpoint)
        assert stats.used_bytes == stats.keys * 100_000 <= 1_000_000
        assert stats.reserved_bytes == 0
    stats = _stats(store.endpoint)
    assert (stats.keys, stats.used_bytes, stats.evictions) == (10, 1_000_000, 15)
    assert client.get([(0, k) for _, k, _, _ in values[15:]]) == [v for _, _, v, _ in values[15:]]
    assert client.get([(0, values[0][1])]) == [None]


def test_a_reader_never_keeps_bytes_from_a_slot_reused_after_its_lease(
    start_store: StoreFactory, make_client: ClientFactory
) -> None:
    """The lease pins a slot only for lease_ms; a reader slower than that must find the generation
    changed and void its copy rather than return another block's bytes."""
    store = start_store("--capacity", "400000", "--lease-ms", "200")
    reader = _shm_client(make_client, store.endpoint)
    writer = _shm_client(make_client, store.endpoint)
    original = os.urandom(100_000)
    assert reader.put([(0, b"victim", original, b"")]) == [pb.STORED]
    copies: list[bytes] = []

    def slow_sink(index: int, slot: memoryview) -> bool:
        # The read lease (200 ms) lapses: the store may now evict and reuse the slot.
        wait_until(lambda: _stats(store.endpoint).leased_keys == 0, 20, "the read lease to expire")
        for i in range(4):
            fillers = [(0, f"filler-{i}-{j}".encode(), os.urandom(100_000), b"") for j in range(2)]
            assert writer.put(fillers) == [pb.STORED] * 2
        copies.append(bytes(slot))
        return True

    assert reader.get_into([(0, b"victim")], (), slow_sink) == [False]
    assert copies and copies[0] != original  # the slot really was reused under the reader
    assert reader.get([(0, b"victim")]) == [None]


def test_racing_processes_are_only_ever_served_the_right_bytes(start_store: StoreFactory) -> None:
    """Three processes put and get content-derived values in a store far smaller than the key space,
    so slots are evicted and reused under them all the time; every served byte is checked."""
    store = start_store("--capacity", "600KiB")
    reports = run_races(store.endpoint, processes=3, rounds=150)
    stats = _stats(store.endpoint)
    assert all(r["served"] > 0 and r["stored"] > 0 for r in reports), reports
    assert stats.evictions > 0 and stats.reserved_bytes == 0
    assert stats.used_bytes <= 600 << 10


def test_a_writer_killed_mid_put_leaves_no_value_and_no_reserved_slot(
    start_store: StoreFactory, make_client: ClientFactory
) -> None:
    store = start_store("--capacity", "1MiB", "--session-ttl-ms", "1000")
    doomed = subprocess.Popen(
        [sys.executable, "-m", "tests.client.shm_worker", "reserve-and-hang", store.endpoint],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert doomed.stdout is not None
        line = doomed.stdout.readline()
        assert line == b"reserved\n", doomed.stderr.read().decode() if doomed.stderr else line
        assert _stats(store.endpoint).reserved_bytes == 4 * (64 << 10)
    finally:
        doomed.kill()
        doomed.wait(timeout=10)
    wait_until(lambda: _stats(store.endpoint).reserved_bytes == 0, 20, "the dead writer's slots to be freed")
    client = _shm_client(make_client, store.endpoint, tenant="shm-tests")
    doomed_keys = [(0, f"doomed-{i}".encode()) for i in range(4)]
    assert client.get(doomed_keys) == [None] * 4
    # Every byte of capacity is usable again: nothing stayed reserved but the live client's spare
    # slot for its next put (1/16 of the capacity here), which it gives back when it closes.
    fill = [(0, f"after-{i}".encode(), os.urandom(64 << 10), b"") for i in range(16)]
    assert client.put(fill) == [pb.STORED] * 16
    stats = _stats(store.endpoint)
    spare = sum(client.shm.spares.held().values()) * (64 << 10)
    assert spare == 64 << 10
    assert (stats.used_bytes + stats.reserved_bytes, stats.reserved_bytes, stats.spare_bytes) == (
        1 << 20,
        spare,
        spare,
    )
    assert stats.evictions == 1  # the oldest block, for the spare slot
    client.close()
    stats = _stats(store.endpoint)
    assert (stats.used_bytes, stats.reserved_bytes) == ((1 << 20) - spare, 0)


def test_unmappable_arena_falls_back_to_inline_and_says_so_once(
    start_store: StoreFactory, make_client: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    store = start_store()  # its own: without tokens every tenant maps the one arena this test removes
    first = _shm_client(make_client, store.endpoint, tenant="fallback")
    first_arena = first.shm.arena()
    assert first_arena is not None
    arena_path = Path("/dev/shm") / first_arena.segment
    arena_path.unlink()  # as if the engine saw another /dev/shm: the offered file is not there
    caplog.set_level(logging.INFO, logger="kvtag_client.store")
    second = make_client(store.endpoint, tenant="fallback")
    assert second.open()
    assert second.data_path == "inline"
    assert second.put([(0, b"inline", b"still-stored", b"")]) == [pb.STORED]
    # A re-opened session tries again and stays inline without a second warning.
    second.session.stub.CloseSession(pb.CloseSessionRequest(session_id=second.session_id), timeout=10)
    assert second.get([(0, b"inline")]) == [b"still-stored"]
    assert first.get([(0, b"inline")]) == [b"still-stored"]  # the attached client keeps its mapping
    warnings = [r for r in caplog.records if "shared-memory path unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "cannot open" in warnings[0].getMessage()
    assert second.data_path == "inline"


def test_inline_choice_and_a_store_without_arena_use_the_inline_path(
    start_store: StoreFactory, make_client: ClientFactory, shared_store: StoreProcess
) -> None:
    chosen = make_client(shared_store.endpoint, data_path="inline")
    assert chosen.open() and chosen.data_path == "inline"
    assert chosen.put([(0, b"chosen", b"bytes", b"")]) == [pb.STORED]
    assert chosen.get([(0, b"chosen")]) == [b"bytes"]
    no_arena = start_store("--shm-dir", "")
    plain = make_client(no_arena.endpoint)
    assert plain.open() and plain.data_path == "inline"
    assert plain.put([(0, b"k", b"v", b"")]) == [pb.STORED]
    assert plain.get([(0, b"k")]) == [b"v"]
    with pytest.raises(ValueError, match="data_path"):
        make_client(shared_store.endpoint, data_path="shm")


def test_value_limit_is_the_same_on_both_paths(start_store: StoreFactory, make_client: ClientFactory) -> None:
    store = start_store("--max-message-bytes", "1MiB")
    shared = _shm_client(make_client, store.endpoint)
    inline = make_client(store.endpoint, data_path="inline")
    assert inline.open()
    limit = shared.limits.max_value_bytes
    items = [(0, b"fits", os.urandom(limit - 4096), b""), (0, b"too-big", os.urandom(limit + 1), b"")]
    assert shared.put(items) == [pb.STORED, pb.REJECTED]
    assert inline.put(items) == [pb.ALREADY_PRESENT, pb.REJECTED]
    assert shared.get([(0, b"fits"), (0, b"too-big")]) == [items[0][2], None]


def test_a_session_commits_only_its_own_reservations_and_each_once(
    shared_store: StoreProcess, make_client: ClientFactory
) -> None:
    owner = _shm_client(make_client, shared_store.endpoint, tenant="commits")
    other = _shm_client(make_client, shared_store.endpoint, tenant="commits")
    reservation = owner.reserve([(0, b"owned", 5, b"")])
    assert (
        reservation is not None
        and reservation.slots[0] is not None
        and reservation.generations[0] is not None
    )
    reservation.slots[0][:] = b"owned"
    generation = reservation.generations[0]
    stolen = other.session.stub.CommitSlots(
        pb.CommitSlotsRequest(session_id=other.session_id, generations=[generation]), timeout=10
    )
    assert [r.status for r in stolen.results] == [pb.REJECTED]
    assert "no such reservation" in stolen.results[0].reason
    assert other.get([(0, b"owned")]) == [None]
    assert owner.commit(reservation) == [pb.STORED]
    again = owner.session.stub.CommitSlots(
        pb.CommitSlotsRequest(session_id=owner.session_id, generations=[generation]), timeout=10
    )
    assert [r.status for r in again.results] == [pb.REJECTED]
    assert other.get([(0, b"owned")]) == [b"owned"]


def _resident(path: str) -> int:
    """Bytes of the file `path` mapped into this process's page tables (smaps Rss of its mappings)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if not line[:1].isupper():  # a mapping's header line: "start-end perms offset dev inode path"
            inside = line.rstrip().endswith(path)
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def test_the_client_maps_what_the_service_prefaulted_before_any_put(
    shared_store: StoreProcess, make_client: ClientFactory
) -> None:
    """The service touches its arena up front; the client follows the arena's faulted word and maps those
    pages into its own page tables in the background, so its first puts do not pay a fault per page."""
    client = _shm_client(make_client, shared_store.endpoint, tenant="premapped")
    arena = client.shm.arena()
    assert arena is not None
    path = next(str(p) for p in Path("/dev/shm").glob(f"*{arena.segment}*"))
    view = arena.view
    at = pages.FAULTED_OFFSET
    wait_until(lambda: int.from_bytes(view[at : at + 8], "little") >= 32 << 20, 30, "the service's prefault")
    wait_until(lambda: _resident(path) >= 32 << 20, 30, "the client's mapping of the prefaulted pages")


def test_read_leases_are_released_soon_after_each_get_without_waiting_for_expiry(
    start_store: StoreFactory, make_client: ClientFactory
) -> None:
    """GetReferences pins the hits under a lease the client releases in the background (one releaser
    thread, batched): many gets leave nothing pinned long before the 60 s lease would expire."""
    store = start_store("--lease-ms", "60000")
    client = _shm_client(make_client, store.endpoint, tenant="release")
    items = [(0, f"r-{n}".encode(), os.urandom(4096), b"") for n in range(32)]
    assert client.put(items) == [pb.STORED] * len(items)

    def releasers() -> int:
        return sum(1 for t in threading.enumerate() if t.name == "kvtag-release")

    before = releasers()  # other tests' clients may still be winding theirs down
    for _ in range(20):
        assert client.get([(0, k) for _, k, _, _ in items]) == [v for _, _, v, _ in items]
    wait_until(lambda: _stats(store.endpoint).leased_keys == 0, 10, "the background releases")
    assert releasers() - before <= 1, "one releaser thread per client, not one per release"


def test_a_stream_of_gets_carries_each_read_lease_release_on_the_next_get(
    start_store: StoreFactory, make_client: ClientFactory
) -> None:
    """Each GetReferences carries the release of the previous get's read lease (GetRequest.lease_id),
    so back-to-back gets send almost no ReleaseLeases of their own, and still nothing stays pinned."""
    store = start_store("--lease-ms", "60000")
    client = _shm_client(make_client, store.endpoint, tenant="carried")
    items = [(0, f"c-{n}".encode(), os.urandom(4096), b"") for n in range(8)]
    assert client.put(items) == [pb.STORED] * len(items)
    sent: list[tuple[str, ...]] = []
    release = client.caller.release  # every ReleaseLeases goes through the caller

    def counted(lease_ids: tuple[str, ...]) -> None:
        sent.append(lease_ids)
        release(lease_ids)

    client.caller.release = counted  # type: ignore[method-assign,assignment]
    for _ in range(30):
        assert client.get([(0, k) for _, k, _, _ in items]) == [v for _, _, v, _ in items]
    wait_until(lambda: _stats(store.endpoint).leased_keys == 0, 10, "the last lease's release")
    released_alone = sum(len(ids) for ids in sent)
    assert released_alone <= 2, f"{released_alone} of 30 read leases needed a ReleaseLeases of their own"


def test_a_large_mixed_put_keeps_every_result_in_its_place(
    shared_store: StoreProcess, make_client: ClientFactory
) -> None:
    """A 9 MiB put holding an already stored block and an unsendable one: results per item, in order,
    counted once, and every byte exact."""
    client = _shm_client(make_client, shared_store.endpoint, tenant="pipelined")
    items = [(0, f"big-{n}".encode(), os.urandom((1 << 20) + n), b"") for n in range(9)]
    assert client.put([items[4]]) == [pb.STORED]
    before = client.counters.put_stored
    batch = [*items[:7], (0, b"", b"no key", b""), *items[7:]]
    statuses = client.put(batch)
    assert (
        statuses == [pb.STORED] * 4 + [pb.ALREADY_PRESENT] + [pb.STORED] * 2 + [pb.REJECTED] + [pb.STORED] * 2
    )
    assert client.counters.put_stored - before == 8
    assert client.get([(0, k) for _, k, _, _ in items]) == [v for _, _, v, _ in items]


def test_closing_a_client_right_after_its_gets_leaves_no_thread_failing_on_the_closed_channel(
    shared_store: StoreProcess, make_client: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() ends the background releaser before it closes the channel: a release still pending
    must not be sent on a closed channel (CloseSession releases the session's leases anyway)."""
    failures: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))
    items = [(0, f"close-{n}".encode(), os.urandom(4096), b"") for n in range(8)]
    for round_ in range(20):
        client = _shm_client(make_client, shared_store.endpoint, tenant="close-race")
        if round_ == 0:
            assert client.put(items) == [pb.STORED] * len(items)
        assert client.get([(0, k) for _, k, _, _ in items]) == [v for _, _, v, _ in items]
        client.close()
        assert not client.shm.releaser.is_alive()
    assert failures == []


def test_a_value_corrupted_in_the_arena_is_caught_by_the_readers_copy_dropped_and_stored_again(
    start_store: StoreFactory, make_client: ClientFactory
) -> None:
    """The client checks its copy against the committed digest (the service does not read the value
    for it), discards a mismatch and has the service drop the value, so a later save stores it anew."""
    store = start_store()
    client = _shm_client(make_client, store.endpoint, tenant="corrupt")
    good, bad = os.urandom(8192), os.urandom(8192)
    assert client.put([(0, b"good", good, b""), (0, b"bad", bad, b"")]) == [pb.STORED, pb.STORED]
    arena = client.shm.arena()
    assert arena is not None
    answer = client.session.stub.GetReferences(
        pb.GetRequest(session_id=client.session_id, blocks=[pb.BlockRef(key=b"bad")], verify_in_client=True),
        timeout=10,
    )
    [reference] = answer.results
    assert reference.xxh3_64 == xxhash.xxh3_64_intdigest(bad), "the digest the client committed"
    ref = reference.slot
    arena.slot(ref.segment, ref.offset, ref.length)[4000] ^= 0x01  # a stray write through the mapping
    client.release((answer.lease.lease_id,))

    assert client.get([(0, b"good"), (0, b"bad")]) == [good, None]
    assert _stats(store.endpoint).corrupted_dropped == 1
    assert client.lookup([(0, b"bad", b"")]).prefix_length == 0
    assert client.put([(0, b"bad", bad, b"")]) == [pb.STORED]
    assert client.get([(0, b"bad")]) == [bad]


@pytest.mark.parametrize("size", [6, LARGE_SLOT_BYTES], ids=["small", "large"])
def test_commit_records_the_clients_digest_and_a_wrong_one_never_serves_bytes(
    shared_store: StoreProcess, make_client: ClientFactory, size: int
) -> None:
    """CommitSlots takes the writer's digests instead of reading the values back. A wrong digest makes
    the value fail its first read (dropped, MISS) on both Get forms, also when it is the half of a
    large get read on the digest thread; a digest list of the wrong length is INVALID_ARGUMENT and
    commits nothing."""
    client = _shm_client(make_client, shared_store.endpoint, tenant=f"digests-{size}")
    keys = [b"honest-0", b"honest-1", b"honest-2", b"liar"]
    values = [os.urandom(size) for _ in keys]
    reservation = client.reserve([(0, key, size, b"") for key in keys])
    assert reservation is not None and None not in reservation.generations
    for slot, value in zip(reservation.slots, values, strict=True):
        assert slot is not None
        slot[:] = value
    generations = [g for g in reservation.generations if g is not None]
    with pytest.raises(grpc.RpcError) as refused:
        client.session.stub.CommitSlots(
            pb.CommitSlotsRequest(session_id=client.session_id, generations=generations, xxh3_64=[1]),
            timeout=10,
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "one per generation" in str(refused.value.details())
    digests = [xxhash.xxh3_64_intdigest(v) for v in values]
    digests[-1] ^= 1
    committed = client.session.stub.CommitSlots(
        pb.CommitSlotsRequest(session_id=client.session_id, generations=generations, xxh3_64=digests),
        timeout=10,
    )
    assert [r.status for r in committed.results] == [pb.STORED] * 4
    before = _stats(shared_store.endpoint).corrupted_dropped
    assert client.get([(0, key) for key in keys]) == [*values[:3], None]
    assert _stats(shared_store.endpoint).corrupted_dropped == before + 1
    assert client.lookup([(0, b"liar", b"")]).prefix_length == 0
    assert client.get([(0, key) for key in keys]) == [*values[:3], None]


def test_large_slots_are_written_and_read_on_two_threads_with_their_exact_digests(
    shared_store: StoreProcess, make_client: ClientFactory
) -> None:
    """A put or get whose slots are all LARGE_SLOT_BYTES or more splits them between the calling
    thread and the client's digest thread; the digests committed are the values' own (the references
    carry them back), the copies are exact, a batch with a small slot stays on the caller's thread,
    and the digest thread ends with the client."""
    client = _shm_client(make_client, shared_store.endpoint, tenant="digest-thread")
    values = [os.urandom(LARGE_SLOT_BYTES + 4096 * n) for n in range(4)]
    sized = [(0, f"dt-{n}".encode(), len(v), b"") for n, v in enumerate(values)]
    fillers: dict[int, str] = {}

    def fill(index: int, slot: memoryview) -> None:
        fillers[index] = threading.current_thread().name
        slot[:] = values[index]

    assert client.put_from(sized, fill) == [pb.STORED] * 4
    assert fillers[0] == fillers[1] == threading.current_thread().name
    assert fillers[2] == fillers[3] != fillers[0]
    assert fillers[2].startswith("kvtag-digest")
    request = pb.GetRequest(session_id=client.session_id, verify_in_client=True)
    for _, key, _, _ in sized:
        request.blocks.add(key=key)
    reply = client.session.stub.GetReferences(request, timeout=10)
    assert [r.xxh3_64 for r in reply.results] == [xxhash.xxh3_64_intdigest(v) for v in values]
    client.release((reply.lease.lease_id,))

    sinks: dict[int, str] = {}
    copies: dict[int, bytes] = {}

    def sink(index: int, source: memoryview) -> bool:
        sinks[index] = threading.current_thread().name
        copies[index] = bytes(source)
        return True

    assert client.get_into([(0, key) for _, key, _, _ in sized], (), sink) == [True] * 4
    assert [copies[n] for n in range(4)] == values
    assert sinks[0] == sinks[1] != sinks[2] == sinks[3]

    mixed = [(0, b"dt-small", 5, b""), (0, b"dt-large", LARGE_SLOT_BYTES, b"")]
    fillers.clear()
    values[:2] = [b"small", os.urandom(LARGE_SLOT_BYTES)]
    assert client.put_from(mixed, fill) == [pb.STORED] * 2
    assert set(fillers.values()) == {threading.current_thread().name}
    assert client.get([(0, b"dt-small"), (0, b"dt-large")]) == values[:2]

    digesters = [t for t in threading.enumerate() if t.name.startswith("kvtag-digest")]
    assert len(digesters) == 1
    client.close()
    digesters[0].join(timeout=10)
    assert not digesters[0].is_alive()


def test_packed_get_references_answer_exactly_what_the_message_per_block_form_does(
    shared_store: StoreProcess, make_client: ClientFactory
) -> None:
    """GetReferences over packed_blocks: the same statuses, slots and digests as the BlockRef form, as
    parallel arrays over the hits; one form per request, and Get refuses the packed one."""
    client = _shm_client(make_client, shared_store.endpoint, tenant="packed-refs")
    stored = [
        (group, f"p-{group}-{n}".encode(), os.urandom(100 + n), b"") for group in (0, 3) for n in range(3)
    ]
    assert client.put(stored) == [pb.STORED] * len(stored)
    asked = [(0, b"p-0-0"), (0, b"absent"), (0, b"p-0-2"), (3, b"p-3-1"), (3, b"p-3-9")]
    listed = client.session.stub.GetReferences(
        pb.GetRequest(
            session_id=client.session_id,
            blocks=[pb.BlockRef(group=g, key=k) for g, k in asked],
            verify_in_client=True,
        ),
        timeout=10,
    )
    runs = [
        pb.PackedBlocks(group=0, key_length=5, keys=b"p-0-0"),
        pb.PackedBlocks(group=0, key_length=6, keys=b"absent"),
    ]
    runs += [
        pb.PackedBlocks(group=0, key_length=5, keys=b"p-0-2"),
        pb.PackedBlocks(group=3, key_length=5, keys=b"p-3-1p-3-9"),
    ]
    packed = client.session.stub.GetReferences(
        pb.GetRequest(session_id=client.session_id, packed_blocks=runs, verify_in_client=True), timeout=10
    )
    assert not packed.results and not listed.HasField("packed")
    assert list(packed.packed.statuses) == [r.status for r in listed.results]
    assert list(packed.packed.statuses) == [pb.HIT, pb.MISS, pb.HIT, pb.HIT, pb.MISS]
    hits = [r for r in listed.results if r.status == pb.HIT]
    assert {r.slot.segment for r in hits} == {packed.packed.segment}
    assert list(packed.packed.offsets) == [r.slot.offset for r in hits]
    assert list(packed.packed.lengths) == [r.slot.length for r in hits] == [100, 102, 101]
    assert list(packed.packed.generations) == [r.slot.generation for r in hits]
    assert list(packed.packed.xxh3_64) == [r.xxh3_64 for r in hits]
    assert list(packed.packed.xxh3_64) == [xxhash.xxh3_64_intdigest(stored[i][2]) for i in (0, 2, 4)]
    client.release((listed.lease.lease_id, packed.lease.lease_id))

    for stub_call, request in (
        (
            client.session.stub.GetReferences,
            pb.GetRequest(session_id=client.session_id, blocks=[pb.BlockRef(key=b"x")], packed_blocks=runs),
        ),
        (client.session.stub.Get, pb.GetRequest(session_id=client.session_id, packed_blocks=runs)),
        (
            client.session.stub.GetReferences,
            pb.GetRequest(
                session_id=client.session_id, packed_blocks=[pb.PackedBlocks(key_length=5, keys=b"p-0-0!")]
            ),
        ),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            stub_call(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert client.get([(g, k) for g, k, _, _ in stored]) == [v for _, _, v, _ in stored]


def test_packed_reserve_slots_answer_each_item_and_record_its_base_key(
    start_store: StoreFactory, make_client: ClientFactory
) -> None:
    """ReserveSlots over packed_items: a status byte per item (a slot, or the outcome known now with
    its reason), slots for the granted ones only, base keys recorded for cross-mode diagnostics as on
    the message-per-item form; malformed packed forms are INVALID_ARGUMENT."""
    store = start_store("--max-message-bytes", "1MiB")
    writer = _shm_client(make_client, store.endpoint, tenant="packed-grants")
    too_large = writer.limits.max_value_bytes + 1
    assert writer.put([(0, b"kept", b"k" * 10, b"")]) == [pb.STORED]
    keys = b"new1kepttoo!grp3"
    runs = [
        pb.PackedBlocks(key_length=4, keys=keys[:12], base_keys=b"b1b2b3"),
        pb.PackedBlocks(group=3, key_length=4, keys=keys[12:]),
    ]
    answer = writer.session.stub.ReserveSlots(
        pb.ReserveSlotsRequest(
            session_id=writer.session_id, packed_items=runs, packed_lengths=[10, 10, too_large, 20]
        ),
        timeout=10,
    )
    packed = answer.packed
    assert not answer.grants
    assert list(packed.statuses) == [pb.PUT_STATUS_UNSPECIFIED, pb.ALREADY_PRESENT, pb.REJECTED, 0]
    assert packed.reasons[0] == "" and str(too_large) in packed.reasons[1], list(packed.reasons)
    assert len(packed.offsets) == len(packed.generations) == 2 and len(set(packed.generations)) == 2
    assert packed.segment == writer.shm.arena().segment  # type: ignore[union-attr]

    # The client's own packed reserve records base keys: another mode's lookup names the holder.
    reader = _shm_client(make_client, store.endpoint, lookahead_tokens=1, tenant="packed-grants")
    assert writer.put([(0, b"legacy-a", b"a" * 10, b"base-a"), (0, b"legacy-b", b"b" * 10, b"base-b")]) == [
        pb.STORED,
        pb.STORED,
    ]
    assert reader.lookup([(0, b"la-a", b"base-a"), (0, b"la-b", b"base-b")]).prefix_length == 0
    with grpc.insecure_channel(store.endpoint) as channel:
        stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
        diagnosis = stub.Diagnose(pb.DiagnoseRequest(), timeout=10)
    [counted] = [m for ns in diagnosis.namespaces for m in ns.modes if m.counters.cross_mode_misses]
    assert counted.counters.cross_mode_misses == 2

    for request, field in (
        (pb.ReserveSlotsRequest(packed_items=runs, packed_lengths=[10]), "packed_lengths"),
        (
            pb.ReserveSlotsRequest(
                packed_items=runs,
                packed_lengths=[1, 1, 1, 1],
                items=[pb.SlotRequest(block=pb.BlockRef(key=b"x"), length=1)],
            ),
            "packed_items",
        ),
        (
            pb.ReserveSlotsRequest(
                packed_items=[pb.PackedBlocks(key_length=4, keys=b"abcde")], packed_lengths=[1]
            ),
            "keys",
        ),
    ):
        request.session_id = writer.session_id
        with pytest.raises(grpc.RpcError) as refused:
            writer.session.stub.ReserveSlots(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in str(refused.value.details()) or field in str(refused.value.trailing_metadata())
