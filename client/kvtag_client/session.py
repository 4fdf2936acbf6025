"""The store session behind StoreClient: its state machine (connected, degraded, refused), the
heartbeat thread that keeps or re-opens it, outages and refusals logged once, and the deadline and
failure types every call shares.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Self

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_proto.channels import ChannelSecurity, open_channel
from kvtag_proto.errors import KvtagError, parse_error
from kvtag_proto.ids import mode_id as derive_mode_id
from kvtag_proto.ids import namespace_id as derive_namespace_id

from kvtag_client.shared_memory import ArenaMapping, UnusableOffer

# One logger for the whole client, under the name users (and tests) already configure.
log = logging.getLogger("kvtag_client.store")


# Limits assumed until OpenSession returns the server's own.
_DEFAULT_LIMITS = pb.Limits(
    max_key_bytes=256, max_batch_items=4096, max_value_bytes=64 << 20, max_message_bytes=4 << 20
)
# Codes that mean "the store (or the path to it) is not working right now".
_OUTAGE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
_REFUSAL_REASONS = frozenset({"MODE_REFUSED", "PROBE_DISAGREEMENT", "INVALID_DESCRIPTOR", "INVALID_PROBE"})
# The store refused the token (absent, wrong, revoked) or its grant: an outage like any other (logged
# once, retried in the background, so a rotated token file is picked up), but said plainly.
_AUTH_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
_DATA_PATHS = ("auto", "inline")


class StoreState(enum.Enum):
    CONNECTED = "connected"
    # Unreachable or erroring: calls return misses/drops, the session is re-opened in the background.
    DEGRADED = "degraded"
    # Refused by the store's policy: the engine runs without the store; logged once with the diff.
    REFUSED = "refused"


@dataclass
class ClientCounters:
    lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    mode_mismatch_blocks: int = 0
    put_stored: int = 0
    put_present: int = 0
    put_conflict: int = 0
    put_rejected: int = 0
    put_dropped: int = 0
    get_failed: int = 0
    degraded_calls: int = 0
    reconnects: int = 0

    def snapshot(self) -> dict[str, int]:
        return asdict(self)


class _CallFailed(Exception):
    """A store call failed and was already handled (state updated, logged); return the fallback."""


class _Deadline:
    """One bound for a whole public call, shared by its re-open and retry."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise _CallFailed("deadline exhausted")
        return left


