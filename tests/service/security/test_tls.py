"""TLS and mutual TLS on the gRPC port with real certificates, certificate and token rotation on SIGHUP
against a real `kvtag-store serve`, the non-loopback rule, and the CLI against a secured store."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag_proto.channels import ChannelSecurity, open_channel
from kvtag_store.app import cli
from kvtag_store.app.server import RunningServer, start_server
from kvtag_store.backends.memory import MemoryBackend, MemoryCensus
from kvtag_store.config import ServiceConfig
from kvtag_store.security.options import Security, check_listen
from kvtag_store.security.tls import ServerTls, TlsFileError
from kvtag_store.security.tokens import TokenRegistry

from tests.certs import Authority, Pair, install
from tests.net import wait_until
from tests.store_process import StoreProcess, store_bin

from ..security_harness import Caller, write_tokens


@dataclass(frozen=True)
class Certs:
    ca: Path
    other_ca: Path
    server: Pair
    client: Pair
    stranger: Pair  # a client certificate from the other CA
    next_ca: Path  # the CA a rotation moves to
    next_server: Pair


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    directory = tmp_path_factory.mktemp("certs")
    ca, other, successor = (Authority(directory, n) for n in ("ca", "other-ca", "next-ca"))
    return Certs(
        ca=ca.cert,
        other_ca=other.cert,
        server=ca.issue("server", server=True),
        client=ca.issue("client", server=False),
        stranger=other.issue("stranger", server=False),
        next_ca=successor.cert,
        next_server=successor.issue("next-server", server=True),
    )


@pytest.fixture
def tls_store(certs: Certs, tmp_path: Path) -> Iterator[tuple[RunningServer, str]]:
    """A TLS + tokens server (no client certificates required) and an engine token of tenant t."""
    tokens_path = tmp_path / "tokens.toml"
    token = write_tokens(tokens_path, [("e", "engine", ["t"])])["e"]
    security = Security(
        tokens=TokenRegistry.from_file(tokens_path), tls=ServerTls(certs.server.cert, certs.server.key)
    )
    server = start_server(MemoryBackend(1 << 20), MemoryCensus(), ServiceConfig(), security=security)
    yield server, token
    server.stop(grace=0)


@pytest.fixture
def mtls_store(certs: Certs) -> Iterator[RunningServer]:
    tls = ServerTls(certs.server.cert, certs.server.key, client_ca=certs.ca)
    server = start_server(MemoryBackend(1 << 20), MemoryCensus(), ServiceConfig(), security=Security(tls=tls))
    yield server
    server.stop(grace=0)


def _stats(target: str, security: ChannelSecurity) -> grpc.StatusCode:
    """OK, or the code a GetStats call failed with (handshake failures surface as UNAVAILABLE)."""
    with open_channel(target, security) as channel:
        try:
            Caller(channel, None).stub.GetStats(pb.GetStatsRequest(), timeout=10)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def test_a_client_trusting_the_store_ca_with_a_token_stores_and_reads(
    certs: Certs, tls_store: tuple[RunningServer, str], tmp_path: Path
) -> None:
    server, token = tls_store
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    with open_channel(
        server.address, ChannelSecurity(tls_ca=str(certs.ca), token_file=str(token_file))
    ) as channel:
        caller = Caller(channel, None)  # the channel itself carries the token
        session = caller.open("t").session_id
        assert caller.put(session, [(b"k", b"v" * 4096)]) == [pb.STORED]
        assert caller.get(session, [b"k"]) == [b"v" * 4096]


def test_a_client_trusting_another_ca_fails_the_handshake(
    certs: Certs, tls_store: tuple[RunningServer, str]
) -> None:
    server, _ = tls_store
    assert _stats(server.address, ChannelSecurity(tls_ca=str(certs.other_ca))) is grpc.StatusCode.UNAVAILABLE
    # A plaintext client gets no answer from a TLS port either.
    assert _stats(server.address, ChannelSecurity()) is grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_refuses_clients_without_a_certificate_of_its_ca(
    certs: Certs, mtls_store: RunningServer
) -> None:
    target = mtls_store.address
    ca = str(certs.ca)
    assert _stats(target, ChannelSecurity(tls_ca=ca)) is grpc.StatusCode.UNAVAILABLE
    stranger = ChannelSecurity(tls_ca=ca, tls_cert=str(certs.stranger.cert), tls_key=str(certs.stranger.key))
    assert _stats(target, stranger) is grpc.StatusCode.UNAVAILABLE
    client = ChannelSecurity(tls_ca=ca, tls_cert=str(certs.client.cert), tls_key=str(certs.client.key))
    assert _stats(target, client) is grpc.StatusCode.OK


def test_mismatched_certificate_and_key_are_refused_at_start(certs: Certs) -> None:
    with pytest.raises(TlsFileError, match="not a matching"):
        ServerTls(certs.server.cert, certs.client.key)


def test_sighup_rotates_certificate_and_tokens_and_keeps_live_sessions(certs: Certs, tmp_path: Path) -> None:
    cert, key, tokens_path = tmp_path / "server.pem", tmp_path / "server.key", tmp_path / "tokens.toml"
    install(certs.server, cert, key)
    tokens = write_tokens(tokens_path, [("old", "engine", ["t"]), ("admin", "admin", ["*"])])
    args = ("--tls-cert", str(cert), "--tls-key", str(key), "--auth-tokens", str(tokens_path))
    with StoreProcess(tmp_path / "store.log", *args) as store:
        live = open_channel(store.endpoint, ChannelSecurity(tls_ca=str(certs.ca)))
        old = Caller(live, tokens["old"])
        session = old.open("t").session_id
        assert old.put(session, [(b"k", b"before")]) == [pb.STORED]

        install(certs.next_server, cert, key)
        rotated = write_tokens(
            tokens_path,
            [("new", "engine", ["t"]), ("admin", "admin", ["*"])],
            tokens={"admin": tokens["admin"]},
        )
        assert store.proc is not None
        store.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "reloaded on SIGHUP" in store.log_tail(), 30, "the SIGHUP reload")

        # The revoked token is refused, on the live connection too.
        with pytest.raises(grpc.RpcError) as refused:
            old.get(session, [b"k"])
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        # The live connection and the session outlive both rotations, under the successor token.
        new = Caller(live, rotated["new"])
        assert new.get(session, [b"k"]) == [b"before"]
        assert new.put(session, [(b"k2", b"after")]) == [pb.STORED]
        # New connections get the new certificate: trusted by the new CA only.
        for ca, expected in ((certs.next_ca, grpc.StatusCode.OK), (certs.ca, grpc.StatusCode.UNAVAILABLE)):
            with open_channel(store.endpoint, ChannelSecurity(tls_ca=str(ca))) as fresh:
                try:
                    Caller(fresh, rotated["admin"]).call("GetStats", pb.GetStatsRequest())
                    code = grpc.StatusCode.OK
                except grpc.RpcError as err:
                    code = err.code()
            assert code is expected, ca.name
        live.close()
        log = store.log_tail(20000)
    for secret in tokens.values():
        assert secret not in log


def test_a_broken_certificate_on_sighup_keeps_the_old_one(certs: Certs, tmp_path: Path) -> None:
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    install(certs.server, cert, key)
    with StoreProcess(tmp_path / "store.log", "--tls-cert", str(cert), "--tls-key", str(key)) as store:
        key.write_text("not a key\n")
        assert store.proc is not None
        store.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "SIGHUP reload kept" in store.log_tail(), 30, "the failed reload")
        assert _stats(store.endpoint, ChannelSecurity(tls_ca=str(certs.ca))) is grpc.StatusCode.OK


def test_a_non_loopback_address_without_tls_and_tokens_is_refused_unless_insecure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The refusal happens before binding, so the test never opens a port beyond loopback.
    refused = subprocess.run(
        [store_bin(), "serve", "--listen", "0.0.0.0:0", "--metrics-listen", ""],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2
    assert "--insecure" in refused.stderr and "TLS" in refused.stderr and "tokens" in refused.stderr
    with caplog.at_level("WARNING", logger="kvtag_store.security"):
        check_listen("0.0.0.0:50051", Security(), insecure=True)
    assert "INSECURE" in caplog.text
    check_listen("127.0.0.1:50051", Security(), insecure=False)
    check_listen("[::1]:50051", Security(), insecure=False)


def test_cli_reaches_a_tls_and_token_store_and_never_prints_the_token(
    certs: Certs, tls_store: tuple[RunningServer, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server, engine_token = tls_store
    admin_token_file = tmp_path / "admin-token"
    # The fixture's registry reads its own file; add an admin by rewriting that file and reloading.
    tokens_path = server.service.access.tokens.path
    assert tokens_path is not None
    admin = write_tokens(
        tokens_path, [("e", "engine", ["t"]), ("admin", "admin", ["*"])], {"e": engine_token}
    )
    assert server.service.access.tokens.reload()
    admin_token_file.write_text(admin["admin"])
    secured = ["--target", server.address, "--tls-ca", str(certs.ca)]
    assert cli.main(["health", *secured]) == 0  # health needs no token
    assert "SERVING" in capsys.readouterr().out
    assert cli.main(["stats", *secured, "--token-file", str(admin_token_file), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "memory"
    engine_file = tmp_path / "engine-token"
    engine_file.write_text(engine_token)
    assert cli.main(["diagnose", *secured, "--token-file", str(engine_file)]) == 1
    assert cli.main(["stats", *secured]) == 1
    out = capsys.readouterr()
    assert "PERMISSION_DENIED" in out.err and "UNAUTHENTICATED" in out.err
    assert engine_token not in out.err + out.out and admin["admin"] not in out.err + out.out
