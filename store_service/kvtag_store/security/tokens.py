"""Bearer tokens: the tokens file (only SHA-256 digests of tokens), its reload, and who a token is.

The small API other parts use (the gRPC gate in access.py, an HTTP status page):

    tokens = TokenRegistry.from_file(path)       # or TokenRegistry.disabled()
    principal = tokens.authenticate(header)      # header: "Bearer <token>" or None
    if principal is None: refuse                 # missing, malformed or unknown token
    principal.may_use(tenant), principal.role    # what it may do

Tokens are random strings minted by `python -m kvtag_store.security.tokens new`; the file holds only their
SHA-256, so a leaked file (or a backup of it) does not hand out access. A plain hash, not a slow
KDF, is enough because tokens carry at least 128 random bits: nothing to brute-force.
"""

from __future__ import annotations

import argparse
import enum
import hashlib
import json
import logging
import re
import secrets
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("kvtag_store.security.tokens")

# A grant of every tenant (the admin default).
ALL_TENANTS = "*"
# Headers longer than this are refused unread: no token we mint is anywhere near it.
MAX_AUTHORIZATION_CHARS = 1024
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_TOKEN_PREFIX = "kvt_"


class Role(enum.Enum):
    """engine: sessions in its tenants; viewer: Diagnose and Stats of its tenants; admin: everything."""

    ENGINE = "engine"
    VIEWER = "viewer"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who presented a token: its entry's name (safe to log), role and granted tenants."""

    name: str
    role: Role
    tenants: frozenset[str]

    def may_use(self, tenant: str) -> bool:
        """True when the principal's grant covers `tenant` ("" is the shared tenant)."""
        return ALL_TENANTS in self.tenants or tenant in self.tenants

    @property
    def opens_sessions(self) -> bool:
        return self.role in (Role.ENGINE, Role.ADMIN)

    @property
    def views(self) -> bool:
        return self.role in (Role.VIEWER, Role.ADMIN)

    @property
    def sees_everything(self) -> bool:
        """Admin of every tenant: sees store-wide figures (capacity, other namespaces)."""
        return self.role is Role.ADMIN and ALL_TENANTS in self.tenants


# The caller when authentication is off (no --auth-tokens): today's open behaviour.
ANONYMOUS = Principal("anonymous", Role.ADMIN, frozenset({ALL_TENANTS}))


class TokenFileError(ValueError):
    """The tokens file cannot be used; the message names the file and entry, never a token."""


def hash_token(token: str) -> str:
    """The hex SHA-256 of a token, as stored in the tokens file."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def new_token() -> str:
    """A fresh token: 256 random bits, URL-safe, with a recognisable prefix for secret scanners."""
    return _TOKEN_PREFIX + secrets.token_urlsafe(32)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `authorization: Bearer <token>` value; None when absent or malformed."""
    if not authorization or len(authorization) > MAX_AUTHORIZATION_CHARS:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or any(c.isspace() for c in token):
        return None
    return token


def parse_tokens(text: str, source: str, *, json_format: bool) -> dict[str, Principal]:
    """Token digest -> Principal from the file's text; TokenFileError on anything doubtful."""
    try:
        document: Any = json.loads(text) if json_format else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise TokenFileError(f"{source}: not valid {'JSON' if json_format else 'TOML'}: {exc}") from None
    entries = document.get("tokens") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise TokenFileError(f"{source}: expected a `tokens` list of entries (see docs/security.md)")
    table: dict[str, Principal] = {}
    names: set[str] = set()
    for index, entry in enumerate(entries):
        where = f"{source}: tokens[{index}]"
        if not isinstance(entry, dict):
            raise TokenFileError(f"{where}: an entry is a table with name, sha256, role, tenants")
        principal, digest = _entry(entry, where)
        if "token" in entry:
            raise TokenFileError(
                f"{where} ({principal.name}): holds a plaintext `token`; store only its `sha256` "
                "(python -m kvtag_store.security.tokens hash) and delete the plaintext"
            )
        if principal.name in names:
            raise TokenFileError(f"{where}: name {principal.name!r} is used twice")
        if digest in table:
            raise TokenFileError(f"{where} ({principal.name}): the same token digest appears twice")
        names.add(principal.name)
        table[digest] = principal
    return table


