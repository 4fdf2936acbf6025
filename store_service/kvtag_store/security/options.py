"""The `serve` security flags (TLS, tokens, tenant quotas, arena groups, --insecure), what they build,
the rule for non-loopback addresses, and the SIGHUP reload of certificates and tokens."""

from __future__ import annotations

import argparse
import grp
import ipaddress
import logging
import os
from dataclasses import dataclass, field

from kvtag_store.config import env_default, env_name, parse_size
from kvtag_store.security.tls import ServerTls, TlsFileError
from kvtag_store.security.tokens import TokenFileError, TokenRegistry

log = logging.getLogger("kvtag_store.security")


@dataclass
class Security:
    """What the server enforces: tokens (disabled = open, as before), TLS (None = plaintext), quotas."""

    tokens: TokenRegistry = field(default_factory=TokenRegistry.disabled)
    tls: ServerTls | None = None
    tenant_quotas: dict[str, int] = field(default_factory=dict)
    shm_groups: dict[str, int] = field(default_factory=dict)  # tenant -> gid of its arena file

    def reload(self) -> bool:
        """SIGHUP: re-read the certificate and the tokens file; what fails to load keeps its old value."""
        ok = self.tokens.reload()
        if self.tls is not None:
            ok = self.tls.reload() and ok
        return ok


def add_arguments(parser: argparse.ArgumentParser) -> None:
    def flag(name: str, help_text: str, **kwargs: object) -> None:
        parser.add_argument(
            name,
            default=env_default(name, ""),
            help=f"{help_text} [env {env_name(name)}]",
            **kwargs,  # type: ignore[arg-type]
        )

    flag("--tls-cert", "PEM certificate chain of the gRPC port; with --tls-key enables TLS")
    flag("--tls-key", "PEM private key of --tls-cert")
    flag("--tls-client-ca", "PEM CA bundle: require client certificates signed by it (mutual TLS)")
    flag("--auth-tokens", "tokens file (TOML, or JSON by .json suffix): require bearer tokens")
    parser.add_argument(
        "--insecure",
        action="store_true",
        default=os.environ.get(env_name("--insecure"), "") in ("1", "true", "yes"),
        help="allow a non-loopback --listen without TLS and tokens (logged as a warning) "
        f"[env {env_name('--insecure')}=1]",
    )
    parser.add_argument(
        "--tenant-quota",
        action="append",
        type=parse_tenant_quota,
        default=None,
        metavar="TENANT=SIZE",
        help="bytes reserved for and capping a tenant (memory backend), repeatable "
        f"[env {env_name('--tenant-quota')}, comma-separated]",
    )
    parser.add_argument(
        "--shm-group",
        action="append",
        type=parse_shm_group,
        default=None,
        metavar="TENANT=GROUP",
        help="the tenant's shared-memory arena file gets this group and mode 0660, so engines of that "
        "tenant map it under their own user while other users cannot open it, repeatable "
        f"[env {env_name('--shm-group')}, comma-separated]",
    )


def parse_tenant_quota(text: str) -> tuple[str, int]:
    tenant, sep, size = text.rpartition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected TENANT=SIZE (e.g. acme=2GiB), got {text!r}")
    quota = parse_size(size)
    if quota <= 0:
        raise argparse.ArgumentTypeError(f"--tenant-quota {text!r}: the size must be positive")
    return tenant.strip(), quota


def parse_shm_group(text: str) -> tuple[str, int]:
    """TENANT=GROUP, GROUP a name or a number; the service must be able to give its files that group."""
    tenant, sep, group = text.rpartition("=")
    if not sep or not group.strip():
        raise argparse.ArgumentTypeError(f"expected TENANT=GROUP (e.g. acme=kvtag-acme), got {text!r}")
    group = group.strip()
    try:
        gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise argparse.ArgumentTypeError(f"--shm-group {text!r}: no group named {group!r}") from None
    if os.geteuid() != 0 and gid not in os.getgroups() and gid != os.getegid():
        raise argparse.ArgumentTypeError(
            f"--shm-group {text!r}: the service's user is not in group {group}, so it cannot give "
            "arena files that group; add it to the group or choose another"
        )
    return tenant.strip(), gid


def build(args: argparse.Namespace) -> Security:
    """Load the files the flags name; argparse.ArgumentTypeError says what is wrong with them."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise argparse.ArgumentTypeError("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise argparse.ArgumentTypeError("--tls-client-ca needs --tls-cert and --tls-key")
    quotas = args.tenant_quota or [
        parse_tenant_quota(item)
        for item in os.environ.get(env_name("--tenant-quota"), "").split(",")
        if item.strip()
    ]
    shm_groups = args.shm_group or [
        parse_shm_group(item)
        for item in os.environ.get(env_name("--shm-group"), "").split(",")
        if item.strip()
    ]
    try:
        tokens = TokenRegistry.from_file(args.auth_tokens) if args.auth_tokens else TokenRegistry.disabled()
        tls = ServerTls(args.tls_cert, args.tls_key, args.tls_client_ca or None) if args.tls_cert else None
    except (TokenFileError, TlsFileError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    security = Security(tokens=tokens, tls=tls, tenant_quotas=dict(quotas), shm_groups=dict(shm_groups))
    check_listen(args.listen, security, insecure=bool(args.insecure))
    return security


def is_loopback(listen: str) -> bool:
    """True for 127.0.0.0/8, ::1, localhost and unix sockets: addresses only this host can reach."""
    if listen.startswith(("unix:", "unix-abstract:")):
        return True
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or a wildcard: reachable from elsewhere as far as we can tell


def check_listen(listen: str, security: Security, *, insecure: bool, flag: str = "--listen") -> None:
    """Refuse to expose an open or plaintext store beyond this host unless the operator said --insecure.
    `flag`: the listen flag named in the refusal (the KV-event sockets follow the same rule)."""
    if is_loopback(listen):
        return
    missing = []
    if security.tls is None:
        missing.append("TLS (--tls-cert/--tls-key)")
    if not security.tokens.enabled:
        missing.append("tokens (--auth-tokens)")
    if not missing:
        return
    if not insecure:
        raise argparse.ArgumentTypeError(
            f"{flag} {listen} is reachable beyond this host but the store has no "
            f"{' and no '.join(missing)}; "
            "configure them (docs/security.md), listen on 127.0.0.1, or pass --insecure on a network "
            "you trust"
        )
    log.warning(
        "INSECURE: listening on %s without %s; anyone who can reach the port can read and write every "
        "tenant's blocks",
        listen,
        " and without ".join(missing),
    )
