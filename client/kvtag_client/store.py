"""The kvtag store client: one session, bounded deadlines, degrade-never-fail.

Every public call returns within its deadline and never raises: when the store
is unreachable, slow or erroring, lookups report misses, puts are dropped and
counted, and a background thread re-opens the session once the store answers
again. A session refused by policy (strict namespace, probe disagreement) is
logged once with the field diff and the engine runs without the store.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from itertools import groupby, repeat
from operator import itemgetter
from typing import Any, TypeVar

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_proto.channels import ChannelSecurity, open_channel
from kvtag_proto.errors import KvtagError, parse_error
from kvtag_proto.ids import mode_id as derive_mode_id
from kvtag_proto.ids import namespace_id as derive_namespace_id

from kvtag_client.get_decoding import Value, decode_get_response
from kvtag_client.put_encoding import PutItemFields, encode_put_request
from kvtag_client.shared_memory import ArenaMapping, UnusableOffer

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# Limits assumed until OpenSession returns the server's own.
_DEFAULT_LIMITS = pb.Limits(
    max_key_bytes=256, max_batch_items=4096, max_value_bytes=64 << 20, max_message_bytes=4 << 20
)
# Room left in each message for framing, session id and per-item overhead.
_MESSAGE_MARGIN = 64 << 10
_ITEM_OVERHEAD = 32
# Puts and gets travel as unary messages of about a quarter of the batch (between these bounds),
# up to _IN_FLIGHT at a time, so the client's encoding or decoding of one overlaps the server's work
# on another (2 cores). Messages stay well under the server limit: a fresh multi-MiB buffer costs
# page faults on both sides, and 4 MiB is also gRPC's default receive limit (docs/benchmarks.md,
# "Figures behind choices in the code").
_MIN_MESSAGE = 256 << 10
_MAX_MESSAGE = (1 << 20) + (64 << 10)
_IN_FLIGHT = 4
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
# A (group, key, length, base_key) item for a put whose bytes the caller writes (reserve / put_from).
SizedItem = tuple[int, bytes, int, bytes]


@dataclass
class SharedPut:
    """Slots reserved for a shared-memory put (StoreClient.reserve): write each granted item's value
    into `slots[i]`, then StoreClient.commit. `statuses[i]` is already final for items without a slot
    (ALREADY_PRESENT, CONFLICT, REJECTED)."""

    session_id: str
    items: list[SizedItem]
    statuses: list[int]
    slots: list[memoryview | None]
    refs: list[pb.SharedMemoryRef | None]

    @property
    def nbytes(self) -> int:
        return sum(slot.nbytes for slot in self.slots if slot is not None)


_HIT_BYTE = bytes([pb.HIT])
_MISS_BYTE = bytes([pb.MISS])


@dataclass(frozen=True, slots=True)
class PackedKeys:
    """A run of block keys of one length in one group, concatenated: Lookup's packed form.

    Why: building a BlockRef message per key cost ~14 ms of a 4,096-key lookup; a run is
    one message whatever its length, and the server cuts it in one C call.
    """

    group: int
    keys: bytes  # count * key_length bytes
    key_length: int
    base_keys: bytes = b""  # empty, or count legacy base keys of one length, concatenated

    @property
    def count(self) -> int:
        """Blocks in the run; a run with key_length 0 stands for one block with an empty key."""
        return len(self.keys) // self.key_length if self.key_length else 1

    def split_keys(self) -> list[bytes]:
        k = self.key_length
        return [self.keys[i : i + k] for i in range(0, self.count * k, k)]

    def split_base_keys(self) -> list[bytes]:
        if not self.base_keys or not self.count:
            return []
        k = len(self.base_keys) // self.count
        return [self.base_keys[i : i + k] for i in range(0, self.count * k, k)]

    def sliced(self, start: int, end: int) -> PackedKeys:
        """Keys [start, end) of the run."""
        k = self.key_length
        base = b""
        if self.base_keys and self.count:
            b = len(self.base_keys) // self.count
            base = self.base_keys[start * b : end * b]
        return PackedKeys(self.group, self.keys[start * k : end * k], k, base)


def pack_blocks(blocks: Sequence[tuple[int, bytes, bytes]]) -> list[PackedKeys]:
    """(group, key, base_key) blocks as runs of consecutive blocks sharing a group, a key length and a
    base key length. The common case (one group, one length) is checked with C-level passes."""
    if not blocks:
        return []
    groups = list(map(itemgetter(0), blocks))
    keys = list(map(itemgetter(1), blocks))
    bases = list(map(itemgetter(2), blocks))
    key_lengths = list(map(len, keys))
    base_lengths = list(map(len, bases))
    n = len(blocks)
    shape = (groups[0], key_lengths[0], base_lengths[0])
    if (
        groups.count(shape[0]) == n
        and key_lengths.count(shape[1]) == n
        and base_lengths.count(shape[2]) == n
        and shape[1]
    ):
        return [PackedKeys(shape[0], b"".join(keys), shape[1], b"".join(bases))]
    runs: list[PackedKeys] = []
    position = 0
    for (group, key_length, _), members in groupby(zip(groups, key_lengths, base_lengths, strict=True)):
        count = len(list(members))
        end = position + count
        if key_length == 0:  # keyless blocks: one run each, answered MISS locally
            runs.extend(PackedKeys(group, b"", 0) for _ in range(count))
        else:
            runs.append(
                PackedKeys(group, b"".join(keys[position:end]), key_length, b"".join(bases[position:end]))
            )
        position = end
    return runs


def _chunked(runs: Sequence[PackedKeys], limit: int) -> Iterator[tuple[int, list[PackedKeys]]]:
    """(offset, runs) of at most `limit` keys each, cutting runs where needed."""
    chunk: list[PackedKeys] = []
    size = 0
    offset = 0
    for run in runs:
        count = run.count
        start = 0
        while start < count:
            take = min(count - start, limit - size)
            chunk.append(run if take == count else run.sliced(start, start + take))
            size += take
            start += take
            if size == limit:
                yield offset, chunk
                offset += size
                chunk, size = [], 0
    if chunk:
        yield offset, chunk


class StoreState(enum.Enum):
    CONNECTED = "connected"
    # Unreachable or erroring: calls return misses/drops, the session is re-opened in the background.
    DEGRADED = "degraded"
    # Refused by the store's policy: the engine runs without the store; logged once with the diff.
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class LookupResult:
    prefix_length: int  # leading HIT count (0 when degraded)
    statuses: list[int]  # kvtag.v1.KeyStatus per block; UNSPECIFIED for blocks not asked
    lease_id: str  # "" when nothing leased; several leases are joined by ","


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


class StoreClient:
    """Thread-safe client of one kvtag store session (see module docstring)."""

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
        self._releases: set[grpc.Future] = set()
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

    # ---- call plumbing -------------------------------------------------------------

    @staticmethod
    def _code(err: grpc.RpcError) -> grpc.StatusCode:
        return err.code() if isinstance(err, grpc.Call) else grpc.StatusCode.UNKNOWN

    def _is_session_gone(self, err: grpc.RpcError) -> bool:
        if self._code(err) is not grpc.StatusCode.NOT_FOUND:
            return False
        detail = parse_error(err)
        return detail is None or detail.reason == "SESSION_NOT_FOUND"

    def _session_for_call(self) -> str | None:
        """The live session id, or None (counted as a degraded call) when the store is not usable now."""
        with self._lock:
            if self.state is StoreState.CONNECTED:
                return self.session_id
            self.counters.degraded_calls += 1
            return None

    def _call(self, deadline: _Deadline, rpc: Callable[[str, float], _T]) -> _T:
        """Run rpc(session_id, timeout); re-open transparently once if the session expired."""
        session_id = self._session_for_call()
        if session_id is None:
            raise _CallFailed("not connected")
        for attempt in (0, 1):
            try:
                return rpc(session_id, deadline.remaining())
            except grpc.RpcError as err:
                if attempt == 0 and self._is_session_gone(err):
                    try:
                        session_id = self._open_session(deadline, stale_session=session_id)
                    except _CallFailed:
                        with self._lock:
                            self.counters.degraded_calls += 1
                        raise
                    continue
                self._on_call_error(err)
                raise _CallFailed(self._code(err).name) from err
        raise AssertionError("unreachable")

    def _on_call_error(self, err: grpc.RpcError) -> None:
        code = self._code(err)
        with self._lock:
            self.counters.degraded_calls += 1
        detail = parse_error(err)
        if detail is not None and detail.reason == "SERVER_BUSY":
            # The store is up but at its admission limit: this call is a miss/drop, the session stays.
            log.debug("kvtag store %s busy: %s", self.endpoint, detail.message)
            return
        if code in _OUTAGE_CODES or code in _AUTH_CODES:
            self._mark_outage(code, err)
        else:
            # A request the store rejected as malformed: a client bug, not an outage.
            log.error("kvtag store %s rejected a request (%s): %s", self.endpoint, code.name, err)

    def _transfer_deadline(self, nbytes: int) -> _Deadline:
        return _Deadline(self.rpc_timeout_s + nbytes / self.min_transfer_bytes_per_s)

    def _batch_size(self) -> int:
        return max(1, self.limits.max_batch_items)

    def _message_budget(self) -> int:
        limit = self.limits.max_message_bytes
        return max(limit // 2, limit - _MESSAGE_MARGIN)

    def _valid_key(self, key: bytes) -> bool:
        return 0 < len(key) <= self.limits.max_key_bytes

    def _block_ref(self, group: int, key: bytes, base_key: bytes = b"") -> pb.BlockRef:
        if base_key and not self._valid_key(base_key):
            base_key = b""  # diagnostics only: drop rather than fail the batch
        return pb.BlockRef(key=key, group=group, base_key=base_key)

    # ---- public calls --------------------------------------------------------------

    def lookup(self, blocks: Sequence[tuple[int, bytes, bytes]], lease_ms: int = 0) -> LookupResult:
        """Leading HIT count, a status per (group, key, base_key) block and a read lease on the hits;
        misses when degraded. Sent in the packed form (see lookup_packed)."""
        return self.lookup_packed(pack_blocks(blocks), lease_ms)

    def lookup_packed(self, runs: Sequence[PackedKeys], lease_ms: int = 0) -> LookupResult:
        """lookup() over runs of concatenated keys: no Python object per key on either side.

        Statuses follow the runs' concatenation. A run with an invalid key length is
        answered MISS locally; invalid base keys are dropped (they only feed diagnostics).
        """
        with self._lock:
            self.counters.lookups += 1
        total = sum(run.count for run in runs)
        if not total:
            return LookupResult(0, [], "")
        statuses = bytearray(total)  # KEY_STATUS_UNSPECIFIED until answered
        leases: list[str] = []
        deadline = _Deadline(self.rpc_timeout_s)
        try:
            for offset, chunk in _chunked(runs, self._batch_size()):
                size = sum(run.count for run in chunk)
                sendable = [self._sendable(run) for run in chunk]
                sent = [run for run in sendable if run is not None]
                answered = self._lookup_chunk(deadline, sent, lease_ms, leases) if sent else b""
                if len(sent) != len(chunk):  # MISS in place of the runs not sent
                    parts, position = [], 0
                    for run, maybe in zip(chunk, sendable, strict=True):
                        if maybe is None:
                            parts.append(_MISS_BYTE * run.count)
                        else:
                            parts.append(answered[position : position + run.count])
                            position += run.count
                    answered = b"".join(parts)
                statuses[offset : offset + size] = answered
                # Later chunks cannot extend a prefix that already broke.
                if answered.count(pb.HIT) != size:
                    break
        except _CallFailed:
            if leases:
                self.release(",".join(leases))
            return LookupResult(0, [int(pb.KEY_STATUS_UNSPECIFIED)] * total, "")
        prefix = total - len(statuses.lstrip(_HIT_BYTE))
        with self._lock:
            self.counters.hit_blocks += statuses.count(pb.HIT)
            self.counters.miss_blocks += statuses.count(pb.MISS)
            self.counters.mode_mismatch_blocks += statuses.count(pb.MODE_MISMATCH)
        return LookupResult(prefix, list(statuses), ",".join(leases))

    def _sendable(self, run: PackedKeys) -> PackedKeys | None:
        """The run as sent: None when its keys are invalid; base keys that are not one valid length
        per key are dropped (they only feed diagnostics), as _block_ref does."""
        if not run.key_length or not self._valid_key(run.keys[: run.key_length]):
            return None
        base = len(run.base_keys)
        if base and (base % run.count or not 0 < base // run.count <= self.limits.max_key_bytes):
            return replace(run, base_keys=b"")
        return run

    def _lookup_chunk(
        self, deadline: _Deadline, runs: list[PackedKeys], lease_ms: int, leases: list[str]
    ) -> bytes:
        """One Lookup RPC over at most max_batch_items keys: their statuses, one byte each."""
        packed = [
            pb.PackedBlocks(key_length=r.key_length, keys=r.keys, group=r.group, base_keys=r.base_keys)
            for r in runs
        ]
        wanted = sum(r.count for r in runs)

        def rpc(sid: str, timeout: float) -> pb.LookupResponse:
            request = pb.LookupRequest(session_id=sid, packed_blocks=packed, lease_ms=lease_ms)
            response: pb.LookupResponse = self._stub.Lookup(request, timeout=timeout)
            return response

        response = self._call(deadline, rpc)
        if response.lease.lease_id:
            leases.append(response.lease.lease_id)
        answered: bytes = response.packed_statuses
        if len(answered) == wanted:
            return answered
        # A store older than the packed form saw no blocks: ask again in the v1 form.
        if not self._v1_lookup_logged:
            self._v1_lookup_logged = True
            log.warning("kvtag store %s does not answer packed Lookups; using the v1 form", self.endpoint)
        refs = [
            self._block_ref(r.group, key, base)
            for r in runs
            for key, base in zip(r.split_keys(), r.split_base_keys() or repeat(b""), strict=False)
        ]

        def rpc_v1(sid: str, timeout: float) -> pb.LookupResponse:
            request = pb.LookupRequest(session_id=sid, blocks=refs, lease_ms=lease_ms)
            response: pb.LookupResponse = self._stub.Lookup(request, timeout=timeout)
            return response

        response = self._call(deadline, rpc_v1)
        if response.lease.lease_id:
            leases.append(response.lease.lease_id)
        return bytes(response.statuses).ljust(wanted, _MISS_BYTE)

    def put(self, items: Sequence[tuple[int, bytes, bytes, bytes]]) -> list[int] | None:
        """Store (group, key, value, base_key) items; a PutStatus per item, or None when all were dropped.

        Batches are split into Put messages within the server's Limits (at most
        max_batch_items items, under max_message_bytes), several in flight. Items that
        cannot be sent at all (bad key, value larger than a message) are REJECTED
        locally; items lost to a failure mid-batch are UNSPECIFIED and counted as dropped,
        except those of the messages answered before the failure.
        """
        if not items:
            return []
        if self._shared_arena() is not None:

            def copy(index: int, slot: memoryview) -> None:
                slot[:] = items[index][2]

            return self.put_from([(g, k, len(v), b) for g, k, v, b in items], copy)
        results: list[int] = [pb.PUT_STATUS_UNSPECIFIED] * len(items)
        with self._lock:
            connected = self.state is StoreState.CONNECTED
        if not connected:
            with self._lock:
                self.counters.degraded_calls += 1
                self.counters.put_dropped += len(items)
            return None
        budget = self._message_budget()
        sendable: list[int] = []
        for n, (_, key, value, _) in enumerate(items):
            if not self._valid_key(key) or len(value) + len(key) + _ITEM_OVERHEAD > budget:
                results[n] = pb.REJECTED
            else:
                sendable.append(n)
                self._value_bytes_estimate = max(self._value_bytes_estimate, len(value))
        total = sum(len(items[n][2]) for n in sendable)
        deadline = self._transfer_deadline(total)
        messages = list(self._put_messages(items, sendable, self._message_target(total)))
        answered = [False]

        def rpc(sid: str, timeout: float) -> None:
            encoded = (encode_put_request(sid, [self._put_fields(items[n]) for n in m]) for m in messages)
            for message, response in zip(
                messages, self._pipelined(self._put_raw, encoded, timeout), strict=True
            ):
                for n, result in zip(message, response.results, strict=False):
                    results[n] = result.status
                answered[0] = True

        with contextlib.suppress(_CallFailed):
            if messages:
                self._call(deadline, rpc)
        with self._lock:
            c = self.counters
            c.put_stored += results.count(pb.STORED)
            c.put_present += results.count(pb.ALREADY_PRESENT)
            c.put_conflict += results.count(pb.CONFLICT)
            c.put_rejected += results.count(pb.REJECTED)
            c.put_dropped += results.count(pb.PUT_STATUS_UNSPECIFIED)
        if not answered[0] and all(r == pb.PUT_STATUS_UNSPECIFIED for r in results):
            return None
        return [int(r) for r in results]

    def _message_target(self, total_bytes: int) -> int:
        """Bytes per message for a transfer of total_bytes: about a share of the batch per call in flight."""
        share = -(-total_bytes // _IN_FLIGHT)
        return max(1, min(self._message_budget(), _MAX_MESSAGE, max(_MIN_MESSAGE, share)))

    def _put_messages(
        self, items: Sequence[tuple[int, bytes, bytes, bytes]], sendable: list[int], target: int
    ) -> Iterator[list[int]]:
        """Item indices grouped into Put messages: <= max_batch_items items, ~target bytes (or one item)."""
        message: list[int] = []
        message_bytes = 0
        for n in sendable:
            _, key, value, base_key = items[n]
            size = len(key) + len(base_key) + len(value) + _ITEM_OVERHEAD
            if message and (message_bytes + size > target or len(message) == self._batch_size()):
                yield message
                message, message_bytes = [], 0
            message.append(n)
            message_bytes += size
        if message:
            yield message

    @staticmethod
    def _pipelined(
        call: grpc.UnaryUnaryMultiCallable, requests: Iterable[bytes], timeout: float
    ) -> Iterator[Any]:
        """Responses of call(request) in request order, with up to _IN_FLIGHT calls outstanding. The next
        request is built (encoded) while earlier ones are on the wire. A failure cancels the rest."""
        pending: collections.deque[grpc.Future] = collections.deque()
        deadline = time.monotonic() + timeout
        try:
            for request in requests:
                pending.append(call.future(request, timeout=max(0.0, deadline - time.monotonic())))
                if len(pending) >= _IN_FLIGHT:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()

    def _put_fields(self, item: tuple[int, bytes, bytes, bytes]) -> PutItemFields:
        """(group, key, value, base_key) as sent: an invalid base key is dropped, as in _block_ref."""
        group, key, value, base_key = item
        if base_key and not self._valid_key(base_key):
            base_key = b""
        return group, key, value, base_key

    def get(self, blocks: Sequence[tuple[int, bytes]], lease_id: str = "") -> list[Value | None]:
        """Values of (group, key) blocks; None for each block not served (miss, mismatch, degraded).

        A value is a read-only buffer (a view into the received message, see get_decoding): compare,
        len() and copy it like bytes; take bytes(value) to keep it beyond the caller's use.

        Get messages of ~_message_target bytes (by the largest value seen so far; the
        server's largest value before any is seen) go several in flight; a lease is
        released with the single message, or after all of them.
        """
        if blocks and self._shared_arena() is not None:
            copies: list[Value | None] = [None] * len(blocks)

            def copy(index: int, slot: memoryview) -> bool:
                copies[index] = bytes(slot)
                return True

            served = self.get_into(blocks, lease_id, copy)
            return [value if ok else None for value, ok in zip(copies, served, strict=True)]
        values: list[Value | None] = [None] * len(blocks)
        if not blocks:
            if lease_id:
                self.release(lease_id)
            return values
        estimate = self._value_bytes_estimate or max(1, self.limits.max_value_bytes)
        deadline = self._transfer_deadline(min(estimate, 1 << 20) * len(blocks))
        valid = [n for n, (_, key) in enumerate(blocks) if self._valid_key(key)]
        target = self._message_target(estimate * len(valid))
        per_message = max(1, min(self._batch_size(), target // (estimate + _ITEM_OVERHEAD)))
        chunks = [valid[i : i + per_message] for i in range(0, len(valid), per_message)]
        single_lease = lease_id if len(chunks) == 1 else ""

        def rpc(sid: str, timeout: float) -> None:
            requests = (
                pb.GetRequest(
                    session_id=sid,
                    blocks=[pb.BlockRef(key=blocks[n][1], group=blocks[n][0]) for n in chunk],
                    lease_id=single_lease,
                ).SerializeToString()
                for chunk in chunks
            )
            for chunk, reply in zip(chunks, self._pipelined(self._get_raw, requests, timeout), strict=True):
                for n, (status, value) in zip(chunk, decode_get_response(reply), strict=False):
                    if status == pb.HIT:
                        values[n] = value
                        if len(value) > self._value_bytes_estimate:
                            self._value_bytes_estimate = len(value)

        try:
            if chunks:
                self._call(deadline, rpc)
            if lease_id and not single_lease:
                self.release(lease_id)
        except _CallFailed:
            if lease_id:
                self.release(lease_id)
        with self._lock:
            self.counters.get_failed += sum(1 for v in values if v is None)
        return values

    # ---- zero-copy calls (the shared-memory path; inline otherwise) ----------------------

    def put_from(
        self, items: Sequence[SizedItem], fill: Callable[[int, memoryview], None]
    ) -> list[int] | None:
        """Store (group, key, length, base_key) items whose bytes `fill(index, destination)` writes
        (exactly `length` bytes into the memoryview): straight into arena slots on the shared-memory
        path, into a fresh buffer sent inline otherwise. Results as for put()."""
        reservation = self.reserve(items)
        if reservation is None:
            if self._shared_arena() is not None or not items:
                return None if items else []
            buffers: list[bytes] = []
            for index, (_, _, length, _) in enumerate(items):
                buffer = bytearray(length)
                fill(index, memoryview(buffer))
                buffers.append(bytes(buffer))
            return self.put([(g, k, buffers[n], b) for n, (g, k, _, b) in enumerate(items)])
        for index, slot in enumerate(reservation.slots):
            if slot is not None:
                fill(index, slot)
        return self.commit(reservation)

    def reserve(self, items: Sequence[SizedItem]) -> SharedPut | None:
        """Slots for a shared-memory put, or None when this session is not on the shared-memory path
        (or the store failed: the items are then counted as dropped)."""
        arena = self._shared_arena()
        if arena is None or not items:
            return None
        statuses: list[int] = [pb.PUT_STATUS_UNSPECIFIED] * len(items)
        slots: list[memoryview | None] = [None] * len(items)
        refs: list[pb.SharedMemoryRef | None] = [None] * len(items)
        sendable = [n for n, (_, key, _, _) in enumerate(items) if self._valid_key(key)]
        for n in range(len(items)):
            if not self._valid_key(items[n][1]):
                statuses[n] = pb.REJECTED
        deadline = _Deadline(self.rpc_timeout_s)
        size = self._batch_size()
        session_id = ""
        try:
            for start in range(0, len(sendable), size):
                chunk = sendable[start : start + size]
                request_items = [
                    pb.SlotRequest(
                        block=self._block_ref(items[n][0], items[n][1], items[n][3]), length=items[n][2]
                    )
                    for n in chunk
                ]

                def rpc(
                    sid: str, timeout: float, request_items: list[pb.SlotRequest] = request_items
                ) -> tuple[str, pb.ReserveSlotsResponse]:
                    request = pb.ReserveSlotsRequest(session_id=sid, items=request_items)
                    return sid, self._stub.ReserveSlots(request, timeout=timeout)

                session_id, response = self._call(deadline, rpc)
                for n, grant in zip(chunk, response.grants, strict=False):
                    if grant.HasField("slot"):
                        try:
                            slots[n] = arena.slot(grant.slot)
                        except ValueError:
                            statuses[n] = pb.REJECTED
                            continue
                        refs[n] = grant.slot
                    else:
                        statuses[n] = grant.status
        except _CallFailed:
            with self._lock:
                self.counters.put_dropped += len(items)
            return None
        return SharedPut(session_id, list(items), statuses, slots, refs)

    def commit(self, reservation: SharedPut) -> list[int] | None:
        """Make the written slots of a reservation visible; a PutStatus per item, or None when the
        store could not be reached (the slots are freed when the session ends)."""
        results = list(reservation.statuses)
        chunk_size = self._batch_size()
        pending = [n for n, ref in enumerate(reservation.refs) if ref is not None]
        deadline = _Deadline(self.rpc_timeout_s)
        sent_any = False
        try:
            for start in range(0, len(pending), chunk_size):
                chunk = pending[start : start + chunk_size]
                generations = [ref.generation for n in chunk if (ref := reservation.refs[n]) is not None]

                def rpc(sid: str, timeout: float, generations: list[int] = generations) -> list[int]:
                    request = pb.CommitSlotsRequest(session_id=sid, generations=generations)
                    response: pb.PutResponse = self._stub.CommitSlots(request, timeout=timeout)
                    return [r.status for r in response.results]

                for n, status in zip(chunk, self._call(deadline, rpc), strict=False):
                    results[n] = status
                sent_any = True
        except _CallFailed:
            pass
        with self._lock:
            c = self.counters
            c.put_stored += results.count(pb.STORED)
            c.put_present += results.count(pb.ALREADY_PRESENT)
            c.put_conflict += results.count(pb.CONFLICT)
            c.put_rejected += results.count(pb.REJECTED)
            c.put_dropped += results.count(pb.PUT_STATUS_UNSPECIFIED)
        if pending and not sent_any and all(r == pb.PUT_STATUS_UNSPECIFIED for r in results):
            return None
        return [int(r) for r in results]

    def get_into(
        self, blocks: Sequence[tuple[int, bytes]], lease_id: str, sink: Callable[[int, memoryview], bool]
    ) -> list[bool]:
        """Hand each served block's bytes to `sink(index, source)`, which copies them where they belong
        and returns False to reject them (e.g. the wrong size); True per block whose copy stands.
        On the shared-memory path `source` is the pinned arena slot, valid only during the call, and a
        copy from a slot reused meanwhile is voided (False); inline it is the received value."""
        arena = self._shared_arena()
        if arena is None:
            values = self.get(blocks, lease_id)
            return [value is not None and sink(n, memoryview(value)) for n, value in enumerate(values)]
        served = [False] * len(blocks)
        if not blocks:
            if lease_id:
                self.release(lease_id)
            return served
        valid = [n for n, (_, key) in enumerate(blocks) if self._valid_key(key)]
        size = self._batch_size()
        chunks = [valid[i : i + size] for i in range(0, len(valid), size)] or [[]]
        deadline = _Deadline(self.rpc_timeout_s)
        try:
            for c, chunk in enumerate(chunks):
                last = c == len(chunks) - 1
                refs = [self._block_ref(blocks[n][0], blocks[n][1]) for n in chunk]

                def rpc(
                    sid: str, timeout: float, refs: list[pb.BlockRef] = refs, last: bool = last
                ) -> pb.GetReferencesResponse:
                    request = pb.GetRequest(session_id=sid, blocks=refs, lease_id=lease_id if last else "")
                    response: pb.GetReferencesResponse = self._stub.GetReferences(request, timeout=timeout)
                    return response

                response = self._call(deadline, rpc)
                try:
                    for n, result in zip(chunk, response.results, strict=False):
                        if result.status != pb.HIT or not result.HasField("slot"):
                            continue
                        ref = result.slot
                        try:
                            source = arena.slot(ref)
                        except ValueError:
                            continue
                        if arena.current(ref) and sink(n, source) and arena.current(ref):
                            served[n] = True
                finally:
                    if response.lease.lease_id:
                        self._release_soon(response.lease.lease_id)
        except _CallFailed:
            if lease_id:
                self.release(lease_id)
        with self._lock:
            self.counters.get_failed += served.count(False)
        return served

    def _release_soon(self, lease_id: str) -> None:
        """Release a read lease without waiting for the answer (it only unpins; leases also expire)."""
        with self._lock:
            session_id = self.session_id
        future = self._stub.ReleaseLeases.future(
            pb.ReleaseLeasesRequest(session_id=session_id, lease_ids=[lease_id]), timeout=self.rpc_timeout_s
        )
        # A dropped grpc future cancels its call: keep it until done.
        with self._lock:
            self._releases.add(future)
        future.add_done_callback(self._released)

    def _released(self, future: grpc.Future) -> None:
        with self._lock:
            self._releases.discard(future)

    def release(self, lease_id: str) -> None:
        """Release a lookup lease early (best effort; leases also expire on their own)."""
        lease_ids = [lid for lid in lease_id.split(",") if lid]
        if not lease_ids:
            return
        with self._lock:
            if self.state is not StoreState.CONNECTED:
                return
            session_id = self.session_id
        try:
            self._stub.ReleaseLeases(
                pb.ReleaseLeasesRequest(session_id=session_id, lease_ids=lease_ids),
                timeout=self.rpc_timeout_s,
            )
        except grpc.RpcError as err:
            if not self._is_session_gone(err):  # a gone session has no leases left to release
                self._on_call_error(err)

    def close(self) -> None:
        """Stop the heartbeat thread, close the session (best effort) and the channel. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake.set()
        with self._lock:
            session_id = self.session_id if self.state is StoreState.CONNECTED else ""
        if session_id:
            with contextlib.suppress(grpc.RpcError):
                self._stub.CloseSession(
                    pb.CloseSessionRequest(session_id=session_id), timeout=min(self.rpc_timeout_s, 0.5)
                )
        self._thread.join(timeout=self.rpc_timeout_s + 1.0)
        self._channel.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
