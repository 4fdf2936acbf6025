"""KV events in a running server: the publisher built from the flags, told by the backend, counted in
the server's registry. The discovery document (sources.py) is served at ROUTE by the status port's
HTTP server; app/server.py puts it behind the status gate."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvtag.v1 import store_pb2 as pb
from prometheus_client import CollectorRegistry

from kvtag_store.backends.base import BlockBackend, Capabilities
from kvtag_store.events.access import CurveAccess
from kvtag_store.events.options import EventOptions
from kvtag_store.events.publisher import EventPublisher
from kvtag_store.events.sources import census_block_sizes

log = logging.getLogger("kvtag_store.events")

ROUTE = "/kv_event_sources"


def start_events(
    options: EventOptions,
    backend: BlockBackend,
    report: Callable[[str], pb.DiagnoseResponse],
    registry: CollectorRegistry,
    *,
    tokens: bool,
) -> tuple[EventPublisher, CurveAccess | None]:
    """Bind the event sockets (CURVE, admin-only, when `tokens`), have the backend tell the publisher,
    start it. OSError when an address cannot be bound."""
    access = CurveAccess() if tokens else None
    publisher = EventPublisher(options, census_block_sizes(report), access)
    observable = Capabilities.of(backend).observable
    if observable is None:
        log.warning("the %s backend reports no blocks: KV events carry only AllBlocksCleared", backend.name)
    else:
        observable.observe_blocks(publisher)
    publisher.register(registry)
    publisher.start()
    return publisher, access
