"""A Put request's items reach the backend as one batch; every item still gets its own answer, in order."""

from __future__ import annotations

from kvtag.v1 import store_pb2 as pb

from ..conftest import ServerFactory


def test_mixed_put_request_answers_every_item_in_request_order(make_store: ServerFactory) -> None:
    store = make_store(capacity=64 << 10)
    session = store.open().session_id
    other = store.open("engine-b").session_id
    assert store.put(other, (b"present", b"first")) == [pb.STORED]
    request = pb.PutRequest(
        session_id=session,
        items=[
            pb.PutItem(block=pb.BlockRef(key=b"a"), value=b"alpha"),
            pb.PutItem(block=pb.BlockRef(key=b"shm"), shared_memory=pb.SharedMemoryRef(segment="seg")),
            pb.PutItem(block=pb.BlockRef(key=b"present"), value=b"second"),
            pb.PutItem(block=pb.BlockRef(key=b"empty")),
            pb.PutItem(block=pb.BlockRef(key=b"huge"), value=bytes((64 << 10) + 1)),
            pb.PutItem(block=pb.BlockRef(key=b"b"), value=b"beta"),
            pb.PutItem(block=pb.BlockRef(key=b"a"), value=b"again"),
        ],
    )
    results = store.stub.Put(request, timeout=5).results
    assert [r.status for r in results] == [
        pb.STORED,
        pb.REJECTED,
        pb.ALREADY_PRESENT,
        pb.REJECTED,
        pb.REJECTED,
        pb.STORED,
        pb.ALREADY_PRESENT,
    ]
    assert "DATA_PATH_INLINE" in results[1].reason
    assert "no payload" in results[3].reason
    assert "capacity" in results[4].reason
    got = store.get(session, b"a", b"present", b"shm", b"empty", b"huge", b"b")
    assert [r.value for r in got] == [b"alpha", b"first", b"", b"", b"", b"beta"]
    assert [r.status for r in got] == [pb.HIT, pb.HIT, pb.MISS, pb.MISS, pb.MISS, pb.HIT]
