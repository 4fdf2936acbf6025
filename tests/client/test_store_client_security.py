"""StoreClient against a real TLS + tokens store: hits with the right CA and token, one clear error and
a store-less engine with a wrong token, recovery once the token file is fixed, the token never logged."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag_client.store import StoreState
from kvtag_proto.channels import ChannelSecurity
from kvtag_store.security.tokens import hash_token, new_token

from tests.certs import Authority, Pair
from tests.net import wait_until

from .conftest import ClientFactory, StoreFactory

# (group, key, value, base_key)
BLOCKS = [(0, b"key-%d" % i, bytes([i]) * 2048, b"") for i in range(4)]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Pair]:
    directory = tmp_path_factory.mktemp("pki")
    ca = Authority(directory, "ca")
    return ca.cert, ca.issue("server", server=True)


@pytest.fixture
def secured(start_store: StoreFactory, pki: tuple[Path, Pair], tmp_path: Path) -> tuple[str, str]:
    """A TLS store whose tokens file grants tenant `acme` to one engine token: (endpoint, token)."""
    _, server = pki
    token = new_token()
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        f'[[tokens]]\nname = "acme-engines"\nsha256 = "{hash_token(token)}"\nrole = "engine"\n'
        'tenants = ["acme"]\n'
    )
    store = start_store(
        "--tls-cert", str(server.cert), "--tls-key", str(server.key), "--auth-tokens", str(tokens)
    )  # fmt: skip
    return store.endpoint, token


def test_client_with_the_store_ca_and_its_token_gets_hits(
    secured: tuple[str, str], pki: tuple[Path, Pair], make_client: ClientFactory, tmp_path: Path
) -> None:
    endpoint, token = secured
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    security = ChannelSecurity(tls_ca=str(pki[0]), token_file=str(token_file))
    client = make_client(endpoint, tenant="acme", security=security)
    assert client.open() and client.state is StoreState.CONNECTED
    assert client.put(BLOCKS) == [pb.STORED] * 4
    assert client.lookup([(g, k, b"") for g, k, _, _ in BLOCKS]).prefix_length == 4
    assert client.get([(g, k) for g, k, _, _ in BLOCKS]) == [v for _, _, v, _ in BLOCKS]


def test_wrong_token_logs_one_clear_error_serves_misses_and_recovers_when_the_file_is_fixed(
    secured: tuple[str, str],
    pki: tuple[Path, Pair],
    make_client: ClientFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    endpoint, token = secured
    wrong = new_token()
    token_file = tmp_path / "token"
    token_file.write_text(wrong)
    security = ChannelSecurity(tls_ca=str(pki[0]), token_file=str(token_file))
    with caplog.at_level(logging.INFO, logger="kvtag_client.store"):
        client = make_client(endpoint, tenant="acme", security=security, reconnect_interval_s=0.2)
        assert not client.open()
        for _ in range(5):
            assert client.lookup([(0, b"key-0", b"")]).prefix_length == 0
            assert client.put(BLOCKS[:1]) is None
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1, [r.getMessage() for r in errors]
        assert "UNAUTHENTICATED" in errors[0].getMessage() and "WITHOUT the store" in errors[0].getMessage()
        # The operator fixes the token file: the background reconnect picks the new token up.
        token_file.write_text(token + "\n")
        wait_until(lambda: client.state is StoreState.CONNECTED, 20, "the client to reconnect")
        assert client.put(BLOCKS) == [pb.STORED] * 4
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert token not in logged and wrong not in logged


def test_token_from_the_environment_and_a_tenant_it_does_not_grant(
    secured: tuple[str, str],
    pki: tuple[Path, Pair],
    make_client: ClientFactory,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    endpoint, token = secured
    monkeypatch.setenv("KVTAG_TOKEN", token)
    security = ChannelSecurity(tls_ca=str(pki[0]))
    assert make_client(endpoint, tenant="acme", security=security).open()
    with caplog.at_level(logging.ERROR, logger="kvtag_client.store"):
        other = make_client(endpoint, tenant="globex", security=security)
        assert not other.open()
        assert other.lookup([(0, b"key-0", b"")]).prefix_length == 0
    assert [r.getMessage().count("TENANT_NOT_GRANTED") for r in caplog.records] == [1]
