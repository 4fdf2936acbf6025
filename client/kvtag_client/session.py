"""The store session: its state machine (connected, degraded, refused), the heartbeat thread that keeps
or re-opens it, and outages and refusals logged once. The data paths hook into its open and close."""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_proto.channels import ChannelSecurity, open_channel
from kvtag_proto.errors import KvtagError, parse_error
from kvtag_proto.ids import mode_id as derive_mode_id
from kvtag_proto.ids import namespace_id as derive_namespace_id

from kvtag_client.deadlines import Deadline
from kvtag_client.errors import AUTH_CODES, CallFailed, is_session_gone, status_code
from kvtag_client.logs import log
from kvtag_client.usage import BaseKey, PendingUsage

# Limits assumed until OpenSession returns the server's own.
_DEFAULT_LIMITS = pb.Limits(
    max_key_bytes=256, max_batch_items=4096, max_value_bytes=64 << 20, max_message_bytes=4 << 20
)
_REFUSAL_REASONS = frozenset({"MODE_REFUSED", "PROBE_DISAGREEMENT", "INVALID_DESCRIPTOR", "INVALID_PROBE"})
DATA_PATHS = ("auto", "inline")

# Called after each OpenSession that succeeded, with its answer and the deadline of the call that
# opened it (the shared-memory path maps the offered arena here).
OpenHook = Callable[[pb.OpenSessionResponse, Deadline], None]


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


