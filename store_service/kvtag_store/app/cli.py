"""`kvtag-store`: serve the store, and ask a running one for its census, stats or health."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_proto.channels import ChannelConfigError, ChannelSecurity, open_channel

from kvtag_store.app import terminal
from kvtag_store.app.server import start_server
from kvtag_store.backends.base import BackendStats, BlockBackend, CensusStore
from kvtag_store.backends.memory import MemoryBackend, MemoryCensus
from kvtag_store.backends.memory.disk.errors import DiskDirError
from kvtag_store.backends.mooncake import options as mooncake_options
from kvtag_store.config import (
    SERVE,
    add_serve_arguments,
    disk_capacity,
    env_default,
    env_name,
    parse_size,
    policy_name,
    service_config,
)
from kvtag_store.events import options as event_options
from kvtag_store.events import subscriber
from kvtag_store.observe import logs, report
from kvtag_store.policy.census_snapshot import SNAPSHOT_NAME, SnapshotCensus
from kvtag_store.security import options

log = logging.getLogger("kvtag_store")
# Start/stop lines are shown at any --log-level: supervisors and tests wait for "serving".
lifecycle = logging.getLogger("kvtag_store.lifecycle")
lifecycle.setLevel(logging.INFO)

DEFAULT_TARGET = SERVE.listen
# Running calls get this long after SIGTERM/SIGINT (docs/operations.md).
GRACE_S = 5.0
# Past grace + this, the process exits whatever is still running (a gRPC call or thread that never
# finishes must not keep a stopped server alive).
HARD_EXIT_SLACK_S = 2.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtag-store",
        description="kvtag store: a KV-cache block store that knows how every key was hashed",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the store service")
    add_serve_arguments(serve)
    options.add_arguments(serve)
    event_options.add_arguments(serve)
    mooncake_options.add_arguments(serve)
    events = commands.add_parser("events", help="print a store's KV events live (docs/kv-events.md)")
    subscriber.add_arguments(events)
    for name, help_text in (
        ("diagnose", "print the census and mismatch report of a running store"),
        ("stats", "print capacity and usage of a running store"),
        ("health", "standard gRPC health check; exit 0 iff SERVING"),
    ):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument(
            "--target",
            default=env_default("--target", DEFAULT_TARGET),
            help=f"store address HOST:PORT [env {env_name('--target')}, default {DEFAULT_TARGET}]",
        )
        sub.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
        add_client_security_arguments(sub)
        if name == "diagnose":
            sub.add_argument("--namespace", default="", help="only this namespace_id")
            sub.add_argument(
                "--filter",
                default="",
                help="only namespaces whose id, model, tenant or a mode id contains this text",
            )
            sub.add_argument(
                "--page-size", type=int, default=0, help="namespaces per Diagnose page (default: the store's)"
            )
            sub.add_argument("--watch", action="store_true", help="redraw until Ctrl-C, marking what changed")
            sub.add_argument("--interval", type=float, default=2.0, help="seconds between redraws")
        if name != "health":
            sub.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(parser, args)
    if args.command == "events":
        return subscriber.run(args)
    try:
        security = client_security(args)
        if args.command == "health":
            code = health_check(args.target, args.timeout, security)
        else:
            code = query(args, security)
        sys.stdout.flush()
    except ChannelConfigError as exc:
        print(f"kvtag-store {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`kvtag-store diagnose | head`): what it read was all it wanted.
        # Point stdout at /dev/null so the interpreter's final flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return code


def add_client_security_arguments(parser: argparse.ArgumentParser) -> None:
    """How diagnose, stats and health reach a store that has TLS and tokens (docs/security.md). The
    variables are KVTAG_CLIENT_*: in a container, KVTAG_TLS_CERT/KEY are the server's own pair."""
    for name, help_text in (
        ("--tls-ca", "PEM CA bundle that signed the store's certificate; enables TLS"),
        ("--tls-cert", "PEM client certificate, for a store that requires mutual TLS"),
        ("--tls-key", "private key of --tls-cert"),
        ("--tls-server-name", "name the store's certificate carries, if not the --target host"),
        ("--token-file", "file holding the bearer token (else $KVTAG_TOKEN)"),
    ):
        env = env_name(name.replace("--", "--client-", 1)) if name.startswith("--tls") else env_name(name)
        parser.add_argument(name, default=os.environ.get(env, ""), help=f"{help_text} [env {env}]")


def client_security(args: argparse.Namespace) -> ChannelSecurity:
    return ChannelSecurity(
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        token_file=args.token_file,
        server_name=args.tls_server_name,
    )


