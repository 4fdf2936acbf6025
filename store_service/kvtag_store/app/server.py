"""Assembles the gRPC server: KvStore, health, reflection, metrics. The one place the
concurrency model is chosen.

Choice: the synchronous grpc server with a thread pool, not grpc.aio. Every
RPC is short and CPU-bound in Python (protobuf field access, dict lookups)
and the backend work is lock-protected in-memory code or a blocking Mooncake
client call; an event loop adds per-call overhead here without freeing the GIL
any sooner, while threads let CRC-32 and payload copies (which drop the GIL)
overlap. docs/benchmarks.md measures it against a plain gRPC bytes service on this model too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from kvtag.v1 import store_pb2 as pb

from kvtag_store.api import codec
from kvtag_store.api.servicer import KvStoreService
from kvtag_store.backends.base import BlockBackend, CensusStore
from kvtag_store.config import SERVE, ServiceConfig
from kvtag_store.events.access import CurveAccess
from kvtag_store.events.options import EventOptions
from kvtag_store.events.publisher import EventPublisher
from kvtag_store.events.service import ROUTE, start_events
from kvtag_store.events.sources import event_sources
from kvtag_store.observe import status_http
from kvtag_store.observe.census_metrics import CensusCollector
from kvtag_store.observe.history import DEFAULT_INTERVAL_S, HitRateHistory
from kvtag_store.observe.metrics import StoreMetrics
from kvtag_store.observe.status import StatusSource, View
from kvtag_store.security.access import Access, AuthInterceptor
from kvtag_store.security.options import Security

log = logging.getLogger("kvtag_store.app.server")

# How long past the grace stop() waits for gRPC to report the calls cancelled.
STOP_SLACK_S = 1.0

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KvStore"].full_name


def kvstore_handlers(service: KvStoreService) -> grpc.GenericRpcHandler:
    """The KvStore method table. No request deserializers: every handler receives the raw bytes and
    parses them itself after cheap checks (kvtag_store.api.intake), so a bad message is answered
    INVALID_ARGUMENT by the handler and nothing can raise inside gRPC. Responses: generated
    serializers, except Get and GetStream whose handlers return encoded bytes (kvtag_store.api.codec)."""
    out = codec.serialize_response

    def unary(method: Callable[..., object]) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(method, response_serializer=out)

    handlers = {
        "OpenSession": unary(service.OpenSession),
        "Heartbeat": unary(service.Heartbeat),
        "CloseSession": unary(service.CloseSession),
        "Lookup": unary(service.Lookup),
        "Put": unary(service.Put),
        "PutStream": grpc.stream_unary_rpc_method_handler(service.PutStream, response_serializer=out),
        "Get": unary(service.Get),
        "GetStream": grpc.unary_stream_rpc_method_handler(service.GetStream, response_serializer=out),
        "ReleaseLeases": unary(service.ReleaseLeases),
        "AttachSharedMemory": unary(service.AttachSharedMemory),
        "ReserveSlots": unary(service.ReserveSlots),
        "CommitSlots": unary(service.CommitSlots),
        "GetReferences": unary(service.GetReferences),
        "Diagnose": unary(service.Diagnose),
        "GetStats": unary(service.GetStats),
    }
    missing = set(pb.DESCRIPTOR.services_by_name["KvStore"].methods_by_name) - set(handlers)
    assert not missing, f"KvStore methods without a handler: {missing}"
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


@dataclass
class RunningServer:
    server: grpc.Server
    service: KvStoreService
    health: health.HealthServicer
    port: int
    address: str
    metrics_address: str
    metrics_http: WSGIServer | None
    metrics_thread: threading.Thread | None
    history: HitRateHistory | None = None
    events: EventPublisher | None = None  # KV events (--kv-events-listen), None when off

    def stop(self, grace: float = 5.0) -> bool:
        """Stop accepting calls, let running ones finish within `grace`, then release everything.
        Returns within about grace + STOP_SLACK_S whatever is in flight, plus the backend's close
        (the disk tier's flush of memory): False when gRPC had not finished by then (the caller of a
        process should then exit without waiting for its threads)."""
        finished = self.stop_serving(grace)
        self.service.backend.close()
        return finished

    def stop_serving(self, grace: float = 5.0) -> bool:
        """stop() without closing the backend: the process closes it apart, outside the hard exit's
        deadline, since a disk tier's close writes memory's blocks to disk and may take longer."""
        self.health.enter_graceful_shutdown()
        finished: bool = self.server.stop(grace).wait(grace + STOP_SLACK_S)
        if not finished:
            log.warning(
                "gRPC calls still running %.1f s after the %.1f s grace; not waiting for them",
                STOP_SLACK_S,
                grace,
            )
        self.service.stop()
        if self.events is not None:
            self.events.stop()
        if self.history is not None:
            self.history.stop()
        if self.metrics_http is not None:
            self.metrics_http.shutdown()
            self.metrics_http.server_close()
        return finished


def event_sources_route(
    publisher: EventPublisher | None, access: CurveAccess | None, report: Callable[[], pb.DiagnoseResponse]
) -> status_http.JsonRoute:
    """GET /kv_event_sources (kvtag_store.events.sources) behind the status gate: admins only (with
    tokens; everyone without, as the status), 404 when events are off."""

    def route(view: View) -> Any:
        if publisher is None:
            raise status_http.Denied(
                404, "KV events are off; start the store with --kv-events-listen HOST:PORT"
            )
        if not view.store_wide:
            raise status_http.Denied(
                403,
                "KV event sources are for admin tokens: the events name every tenant's namespaces",
            )
        return event_sources(publisher, access, report())

    return route


def start_server(
    backend: BlockBackend,
    census_store: CensusStore,
    config: ServiceConfig,
    *,
    listen: str = "127.0.0.1:0",
    metrics_listen: str = "",
    workers: int = SERVE.workers,
    history_interval_s: float = DEFAULT_INTERVAL_S,
    status_gate: status_http.Gate | None = None,
    security: Security | None = None,
    events: EventOptions | None = None,
) -> RunningServer:
    """Bind, start and return the server; the caller owns stopping it. The HTTP port (metrics_listen)
    serves /metrics, the status page and its JSON (status_http); `status_gate` decides who sees what
    there (default: the tokens of `security`, or open without them). `security` adds TLS, tokens and
    tenant quotas (none by default: plaintext and open, for loopback use). `events` publishes KV events
    (kvtag_store.events; None: off, no socket opened)."""
    security = security or Security()
    if status_gate is None:
        status_gate = (
            status_http.token_gate(security.tokens.authenticate)
            if security.tokens.enabled
            else status_http.open_gate
        )
    max_message = config.limits.max_message_bytes
    options = [
        ("grpc.max_receive_message_length", max_message),
        ("grpc.max_send_message_length", max_message),
        ("grpc.so_reuseport", 0),
    ]
    metrics = StoreMetrics()
    interceptors = (
        [
            AuthInterceptor(
                security.tokens, lambda rpc: metrics.rpc_errors.labels(rpc, "UNAUTHENTICATED").inc()
            )
        ]
        if security.tokens.enabled
        else []
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtag-rpc"),
        options=options,
        interceptors=interceptors,
    )
    service = KvStoreService(backend, census_store, config, metrics, Access(security.tokens))
    server.add_generic_rpc_handlers((kvstore_handlers(service),))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    if security.tls is not None:
        port = server.add_secure_port(listen, security.tls.credentials())
    else:
        port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    host = listen.rpartition(":")[0]
    address = f"{host}:{port}"
    metrics_http: WSGIServer | None = None
    metrics_thread: threading.Thread | None = None
    metrics_address = ""
    metrics.registry.register(CensusCollector(service.census.report))
    history = HitRateHistory(service.census.report, interval_s=history_interval_s)
    service.forget_listeners.append(history.forget)
    publisher, access = None, None
    if events is not None:
        publisher, access = start_events(
            events, backend, service.census.report, metrics.registry, tokens=security.tokens.enabled
        )
        service.tokens.note = publisher.note_tokens
    if metrics_listen:
        source = StatusSource(service.census.report, backend.stats, history, pages=service.pages)
        routes = {ROUTE: event_sources_route(publisher, access, service.census.report)}
        app = status_http.status_app(source, metrics.registry, status_gate, routes)
        try:
            metrics_http, metrics_thread = status_http.serve(metrics_listen, app)
        except BaseException:
            if publisher is not None:
                publisher.stop()
            raise
        metrics_address = f"{metrics_listen.rpartition(':')[0]}:{metrics_http.server_port}"
    service.start()
    history.start()
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(
        server,
        service,
        health_servicer,
        port,
        address,
        metrics_address,
        metrics_http,
        metrics_thread,
        history,
        publisher,
    )