class Session:
    """Thread-safe session of one engine with one kvtag store; StoreClient adds the calls."""

    def __init__(
        self,
        endpoint: str,
        *,
        engine_id: str,
        namespace: pb.NamespaceDescriptor,
        mode: pb.HashingMode,
        probe_keys: Sequence[bytes],
        labels: Mapping[str, str] | None = None,
        rpc_timeout_s: float = 1.0,
        reconnect_interval_s: float = 2.0,
        block_bytes_hint: int = 0,
        min_transfer_bytes_per_s: float = 20e6,
        security: ChannelSecurity | None = None,
        data_path: str = "auto",
    ) -> None:
        """Builds the channel and starts the heartbeat thread; does not contact the store (see open()).

        block_bytes_hint (bytes per stored value, if known) and min_transfer_bytes_per_s
        stretch the deadline of large puts and gets: rpc_timeout_s + bytes / rate.
        security: TLS files and the token file (default: plaintext, token from $KVTAG_TOKEN if set);
        a file that cannot be read raises kvtag_proto.channels.ChannelConfigError here.

        data_path "auto" moves values through the store's shared-memory arena when the store offers it
        and this process can map it (same host, shared /dev/shm), else inline in gRPC messages;
        "inline" never uses shared memory. `data_path` (the property) says which one is in use.
        """
        if data_path not in _DATA_PATHS:
            raise ValueError(f"data_path must be one of {_DATA_PATHS}, got {data_path!r}")
        self._data_path_choice = data_path
        self._arena: ArenaMapping | None = None
        self._shm_logged = False
        # Shared-memory read leases waiting for the releaser thread (shared_memory_transfer).
        self._pending_releases: list[str] = []
        self._release_wake = threading.Event()
        self._releaser: threading.Thread | None = None
        # Takes large shared-memory slots' digests beside the next copy (shared_memory_transfer).
        self._digester: ThreadPoolExecutor | None = None
        # Spare slots granted by CommitSlots for the next put (shared_memory_transfer): value length ->
        # [(offset, generation, time the granting call was sent)], of the session and arena segment
        # they were granted in.
        self._spares: dict[int, list[tuple[int, int, float]]] = {}
        self._spares_of: tuple[str, str] = ("", "")
        self.endpoint = endpoint
        self.engine_id = engine_id
        self.namespace = namespace
        self.mode = mode
        self.probe_keys = list(probe_keys)
        self.labels = dict(labels or {})
        self.rpc_timeout_s = rpc_timeout_s
        self.reconnect_interval_s = reconnect_interval_s
        self.min_transfer_bytes_per_s = min_transfer_bytes_per_s
        self._value_bytes_estimate = block_bytes_hint

        self.state = StoreState.DEGRADED
        self.session_id = ""
        self.mode_id = derive_mode_id(mode)
        self.namespace_id = derive_namespace_id(namespace)
        self.refusal: pb.ModeRefusal | None = None
        self.refusal_error: KvtagError | None = None
        self.warnings: list[pb.CensusWarning] = []
        self.counters = ClientCounters()
        self.limits = pb.Limits()
        self.limits.CopyFrom(_DEFAULT_LIMITS)
        self.session_ttl_ms = 0

        self._lock = threading.Lock()  # state, session id, counters
        self._open_lock = threading.Lock()  # one OpenSession at a time
        self._ever_connected = False
        self._v1_lookup_logged = False
        self._outage_logged = False
        self._logged_warnings: set[tuple[str, str]] = set()
        self._closed = threading.Event()
        self._wake = threading.Event()
        backoff_ms = max(100, int(reconnect_interval_s * 1000))
        self._channel = open_channel(
            endpoint,
            security,
            options=[
                ("grpc.max_send_message_length", -1),
                ("grpc.max_receive_message_length", -1),
                # Re-dial a restarted store within the reconnect interval, not gRPC's default 2 minutes.
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", backoff_ms),
            ],
        )
        self._stub = store_pb2_grpc.KvStoreStub(self._channel)  # type: ignore[no-untyped-call]
        # Put with requests encoded by put_encoding, Get with replies read by get_decoding: bytes pass
        # through gRPC unserialized.
        self._put_raw = self._channel.unary_unary(
            "/kvtag.v1.KvStore/Put", request_serializer=None, response_deserializer=pb.PutResponse.FromString
        )
        self._get_raw = self._channel.unary_unary(
            "/kvtag.v1.KvStore/Get", request_serializer=None, response_deserializer=None
        )
        self._thread = threading.Thread(target=self._maintain, name="kvtag-store-heartbeat", daemon=True)
        self._thread.start()

    # ---- session -------------------------------------------------------------------

    def open(self) -> bool:
        """Try to open the session now, within rpc_timeout_s; True when CONNECTED."""
        if self._closed.is_set():
            return False
        with contextlib.suppress(_CallFailed):
            self._open_session(_Deadline(self.rpc_timeout_s), stale_session="")
        return self.state is StoreState.CONNECTED

    def _open_session(self, deadline: _Deadline, stale_session: str) -> str:
        """Open a new session unless another thread already replaced `stale_session`; return its id."""
        with self._open_lock:
            with self._lock:
                if self.state is StoreState.REFUSED:
                    raise _CallFailed("refused")
                if self.state is StoreState.CONNECTED and self.session_id != stale_session:
                    return self.session_id
            paths = [pb.DATA_PATH_INLINE]
            if self._data_path_choice == "auto":
                paths.insert(0, pb.DATA_PATH_SHARED_MEMORY)
            request = pb.OpenSessionRequest(
                engine_id=self.engine_id,
                namespace=self.namespace,
                mode=self.mode,
                probe_keys=self.probe_keys,
                data_paths=paths,
                labels=self.labels,
            )
            try:
                response: pb.OpenSessionResponse = self._stub.OpenSession(
                    request, timeout=deadline.remaining()
                )
            except grpc.RpcError as err:
                self._on_open_error(err)
                raise _CallFailed("open failed") from err
            with self._lock:
                reconnect = self._ever_connected
                self._ever_connected = True
                self.session_id = response.session_id
                self.mode_id = response.mode_id or self.mode_id
                self.namespace_id = response.namespace_id or self.namespace_id
                self.session_ttl_ms = response.session_ttl_ms
                if response.HasField("limits"):
                    self.limits = self._merged_limits(response.limits)
                self.warnings = list(response.warnings)
                if self._arena is not None:
                    self._arena.close()
                self._arena = None
                self.state = StoreState.CONNECTED
                if reconnect:
                    self.counters.reconnects += 1
                was_out, self._outage_logged = self._outage_logged, False
            if was_out:
                log.warning(
                    "kvtag store %s is back: session %s re-opened", self.endpoint, response.session_id
                )
            else:
                log.info(
                    "kvtag store %s: session %s open (namespace %s, mode %s)",
                    self.endpoint,
                    response.session_id,
                    self.namespace_id,
                    self.mode_id,
                )
            self._log_warnings(response.warnings)
            if self._data_path_choice == "auto":
                self._attach(response, deadline)
            self._wake.set()  # the heartbeat period may have changed
            return response.session_id

    def _attach(self, response: pb.OpenSessionResponse, deadline: _Deadline) -> None:
        """Map the offered arena and prove it with its nonce; on any failure stay inline (logged once)."""
        if not response.HasField("shared_memory_offer"):
            self._inline_fallback(
                "the store offers no shared-memory arena (another backend, or --shm-dir is off)"
            )
            return
        offer = response.shared_memory_offer
        try:
            arena = ArenaMapping(offer)
        except UnusableOffer as exc:
            self._inline_fallback(f"{exc} (another host, or no shared /dev/shm)")
            return
        try:
            attached: pb.AttachSharedMemoryResponse = self._stub.AttachSharedMemory(
                pb.AttachSharedMemoryRequest(session_id=response.session_id, nonce=arena.nonce),
                timeout=deadline.remaining(),
            )
        except (grpc.RpcError, _CallFailed) as exc:
            self._inline_fallback(f"AttachSharedMemory failed: {exc}")
            return
        if attached.data_path != pb.DATA_PATH_SHARED_MEMORY:
            self._inline_fallback(f"the store did not accept this mapping of {offer.path}")
            return
        with self._lock:
            if self.session_id == response.session_id:
                self._arena = arena
        log.info("kvtag store %s: values move through shared memory (%s)", self.endpoint, offer.path)

    def _inline_fallback(self, why: str) -> None:
        with self._lock:
            first, self._shm_logged = not self._shm_logged, True
        if first:
            log.warning(
                "kvtag store %s: shared-memory path unavailable, using the inline path: %s",
                self.endpoint,
                why,
            )

    @property
    def data_path(self) -> str:
        """ "shared_memory" while values move through the store's arena, else "inline"."""
        with self._lock:
            return (
                "shared_memory"
                if self._arena is not None and self.state is StoreState.CONNECTED
                else "inline"
            )

    def _shared_arena(self) -> ArenaMapping | None:
        with self._lock:
            return self._arena if self.state is StoreState.CONNECTED else None

    @staticmethod
    def _merged_limits(server: pb.Limits) -> pb.Limits:
        """The server's limits, with the defaults standing in for fields it left at 0."""
        merged = pb.Limits()
        merged.CopyFrom(_DEFAULT_LIMITS)
        for name in ("max_key_bytes", "max_batch_items", "max_value_bytes", "max_message_bytes"):
            if getattr(server, name):
                setattr(merged, name, getattr(server, name))
        return merged

    def _on_open_error(self, err: grpc.RpcError) -> None:
        detail = parse_error(err)
        code = err.code() if isinstance(err, grpc.Call) else grpc.StatusCode.UNKNOWN
        if detail is not None and detail.reason in _REFUSAL_REASONS and code not in _AUTH_CODES:
            with self._lock:
                self.state = StoreState.REFUSED
                self.session_id = ""
                self.refusal = detail.mode_refusal
                self.refusal_error = detail
            log.error("%s", self._refusal_text(detail))
            return
        self._mark_outage(code, err)

    def _refusal_text(self, detail: KvtagError) -> str:
        lines = [
            f"kvtag store {self.endpoint} refused engine {self.engine_id!r} "
            f"({detail.reason}): {detail.message}",
        ]
        if detail.mode_refusal is not None:
            refusal = detail.mode_refusal
            lines.append(
                f"  namespace {refusal.namespace_id} is established on mode {refusal.established_mode_id}; "
                f"this engine hashes with mode {refusal.requested_mode_id}. Differing fields:"
            )
            lines.extend(
                f"    {d.field}: store has {d.established!r}, this engine has {d.requested!r}"
                for d in refusal.diffs
            )
        if detail.probe_disagreement is not None:
            probe = detail.probe_disagreement
            lines.append(
                f"  same declared mode {probe.mode_id} as engine {probe.reference_engine_id!r}, "
                f"but different probe keys: {probe.likely_cause}"
            )
        lines.extend(f"  {field}: {description}" for field, description in detail.field_violations)
        lines.append(
            "  Running WITHOUT the store: every lookup misses and every save is dropped. Align the settings "
            "above with the other engines, or use a separate namespace (cache salt / tenant)."
        )
        return "\n".join(lines)

    def _log_warnings(self, warnings: Sequence[pb.CensusWarning]) -> None:
        for warning in warnings:
            marker = (warning.kind, warning.other_mode_id)
            with self._lock:
                if marker in self._logged_warnings:
                    continue
                self._logged_warnings.add(marker)
            log.warning(
                "kvtag store %s census warning %s (other mode %s): %s",
                self.endpoint,
                warning.kind,
                warning.other_mode_id,
                warning.message,
            )

    def _mark_outage(self, code: grpc.StatusCode, err: BaseException | None) -> None:
        with self._lock:
            if self.state is StoreState.REFUSED or self._closed.is_set():
                return
            self.state = StoreState.DEGRADED
            first, self._outage_logged = not self._outage_logged, True
        self._wake.set()  # the heartbeat thread switches to the reconnect period
        if first:
            what = code.name
            detail = parse_error(err) if isinstance(err, grpc.RpcError) else None
            if detail is not None and detail.reason:
                what += "/" + detail.reason
            message = err.details() if isinstance(err, grpc.Call) else str(err)
            if code in _AUTH_CODES:
                log.error(
                    "kvtag store %s refused engine %r (%s): %s. Running WITHOUT the store: lookups miss and "
                    "saves are dropped; retrying every %.1f s in case the token or its grant is fixed",
                    self.endpoint,
                    self.engine_id,
                    what,
                    message,
                    self.reconnect_interval_s,
                )
                return
            log.warning(
                "kvtag store %s is not answering (%s: %s); lookups report misses and saves are dropped "
                "until it returns (retrying every %.1f s)",
                self.endpoint,
                what,
                message,
                self.reconnect_interval_s,
            )

    # ---- background heartbeat / reconnect ------------------------------------------

    def _maintain(self) -> None:
        """Heartbeat at ttl/3 while connected; re-open every reconnect interval while degraded."""
        while not self._closed.is_set():
            with self._lock:
                state, session_id, ttl_ms = self.state, self.session_id, self.session_ttl_ms
            connected = state is StoreState.CONNECTED and ttl_ms > 0
            period = ttl_ms / 3000.0 if connected else self.reconnect_interval_s
            if self._wake.wait(period):
                self._wake.clear()
                continue
            if self._closed.is_set():
                return
            with self._lock:
                state, session_id = self.state, self.session_id
            try:
                if state is StoreState.CONNECTED:
                    self._heartbeat(session_id)
                elif state is StoreState.DEGRADED:
                    self._recover(session_id)
            except _CallFailed:
                pass
            except Exception:  # the thread must survive anything; the next period tries again
                log.exception("kvtag store client maintenance failed")

    def _heartbeat(self, session_id: str) -> None:
        try:
            response = self._stub.Heartbeat(
                pb.HeartbeatRequest(session_id=session_id), timeout=self.rpc_timeout_s
            )
        except grpc.RpcError as err:
            if self._is_session_gone(err):
                self._open_session(_Deadline(self.rpc_timeout_s), stale_session=session_id)
            else:
                self._mark_outage(self._code(err), err)
            return
        if response.session_ttl_ms:
            with self._lock:
                self.session_ttl_ms = response.session_ttl_ms

    def _recover(self, session_id: str) -> None:
        """Back from an outage: keep the old session if the store still knows it, else open a new one."""
        if session_id:
            try:
                self._stub.Heartbeat(pb.HeartbeatRequest(session_id=session_id), timeout=self.rpc_timeout_s)
            except grpc.RpcError as err:
                if not self._is_session_gone(err):
                    self._mark_outage(self._code(err), err)
                    return
            else:
                with self._lock:
                    if self.state is not StoreState.DEGRADED or self.session_id != session_id:
                        return
                    self.state = StoreState.CONNECTED
                    self.counters.reconnects += 1
                    self._outage_logged = False
                log.warning("kvtag store %s is back: session %s still valid", self.endpoint, session_id)
                return
        self._open_session(_Deadline(self.rpc_timeout_s), stale_session=session_id)

    # ---- errors ----------------------------------------------------------------------

    @staticmethod
    def _code(err: grpc.RpcError) -> grpc.StatusCode:
        return err.code() if isinstance(err, grpc.Call) else grpc.StatusCode.UNKNOWN

    def _is_session_gone(self, err: grpc.RpcError) -> bool:
        if self._code(err) is not grpc.StatusCode.NOT_FOUND:
            return False
        detail = parse_error(err)
        return detail is None or detail.reason == "SESSION_NOT_FOUND"

    def close(self) -> None:
        """Stop the heartbeat thread, close the session (best effort) and the channel. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake.set()
        self._release_wake.set()
        with self._lock:
            session_id = self.session_id if self.state is StoreState.CONNECTED else ""
        if session_id:
            with contextlib.suppress(grpc.RpcError):
                self._stub.CloseSession(
                    pb.CloseSessionRequest(session_id=session_id), timeout=min(self.rpc_timeout_s, 0.5)
                )
        self._thread.join(timeout=self.rpc_timeout_s + 1.0)
        if self._releaser is not None:  # its call in flight must end before the channel closes
            self._releaser.join(timeout=self.rpc_timeout_s + 1.0)
        with self._lock:
            if self._arena is not None:
                self._arena.close()
            digester = self._digester
        if digester is not None:
            digester.shutdown(wait=True)
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
