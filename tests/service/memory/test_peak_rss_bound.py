"""The documented memory bound (docs/operations.md, "Memory bound") against a real `kvtag-store serve`
process: the worst requests from several threads at once, the server's peak RSS read from /proc.

Worst requests: batches just under the message limit that are refused by count (millions of tiny
items: before requests were counted ahead of parsing, one Lookup of 10 million 2-byte keys raised RSS
by ~1.4 GiB before it was refused), and the largest requests that are admitted (a full batch of the
longest keys, a Put of values filling a message, a Get whose reply fills a message), which the
admission limit (--max-inflight-bytes) serves or turns away busy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb

from tests.descriptors import PROBE, mode, namespace
from tests.store_process import StoreProcess

MIB = 1 << 20
CAPACITY = 64 * MIB
MAX_MESSAGE = 16 * MIB
INFLIGHT = 64 * MIB
WORKERS = 4
THREADS = 8
ROUNDS = 3
VALUES = 15  # 1 MiB values in one Put or Get: just under the message limit
# The stated overhead (docs/operations.md): interpreter, gRPC and index (128 MiB), what the handlers
# may hold (--max-inflight-bytes), and four message sizes (about three copies: gRPC's buffers, its
# contiguous copy, the Python bytes; one more for allocator slack) for every call in flight.
BOUND = CAPACITY + 128 * MIB + INFLIGHT + 4 * THREADS * MAX_MESSAGE
ROOM = MAX_MESSAGE - 64 * 1024


def rss(pid: int, field: str) -> int:
    """VmHWM (peak) or VmRSS (now) of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def value(round_: int, i: int) -> bytes:
    return bytes([round_ % 256, i]) * (MIB // 2)


@pytest.mark.slow
def test_worst_requests_from_several_threads_stay_within_the_documented_bound(tmp_path: Path) -> None:
    args = ["--capacity", "64MiB", "--max-message-bytes", "16MiB", "--max-inflight-bytes", "64MiB"]
    with StoreProcess(tmp_path / "store.log", *args, "--workers", str(WORKERS)) as store:
        assert store.proc is not None
        idle = rss(store.proc.pid, "VmRSS")
        options = [
            ("grpc.max_send_message_length", 2 * MAX_MESSAGE),
            ("grpc.max_receive_message_length", 2 * MAX_MESSAGE),
        ]
        with grpc.insecure_channel(store.endpoint, options=options) as channel:

            def raw(method: str) -> grpc.UnaryUnaryMultiCallable:
                return channel.unary_unary(f"/kvtag.v1.KvStore/{method}")

            opened = pb.OpenSessionRequest(
                engine_id="e", namespace=namespace(), mode=mode(), probe_keys=PROBE
            )
            sid = pb.OpenSessionResponse.FromString(raw("OpenSession")(opened.SerializeToString())).session_id
            long_key = b"\x12\x83\x02\x0a\x80\x02" + b"k" * 256  # a block with a 256-byte key
            requests: dict[str, Callable[[int], tuple[str, bytes]]] = {
                # Refused by count: ~2.7 million 2-byte keys in the Lookup fast-path shape.
                "LookupCount": lambda r: (
                    "Lookup",
                    pb.LookupRequest(session_id=sid).SerializeToString()
                    + b"\x12\x04\x0a\x02ab" * (ROOM // 6),
                ),
                # Refused by count: ~2.7 million keyed blocks with a group (the generated-parser shape).
                "GetCount": lambda r: (
                    "Get",
                    pb.GetRequest(session_id=sid).SerializeToString()
                    + b"\x12\x04\x10\x01\x0a\x00" * (ROOM // 6),
                ),
                # Refused by count: ~8 million empty items.
                "PutCount": lambda r: (
                    "Put",
                    pb.PutRequest(session_id=sid).SerializeToString() + b"\x12\x00" * (ROOM // 2),
                ),
                # Admitted or busy: the full default batch (65,536) of the longest keys, ~17 MiB of
                # Python objects in the handler.
                "LookupWide": lambda r: (
                    "Lookup",
                    pb.LookupRequest(session_id=sid).SerializeToString()
                    + long_key * min(65_536, ROOM // len(long_key)),
                ),
                # Stored: 15 values of 1 MiB, new keys every round (older ones are evicted).
                "PutValues": lambda r: (
                    "Put",
                    pb.PutRequest(
                        session_id=sid,
                        items=[
                            pb.PutItem(block=pb.BlockRef(key=b"v%d-%d" % (r, i)), value=value(r, i))
                            for i in range(VALUES)
                        ],
                    ).SerializeToString(),
                ),
                # Admitted or busy: a reply of 15 MiB (the values of round 0, stored before the rounds).
                "GetValues": lambda r: (
                    "Get",
                    pb.GetRequest(
                        session_id=sid, blocks=[pb.BlockRef(key=b"v0-%d" % i) for i in range(VALUES)]
                    ).SerializeToString(),
                ),
            }
            kinds = ["LookupCount", "GetCount", "PutCount", "LookupWide", "LookupWide"]
            kinds += ["PutValues", "GetValues", "GetValues"]
            assert len(kinds) == THREADS
            answers: dict[str, set[str]] = {name: set() for name in requests}
            damaged: list[str] = []
            lock = threading.Lock()

            def send(name: str, round_: int) -> None:
                method, data = requests[name](round_)
                try:
                    reply = raw(method)(data, timeout=120)
                    outcome = "OK"
                    if name == "GetValues":  # a hit must be byte-exact (a miss would be an eviction)
                        got = pb.GetResponse.FromString(reply)
                        for i, result in enumerate(got.results):
                            if result.status != pb.MISS and result.value != value(0, i):
                                damaged.append(f"round {round_}: v0-{i}")
                except grpc.RpcError as exc:
                    outcome = exc.code().name
                with lock:
                    answers[name].add(outcome)

            for fill in range(-3, 1):  # 60 MiB stored: the capacity is in use
                send("PutValues", fill)
            for round_ in range(1, ROUNDS + 1):
                threads = [threading.Thread(target=send, args=(name, round_)) for name in kinds]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            stats = pb.GetStatsResponse.FromString(raw("GetStats")(b"", timeout=10))
        peak = rss(store.proc.pid, "VmHWM")
    print(
        f"idle RSS {idle / MIB:.0f} MiB, peak {peak / MIB:.0f} MiB, bound {BOUND / MIB:.0f} MiB, "
        f"answers {answers}"
    )
    # The oversized batches were refused by count (or turned away busy), never served.
    for name in ("LookupCount", "GetCount", "PutCount"):
        assert answers[name] <= {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}, (name, answers[name])
    assert "INVALID_ARGUMENT" in answers["LookupCount"] | answers["GetCount"] | answers["PutCount"]
    # The admitted kinds were served or turned away busy, and every value read back was intact.
    for name in ("LookupWide", "GetValues", "PutValues"):
        assert answers[name] <= {"OK", "RESOURCE_EXHAUSTED"}, (name, answers[name])
    assert "OK" in answers["PutValues"] and stats.used_bytes > CAPACITY // 2
    assert not damaged, damaged
    assert peak <= BOUND, f"peak RSS {peak / MIB:.0f} MiB above the documented {BOUND / MIB:.0f} MiB"
