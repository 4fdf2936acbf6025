"""Service settings: the `serve` flags, their KVTAG_* environment variables, sizes like 4GiB.

One rule for every flag of the service and its backends: the command-line flag, then its
KVTAG_* environment variable (env_name), then (Mooncake only) the --mooncake-config file,
then the default. Defaults are written once, in the dataclasses below; sizes are read by
parse_size only."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtag.v1 import store_pb2 as pb

ENV_PREFIX = "KVTAG_"

_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


class SizeError(ValueError, argparse.ArgumentTypeError):
    """A malformed size: a ValueError for library callers, an ArgumentTypeError for argparse."""


def parse_size(text: str) -> int:
    """Bytes from "1073741824", "4GiB", "512MiB", "64KiB" (binary, IEC) or "2GB", "64MB" (decimal, SI);
    K, M, G and T, with or without the B."""
    match = _SIZE.match(text)
    if match is None:
        raise SizeError(f"not a size: {text!r} (examples: 4GiB, 512MiB, 64MB = 64,000,000 bytes, 1073741824)")
    number, unit = int(match.group(1)), (match.group(2) or "").upper().rstrip("B")
    if not unit:
        return number
    power = "KMGT".index(unit[0]) + 1
    base = 1024 if unit.endswith("I") else 1000
    return number * int(base**power)


def format_size(size: int) -> str:
    """The shortest exact binary spelling: 67108864 -> "64MiB"."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size and size % (1 << shift) == 0:
            return f"{size >> shift}{unit}"
    return str(size)