def _build_backend(args: argparse.Namespace, security: options.Security) -> tuple[BlockBackend, CensusStore]:
    if args.backend == "mooncake":
        if security.tenant_quotas:
            raise ValueError("--tenant-quota applies to the memory backend only (docs/security.md)")
        return mooncake_options.build(args, security.shm_groups)
    capacity = parse_size(str(args.capacity))
    disk_dir = str(args.disk_dir)
    backend = MemoryBackend(
        capacity,
        security.tenant_quotas,
        shm_dir=args.shm_dir or None,
        shm_groups=security.shm_groups,
        prefault=args.prefault,
        disk_dir=disk_dir or None,
        disk_capacity=disk_capacity(disk_dir, str(args.disk_capacity), capacity) if disk_dir else 0,
    )
    if not disk_dir:
        return backend, MemoryCensus()
    # Admission survives a restart with the blocks: strict namespaces keep their mode (census_snapshot).
    try:
        census = SnapshotCensus(Path(disk_dir) / SNAPSHOT_NAME, backend.restored())
    except BaseException:
        backend.close()
        raise
    return backend, census


def _disk_fields(stats: BackendStats) -> dict[str, object]:
    """The serving line's disk tier: what a restart found (keys, bytes) and its capacity."""
    for tier in stats.tiers:
        if tier.tier == "disk":
            return {
                "disk_keys": tier.keys,
                "disk_used_bytes": tier.used_bytes,
                "disk_capacity_bytes": tier.capacity_bytes,
            }
    return {}


def _disk_flags_error(args: argparse.Namespace) -> str | None:
    """Why the disk flags cannot apply, checked before anything starts."""
    if args.backend == "mooncake" and (args.disk_dir or args.disk_capacity):
        return (
            "--disk-dir/--disk-capacity are for the memory backend; Mooncake has its own offload to "
            "SSD (configure it on the Mooncake cluster, docs/mooncake.md)"
        )
    if args.disk_capacity and not args.disk_dir:
        return "--disk-capacity needs --disk-dir (the directory of the disk tier)"
    return None


def serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        config = service_config(args)
        workers = int(args.workers)
        parse_size(str(args.capacity))
        if args.disk_capacity:
            disk_capacity(str(args.disk_dir), str(args.disk_capacity), 1)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser.error(str(exc))
    disk_error = _disk_flags_error(args)
    if disk_error is not None:
        print(f"kvtag-store serve: {disk_error}", file=sys.stderr)
        return 2
    logs.configure(args.log_format, args.log_level)
    try:
        security = options.build(args)
        events = event_options.build(args, security)
    except argparse.ArgumentTypeError as exc:
        log.error("cannot start: %s", exc)
        return 2
    # A full store holds millions of GC-tracked objects (entries, address tuples); the default
    # gen0 threshold of 700 makes every 4,096-key request trigger several collections.
    gc.set_threshold(50_000, 20, 20)
    stop = threading.Event()
    deadlines: list[threading.Timer] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        lifecycle.info("stopping on signal", extra={"signal": signal.Signals(signum).name})
        if not stop.is_set():
            deadline = threading.Timer(GRACE_S + HARD_EXIT_SLACK_S, _exit_now)
            deadline.daemon = True
            deadline.start()
            deadlines.append(deadline)
        stop.set()

    def on_reload(_signum: int, _frame: FrameType | None) -> None:
        ok = security.reload()
        lifecycle.info("reloaded on SIGHUP" if ok else "SIGHUP reload kept some old files (see errors)")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_reload)
    if str(args.max_tenant_arenas) != str(SERVE.max_tenant_arenas):
        log.warning(
            "--max-tenant-arenas is deprecated and ignored: tenants get an arena of their own only when "
            "named by --tenant-quota, --shm-group or the --auth-tokens file (docs/operations.md)"
        )
    try:
        backend, census_store = _build_backend(args, security)
    except DiskDirError as exc:  # names the path and the reason, including "another store holds it"
        log.error("cannot start: %s", exc)
        return 2
    except Exception as exc:  # an unreachable backend: say so and exit non-zero
        log.error("cannot start: %s", exc)
        return 1
    try:
        running = start_server(
            backend,
            census_store,
            config,
            listen=args.listen,
            metrics_listen=args.metrics_listen,
            workers=workers,
            security=security,
            events=events,
        )
    except Exception as exc:  # a bind failure: say so and exit non-zero
        log.error("cannot start: %s", exc)
        backend.close()
        return 1
    stats = backend.stats()
    lifecycle.info(
        "kvtag-store serving on %s",
        running.address,
        extra={
            "listen": running.address,
            "backend": stats.backend,
            "capacity_bytes": stats.capacity_bytes,
            "policy": policy_name(config.default_policy),
            "metrics": running.metrics_address or "disabled",
            "kv_events": running.events.endpoint if running.events is not None else "off",
            "tls": "off" if security.tls is None else ("mutual" if security.tls.mutual else "on"),
            "tokens": len(security.tokens) if security.tokens.enabled else "off",
            "pid": os.getpid(),
            **_disk_fields(stats),
        },
    )
    while not stop.wait(1.0):
        pass
    finished = running.stop_serving(grace=GRACE_S)
    # The hard exit guards gRPC's stop only: the backend's close (a disk tier writing memory's blocks
    # out, so a restart keeps them) runs to its end, then the process exits.
    for deadline in deadlines:
        deadline.cancel()
    closing = time.monotonic()
    backend.close()
    if args.disk_dir:
        lifecycle.info("closed the disk tier", extra={"seconds": round(time.monotonic() - closing, 3)})
    if finished:
        lifecycle.info("stopped cleanly")
        return 0
    _exit_now()
    return 0


