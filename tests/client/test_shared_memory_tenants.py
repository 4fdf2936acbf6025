"""The shared-memory data path against a real TLS + tokens store keeps tenants apart: an engine of
tenant A maps only A's arena, which never holds B's bytes, and a tenant-A token gets nothing of B's
arena through any call (no offer, no attach, no reference, no commit of B's slots); every arena file
is private to the service's user, so another user cannot open it at all, and `--shm-group` opens a
tenant's file to that tenant's group only."""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag_client.store import StoreClient
from kvtag_proto.channels import ChannelSecurity
from kvtag_store.security.tokens import hash_token, new_token

from tests.certs import Authority

from .conftest import ClientFactory, StoreFactory

NOBODY = 65534


def _entry(name: str, token: str, tenant: str) -> str:
    return (
        f'[[tokens]]\nname = "{name}"\nsha256 = "{hash_token(token)}"\nrole = "engine"\n'
        f'tenants = ["{tenant}"]\n'
    )


def _refused(call: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    assert isinstance(call, grpc.Call)
    return call.code(), call.details() or ""


def test_a_tenant_a_token_never_reaches_tenant_b_values_through_shared_memory(
    start_store: StoreFactory, make_client: ClientFactory, tmp_path: Path
) -> None:
    ca = Authority(tmp_path / "pki", "ca")
    server = ca.issue("server", server=True)
    token_a, token_b = new_token(), new_token()
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(_entry("acme-engines", token_a, "acme") + _entry("globex-engines", token_b, "globex"))
    store = start_store(
        "--tls-cert", str(server.cert), "--tls-key", str(server.key), "--auth-tokens", str(tokens),
        "--capacity", "16MiB",  # arenas of ~50 MiB, read whole below
    )  # fmt: skip

    def engine(tenant: str, token: str) -> StoreClient:
        token_file = tmp_path / f"{tenant}.token"
        token_file.write_text(token + "\n")
        client = make_client(
            store.endpoint, tenant=tenant, security=ChannelSecurity(str(ca.cert), token_file=str(token_file))
        )
        assert client.open() and client.data_path == "shared_memory", f"{tenant}: no shared-memory path"
        return client

    a, b = engine("acme", token_a), engine("globex", token_b)
    secret = os.urandom(4096)
    assert b.put([(0, b"globex-block", secret, b"")]) == [pb.STORED]
    assert b.get([(0, b"globex-block")]) == [secret]
    pending = b.reserve([(0, b"globex-pending", 64, b"")])
    assert pending is not None and pending.generations[0] is not None
    a_arena, b_arena = a.shm.arena(), b.shm.arena()
    assert a_arena is not None and b_arena is not None

    # Each tenant has its own arena file; A's mapping (the whole file) never holds B's bytes.
    a_path, b_path = Path("/dev/shm") / a_arena.segment, Path("/dev/shm") / b_arena.segment
    assert a_path != b_path
    assert secret in b_path.read_bytes() and secret not in a_path.read_bytes()
    assert secret not in bytes(a_arena.view)

    # Files are private to the service's user: another user cannot even open them.
    for path in (a_path, b_path):
        info = path.stat()
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid(), oct(info.st_mode)
        denied = subprocess.run(["head", "-c", "1", str(path)], user=NOBODY, capture_output=True, timeout=30)
        assert denied.returncode != 0 and b"Permission denied" in denied.stderr

    # With token A's channel, nothing of B's arena is handed out, whatever session id is named.
    stub = a.session.stub
    b_session = b.session_id
    b_nonce = b_arena.nonce
    open_b = pb.OpenSessionRequest(
        engine_id="intruder",
        namespace=b.namespace,
        mode=b.mode,
        probe_keys=b.probe_keys,
        data_paths=[pb.DATA_PATH_SHARED_MEMORY, pb.DATA_PATH_INLINE],
    )
    with pytest.raises(grpc.RpcError) as opened:
        stub.OpenSession(open_b, timeout=10)
    assert _refused(opened.value)[0] is grpc.StatusCode.PERMISSION_DENIED
    block = pb.BlockRef(group=0, key=b"globex-block")
    generation = pending.generations[0]
    calls: dict[str, Callable[[str], object]] = {
        "AttachSharedMemory": lambda sid: stub.AttachSharedMemory(
            pb.AttachSharedMemoryRequest(session_id=sid, nonce=b_nonce), timeout=10
        ),
        "GetReferences": lambda sid: stub.GetReferences(
            pb.GetRequest(session_id=sid, blocks=[block]), timeout=10
        ),
        "ReserveSlots": lambda sid: stub.ReserveSlots(
            pb.ReserveSlotsRequest(session_id=sid, items=[pb.SlotRequest(block=block, length=64)]), timeout=10
        ),
        "CommitSlots": lambda sid: stub.CommitSlots(
            pb.CommitSlotsRequest(session_id=sid, generations=[generation]), timeout=10
        ),
    }
    unknown = "0" * len(b_session)
    for name, call in calls.items():
        answers = []
        for session_id in (b_session, unknown):
            with pytest.raises(grpc.RpcError) as refused:
                call(session_id)
            code, details = _refused(refused.value)
            answers.append((code, details.replace(session_id, "<id>")))
        # Answered exactly as an unknown session id is: B's session is not even confirmed to exist.
        assert answers[0] == answers[1] and answers[0][0] is grpc.StatusCode.NOT_FOUND, (name, answers)

    # In its own session, A's token gets no reference to B's block, cannot commit B's reservation,
    # and B's nonce does not attach A's session to anything but A's own arena.
    own = stub.GetReferences(pb.GetRequest(session_id=a.session_id, blocks=[block]), timeout=10)
    assert [r.status for r in own.results] == [pb.MISS] and not own.results[0].HasField("slot")
    stolen = stub.CommitSlots(
        pb.CommitSlotsRequest(session_id=a.session_id, generations=[generation]), timeout=10
    )
    assert [r.status for r in stolen.results] == [pb.REJECTED]
    attach = stub.AttachSharedMemory(
        pb.AttachSharedMemoryRequest(session_id=a.session_id, nonce=b_nonce), timeout=10
    )
    assert attach.data_path == pb.DATA_PATH_INLINE
    assert a.get([(0, b"globex-block")]) == [None]

    # B is untouched: its reservation still commits and its value reads back byte for byte.
    slot = pending.slots[0]
    assert slot is not None
    slot[:] = b"p" * 64
    assert b.commit(pending) == [pb.STORED]
    assert b.get([(0, b"globex-block"), (0, b"globex-pending")]) == [secret, b"p" * 64]
    log = store.log_tail(200_000)
    assert token_a not in log and token_b not in log


def test_with_shm_groups_each_tenants_arena_opens_only_for_its_own_group(
    start_store: StoreFactory, make_client: ClientFactory
) -> None:
    """Engines of isolated tenants run under their own users: `--shm-group` lets each map its own
    tenant's arena (group, mode 0660) and still not open another tenant's."""
    groups = {"acme": 40001, "globex": 40002}
    store = start_store(
        "--capacity", "16MiB", "--shm-group", "acme=40001", "--shm-group", "globex=40002"
    )  # fmt: skip
    paths = {}
    for tenant in groups:
        client = make_client(store.endpoint, tenant=tenant)
        assert client.open() and client.data_path == "shared_memory"
        arena = client.shm.arena()
        assert arena is not None
        paths[tenant] = Path("/dev/shm") / arena.segment
    shared = make_client(store.endpoint, tenant="")
    assert shared.open()
    shared_arena = shared.shm.arena()
    assert shared_arena is not None
    assert stat.S_IMODE((Path("/dev/shm") / shared_arena.segment).stat().st_mode) == 0o600
    for tenant, gid in groups.items():
        info = paths[tenant].stat()
        assert (info.st_gid, stat.S_IMODE(info.st_mode)) == (gid, 0o660)
    for tenant, gid in groups.items():
        for other, path in paths.items():
            # Another user in the tenant's group: read and write its own arena (as the client maps it).
            opened = subprocess.run(
                ["dd", f"of={path}", "bs=1", "count=0", "conv=notrunc", "status=none"],
                user=NOBODY,
                group=NOBODY,
                extra_groups=[gid],
                capture_output=True,
                timeout=30,
            )
            assert (opened.returncode == 0) == (other == tenant), (tenant, other, opened.stderr)
            read = subprocess.run(
                ["head", "-c", "4096", str(path)], user=NOBODY, group=NOBODY, extra_groups=[gid],
                capture_output=True, timeout=30,
            )  # fmt: skip
            assert (read.returncode == 0 and read.stdout[:8] == b"KVTAGARN") == (other == tenant)


def test_shm_group_must_be_one_the_service_can_give(start_store: StoreFactory) -> None:
    with pytest.raises(RuntimeError, match="no group named"):
        start_store("--shm-group", "acme=no-such-group-kvtag")
