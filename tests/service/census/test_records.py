"""The census's record logs: each keeps its own last `limit`, all together at most the shelf's bound,
and a closed log gives its records and its deque back at once while the shelf still names it."""

from __future__ import annotations

import sys

from kvtag_store.policy.records import RecordLog, RecordShelf


def test_each_log_keeps_its_last_records_and_the_shelf_bounds_them_all() -> None:
    shelf = RecordShelf(max_records=10)
    first: RecordLog[int] = RecordLog(limit=4)
    second: RecordLog[int] = RecordLog(limit=4)
    for n in range(6):
        shelf.add(first, n, 1)
    assert list(first) == [2, 3, 4, 5] and first.forgotten == 2
    for n in range(8):
        shelf.add(second, 100 + n, 1)
    assert list(second) == [104, 105, 106, 107]
    assert len(first) + len(second) <= 10
    assert first.forgotten + len(first) == 6, "what leaves a log is counted"


def test_a_closed_log_frees_its_deque_and_takes_no_more_records() -> None:
    shelf = RecordShelf(max_records=100)
    logs: list[RecordLog[bytes]] = [RecordLog(limit=16) for _ in range(20)]
    for log in logs:
        for _ in range(5):
            shelf.add(log, b"x" * 1000, 1)
    assert all(log._items is not None and len(log._items) == 5 for log in logs)
    for log in logs:
        log.close()
        shelf.add(log, b"late", 1)  # a record for a forgotten owner is dropped, not kept
        assert not log and list(log) == [] and log.dead
    # 20,000 forgotten namespaces' logs must not keep a container each.
    assert all(log._items is None for log in logs), "closed logs hold no container"
    live: RecordLog[bytes] = RecordLog(limit=16)
    for _ in range(200):  # the dead logs' shelf entries age out as no-ops
        shelf.add(live, b"y", 1)
    assert len(live) == 16 and len(shelf) == 100


def test_logs_hold_a_deque_only_while_they_hold_records() -> None:
    """Most logs never get a record (three per namespace and mode): they must cost no container, and
    one the shelf emptied gives its list up, so lists never outnumber the records kept; a log with
    one record costs a small list, not a deque's ~600-byte block."""
    shelf = RecordShelf(max_records=50)
    logs: list[RecordLog[int]] = [RecordLog(limit=4) for _ in range(200)]
    assert all(log._items is None for log in logs), "empty logs hold no container"
    for n, log in enumerate(logs):
        shelf.add(log, n, 1)
    holding = [log for log in logs if log]
    assert len(holding) == 50 and [next(iter(log)) for log in holding] == list(range(150, 200))
    assert sum(log._items is not None for log in logs) == 50, "the 150 emptied logs gave their lists up"
    assert all(sys.getsizeof(log._items) <= 120 for log in holding)
    assert all(log.forgotten == 1 for log in logs[:150])
    shelf.add(logs[0], 7, 1)  # an emptied log takes records again
    assert list(logs[0]) == [7]


def test_dropping_closed_logs_leaves_only_the_live_logs_entries() -> None:
    """After a sweep forgets namespaces their logs' shelf entries go at once, not as newer records
    push them out (until then they keep every forgotten log alive)."""
    shelf = RecordShelf(max_records=100)
    gone: list[RecordLog[int]] = [RecordLog(limit=4) for _ in range(10)]
    kept: RecordLog[int] = RecordLog(limit=4)
    for n, log in enumerate(gone):
        shelf.add(log, n, 1)
        shelf.add(kept, n, 1)
    for log in gone:
        log.close()
    assert len(shelf) == 20
    shelf.drop_closed()
    assert len(shelf) == 10 and list(kept) == [6, 7, 8, 9]
    for n in range(100):  # the bound still counts the live log's own entries
        shelf.add(kept, n, 1)
    assert len(shelf) == 100 and list(kept) == [96, 97, 98, 99]


def test_the_shelf_bounds_the_bytes_of_the_records_it_keeps() -> None:
    """Long labels make records large: the store-wide byte bound drops the oldest ones first, counted,
    so 8,192 records of 4 KiB cannot hold 32 MiB."""
    shelf = RecordShelf(max_records=1000, max_bytes=10_000)
    logs: list[RecordLog[bytes]] = [RecordLog(limit=16) for _ in range(10)]
    for n in range(100):
        shelf.add(logs[n % 10], bytes(1000), 1000)
    assert shelf.encoded_bytes <= 10_000 and len(shelf) == 10
    assert sum(len(log) for log in logs) == 10
    assert sum(log.forgotten for log in logs) == 90, "what the bound dropped is counted"
    shelf.add(logs[0], bytes(50_000), 50_000)  # one record larger than the bound is still kept
    assert list(logs[0])[-1] == bytes(50_000) and len(shelf) == 1


def test_gone_engine_records_leave_no_object_behind_once_dropped() -> None:
    """A burst of engines that come and go must give back what their records took: any object that
    outlives its record pins an interpreter arena (1 MiB) once the burst's other objects are gone.
    protobuf's upb kept ~70 of every 50,000 records built with a labels= keyword."""
    import gc
    import tracemalloc

    from kvtag_store.policy.census_state import gone_record
    from kvtag_store.policy.sessions import Session

    def session(n: int) -> Session:
        return Session(f"s-{n}", f"engine-{n}", "ns-x", "m-x", {"host": f"h{n}"}, n, n, 0.0)

    gone_record(session(0))
    tracemalloc.start(1)
    try:
        before = tracemalloc.take_snapshot()
        records = [gone_record(session(n)) for n in range(50_000)]
        assert records[-1].labels["host"] == "h49999" and records[-1].engine_id == "engine-49999"
        del records
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    census_state = sys.modules["kvtag_store.policy.census_state"].__file__
    assert census_state is not None
    left = sum(
        stat.count_diff
        for stat in after.compare_to(before, "filename")
        if stat.traceback[0].filename == census_state and stat.count_diff > 0
    )
    assert left <= 2, f"{left} objects made by gone_record outlived their records"