def parse_policy(text: str) -> int:
    names: dict[str, int] = {"isolate": pb.POLICY_ISOLATE, "strict": pb.POLICY_STRICT}
    try:
        return names[text.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown policy {text!r}: use isolate or strict") from None


_POLICY_NAMES: dict[int, str] = {pb.POLICY_ISOLATE: "isolate", pb.POLICY_STRICT: "strict"}


def policy_name(policy: int) -> str:
    return _POLICY_NAMES.get(policy, "unspecified")


def parse_namespace_policy(text: str) -> tuple[str, int]:
    ns_id, sep, policy = text.partition("=")
    if not sep or not ns_id.strip():
        raise argparse.ArgumentTypeError(f"expected NAMESPACE_ID=POLICY, got {text!r}")
    return ns_id.strip(), parse_policy(policy)


def env_name(flag: str) -> str:
    """--session-ttl-ms -> KVTAG_SESSION_TTL_MS."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def env_default(flag: str, default: str) -> str:
    return os.environ.get(env_name(flag), default)


@dataclass(frozen=True)
class ServiceLimits:
    max_key_bytes: int = 256
    max_batch_items: int = 65536
    max_message_bytes: int = 64 << 20


_DURATION = re.compile(r"^\s*(\d+)\s*(ms|s|m|h)?\s*$", re.IGNORECASE)
_DURATION_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}


def parse_duration_ms(text: str) -> int:
    """Milliseconds from "10m", "90s", "1h", "500ms"; a plain number is seconds."""
    match = _DURATION.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (examples: 10m, 90s, 1h, 500ms)")
    return int(match.group(1)) * _DURATION_MS[(match.group(2) or "s").lower()]


def format_duration_ms(ms: int) -> str:
    """The shortest exact spelling: 600000 -> "10m"."""
    for unit in ("h", "m", "s"):
        if ms and ms % _DURATION_MS[unit] == 0:
            return f"{ms // _DURATION_MS[unit]}{unit}"
    return f"{ms}ms"


@dataclass(frozen=True)
class Caps:
    """Bounds on what clients can make the control plane hold (docs/operations.md, "Memory bound").
    A session that would pass one is refused RESOURCE_EXHAUSTED before anything is kept."""

    max_namespaces: int = 4096
    max_namespaces_per_tenant: int = 1024
    max_sessions: int = 4096
    max_sessions_per_tenant: int = 1024


@dataclass(frozen=True)
class ServiceConfig:
    """Everything the API layer needs to know; the CLI builds it from flags."""

    default_policy: int = pb.POLICY_ISOLATE
    namespace_policies: dict[str, int] = field(default_factory=dict)
    session_ttl_ms: int = 30_000
    default_lease_ms: int = 30_000
    max_lease_ms: int = 600_000
    limits: ServiceLimits = field(default_factory=ServiceLimits)
    # Bound on the base-key index used to count cross-mode misses.
    base_index_entries: int = 200_000
    # Admission limit: request and reply bytes (and parsed items) held at once, server-wide.
    max_inflight_bytes: int = 256 << 20
    # A namespace with no live session, no stored block and no lease is forgotten this long after
    # its last activity (its counters, engines and history with it).
    census_retention_ms: int = 600_000
    caps: Caps = field(default_factory=Caps)


@dataclass(frozen=True)
class ServeDefaults:
    """Defaults of the serve flags that are not ServiceConfig fields."""

    listen: str = "127.0.0.1:50051"
    capacity_bytes: int = 1 << 30
    metrics_listen: str = "127.0.0.1:9464"
    workers: int = 16
    # Deprecated, ignored (a warning when set): the flag's default, to tell a command line that sets it.
    max_tenant_arenas: int = 16
    # Memory backend: "full" touches the capacity up front, "lazy" only a window ahead of use.
    prefault: str = "full"
    # Memory backend's disk tier (--disk-dir): with no --disk-capacity, this many times --capacity,
    # capped by what the file system can give it (docs/disk-tier.md).
    disk_capacity_factor: int = 4


CONFIG = ServiceConfig()
CAPS = Caps()
LIMITS = ServiceLimits()
SERVE = ServeDefaults()


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The serve flags; each defaults to its KVTAG_* environment variable, then to the built-in default."""

    def flag(name: str, default: str, help_text: str, **kwargs: object) -> None:
        env = env_name(name)
        parser.add_argument(
            name,
            default=env_default(name, default),
            help=f"{help_text} [env {env}, default {default!r}]",
            **kwargs,  # type: ignore[arg-type]
        )

    flag("--listen", SERVE.listen, "gRPC listen address HOST:PORT (port 0 picks a free one)")
    flag(
        "--capacity",
        format_size(SERVE.capacity_bytes),
        "bytes of values the memory backend holds, e.g. 4GiB, 512MiB",
    )
    flag("--policy", policy_name(CONFIG.default_policy), "default namespace policy: isolate or strict")
    flag("--metrics-listen", SERVE.metrics_listen, "Prometheus metrics HOST:PORT; empty disables")
    flag(
        "--shm-dir",
        "/dev/shm",
        "directory of the shared-memory arenas same-host clients map (the memory backend's values, "
        "the Mooncake backend's staging); empty: inline path only",
    )
    flag("--backend", "memory", "storage backend: memory or mooncake", choices=["memory", "mooncake"])
    flag("--session-ttl-ms", str(CONFIG.session_ttl_ms), "a session expires this long after its last call")
    flag("--lease-ms", str(CONFIG.default_lease_ms), "default read lease for Lookup hits")
    flag("--max-lease-ms", str(CONFIG.max_lease_ms), "longest lease a client may ask for")
    flag("--max-key-bytes", str(LIMITS.max_key_bytes), "longest accepted key")
    flag("--max-batch-items", str(LIMITS.max_batch_items), "most items in one Lookup/Put/Get request")
    flag(
        "--max-message-bytes",
        format_size(LIMITS.max_message_bytes),
        "largest gRPC message sent or received",
    )
    flag(
        "--max-inflight-bytes",
        format_size(CONFIG.max_inflight_bytes),
        "admission limit: request and reply bytes handled at once, server-wide (at least "
        "--max-message-bytes); beyond it calls get RESOURCE_EXHAUSTED / SERVER_BUSY",
    )
    flag("--workers", str(SERVE.workers), "gRPC worker threads")
    flag(
        "--base-index-entries",
        str(CONFIG.base_index_entries),
        "bound of the base-key index behind cross-mode miss counts",
    )
    flag(
        "--census-retention",
        format_duration_ms(CONFIG.census_retention_ms),
        "forget a namespace with no live session, stored block or lease this long after its last "
        "activity (e.g. 10m, 90s, 1h; a plain number is seconds)",
    )
    flag("--max-namespaces", str(CAPS.max_namespaces), "namespaces the census holds at once, store-wide")
    flag("--max-namespaces-per-tenant", str(CAPS.max_namespaces_per_tenant), "namespaces per tenant")
    flag("--max-sessions", str(CAPS.max_sessions), "live sessions, store-wide")
    flag("--max-sessions-per-tenant", str(CAPS.max_sessions_per_tenant), "live sessions per tenant")
    flag(
        "--max-tenant-arenas",
        str(SERVE.max_tenant_arenas),
        "deprecated, ignored: tenant arenas are bounded by what the operator names (--tenant-quota, "
        "--shm-group, the --auth-tokens file), and no tenant is refused for want of one",
    )
    flag(
        "--prefault",
        SERVE.prefault,
        "memory backend: full allocates the capacity's pages from the first session on, in the background "
        "(the memory is committed once it settles: in a tmpfs shm dir it shows in the arena files, "
        "du /dev/shm/kvtag-*, not in RSS); lazy touches only a window ahead of use (memory grows with "
        "use, and a put may wait for first touches)",
        choices=["full", "lazy"],
    )
    flag(
        "--disk-dir",
        "",
        "memory backend: directory of the disk tier (values evicted from memory go there and are read "
        "back; a restart on it keeps the cache); empty: memory only. Used by one store at a time",
    )
    flag(
        "--disk-capacity",
        "",
        f"bytes of values the disk tier holds, e.g. 64GiB; empty: {SERVE.disk_capacity_factor}x "
        "--capacity, capped by the file system's free space plus what the tier already holds",
    )
    flag("--log-format", "text", "log format: text or json", choices=["text", "json"])
    flag("--log-level", "info", "log level: debug, info, warning, error")
    env = env_name("--namespace-policy")
    parser.add_argument(
        "--namespace-policy",
        action="append",
        type=parse_namespace_policy,
        default=None,
        metavar="NAMESPACE_ID=POLICY",
        help=f"per-namespace policy override, repeatable [env {env}, comma-separated]",
    )


def service_config(args: argparse.Namespace) -> ServiceConfig:
    """Validate the parsed flags into a ServiceConfig (argparse.ArgumentTypeError on bad values)."""
    overrides: Sequence[tuple[str, int]] = args.namespace_policy or [
        parse_namespace_policy(item)
        for item in os.environ.get(env_name("--namespace-policy"), "").split(",")
        if item.strip()
    ]
    max_message_bytes = parse_size(str(args.max_message_bytes))
    max_inflight_bytes = parse_size(str(args.max_inflight_bytes))
    if max_inflight_bytes < max_message_bytes:
        raise argparse.ArgumentTypeError(
            f"--max-inflight-bytes ({max_inflight_bytes}) must be at least --max-message-bytes "
            f"({max_message_bytes}), or the largest message could never be admitted"
        )
    return ServiceConfig(
        default_policy=parse_policy(args.policy),
        namespace_policies=dict(overrides),
        session_ttl_ms=positive_int("--session-ttl-ms", args.session_ttl_ms),
        default_lease_ms=positive_int("--lease-ms", args.lease_ms),
        max_lease_ms=positive_int("--max-lease-ms", args.max_lease_ms),
        limits=ServiceLimits(
            max_key_bytes=positive_int("--max-key-bytes", args.max_key_bytes),
            max_batch_items=positive_int("--max-batch-items", args.max_batch_items),
            max_message_bytes=max_message_bytes,
        ),
        base_index_entries=positive_int("--base-index-entries", args.base_index_entries),
        max_inflight_bytes=max_inflight_bytes,
        census_retention_ms=_retention(args.census_retention),
        caps=Caps(
            max_namespaces=positive_int("--max-namespaces", args.max_namespaces),
            max_namespaces_per_tenant=positive_int(
                "--max-namespaces-per-tenant", args.max_namespaces_per_tenant
            ),
            max_sessions=positive_int("--max-sessions", args.max_sessions),
            max_sessions_per_tenant=positive_int("--max-sessions-per-tenant", args.max_sessions_per_tenant),
        ),
    )


def _retention(value: object) -> int:
    retention = parse_duration_ms(str(value))
    if retention <= 0:
        raise argparse.ArgumentTypeError(f"--census-retention must be positive, got {value!r}")
    return retention


def positive_int(flag: str, value: object) -> int:
    """A flag's value as a positive integer, or an argparse error naming the flag."""
    try:
        number = int(str(value))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag} must be a positive integer, got {value!r}") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"{flag} must be a positive integer, got {value!r}")
    return number


def disk_capacity(disk_dir: str, text: str, capacity_bytes: int) -> int:
    """--disk-capacity in bytes; when empty, SERVE.disk_capacity_factor x --capacity, capped by the
    file system's free space plus the bytes already under DIR (a restart must not shrink the tier
    below what it holds), less 5% headroom for the file system. SizeError on a malformed size."""
    if text.strip():
        size = parse_size(text)
        if size <= 0:
            raise SizeError(f"--disk-capacity must be positive, got {text!r}")
        return size
    wanted = SERVE.disk_capacity_factor * capacity_bytes
    probe = os.path.abspath(disk_dir)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return wanted  # the backend names the unusable directory
    held = _bytes_under(disk_dir)
    return max(1, min(wanted, (free + held) * 95 // 100))


def _bytes_under(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total
