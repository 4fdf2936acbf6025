"""Call plumbing every RPC shares: admission of the raw request bytes, timing, and failures turned
into rich gRPC statuses, counted and logged."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import grpc

from kvtag_store import errors
from kvtag_store.api import intake
from kvtag_store.api.inflight import InflightBudget
from kvtag_store.backends.base import BackendUnavailable
from kvtag_store.observe import logs
from kvtag_store.observe.metrics import StoreMetrics

log = logging.getLogger("kvtag_store.api.calls")
# Reasons of requests refused before they were read (malformed bytes, admission): a client can send
# them at any rate, so their log lines are rate-limited.
_UNREAD = frozenset({"MALFORMED_REQUEST", "SERVER_BUSY"})

R = TypeVar("R")


class Calls:
    def __init__(self, max_batch_items: int, admission: InflightBudget, metrics: StoreMetrics) -> None:
        self.max_batch_items = max_batch_items
        self.admission = admission
        self.metrics = metrics
        # Requests refused unread: one line a second per reason.
        self.rejections = logs.RateLimited(log)

    def admitted(self, spec: intake.Intake, data: bytes) -> AbstractContextManager[Any]:
        """The parsed request, its cost held against the admission limit while the block runs."""
        return intake.admitted(spec, data, self.max_batch_items, self.admission)

    def run(self, name: str, context: grpc.ServicerContext, call: Callable[[], R]) -> R:
        """call(), timed; an ApiError or BackendUnavailable aborts the RPC with its rich status."""
        started = time.perf_counter()
        try:
            return call()
        except errors.ApiError as exc:
            failure = exc
        except BackendUnavailable as exc:
            failure = errors.backend_unavailable(str(exc))
        except Exception:  # a bug: log it with the stack; gRPC answers UNKNOWN
            log.exception("%s failed unexpectedly", name, extra={"rpc": name})
            raise
        finally:
            self.metrics.rpc_seconds.labels(name).observe(time.perf_counter() - started)
        self.refused(name, failure)
        context.abort_with_status(failure.status)
        raise AssertionError("abort_with_status returns only by raising")

    def refused(self, name: str, failure: errors.ApiError) -> None:
        """Count and log a refused call: one line each, rate-limited for requests refused unread."""
        self.metrics.rpc_errors.labels(name, failure.reason).inc()
        extra = {"rpc": name, "reason": failure.reason}
        if failure.reason in _UNREAD:
            self.rejections.warning(failure.reason, "%s refused: %s", name, failure.message, extra=extra)
        else:
            log.info("%s refused: %s", name, failure.message, extra=extra)


class Servicer(Protocol):
    calls: Calls


S = TypeVar("S", bound=Servicer)


def rpc(
    spec: intake.Intake | None,
) -> Callable[[Callable[[S, Any, grpc.ServicerContext], R]], Callable[..., R]]:
    """An RPC method through Calls.run; with `spec` it receives the request parsed from the raw bytes
    (intake.admitted: counted, admitted, parsed, held until it returns), without it what gRPC gives
    (the raw stream of PutStream)."""

    def decorate(method: Callable[[S, Any, grpc.ServicerContext], R]) -> Callable[..., R]:
        name = method.__name__

        @functools.wraps(method)
        def wrapper(self: S, data: Any, context: grpc.ServicerContext) -> R:
            if spec is None:
                return self.calls.run(name, context, lambda: method(self, data, context))

            def admitted() -> R:
                with self.calls.admitted(spec, data) as request:
                    return method(self, request, context)

            return self.calls.run(name, context, admitted)

        return wrapper

    return decorate
