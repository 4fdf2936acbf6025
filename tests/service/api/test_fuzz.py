"""Seeded fuzzing of every KvStore method with mutated valid messages, against a real server on
loopback: every answer is OK or a status docs/errors.md lists (with its code and a kvtag ErrorInfo),
every refusal is counted, nothing logs a traceback, the admission budget is whole afterwards, and the
server still serves the values it held before, byte for byte.

Bounded: ROUNDS calls per seed (about 2 s a seed on the shared 2-core machine)."""

from __future__ import annotations

import logging
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_proto.errors import parse_error
from kvtag_store.app.server import RunningServer, start_server
from kvtag_store.backends.memory import MemoryBackend, MemoryCensus
from kvtag_store.config import ServiceConfig, ServiceLimits

from tests.descriptors import PROBE, mode, namespace

ROUNDS = 400
SEEDS = [1, 2, 3]
MAX_BATCH = 16
# Values stored before the fuzzing; the capacity leaves room for everything the fuzzer stores, so
# none of them may be evicted, overwritten or damaged.
KEPT = {b"kept-%d" % i: bytes([i]) * (1000 + 37 * i) for i in range(8)}
ERRORS_MD = Path(__file__).resolve().parents[3] / "docs" / "errors.md"


def documented_reasons() -> dict[str, grpc.StatusCode]:
    """reason -> code, read from the request-level table of docs/errors.md."""
    rows = re.findall(r"^\| `([A-Z_]+)` \| `([A-Z_]+)` \|", ERRORS_MD.read_text(), re.MULTILINE)
    return {reason: grpc.StatusCode[code] for reason, code in rows}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    config = ServiceConfig(
        limits=ServiceLimits(max_key_bytes=64, max_batch_items=MAX_BATCH, max_message_bytes=1 << 20),
        max_inflight_bytes=1 << 20,
    )
    running = start_server(MemoryBackend(16 << 20), MemoryCensus(), config, listen="127.0.0.1:0")
    yield running
    running.stop(grace=0)


@pytest.fixture(scope="module")
def kept(server: RunningServer) -> Iterator[tuple[Any, str]]:
    """A session of the fuzzer's namespace and mode holding KEPT."""
    with grpc.insecure_channel(server.address) as channel:
        stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
        opened = stub.OpenSession(
            pb.OpenSessionRequest(engine_id="keeper", namespace=namespace(), mode=mode(), probe_keys=PROBE),
            timeout=5,
        )
        items = [pb.PutItem(block=pb.BlockRef(key=k), value=v) for k, v in KEPT.items()]
        put = stub.Put(pb.PutRequest(session_id=opened.session_id, items=items), timeout=5)
        assert [r.status for r in put.results] == [pb.STORED] * len(KEPT)
        yield stub, opened.session_id


def _valid_messages(session_id: str, rng: random.Random) -> dict[str, bytes]:
    keys = [bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 40))) for _ in range(rng.randint(0, 6))]
    keys += rng.sample(sorted(KEPT), rng.randint(0, 2))  # Get/Lookup/Put the kept keys too
    refs = [pb.BlockRef(key=k, group=rng.choice([0, 0, 1])) for k in keys]
    items = [pb.PutItem(block=r, value=bytes(rng.randint(0, 3000))) for r in refs]
    width = rng.randint(1, 40)  # the packed forms: the same keys cut or padded to one length
    packed = pb.PackedBlocks(
        key_length=width, keys=b"".join(k[:width].ljust(width, b"-") for k in keys), group=rng.choice([0, 1])
    )
    messages: dict[str, pb.Message] = {  # type: ignore[name-defined]
        "OpenSession": pb.OpenSessionRequest(
            engine_id=f"fuzz-{rng.randint(0, 3)}",
            namespace=namespace(),
            mode=mode(lookahead=rng.choice([0, 1])),
            probe_keys=PROBE,
            labels={"k": "v"},
            data_paths=rng.sample([pb.DATA_PATH_INLINE, pb.DATA_PATH_SHARED_MEMORY], rng.randint(0, 2)),
        ),
        "Heartbeat": pb.HeartbeatRequest(session_id=session_id),
        "CloseSession": pb.CloseSessionRequest(session_id="s-other"),
        "Lookup": pb.LookupRequest(session_id=session_id, blocks=refs, lease_ms=rng.randint(0, 5000)),
        "Put": pb.PutRequest(session_id=session_id, items=items),
        "PutStream": pb.PutRequest(session_id=session_id, items=items),
        "Get": pb.GetRequest(session_id=session_id, blocks=refs),
        "GetStream": pb.GetRequest(session_id=session_id, blocks=refs),
        "ReleaseLeases": pb.ReleaseLeasesRequest(session_id=session_id, lease_ids=["l-1", "l-2"]),
        "AttachSharedMemory": pb.AttachSharedMemoryRequest(session_id=session_id, nonce=rng.randbytes(16)),
        "ReserveSlots": rng.choice(
            [
                pb.ReserveSlotsRequest(
                    session_id=session_id,
                    items=[pb.SlotRequest(block=r, length=rng.randint(0, 5000)) for r in refs],
                ),
                pb.ReserveSlotsRequest(
                    session_id=session_id,
                    packed_items=[packed],
                    packed_lengths=[rng.randint(0, 5000) for _ in refs],
                ),
            ]
        ),
        "CommitSlots": pb.CommitSlotsRequest(
            session_id=session_id,
            generations=[rng.getrandbits(64) for _ in range(rng.randint(0, 4))],
            packed_items=rng.choice([[], [packed]]),
            spare_lengths=[rng.randint(0, 5000) for _ in range(rng.randint(0, 3))],
            cancel_generations=[rng.getrandbits(64) for _ in range(rng.randint(0, 2))],
        ),
        "GetReferences": rng.choice(
            [
                pb.GetRequest(session_id=session_id, blocks=refs),
                pb.GetRequest(session_id=session_id, packed_blocks=[packed], verify_in_client=True),
            ]
        ),
        "Diagnose": pb.DiagnoseRequest(namespace_id=rng.choice(["", "ns-x"])),
        "GetStats": pb.GetStatsRequest(),
    }
    return {name: message.SerializeToString() for name, message in messages.items()}


