"""A gRPC proxy in front of a real kvtag store that, on demand, answers every call with an error.

This is the one fake in the client suite, and it only injects the fault: while
healthy it forwards raw request bytes to the real store and its answers back.
With `v1_lookup` set it plays a store older than Lookup's packed form: such a
store's parser skips the unknown packed_blocks field, so the proxy drops it.
With `busy_marker` set it plays a store at its admission limit for every Put whose
bytes contain the marker (RESOURCE_EXHAUSTED / SERVER_BUSY with a retry hint).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag_proto.errors import build_status

_UNARY = {
    "OpenSession",
    "Heartbeat",
    "CloseSession",
    "Lookup",
    "Put",
    "Get",
    "ReleaseLeases",
    "Diagnose",
    "GetStats",
}


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        self.failing = threading.Event()
        self.v1_lookup = threading.Event()
        self.failed_calls = 0
        self.busy_marker: bytes | None = None
        self.busy_calls = 0
        self._channel = grpc.insecure_channel(upstream, options=[("grpc.max_receive_message_length", -1)])
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        self._server.add_generic_rpc_handlers([_Handler(self)])
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{self.port}"
        self._server.start()

    def fail(self, context: grpc.ServicerContext) -> None:
        self.failed_calls += 1
        context.abort_with_status(
            build_status(grpc.StatusCode.UNAVAILABLE, "BACKEND_UNAVAILABLE", "injected fault: backend down")
        )

    def unary(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        if self.failing.is_set():
            self.fail(context)
        marker = self.busy_marker
        if marker is not None and method.endswith("/Put") and marker in request:
            self.busy_calls += 1
            context.abort_with_status(
                build_status(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "SERVER_BUSY",
                    "injected fault: admission limit reached",
                    retry_delay_ms=50,
                )
            )
        if self.v1_lookup.is_set() and method.endswith("/Lookup"):
            message = pb.LookupRequest.FromString(request)
            message.ClearField("packed_blocks")
            request = message.SerializeToString()
        call = self._channel.unary_unary(method)
        response: bytes = call(request, timeout=context.time_remaining())
        return response

    def stream_in(self, method: str, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        if self.failing.is_set():
            self.fail(context)
        call = self._channel.stream_unary(method)
        response: bytes = call(requests, timeout=context.time_remaining())
        return response

    def stream_out(self, method: str, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        if self.failing.is_set():
            self.fail(context)
        yield from self._channel.unary_stream(method)(request, timeout=context.time_remaining())

    def close(self) -> None:
        self._server.stop(0).wait()
        self._channel.close()


class _Handler(grpc.GenericRpcHandler):  # type: ignore[misc]
    def __init__(self, proxy: FaultProxy) -> None:
        self._proxy = proxy

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        method: str = handler_call_details.method
        name = method.rsplit("/", 1)[-1]
        proxy = self._proxy
        if name in _UNARY:
            return grpc.unary_unary_rpc_method_handler(lambda req, ctx: proxy.unary(method, req, ctx))
        if name == "PutStream":
            return grpc.stream_unary_rpc_method_handler(lambda reqs, ctx: proxy.stream_in(method, reqs, ctx))
        if name == "GetStream":
            return grpc.unary_stream_rpc_method_handler(lambda req, ctx: proxy.stream_out(method, req, ctx))
        return None
