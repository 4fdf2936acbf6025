"""The tokens file: only digests, TOML or JSON, every doubtful entry refused with a message that names
the entry and never the secret."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from kvtag_store.security.tokens import (
    ANONYMOUS,
    Role,
    TokenFileError,
    TokenRegistry,
    bearer_token,
    hash_token,
)

from ..security_harness import write_tokens


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_tokens_file_in_toml_or_json_maps_tokens_to_principals(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"tokens{suffix}"
    tokens = write_tokens(path, [("a", "engine", ["acme", ""]), ("root", "admin", ["*"])])
    registry = TokenRegistry.from_file(path)
    principal = registry.authenticate(f"Bearer {tokens['a']}")
    assert principal is not None and principal.role is Role.ENGINE
    assert principal.may_use("acme") and principal.may_use("") and not principal.may_use("other")
    assert not principal.sees_everything
    root = registry.authenticate(f"Bearer {tokens['root']}")
    assert root is not None and root.sees_everything
    assert registry.authenticate(None) is None
    assert registry.authenticate(f"Bearer {tokens['a']}x") is None
    for token in tokens.values():
        assert token not in path.read_text()  # only digests on disk


def test_without_a_tokens_file_every_caller_is_anonymous_as_before() -> None:
    assert TokenRegistry.disabled().authenticate(None) is ANONYMOUS


_ENTRY = '[[tokens]]\nname = "a"\nsha256 = "{d}"\n'


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        (_ENTRY + 'token = "kvt_secret"\nrole = "engine"\ntenants = ["t"]\n', "plaintext"),
        (_ENTRY + 'role = "root"\ntenants = ["t"]\n', "role"),
        (_ENTRY + 'role = "engine"\n', "tenants"),
        ('[[tokens]]\nname = "a"\nsha256 = "abc"\nrole = "engine"\ntenants = ["t"]\n', "sha256"),
        (_ENTRY + 'role = "viewer"\ntenants = ["t"]\nexpires = 1\n', "unknown"),
        ((_ENTRY + 'role = "engine"\ntenants = ["t"]\n') * 2, "twice"),
        ("tokens = 3\n", "tokens"),
        ("not toml [\n", "TOML"),
    ],
)
def test_a_doubtful_tokens_file_is_refused_naming_the_entry_not_the_secret(
    tmp_path: Path, body: str, complaint: str
) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(body.replace("{d}", hash_token("kvt_secret")))
    with pytest.raises(TokenFileError, match=complaint) as refused:
        TokenRegistry.from_file(path)
    assert "kvt_secret" not in str(refused.value)


@pytest.mark.parametrize(
    "header",
    ["", "Bearer", "Bearer ", "Basic x", "Bearer a b", "Bearer\ta", "x" * 2000, "Bearer " + "a" * 1020],
)
def test_malformed_authorization_values_carry_no_token(header: str) -> None:
    assert bearer_token(header) is None


def test_minted_token_entry_pastes_into_a_tokens_file(tmp_path: Path) -> None:
    minted = subprocess.run(
        [sys.executable, "-m", "kvtag_store.security.tokens", "new", "--name", "acme-engines",
         "--role", "engine", "--tenant", "acme"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    token = minted.stderr.strip().rpartition(" ")[2]
    assert token.startswith("kvt_") and token not in minted.stdout
    path = tmp_path / "tokens.toml"
    path.write_text(minted.stdout)
    principal = TokenRegistry.from_file(path).authenticate(f"Bearer {token}")
    assert principal is not None and principal.name == "acme-engines" and principal.tenants == {"acme"}
    hashed = subprocess.run(
        [sys.executable, "-m", "kvtag_store.security.tokens", "hash"], input=token + "\n",
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert hashed.stdout.strip() == hash_token(token)