def _mutate(data: bytes, rng: random.Random) -> bytes:
    """One of: unchanged, bit flips, truncation, garbage appended, a chunk duplicated, random bytes,
    a field repeated past the batch limit."""
    kind = rng.randrange(7)
    buf = bytearray(data)
    if kind == 1 and buf:
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    elif kind == 2 and buf:
        del buf[rng.randrange(len(buf)) :]
    elif kind == 3:
        buf += bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 30)))
    elif kind == 4 and buf:
        start = rng.randrange(len(buf))
        buf += buf[start : start + rng.randint(1, 64)] * rng.randint(1, 5)
    elif kind == 5:
        buf = bytearray(rng.getrandbits(8) for _ in range(rng.randint(0, 200)))
    elif kind == 6:
        buf += b"\x12\x03\x0a\x01k" * (MAX_BATCH + rng.randint(1, 40))
    return bytes(buf)


def _call(channel: grpc.Channel, method: str, data: bytes, rng: random.Random) -> Callable[[], object]:
    path = f"/kvtag.v1.KvStore/{method}"
    if method == "PutStream":
        stream = channel.stream_unary(path)
        extra = [_mutate(data, rng) for _ in range(rng.randint(0, 2))]
        return lambda: stream(iter([data, *extra]), timeout=10)
    if method == "GetStream":
        reader = channel.unary_stream(path)
        return lambda: list(reader(data, timeout=10))
    unary = channel.unary_unary(path)
    return lambda: unary(data, timeout=10)


def _refusals(server: RunningServer) -> float:
    families = server.service.metrics.registry.collect()
    return sum(
        s.value
        for f in families
        if f.name == "kvtag_rpc_errors"
        for s in f.samples
        if s.name.endswith("_total")
    )


def test_the_fuzzer_reaches_every_method() -> None:
    assert set(_valid_messages("s", random.Random(0))) == set(
        pb.DESCRIPTOR.services_by_name["KvStore"].methods_by_name
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_mutated_requests_to_every_method_get_documented_answers(
    server: RunningServer,
    kept: tuple[Any, str],
    seed: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    documented = documented_reasons()
    assert {"MALFORMED_REQUEST", "SERVER_BUSY", "BATCH_TOO_LARGE"} <= set(documented)
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    refused_before = _refusals(server)
    with grpc.insecure_channel(server.address) as channel, caplog.at_level(logging.INFO):
        opened = pb.OpenSessionRequest(engine_id="fuzz", namespace=namespace(), mode=mode(), probe_keys=PROBE)
        session_id = pb.OpenSessionResponse.FromString(
            channel.unary_unary("/kvtag.v1.KvStore/OpenSession")(opened.SerializeToString(), timeout=5)
        ).session_id
        for _ in range(ROUNDS):
            valid = _valid_messages(session_id, rng)
            method = rng.choice(sorted(valid))
            data = _mutate(valid[method], rng)
            try:
                _call(channel, method, data, rng)()
                outcomes["OK"] += 1
            except grpc.RpcError as exc:
                error = parse_error(exc)
                assert error is not None, f"{method}: a status without kvtag details: {exc}"
                assert documented.get(error.reason) == error.code, f"{method}: {error.reason} {error.code}"
                assert error.message
                outcomes[error.reason] += 1
    refusals = sum(n for outcome, n in outcomes.items() if outcome != "OK")
    assert _refusals(server) - refused_before == refusals, (
        "every refusal is counted in kvtag_rpc_errors_total"
    )
    assert server.service.admission.held == 0, "every call gave back what it held"
    assert not [r for r in caplog.records if r.exc_info], "no request may log a traceback"
    # Still serving, and what was stored before is there byte for byte.
    stub, kept_session = kept
    got = stub.Get(
        pb.GetRequest(session_id=kept_session, blocks=[pb.BlockRef(key=k) for k in KEPT]), timeout=5
    )
    assert [(r.status, r.value) for r in got.results] == [(pb.HIT, v) for v in KEPT.values()]
    # The generator reaches the interesting answers, not only one kind.
    assert outcomes["OK"] > 0 and outcomes["MALFORMED_REQUEST"] > 0 and outcomes["BATCH_TOO_LARGE"] > 0, (
        outcomes
    )