class Session:
    """Thread-safe session of one engine with one kvtag store: the channel, the session's state and
    counters; StoreClient's parts make the calls."""

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
        min_transfer_bytes_per_s: float = 20e6,
        security: ChannelSecurity | None = None,
        data_path: str = "auto",
    ) -> None:
        """Builds the channel and starts the heartbeat thread; does not contact the store (see open()).
        Arguments as StoreClient's."""
        if data_path not in DATA_PATHS:
            raise ValueError(f"data_path must be one of {DATA_PATHS}, got {data_path!r}")
        self.data_path_choice = data_path
        self.endpoint = endpoint
        self.engine_id = engine_id
        self.namespace = namespace
        self.mode = mode
        self.probe_keys = list(probe_keys)
        self.labels = dict(labels or {})
        self.rpc_timeout_s = rpc_timeout_s
        self.reconnect_interval_s = reconnect_interval_s
        self.min_transfer_bytes_per_s = min_transfer_bytes_per_s

        self.state = StoreState.DEGRADED
        self.session_id = ""
        self.mode_id = derive_mode_id(mode)
        self.namespace_id = derive_namespace_id(namespace)
        self.refusal: pb.ModeRefusal | None = None
        self.refusal_error: KvtagError | None = None
        self.warnings: list[pb.CensusWarning] = []
        self.counters = ClientCounters()
        self.usage = PendingUsage()  # add_usage: what the store has not acknowledged yet
        self.limits = pb.Limits()
        self.limits.CopyFrom(_DEFAULT_LIMITS)
        self.session_ttl_ms = 0
        # What an outage costs this client's engine, for the warning (a companion's peer serves on).
        self.outage_effect = "lookups report misses and saves are dropped"
        # The store publishes KV events and asks for the token ids of puts (BlockRef.token_ids).
        self.wants_token_ids = False
        self.on_open: list[OpenHook] = []
        # Run by close() after the heartbeat thread ended and before the channel closes.
        self.on_close: list[Callable[[], None]] = []
        # Set by close(): background threads end, a failing call is no longer an outage.
        self.closed = threading.Event()

        self._lock = threading.Lock()  # state, session id, counters
        self._open_lock = threading.Lock()  # one OpenSession at a time
        self._ever_connected = False
        self._outage_logged = False
        self._logged_warnings: set[tuple[str, str]] = set()
        self._wake = threading.Event()
        backoff_ms = max(100, int(reconnect_interval_s * 1000))
        self.channel = open_channel(
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
        # Read at each call, so a test may stand a counting stub in its place.
        self.stub = store_pb2_grpc.KvStoreStub(self.channel)  # type: ignore[no-untyped-call]
        # Put with requests encoded by inline.put_encoding, Get with replies read by inline.get_decoding:
        # bytes pass through gRPC unserialized.
        self.put_raw = self.channel.unary_unary(
            "/kvtag.v1.KvStore/Put", request_serializer=None, response_deserializer=pb.PutResponse.FromString
        )
        self.get_raw = self.channel.unary_unary(
            "/kvtag.v1.KvStore/Get", request_serializer=None, response_deserializer=None
        )
        self._thread = threading.Thread(target=self._maintain, name="kvtag-store-heartbeat", daemon=True)
        self._thread.start()

    # ---- state the calls read ------------------------------------------------------

    def connected_id(self) -> str | None:
        """The session id while CONNECTED, else None."""
        with self._lock:
            return self.session_id if self.state is StoreState.CONNECTED else None

    def id_for_call(self) -> str | None:
        """The live session id, or None (counted as a degraded call) when the store is not usable now."""
        with self._lock:
            if self.state is StoreState.CONNECTED:
                return self.session_id
            self.counters.degraded_calls += 1
            return None

    @contextlib.contextmanager
    def counting(self) -> Iterator[ClientCounters]:
        """The counters, held for an update."""
        with self._lock:
            yield self.counters

    # ---- session -------------------------------------------------------------------

    def open(self) -> bool:
        """Try to open the session now, within rpc_timeout_s; True when CONNECTED."""
        if self.closed.is_set():
            return False
        with contextlib.suppress(CallFailed):
            self.open_session(Deadline(self.rpc_timeout_s), stale_session="")
        return self.state is StoreState.CONNECTED

    def open_session(self, deadline: Deadline, stale_session: str) -> str:
        """Open a new session unless another thread already replaced `stale_session`; return its id."""
        with self._open_lock:
            with self._lock:
                if self.state is StoreState.REFUSED:
                    raise CallFailed("refused")
                if self.state is StoreState.CONNECTED and self.session_id != stale_session:
                    return self.session_id
            paths = [pb.DATA_PATH_INLINE]
            if self.data_path_choice == "auto":
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
                response: pb.OpenSessionResponse = self.stub.OpenSession(
                    request, timeout=deadline.remaining()
                )
            except grpc.RpcError as err:
                self._on_open_error(err)
                raise CallFailed("open failed") from err
            with self._lock:
                reconnect = self._ever_connected
                self._ever_connected = True
                self.session_id = response.session_id
                self.mode_id = response.mode_id or self.mode_id
                self.namespace_id = response.namespace_id or self.namespace_id
                self.session_ttl_ms = response.session_ttl_ms
                self.wants_token_ids = response.wants_token_ids
                if response.HasField("limits"):
                    self.limits = _merged_limits(response.limits)
                self.warnings = list(response.warnings)
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
            for hook in self.on_open:
                hook(response, deadline)
            self._wake.set()  # the heartbeat period may have changed
            return response.session_id

    def _on_open_error(self, err: grpc.RpcError) -> None:
        detail = parse_error(err)
        code = status_code(err)
        if detail is not None and detail.reason in _REFUSAL_REASONS and code not in AUTH_CODES:
            with self._lock:
                self.state = StoreState.REFUSED
                self.session_id = ""
                self.refusal = detail.mode_refusal
                self.refusal_error = detail
            log.error("%s", refusal_text(self.endpoint, self.engine_id, detail))
            return
        self.mark_outage(code, err)

    def _log_warnings(self, warnings: Sequence[pb.CensusWarning]) -> None:
        for warning in warnings:
            # A LAYOUT_SPLIT names a sibling namespace, not a mode: each sibling is logged once.
            other = warning.other_mode_id or warning.other_namespace_id
            marker = (warning.kind, other)
            with self._lock:
                if marker in self._logged_warnings:
                    continue
                self._logged_warnings.add(marker)
            log.warning(
                "kvtag store %s census warning %s (other %s %s): %s",
                self.endpoint,
                warning.kind,
                "mode" if warning.other_mode_id else "namespace",
                other,
                warning.message,
            )

    def mark_outage(self, code: grpc.StatusCode, err: BaseException | None) -> None:
        """DEGRADED (unless refused or closed): the heartbeat thread re-opens; the first is logged."""
        with self._lock:
            if self.state is StoreState.REFUSED or self.closed.is_set():
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
            if code in AUTH_CODES:
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
                "kvtag store %s is not answering (%s: %s); %s until it returns (retrying every %.1f s)",
                self.endpoint,
                what,
                message,
                self.outage_effect,
                self.reconnect_interval_s,
            )

    # ---- background heartbeat / reconnect ------------------------------------------

    def _maintain(self) -> None:
        """Heartbeat at ttl/3 while connected; re-open every reconnect interval while degraded."""
        while not self.closed.is_set():
            with self._lock:
                state, session_id, ttl_ms = self.state, self.session_id, self.session_ttl_ms
            connected = state is StoreState.CONNECTED and ttl_ms > 0
            period = ttl_ms / 3000.0 if connected else self.reconnect_interval_s
            if self._wake.wait(period):
                self._wake.clear()
                continue
            if self.closed.is_set():
                return
            with self._lock:
                state, session_id = self.state, self.session_id
            try:
                if state is StoreState.CONNECTED:
                    self._heartbeat(session_id)
                elif state is StoreState.DEGRADED:
                    self._recover(session_id)
            except CallFailed:
                pass
            except Exception:  # the thread must survive anything; the next period tries again
                log.exception("kvtag store client maintenance failed")

    def add_usage(
        self,
        *,
        lookups: int = 0,
        hits: int = 0,
        misses: int = 0,
        stored: int = 0,
        stored_base_keys: Sequence[BaseKey] = (),
        missed_base_keys: Sequence[BaseKey] = (),
    ) -> None:
        """Counts of a data path that bypasses the store (the companion mode), sent with the next
        heartbeat; counts the store never acknowledged (it was down) go with the first heartbeat after
        it returns. The base keys are bounded lists (usage.PendingUsage): past the bound they are
        dropped and counted, never waited for."""
        self.usage.add(
            lookups=lookups,
            hits=hits,
            misses=misses,
            stored=stored,
            stored_base_keys=stored_base_keys,
            missed_base_keys=missed_base_keys,
            max_key_bytes=self.limits.max_key_bytes,
        )

    def flush_usage(self) -> bool:
        """Send the pending usage now (a heartbeat); True once the store has it."""
        with self._lock:
            state, session_id = self.state, self.session_id
        if state is not StoreState.CONNECTED:
            return False
        with contextlib.suppress(CallFailed):
            self._heartbeat(session_id)
        return self.usage.empty()

    def _heartbeat(self, session_id: str) -> None:
        with self.usage.sending:
            usage = self.usage.report()
            request = pb.HeartbeatRequest(session_id=session_id)
            if usage.ByteSize():
                request.usage.CopyFrom(usage)
            try:
                response = self.stub.Heartbeat(request, timeout=self.rpc_timeout_s)
            except grpc.RpcError as err:
                if is_session_gone(err):
                    self.open_session(Deadline(self.rpc_timeout_s), stale_session=session_id)
                else:
                    self.mark_outage(status_code(err), err)
                return
            self.usage.acknowledge(usage)
        with self._lock:
            if response.session_ttl_ms:
                self.session_ttl_ms = response.session_ttl_ms

    def _recover(self, session_id: str) -> None:
        """Back from an outage: keep the old session if the store still knows it, else open a new one."""
        if session_id:
            try:
                self.stub.Heartbeat(pb.HeartbeatRequest(session_id=session_id), timeout=self.rpc_timeout_s)
            except grpc.RpcError as err:
                if not is_session_gone(err):
                    self.mark_outage(status_code(err), err)
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
        self.open_session(Deadline(self.rpc_timeout_s), stale_session=session_id)

    def close(self) -> None:
        """Stop the heartbeat thread, close the session (best effort), run the close hooks, close the
        channel. Idempotent."""
        if self.closed.is_set():
            return
        self.closed.set()
        self._wake.set()
        with self._lock:
            session_id = self.session_id if self.state is StoreState.CONNECTED else ""
        with self.usage.sending:
            usage = self.usage.report()
            if session_id and usage.ByteSize():  # the last counts, before the session ends
                with contextlib.suppress(grpc.RpcError):
                    self.stub.Heartbeat(
                        pb.HeartbeatRequest(session_id=session_id, usage=usage),
                        timeout=min(self.rpc_timeout_s, 0.5),
                    )
                    self.usage.acknowledge(usage)
        if session_id:
            with contextlib.suppress(grpc.RpcError):
                self.stub.CloseSession(
                    pb.CloseSessionRequest(session_id=session_id), timeout=min(self.rpc_timeout_s, 0.5)
                )
        self._thread.join(timeout=self.rpc_timeout_s + 1.0)
        for hook in self.on_close:
            hook()
        self.channel.close()


def _merged_limits(server: pb.Limits) -> pb.Limits:
    """The server's limits, with the defaults standing in for fields it left at 0."""
    merged = pb.Limits()
    merged.CopyFrom(_DEFAULT_LIMITS)
    for name in ("max_key_bytes", "max_batch_items", "max_value_bytes", "max_message_bytes"):
        if getattr(server, name):
            setattr(merged, name, getattr(server, name))
    return merged


def refusal_text(endpoint: str, engine_id: str, detail: KvtagError) -> str:
    """The refusal as logged once: what the store said, the differing fields, and what to do next."""
    lines = [f"kvtag store {endpoint} refused engine {engine_id!r} ({detail.reason}): {detail.message}"]
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