def _exit_now() -> None:
    """Exit 0 without waiting for threads still inside gRPC calls (their clients see the
    connection close). The shutdown's hard deadline, and the end of a stop that timed out."""
    lifecycle.warning("exiting with calls still running after the %.0f s grace", GRACE_S)
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)


def health_check(target: str, timeout: float, security: ChannelSecurity | None = None) -> int:
    with open_channel(target, security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            answer = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as exc:
            print(f"{target}: not healthy ({_describe(exc)})", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    print(f"{target}: {status}")
    return 0 if answer.status == health_pb2.HealthCheckResponse.SERVING else 1


def query(args: argparse.Namespace, security: ChannelSecurity) -> int:
    if args.command == "diagnose" and args.watch:
        return watch_diagnose(args, security)
    with open_channel(args.target, security) as channel:
        stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
        try:
            if args.command == "diagnose":
                answer: pb.DiagnoseResponse | pb.GetStatsResponse = diagnose_pages(stub, args)
            else:
                answer = stub.GetStats(pb.GetStatsRequest(), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(
                f"cannot reach the store at {args.target}: {_describe(exc)}",
                file=sys.stderr,
            )
            return 1
    if args.json:
        print(
            json.dumps(
                json_format.MessageToDict(
                    answer, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
                ),
                indent=2,
            )
        )
    elif isinstance(answer, pb.DiagnoseResponse):
        print(_with_degraded(report.diagnose_table(answer), args, security))
    else:
        print(report.stats_table(answer))
    return 0


def watch_diagnose(args: argparse.Namespace, security: ChannelSecurity) -> int:
    if args.json or args.interval <= 0:
        print("diagnose --watch draws the table: drop --json; --interval must be > 0", file=sys.stderr)
        return 2
    with open_channel(args.target, security) as channel:
        stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]

        def fetch() -> str:
            try:
                answer = diagnose_pages(stub, args, first_only=True)
            except grpc.RpcError as exc:
                return f"cannot reach the store at {args.target}: {_describe(exc)}"
            shown = _with_degraded(report.diagnose_table(answer), args, security, stub)
            if answer.next_page_token:
                shown += (
                    f"\n\n{len(answer.namespaces)} of {answer.total_namespaces} namespaces shown (the first "
                    "page: splits, then refusals, then the most active); narrow with --filter"
                )
            return shown

        return terminal.run(
            fetch, sys.stdout, title=f"kvtag-store diagnose {args.target}", interval_s=args.interval
        )


def _with_degraded(
    table: str,
    args: argparse.Namespace,
    security: ChannelSecurity,
    stub: store_pb2_grpc.KvStoreStub | None = None,
) -> str:
    """The Diagnose table under a line per degraded tier (a disk tier out of use explains lost hits).
    GetStats answers tiers to admins only; for other callers, or an older store, the table alone."""
    try:
        if stub is None:
            with open_channel(args.target, security) as channel:
                stats = store_pb2_grpc.KvStoreStub(channel).GetStats(  # type: ignore[no-untyped-call]
                    pb.GetStatsRequest(), timeout=args.timeout
                )
        else:
            stats = stub.GetStats(pb.GetStatsRequest(), timeout=args.timeout)
    except grpc.RpcError:
        return table
    lines = report.degraded_lines(stats)
    return "\n".join([*lines, "", table]) if lines else table


def diagnose_pages(
    stub: store_pb2_grpc.KvStoreStub, args: argparse.Namespace, first_only: bool = False
) -> pb.DiagnoseResponse:
    """Diagnose's pages, followed to the last and joined (or only the first, for --watch); each page
    gets the whole --timeout."""
    request = pb.DiagnoseRequest(
        namespace_id=args.namespace, filter=args.filter, page_size=max(0, args.page_size)
    )
    joined = pb.DiagnoseResponse()
    while True:
        page: pb.DiagnoseResponse = stub.Diagnose(request, timeout=args.timeout)
        joined.namespaces.extend(page.namespaces)
        joined.total_namespaces = page.total_namespaces
        if first_only:
            joined.next_page_token = page.next_page_token
        if first_only or not page.next_page_token:
            return joined
        request.page_token = page.next_page_token


def _describe(exc: grpc.RpcError) -> str:
    if isinstance(exc, grpc.Call):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


if __name__ == "__main__":
    sys.exit(main())