def _entry(entry: Mapping[str, Any], where: str) -> tuple[Principal, str]:
    unknown = set(entry) - {"name", "sha256", "role", "tenants", "token"}
    if unknown:
        raise TokenFileError(f"{where}: unknown fields {sorted(unknown)}")
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        raise TokenFileError(f"{where}: `name` must be a non-empty string")
    digest = entry.get("sha256")
    if not isinstance(digest, str) or not _SHA256_HEX.match(digest.lower()):
        raise TokenFileError(f"{where} ({name}): `sha256` must be the 64 hex digits of the token's SHA-256")
    try:
        role = Role(entry.get("role"))
    except ValueError:
        raise TokenFileError(f"{where} ({name}): `role` must be engine, viewer or admin") from None
    tenants = entry.get("tenants", [ALL_TENANTS] if role is Role.ADMIN else None)
    if not isinstance(tenants, list) or not tenants or not all(isinstance(t, str) for t in tenants):
        raise TokenFileError(
            f'{where} ({name}): `tenants` must be a non-empty list of tenant names ("" is the shared '
            'tenant, "*" every tenant)'
        )
    return Principal(name.strip(), role, frozenset(tenants)), digest.lower()


class TokenRegistry:
    """The current token table; reload() swaps it atomically and keeps the old one on a bad file."""

    def __init__(self, path: Path | None, table: dict[str, Principal] | None) -> None:
        self.path = path
        self._table = table
        self._named = _named_tenants(table)

    @classmethod
    def disabled(cls) -> TokenRegistry:
        """No tokens file: every caller is ANONYMOUS, as before authentication existed."""
        return cls(None, None)

    @classmethod
    def from_file(cls, path: str | Path) -> TokenRegistry:
        file = Path(path)
        return cls(file, _read(file))

    @property
    def enabled(self) -> bool:
        return self._table is not None

    def __len__(self) -> int:
        return len(self._table or {})

    def names(self, tenant: str) -> bool:
        """True when an entry that opens sessions names `tenant` itself (not through "*"): the tenants
        the operator listed, the only ones a tenant arena of their own is made for (a name reached
        through "*" is the caller's choice, unbounded)."""
        return tenant in self._named

    def authenticate(self, authorization: str | None) -> Principal | None:
        """The principal of an `authorization` header value, ANONYMOUS when authentication is off,
        None when the token is missing, malformed or not in the file."""
        table = self._table
        if table is None:
            return ANONYMOUS
        token = bearer_token(authorization)
        if token is None:
            return None
        # Looked up by digest: the comparison never runs over the secret itself.
        return table.get(hash_token(token))

    def reload(self) -> bool:
        """Re-read the file (SIGHUP). On an error the previous table stays in force; False is returned."""
        if self.path is None:
            return True
        try:
            table = _read(self.path)
        except TokenFileError as exc:
            log.error("tokens file not reloaded, the previous tokens stay in force: %s", exc)
            return False
        self._named = _named_tenants(table)
        self._table = table  # one reference swap: readers see the old table or the new one
        log.info("tokens reloaded", extra={"tokens": len(table), "path": str(self.path)})
        return True


def _named_tenants(table: dict[str, Principal] | None) -> frozenset[str]:
    """The tenants the table's session-opening entries name, "*" aside."""
    return frozenset(
        tenant
        for principal in (table or {}).values()
        if principal.opens_sessions
        for tenant in principal.tenants
        if tenant != ALL_TENANTS
    )


def _read(path: Path) -> dict[str, Principal]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenFileError(f"cannot read tokens file {path}: {exc}") from None
    return parse_tokens(text, str(path), json_format=path.suffix.lower() == ".json")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvtag_store.security.tokens new|hash`: mint a token and print its entry, or hash one."""
    parser = argparse.ArgumentParser(prog="python -m kvtag_store.security.tokens", description=main.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    mint = commands.add_parser("new", help="print a new token (stderr) and its tokens-file entry (stdout)")
    mint.add_argument("--name", required=True)
    mint.add_argument("--role", required=True, choices=[r.value for r in Role])
    mint.add_argument("--tenant", action="append", default=None, help='repeatable; "" is the shared tenant')
    commands.add_parser("hash", help="read a token on stdin, print its sha256 for the tokens file")
    args = parser.parse_args(argv)
    if args.command == "hash":
        print(hash_token(sys.stdin.readline().strip()))
        return 0
    token = new_token()
    tenants = args.tenant or ([ALL_TENANTS] if args.role == "admin" else None)
    if not tenants:
        parser.error("--tenant is required for engine and viewer tokens")
    print(f"token for {args.name} (shown once, give it to the client): {token}", file=sys.stderr)
    print(
        f'[[tokens]]\nname = {json.dumps(args.name)}\nsha256 = "{hash_token(token)}"\n'
        f'role = "{args.role}"\ntenants = {json.dumps(tenants)}'
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
