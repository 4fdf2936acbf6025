"""The `serve` flags of KV events (--kv-events-*) and the settings they make. Off unless
--kv-events-listen is given: then, and only then, the store opens its event sockets."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvtag_store.config import env_default, env_name, format_size, parse_size, positive_int
from kvtag_store.security.options import Security, check_listen


@dataclass(frozen=True)
class EventOptions:
    """Where the event sockets listen and the bounds that keep a slow subscriber off the put path."""

    # PUB socket, HOST:PORT (port 0 picks a free one).
    listen: str
    # ROUTER socket answering replay requests; "" = the PUB host, on the PUB port + 1 (any free port
    # when the PUB port is 0).
    replay_listen: str = ""
    # Batches queued per subscriber (ZMQ send high-water mark) before it misses live batches; also the
    # most batches one replay answer sends.
    hwm: int = 1000
    # The replay buffer: the last this many batches, within this many bytes.
    replay_batches: int = 10_000
    replay_bytes: int = 64 << 20
    # Events waiting for the publisher thread; past it, new events are dropped and counted.
    queue_events: int = 100_000
    # Most events per batch (one batch per topic per flush).
    batch_events: int = 256
    # How often the publisher thread flushes the queue (ms).
    flush_ms: int = 5

    def replay_address(self) -> str:
        if self.replay_listen:
            return self.replay_listen
        host, _, port = self.listen.rpartition(":")
        return f"{host}:{int(port) + 1 if int(port) else 0}"


DEFAULTS = EventOptions(listen="")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    def flag(name: str, default: str, help_text: str) -> None:
        parser.add_argument(
            name,
            default=env_default(name, default),
            help=f"{help_text} [env {env_name(name)}, default {default!r}]",
        )

    flag(
        "--kv-events-listen",
        "",
        "publish KV events (vLLM's format, ZMQ PUB) on HOST:PORT; empty: off, no socket opened "
        "(docs/kv-events.md)",
    )
    flag(
        "--kv-events-replay-listen",
        "",
        "HOST:PORT of the KV-event replay socket (ZMQ ROUTER); empty: the --kv-events-listen host, port + 1",
    )
    flag("--kv-events-hwm", str(DEFAULTS.hwm), "batches queued per event subscriber before it misses some")
    flag("--kv-events-replay-batches", str(DEFAULTS.replay_batches), "batches kept for replay")
    flag("--kv-events-replay-bytes", format_size(DEFAULTS.replay_bytes), "bytes of batches kept for replay")
    flag(
        "--kv-events-queue",
        str(DEFAULTS.queue_events),
        "events waiting to be published; past it new events are dropped (and counted)",
    )


def build(args: argparse.Namespace, security: Security) -> EventOptions | None:
    """The settings, or None when events are off; argparse.ArgumentTypeError when a flag is wrong or an
    address would expose the events beyond this host without TLS and tokens (as --listen)."""
    if not args.kv_events_listen:
        return None
    for flag, address in (
        ("--kv-events-listen", str(args.kv_events_listen)),
        ("--kv-events-replay-listen", str(args.kv_events_replay_listen)),
    ):
        if address and not address.rpartition(":")[2].isdigit():
            raise argparse.ArgumentTypeError(f"{flag} must be HOST:PORT, got {address!r}")
    try:
        options = EventOptions(
            listen=str(args.kv_events_listen),
            replay_listen=str(args.kv_events_replay_listen),
            hwm=positive_int("--kv-events-hwm", args.kv_events_hwm),
            replay_batches=positive_int("--kv-events-replay-batches", args.kv_events_replay_batches),
            replay_bytes=parse_size(str(args.kv_events_replay_bytes)),
            queue_events=positive_int("--kv-events-queue", args.kv_events_queue),
        )
        for flag, address in (
            ("--kv-events-listen", options.listen),
            ("--kv-events-replay-listen", options.replay_address()),
        ):
            check_listen(address, security, insecure=bool(args.insecure), flag=flag)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return options
