"""No client can lock new tenants out of a store (issue 42). A seeded fuzz of 10,000 well-formed and
malformed calls, one at a time, opens sessions under random tenant names, as any client may: without
tokens a tenant is a label the client picks. Afterwards a tenant no call named gets a full round trip,
without tokens and with them (for a tenant the tokens file names). With tokens, a flood of calls
without a valid token cannot make the store refuse a granted tenant either.

Before the fix, 16 junk tenants filled --max-tenant-arenas and every new tenant was refused
NAMESPACE_CAP_REACHED for --census-retention (10 min)."""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_proto.channels import ChannelSecurity, open_channel
from kvtag_proto.errors import parse_error
from kvtag_store.app.server import RunningServer, start_server
from kvtag_store.backends.memory import MemoryBackend, MemoryCensus
from kvtag_store.config import ServiceConfig, ServiceLimits
from kvtag_store.security.options import Security
from kvtag_store.security.tokens import TokenRegistry

from tests.descriptors import PROBE, mode, namespace

from ..api.test_fuzz import MAX_BATCH, _call, _mutate, _valid_messages, documented_reasons
from ..security_harness import write_tokens

RPCS = 10_000
SEED = 42
# One call in this many opens a session under a random tenant name (the rest are the fuzzer's
# mutated calls of every method): ~800 tenants, far past the old cap of 16 and within the
# namespace and session caps, which are not what this file is about.
OPEN_EVERY = 12
NEW_TENANT = "fz-final"
VALUE = bytes(range(256)) * 64


@dataclass
class Fuzzed:
    server: RunningServer
    backend: MemoryBackend
    census: MemoryCensus
    shm: Path
    tokens: dict[str, str]


def _serve(tmp_path: Path, grants: list[tuple[str, str, list[str]]] | None) -> Fuzzed:
    shm = tmp_path / "shm"
    shm.mkdir()
    backend = MemoryBackend(32 << 20, shm_dir=str(shm), prefault="lazy")
    config = ServiceConfig(
        limits=ServiceLimits(max_key_bytes=64, max_batch_items=MAX_BATCH, max_message_bytes=1 << 20),
        max_inflight_bytes=1 << 20,
    )
    security, tokens = Security(), {}
    if grants is not None:
        tokens = write_tokens(tmp_path / "tokens.toml", grants)
        security = Security(tokens=TokenRegistry.from_file(tmp_path / "tokens.toml"))
    census = MemoryCensus()
    server = start_server(backend, census, config, listen="127.0.0.1:0", security=security)
    return Fuzzed(server, backend, census, shm, tokens)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[[list[tuple[str, str, list[str]]] | None], Fuzzed]]:
    started: list[Fuzzed] = []

    def factory(grants: list[tuple[str, str, list[str]]] | None) -> Fuzzed:
        started.append(_serve(tmp_path, grants))
        return started[-1]

    yield factory
    for fuzzed in started:
        fuzzed.server.stop(grace=0)


def _channel(tmp_path: Path, address: str, token: str | None) -> grpc.Channel:
    if token is None:
        return open_channel(address, ChannelSecurity(use_env_token=False))
    path = tmp_path / f"token-{abs(hash(token))}"
    path.write_text(token)
    return open_channel(address, ChannelSecurity(token_file=str(path), use_env_token=False))


def _open(tenant: str, engine: str = "fuzz") -> bytes:
    return pb.OpenSessionRequest(
        engine_id=engine, namespace=namespace(tenant=tenant), mode=mode(), probe_keys=PROBE
    ).SerializeToString()


def _fuzz(channel: grpc.Channel, rng: random.Random, tenants: Callable[[random.Random], str]) -> Counter[str]:
    """RPCS calls, one at a time: every OPEN_EVERY-th (on average) an OpenSession under `tenants(rng)`,
    mutated a third of the time, the others the fuzzer's mutated calls of every method on one of the
    sessions opened so far. Every refusal must be one docs/errors.md lists. Returns outcome counts."""
    documented = documented_reasons()
    open_session = channel.unary_unary("/kvtag.v1.KvStore/OpenSession")
    sessions: list[str] = []
    outcomes: Counter[str] = Counter()
    for _ in range(RPCS):
        try:
            if not sessions or rng.randrange(OPEN_EVERY) == 0:
                data = _open(tenants(rng), f"fuzz-{rng.randrange(4)}")
                if rng.randrange(3) == 0:
                    data = _mutate(data, rng)
                reply = pb.OpenSessionResponse.FromString(open_session(data, timeout=10))
                if reply.session_id:
                    sessions = [*sessions[-31:], reply.session_id]
            else:
                valid = _valid_messages(rng.choice(sessions), rng)
                method = rng.choice(sorted(valid))
                _call(channel, method, _mutate(valid[method], rng), rng)()
            outcomes["OK"] += 1
        except grpc.RpcError as exc:
            error = parse_error(exc)
            assert error is not None, f"a status without kvtag details: {exc}"
            assert documented.get(error.reason) == error.code, (error.reason, error.code, error.message)
            outcomes[error.reason] += 1
    return outcomes


