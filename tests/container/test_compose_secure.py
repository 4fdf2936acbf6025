"""compose.secure.yaml: the image reads its certificate, key and tokens file from a mounted directory,
its HEALTHCHECK passes over TLS, tokens are enforced, and SIGHUP reloads the mounted files."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_proto.channels import ChannelSecurity, open_channel
from kvtag_store.security.tokens import hash_token, new_token

from tests.certs import Authority
from tests.descriptors import PROBE, mode, namespace
from tests.net import free_port, wait_until

from . import podman as pm

pytestmark = pytest.mark.slow  # real podman containers


def _tokens_file(path: Path, grants: dict[str, str]) -> None:
    path.write_text(
        "".join(
            f'[[tokens]]\nname = "{name}"\nsha256 = "{hash_token(token)}"\n'
            'role = "engine"\ntenants = ["acme"]\n'
            for name, token in grants.items()
        )
    )


@pytest.fixture(scope="module")
def secure_stack(image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    secrets = tmp_path_factory.mktemp("secrets")
    work = tmp_path_factory.mktemp("pki")
    ca = Authority(work, "ca")
    server = ca.issue("server", server=True)
    shutil.copyfile(ca.cert, secrets / "ca.pem")
    shutil.copyfile(server.cert, secrets / "server.pem")
    shutil.copyfile(server.key, secrets / "server.key")
    token = new_token()
    _tokens_file(secrets / "tokens.toml", {"acme-engines": token})
    for file in [secrets, *secrets.iterdir()]:  # the service runs as uid 10001
        file.chmod(0o755 if file.is_dir() else 0o644)
    grpc_port = free_port()
    stack = pm.ComposeProject(
        "compose.secure.yaml",
        f"{pm.RUN_ID}-secure",
        {
            "KVTAG_IMAGE": image,
            "KVTAG_SECRETS_DIR": str(secrets),
            "KVTAG_GRPC_PORT": str(grpc_port),
            "KVTAG_METRICS_PORT": str(free_port()),
        },
    )
    try:
        stack.compose("up", "--detach")
        name = stack.container("kvtag")
        pm.wait_healthy(name)  # the image's HEALTHCHECK, over TLS
        yield {
            "name": name,
            "target": f"127.0.0.1:{grpc_port}",
            "ca": ca.cert,
            "secrets": secrets,
            "token": token,
        }
    finally:
        stack.down()


def _open(target: str, ca: Path, token_file: Path) -> tuple[grpc.Channel, str]:
    channel = open_channel(target, ChannelSecurity(tls_ca=str(ca), token_file=str(token_file)))
    kv = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
    request = pb.OpenSessionRequest(
        engine_id="e", namespace=namespace(tenant="acme"), mode=mode(), probe_keys=list(PROBE)
    )
    return channel, kv.OpenSession(request, timeout=10).session_id


def test_secure_compose_enforces_tls_and_tokens_and_reloads_on_sighup(
    secure_stack: dict[str, object], tmp_path: Path
) -> None:
    name, target, ca = str(secure_stack["name"]), str(secure_stack["target"]), Path(str(secure_stack["ca"]))
    token_file = tmp_path / "token"
    token_file.write_text(str(secure_stack["token"]))
    channel, session = _open(target, ca, token_file)
    kv = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
    item = pb.PutItem(block=pb.BlockRef(key=b"k"), value=b"v" * 100)
    assert kv.Put(pb.PutRequest(session_id=session, items=[item]), timeout=10).results[0].status == pb.STORED
    anonymous = store_pb2_grpc.KvStoreStub(open_channel(target, ChannelSecurity(tls_ca=str(ca))))  # type: ignore[no-untyped-call]
    with pytest.raises(grpc.RpcError) as refused:
        anonymous.GetStats(pb.GetStatsRequest(), timeout=10)
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    # Rotate the token in the mounted file and reload: the old token is refused, the session lives on.
    successor = new_token()
    secrets = Path(str(secure_stack["secrets"]))
    _tokens_file(secrets / "tokens.toml", {"acme-engines-2": successor})
    pm.podman("kill", "--signal", "HUP", name)
    wait_until(lambda: "reloaded on SIGHUP" in pm.logs(name), 30, "the SIGHUP reload")
    with pytest.raises(grpc.RpcError) as revoked:
        kv.Heartbeat(pb.HeartbeatRequest(session_id=session), timeout=10)
    assert revoked.value.code() is grpc.StatusCode.UNAUTHENTICATED
    token_file.write_text(successor)
    got = kv.Get(pb.GetRequest(session_id=session, blocks=[pb.BlockRef(key=b"k")]), timeout=10)
    assert (got.results[0].status, got.results[0].value) == (pb.HIT, b"v" * 100)
    channel.close()
    pm.wait_healthy(name)
    logs = pm.logs(name)
    assert str(secure_stack["token"]) not in logs and successor not in logs
    assert pm.stop(name) == 0, logs