def _round_trip(channel: grpc.Channel, tenant: str, key: bytes = b"k") -> None:
    """A session of `tenant`: put `key`, Lookup (a leased hit), Get (byte-exact), close."""
    stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
    opened = stub.OpenSession(
        pb.OpenSessionRequest(
            engine_id="newcomer",
            namespace=namespace(tenant=tenant),
            mode=mode(),
            probe_keys=PROBE,
            data_paths=[pb.DATA_PATH_SHARED_MEMORY],
        ),
        timeout=10,
    )
    sid = opened.session_id
    put = stub.Put(pb.PutRequest(session_id=sid, items=[pb.PutItem(block=pb.BlockRef(key=key), value=VALUE)]))
    assert [r.status for r in put.results] == [pb.STORED]
    lookup = stub.Lookup(pb.LookupRequest(session_id=sid, blocks=[pb.BlockRef(key=key)]), timeout=10)
    assert list(lookup.statuses) == [pb.HIT]
    got = stub.Get(
        pb.GetRequest(session_id=sid, blocks=[pb.BlockRef(key=key)], lease_id=lookup.lease.lease_id),
        timeout=10,
    )
    assert [(r.status, r.value) for r in got.results] == [(pb.HIT, VALUE)]
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)


def _junk_tenant(rng: random.Random) -> str:
    return f"junk-{rng.getrandbits(40):x}"


def test_after_a_fuzz_of_random_tenants_without_tokens_a_new_tenant_round_trips(
    serve: Callable[[list[tuple[str, str, list[str]]] | None], Fuzzed], tmp_path: Path
) -> None:
    fuzzed = serve(None)
    with _channel(tmp_path, fuzzed.server.address, None) as channel:
        outcomes = _fuzz(channel, random.Random(SEED), _junk_tenant)
        assert outcomes["OK"] > RPCS // 4 and outcomes["MALFORMED_REQUEST"] > 0, outcomes
        assert fuzzed.census.namespaces_held() > 16 * 10, "the fuzz named many tenants"
        assert outcomes["NAMESPACE_CAP_REACHED"] == 0, outcomes
        # Every tenant is a label here: they all share the pool's one arena, whatever their number.
        assert fuzzed.backend.arenas() == 1
        assert len([p for p in fuzzed.shm.iterdir() if p.name.startswith("kvtag-")]) == 1
        _round_trip(channel, NEW_TENANT)


def test_after_a_fuzz_with_tokens_a_new_tenant_the_file_names_round_trips(
    serve: Callable[[list[tuple[str, str, list[str]]] | None], Fuzzed], tmp_path: Path
) -> None:
    """The fuzz calls under an admin token granting every tenant ("*"), and now and then under an engine
    token of two named tenants: random tenants share one arena, the named ones have theirs."""
    fuzzed = serve(
        [
            ("fuzzer", "admin", ["*"]),
            ("team", "engine", ["team-a", "team-b"]),
            ("fresh", "engine", [NEW_TENANT]),
        ]
    )
    named = ["team-a", "team-b"]
    with (
        _channel(tmp_path, fuzzed.server.address, fuzzed.tokens["fuzzer"]) as channel,
        _channel(tmp_path, fuzzed.server.address, fuzzed.tokens["fresh"]) as fresh,
    ):
        outcomes = _fuzz(channel, random.Random(SEED), lambda rng: rng.choice([*named, _junk_tenant(rng)]))
        assert outcomes["OK"] > RPCS // 4, outcomes
        assert outcomes["NAMESPACE_CAP_REACHED"] == 0, outcomes
        # Arenas: the named tenants' and the one every "*"-reached tenant shares; never one per name.
        assert fuzzed.backend.arenas() <= len(named) + 1
        _round_trip(fresh, NEW_TENANT)
        assert fuzzed.backend.arenas() <= len(named) + 2
        # Its token reaches only its tenant: a refusal, not a lock-out, for any other.
        with pytest.raises(grpc.RpcError) as refused:
            _round_trip(fresh, "team-a")
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_with_tokens_an_unauthenticated_flood_cannot_make_the_store_refuse_a_granted_tenant(
    serve: Callable[[list[tuple[str, str, list[str]]] | None], Fuzzed], tmp_path: Path
) -> None:
    """Four threads send 6,000 calls without a valid token (none, a wrong one, a malformed header),
    OpenSession of fresh tenant names and the fuzzer's calls of every method: each is refused
    UNAUTHENTICATED before the service sees it, and the granted tenant is served during and after."""
    fuzzed = serve([("acme-engines", "engine", ["acme"])])
    address = fuzzed.server.address
    refusals: Counter[str] = Counter()
    lock = threading.Lock()

    def flood(seed: int) -> None:
        rng = random.Random(seed)
        metadata = [None, [("authorization", "Bearer kvt_wrong")], [("authorization", "Basic x")]][seed % 3]
        with grpc.insecure_channel(address) as channel:
            open_session = channel.unary_unary("/kvtag.v1.KvStore/OpenSession")
            for i in range(1500):
                try:
                    if i % 2 == 0:
                        open_session(_open(_junk_tenant(rng)), metadata=metadata, timeout=10)
                    else:
                        valid = _valid_messages("s-" + rng.randbytes(8).hex(), rng)
                        method = rng.choice(sorted(set(valid) - {"PutStream", "GetStream"}))
                        unary = channel.unary_unary(f"/kvtag.v1.KvStore/{method}")
                        unary(_mutate(valid[method], rng), metadata=metadata, timeout=10)
                    outcome = "OK"
                except grpc.RpcError as exc:
                    outcome = exc.code().name
                with lock:
                    refusals[outcome] += 1

    threads = [threading.Thread(target=flood, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    with _channel(tmp_path, address, fuzzed.tokens["acme-engines"]) as acme:
        _round_trip(acme, "acme")  # served during the flood
        for thread in threads:
            thread.join()
        assert set(refusals) == {"UNAUTHENTICATED"} and refusals["UNAUTHENTICATED"] == 6000, refusals
        assert fuzzed.census.namespaces_held() <= 1  # the flood kept nothing
        _round_trip(acme, "acme", b"after")
