"""BlockBackend over a Mooncake Store cluster: tagged, checksummed values that outlive the service.

Every value carries the header of `mooncake.format`, so any replica (or a
restarted one) can verify a value without this process's memory. Mooncake's
put keeps an existing value and still returns 0, so a put is followed by a
read of the stored header: only our own writer nonce proves a store happened.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtag_store.backends.arena import Arena
from kvtag_store.backends.base import (
    BackendStats,
    BackendUnavailable,
    BlockAddress,
    KeyStatus,
    Payload,
    PutOutcome,
    PutResult,
    ReadResult,
    SlotReference,
)
from kvtag_store.backends.mooncake.errors import ErrorCounters, MooncakeCode, describe
from kvtag_store.backends.mooncake.format import (
    HEADER_BYTES,
    FormatError,
    decode_header,
    encode_header,
    object_key,
    object_keys,
    payload_checksum,
    verify_payload,
)
from kvtag_store.backends.mooncake.mode_cache import ModeCache
from kvtag_store.backends.mooncake.staging import Staged, StagedAddress, Staging

_OK = MooncakeCode.OK
# Put codes after which the stored header, not the code, says what happened.
_PUT_ACCEPTED = (MooncakeCode.OK, MooncakeCode.OBJECT_ALREADY_EXISTS)
# Read-back codes of a value another writer is still putting (it is not readable yet).
_IN_FLIGHT = (MooncakeCode.OBJECT_NOT_FOUND, MooncakeCode.OBJECT_ALREADY_EXISTS)
_MISSING = MooncakeCode.OBJECT_NOT_FOUND
_RPC_FAIL = MooncakeCode.RPC_FAIL
# Header reads per get_into_ranges call; the registered arena holds this many headers.
_HEADER_SLOTS = 1024
# A put that returned 0 but whose header is not readable yet may be another writer's in-flight put.
_VERIFY_ATTEMPTS = 5
_VERIFY_BACKOFF_S = 0.02
_BREAKER_S = 1.0
# A Get that met a dead storage process starts no new read past this; a read that failed after
# at least _SLOW_FAILURE_S waited for Mooncake's transfer timeout (about 1 s) and is not retried.
_GET_DEADLINE_S = 1.0
_SLOW_FAILURE_S = 0.5
# How long a storage process that failed a transfer is skipped by reads (the master's default
# --client_ttl is 10 s); afterwards one read probes it again.
_SUSPECT_S = 5.0
_ALREADY_PRESENT = PutResult(PutOutcome.ALREADY_PRESENT)
_NO_RESERVATION = PutResult(
    PutOutcome.REJECTED,
    "no such reservation: the slot was not reserved by this session for this block, was already "
    "committed, or its session expired; reserve again (ReserveSlots)",
)
# Spare slots would hold staging memory between puts that the reads also need: this backend
# stages values only for the put that names them.
_NO_SPARES = PutResult(
    PutOutcome.REJECTED, "the Mooncake backend grants no spare slots: reserve them with ReserveSlots"
)
_STAGING_FULL = PutResult(
    PutOutcome.REJECTED,
    "the Mooncake backend's shared-memory staging arena is full (values being written or read by "
    "same-host clients); retry, or raise --mooncake-shm-staging",
)


class MooncakeClient(Protocol):
    """The part of mooncake.store.MooncakeDistributedStore kvtag uses (the wheel ships no stubs)."""

    def put_parts(self, key: str, *parts: Any) -> int: ...
    def put_batch(self, keys: list[str], values: list[Any]) -> int: ...
    def put(self, key: str, value: Any, config: Any = ...) -> int: ...
    def get(self, key: str) -> bytes: ...
    def get_batch(self, keys: list[str]) -> list[bytes]: ...
    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[Any]]: ...
    def batch_is_exist(self, keys: list[str]) -> list[int]: ...
    def batch_remove(self, keys: list[str], force: bool = ...) -> list[int]: ...
    def batch_put_from_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...
    def batch_get_into_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...
    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...
    def unregister_buffer(self, buffer_ptr: int) -> int: ...
    def get_into_ranges(
        self,
        buffer_ptrs: list[int],
        all_keys: list[list[str]],
        all_dst_offsets: list[list[list[int]]],
        all_src_offsets: list[list[list[int]]],
        all_sizes: list[list[list[int]]],
    ) -> list[list[list[int]]]: ...
    def close(self) -> int: ...


@dataclass(frozen=True, slots=True)
class MooncakeSettings:
    """Resolved connection settings (see mooncake.options for the flags that fill them)."""

    master: str
    metrics: str
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    device_names: str = ""
    local_buffer_bytes: int = 64 << 20
    segment_bytes: int = 0
    lease_ttl_ms: int = 10_000
    # Where same-host clients map the staging arenas (the service's --shm-dir); None: inline only.
    shm_dir: str | None = None
    shm_staging_bytes: int = 256 << 20
    # tenant -> gid of its staging arena file (--shm-group), mode 0660 instead of 0600.
    shm_groups: Mapping[str, int] = field(default_factory=dict)


def connect(settings: MooncakeSettings) -> MooncakeClient:
    """Open a Mooncake client (P2P handshake metadata, never HTTP metadata)."""
    from mooncake.store import MooncakeDistributedStore

    _probe_master(settings.master)
    client = MooncakeDistributedStore()
    rc = client.setup(
        settings.local_hostname,
        "P2PHANDSHAKE",
        settings.segment_bytes,
        settings.local_buffer_bytes,
        settings.protocol,
        settings.device_names,
        settings.master,
    )
    if rc != 0:
        raise BackendUnavailable(
            f"cannot join the Mooncake cluster at master {settings.master} (setup returned {rc}); "
            "check that mooncake_master runs there and that this host can reach it"
        )
    return client  # type: ignore[no-any-return]


def _probe_master(master: str, timeout_s: float = 3.0) -> None:
    """Fail in milliseconds when nothing listens at the master address: Mooncake's setup would
    retry for about a minute and a half before giving up."""
    host, _, port = master.rpartition(":")
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        raise BackendUnavailable(
            f"Mooncake master {master} unreachable ({exc}); "
            "start mooncake_master there or fix --mooncake-master"
        ) from exc


class _HeaderReader:
    """Reads only the headers of many objects into one registered arena (get_into_ranges)."""

    def __init__(self, client: MooncakeClient) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._arena = ctypes.create_string_buffer(HEADER_BYTES * _HEADER_SLOTS)
        self._ptr = ctypes.addressof(self._arena)
        rc = client.register_buffer(self._ptr, HEADER_BYTES * _HEADER_SLOTS)
        if rc != 0:
            raise BackendUnavailable(f"cannot register the header buffer with Mooncake: {describe(rc)}")

    def read(self, keys: Sequence[str]) -> list[bytes | int]:
        """Per key: the header bytes, or a negative Mooncake code (-704 missing, -600 too short...)."""
        out: list[bytes | int] = []
        for start in range(0, len(keys), _HEADER_SLOTS):
            chunk = list(keys[start : start + _HEADER_SLOTS])
            n = len(chunk)
            with self._lock:
                codes = self._client.get_into_ranges(
                    [self._ptr],
                    [chunk],
                    [[[i * HEADER_BYTES] for i in range(n)]],
                    [[[0]] * n],
                    [[[HEADER_BYTES]] * n],
                )[0]
                raw = ctypes.string_at(self._ptr, n * HEADER_BYTES)
            for i, per_range in enumerate(codes):
                code = per_range[0]
                out.append(raw[i * HEADER_BYTES : (i + 1) * HEADER_BYTES] if code >= 0 else code)
        return out

    def close(self) -> None:
        self._client.unregister_buffer(self._ptr)


class _LeaseKeeper:
    """Holds Mooncake read leases on pinned objects by re-reading their existence every ttl/3.

    Mooncake grants a lease (default 10 s, the master's --default_kv_lease_ttl)
    on every read or existence check and refuses to evict or remove a leased
    object; kvtag's leases are longer, so pinned keys are renewed until unpinned.
    """

    def __init__(self, client: MooncakeClient, lease_ttl_ms: int) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._pins: Counter[str] = Counter()
        self._stop = threading.Event()
        self._period_s = max(lease_ttl_ms / 3000, 0.05)
        self._thread = threading.Thread(target=self._run, name="kvtag-mooncake-leases", daemon=True)
        self._thread.start()

    def pin(self, keys: Sequence[str]) -> None:
        with self._lock:
            self._pins.update(keys)

    def unpin(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                if self._pins[key] <= 1:
                    self._pins.pop(key, None)
                else:
                    self._pins[key] -= 1

    def count(self) -> int:
        with self._lock:
            return len(self._pins)

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            with self._lock:
                keys = list(self._pins)
            for start in range(0, len(keys), 4096):
                # A failure (master down) is retried next period; the lease may lapse meanwhile,
                # which costs a miss, never wrong bytes.
                self._client.batch_is_exist(keys[start : start + 4096])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class MooncakeBackend:
    """A BlockBackend whose blocks live in a Mooncake Store cluster shared by kvtag replicas."""

    name = "mooncake"

    def __init__(self, client: MooncakeClient, settings: MooncakeSettings) -> None:
        self._client = client
        self._settings = settings
        self._headers = _HeaderReader(client)
        self._tags = ModeCache()
        self._leases = _LeaseKeeper(client, settings.lease_ttl_ms)
        self._suspects = _SuspectProcesses()
        self._closers: list[Callable[[], None]] = []
        self._capacity_seen: tuple[float, int | None] = (float("-inf"), None)
        self.errors = ErrorCounters()
        self._corrupted = 0
        self._count_lock = threading.Lock()
        # When the master last failed. With the master down, Mooncake's client spends about 4 s
        # retrying each call; for a short window after a failure kvtag answers UNAVAILABLE at once
        # instead of queueing more callers behind those retries.
        self._master_failed_at = -_BREAKER_S
        self._staging = (
            Staging(client, settings.shm_dir, settings.shm_staging_bytes, settings.shm_groups)
            if settings.shm_dir
            else None
        )
        self._reservations: dict[int, tuple[str, BlockAddress, Staged]] = {}  # generation -> reserved
        self._reserved_lock = threading.Lock()

    @property
    def max_value_bytes(self) -> int:
        # put_parts and get_batch stage values in the local buffer; leave room for concurrent calls.
        return self._settings.local_buffer_bytes // 4 - HEADER_BYTES

    def _check_master(self, what: str) -> None:
        if time.monotonic() - self._master_failed_at < _BREAKER_S:
            raise BackendUnavailable(
                f"Mooncake master {self._settings.master} failed moments ago; not {what} for up to "
                f"{_BREAKER_S:.0f} s, retry with backoff"
            )

    def _unavailable(self, what: str, code: int) -> BackendUnavailable:
        self._master_failed_at = time.monotonic()
        return BackendUnavailable(
            f"Mooncake master {self._settings.master} unreachable while {what} ({describe(code)}); "
            "retry with backoff, kvtag resumes when the master is back"
        )

    def _exists(self, mkeys: list[str], what: str) -> list[int]:
        """batch_is_exist's code per key (1 present); UNAVAILABLE when the master did not answer."""
        exists = self._client.batch_is_exist(mkeys)
        if _RPC_FAIL in exists or -1 in exists:
            self.errors.add(_RPC_FAIL)
            raise self._unavailable(what, _RPC_FAIL)
        return exists

    def _drop_corrupt(self, keys: Sequence[str]) -> None:
        """Remove values that fail verification so a correct put can take their place."""
        with self._count_lock:
            self._corrupted += len(keys)
        self._tags.forget(keys)
        self._client.batch_remove(list(keys), True)

    # -- writes -------------------------------------------------------------

    def put(self, namespace_id: str, mode_id: str, address: BlockAddress, value: Payload) -> PutResult:
        if len(value) > self.max_value_bytes:
            return PutResult(
                PutOutcome.REJECTED,
                f"value of {len(value)} bytes exceeds the Mooncake backend limit of {self.max_value_bytes} "
                "bytes (a quarter of --mooncake-local-buffer); raise the local buffer",
            )
        self._check_master("storing")
        group, key = address
        mkey = object_key(namespace_id, group, key)
        nonce = os.urandom(8)
        try:
            header = encode_header(namespace_id, mode_id, group, key, value, nonce)
        except ValueError as exc:
            return PutResult(PutOutcome.REJECTED, str(exc))
        for _attempt in range(2):
            rc = self._client.put_parts(mkey, header, value)
            if rc == MooncakeCode.BUFFER_OVERFLOW:
                # The local buffer is busy with concurrent transfers: one short retry.
                time.sleep(_VERIFY_BACKOFF_S)
                rc = self._client.put_parts(mkey, header, value)
            if rc == _RPC_FAIL:
                self.errors.add(rc)
                raise self._unavailable("storing a block", rc)
            if rc not in _PUT_ACCEPTED:
                self.errors.add(rc)
                return PutResult(PutOutcome.REJECTED, self._put_failure(rc))
            result = self._verify_put(namespace_id, mode_id, address, mkey, nonce)
            if result is not None:
                return result
        return PutResult(PutOutcome.REJECTED, "the key held a corrupt value; it was dropped, retry the put")

    def _judge(
        self,
        found: bytes,
        namespace_id: str,
        mode_id: str,
        address: BlockAddress,
        mkey: str,
        nonce: bytes,
        seen: dict[str, str],
    ) -> PutResult | None:
        """The outcome a stored header proves, its tag noted in `seen`; None if it was corrupt (and is
        now dropped)."""
        try:
            stored = decode_header(found, namespace_id, *address)
        except FormatError:
            self._drop_corrupt([mkey])
            return None
        seen[mkey] = stored.mode_id
        if stored.nonce == nonce:
            return PutResult(PutOutcome.STORED)
        if stored.mode_id != mode_id:
            return PutResult(PutOutcome.CONFLICT, f"key is held by mode {stored.mode_id}")
        return PutResult(PutOutcome.ALREADY_PRESENT)

    def _verify_put(
        self, namespace_id: str, mode_id: str, address: BlockAddress, mkey: str, nonce: bytes
    ) -> PutResult | None:
        """What the put really did, from the stored header; None if a corrupt value was dropped."""
        for attempt in range(_VERIFY_ATTEMPTS):
            found = self._headers.read([mkey])[0]
            if isinstance(found, bytes):
                seen: dict[str, str] = {}
                result = self._judge(found, namespace_id, mode_id, address, mkey, nonce, seen)
                self._tags.learn(list(seen), list(seen.values()))
                return result
            if found == _RPC_FAIL:
                self.errors.add(found)
                raise self._unavailable("confirming a store", found)
            if found not in _IN_FLIGHT:
                self.errors.add(found)
                return PutResult(
                    PutOutcome.REJECTED, f"the store could not be confirmed: {describe(found)} on read-back"
                )
            # Missing right after a successful put: another writer's put is still in flight.
            time.sleep(_VERIFY_BACKOFF_S * (attempt + 1))
        self.errors.add(_MISSING)
        return PutResult(
            PutOutcome.REJECTED,
            "Mooncake accepted the put but the value was not readable afterwards "
            "(a concurrent writer or an immediate eviction); not counted as stored",
        )

    def put_many(
        self, namespace_id: str, mode_id: str, items: Sequence[tuple[BlockAddress, Payload]]
    ) -> list[PutResult]:
        """`put` for a batch: one Mooncake put_batch and one header read-back per chunk instead of a
        round trip pair per item. Per-item truth still comes from each item's stored header."""
        self._check_master("storing")
        results: list[PutResult | None] = [None] * len(items)
        budget = self._settings.local_buffer_bytes // 4
        chunk: list[int] = []
        chunk_keys: set[str] = set()
        chunk_bytes = 0
        single: list[int] = []
        for index, (address, value) in enumerate(items):
            mkey = object_key(namespace_id, *address)
            if len(value) > self.max_value_bytes or mkey in chunk_keys:
                single.append(index)  # refused by put with its reason / a duplicate judged after
                continue
            if chunk and chunk_bytes + len(value) + HEADER_BYTES > budget:
                self._put_chunk(namespace_id, mode_id, items, chunk, results, single)
                chunk, chunk_keys, chunk_bytes = [], set(), 0
            chunk.append(index)
            chunk_keys.add(mkey)
            chunk_bytes += len(value) + HEADER_BYTES
        if chunk:
            self._put_chunk(namespace_id, mode_id, items, chunk, results, single)
        for index in single:
            results[index] = self.put(namespace_id, mode_id, *items[index])
        missing = PutResult(PutOutcome.REJECTED, "internal: no outcome")
        return [r if r is not None else missing for r in results]

    def _put_chunk(
        self,
        namespace_id: str,
        mode_id: str,
        items: Sequence[tuple[BlockAddress, Payload]],
        chunk: list[int],
        results: list[PutResult | None],
        single: list[int],
    ) -> None:
        mkeys: list[str] = []
        nonces: list[bytes] = []
        blobs: list[bytes] = []
        for index in chunk:
            (group, key), value = items[index]
            nonce = os.urandom(8)
            try:
                header = encode_header(namespace_id, mode_id, group, key, value, nonce)
            except ValueError as exc:
                results[index] = PutResult(PutOutcome.REJECTED, str(exc))
                continue
            mkeys.append(object_key(namespace_id, group, key))
            nonces.append(nonce)
            blobs.append(header + value)
        chunk = [i for i in chunk if results[i] is None]
        if not chunk:
            return
        rc = self._client.put_batch(mkeys, blobs)
        if rc == _RPC_FAIL:
            self.errors.add(rc)
            raise self._unavailable("storing blocks", rc)
        if rc not in _PUT_ACCEPTED:
            self.errors.add(rc)
        addresses = [items[index][0] for index in chunk]
        judged = self._judge_stored(namespace_id, mode_id, addresses, mkeys, nonces, [rc] * len(chunk))
        for index, result in zip(chunk, judged, strict=True):
            results[index] = result
            if result is None:
                single.append(index)

    def _judge_stored(
        self,
        namespace_id: str,
        mode_id: str,
        addresses: Sequence[BlockAddress],
        mkeys: list[str],
        nonces: list[bytes],
        codes: Sequence[int],
    ) -> list[PutResult | None]:
        """Each batch-put item's outcome from its stored header (one read-back for all), None where only
        the single path can tell: a corrupt value was dropped, or another writer's put is in flight."""
        out: list[PutResult | None] = []
        seen: dict[str, str] = {}
        for address, mkey, nonce, rc, found in zip(
            addresses, mkeys, nonces, codes, self._headers.read(mkeys), strict=True
        ):
            if isinstance(found, bytes):
                out.append(self._judge(found, namespace_id, mode_id, address, mkey, nonce, seen))
            elif found in _IN_FLIGHT and rc in _PUT_ACCEPTED:
                out.append(None)
            elif found == _RPC_FAIL:
                self.errors.add(found)
                raise self._unavailable("confirming a store", found)
            else:
                out.append(
                    PutResult(
                        PutOutcome.REJECTED, self._put_failure(rc if rc not in _PUT_ACCEPTED else found)
                    )
                )
        self._tags.learn(list(seen), list(seen.values()))
        return out

    def _put_failure(self, code: int) -> str:
        if code == MooncakeCode.NO_AVAILABLE_HANDLE:
            if self._mounted_bytes() == 0:
                return (
                    "no Mooncake storage segment is mounted (NO_AVAILABLE_HANDLE -200, cluster capacity "
                    "0 bytes); start a storage node (mooncake_client --global_segment_size=...) or give "
                    "a kvtag replica --mooncake-segment-size"
                )
            return (
                "Mooncake cluster full (NO_AVAILABLE_HANDLE -200): eviction has not freed room yet or "
                "everything is leased; retry later or add storage segments"
            )
        if code == MooncakeCode.TRANSFER_FAIL:
            return "transfer to the Mooncake storage process failed (TRANSFER_FAIL -800); not stored"
        if code == MooncakeCode.BUFFER_OVERFLOW:
            return "the Mooncake local buffer is busy (-600); retry or raise --mooncake-local-buffer"
        return f"Mooncake refused the put: {describe(code)}"

    def _mounted_bytes(self) -> int | None:
        """The cluster's mounted capacity from the master's metrics (None if they cannot be read),
        read at most once a second: a batch of refused puts asks once."""
        at, capacity = self._capacity_seen
        if time.monotonic() - at > 1.0:
            try:
                metrics = read_master_metrics(self._settings.metrics)
                capacity = int(metrics.get("master_total_capacity_bytes", -1))
            except BackendUnavailable:
                capacity = None
            self._capacity_seen = (time.monotonic(), capacity)
        return capacity

    # -- reads --------------------------------------------------------------

    def lookup(self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]) -> list[KeyStatus]:
        """The master says which blocks exist (one call, which also takes Mooncake's read lease); their
        tags come from the mode cache, and only blocks this service has not seen have their headers
        read (~0.1 ms each). See mode_cache for what a stale tag can and cannot do."""
        if not addresses:
            return []
        self._check_master("looking up")
        mkeys = object_keys(namespace_id, addresses)
        exists = self._exists(mkeys, "looking blocks up")
        statuses = [KeyStatus.MISS] * len(mkeys)
        present = [i for i, code in enumerate(exists) if code == 1]
        if len(present) < len(mkeys):
            self._tags.forget([mkeys[i] for i, code in enumerate(exists) if code != 1])
        unseen: list[int] = []
        for i, tag in zip(present, self._tags.modes([mkeys[i] for i in present]), strict=True):
            if tag is None:
                unseen.append(i)
            else:
                statuses[i] = KeyStatus.HIT if tag == mode_id else KeyStatus.MODE_MISMATCH
        if unseen:
            read = self._read_tags(
                namespace_id, mode_id, [addresses[i] for i in unseen], [mkeys[i] for i in unseen]
            )
            for i, status in zip(unseen, read, strict=True):
                statuses[i] = status
        return statuses

    def _read_tags(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress], mkeys: list[str]
    ) -> list[KeyStatus]:
        """Statuses from the stored headers, their tags learnt; damaged ones dropped (MISS)."""
        found = self._headers.read(mkeys)
        statuses: list[KeyStatus] = []
        corrupt: list[str] = []
        seen: dict[str, str] = {}
        for (group, key), mkey, raw in zip(addresses, mkeys, found, strict=True):
            if isinstance(raw, int):
                if raw == _RPC_FAIL:
                    self.errors.add(raw)
                    raise self._unavailable("looking blocks up", raw)
                if raw != _MISSING:
                    self.errors.add(raw)
                if raw == MooncakeCode.BUFFER_OVERFLOW:
                    corrupt.append(mkey)  # shorter than a header: not a kvtag value
                statuses.append(KeyStatus.MISS)
                continue
            try:
                header = decode_header(raw, namespace_id, group, key)
            except FormatError:
                corrupt.append(mkey)
                statuses.append(KeyStatus.MISS)
                continue
            seen[mkey] = header.mode_id
            statuses.append(KeyStatus.HIT if header.mode_id == mode_id else KeyStatus.MODE_MISMATCH)
        self._tags.learn(list(seen), list(seen.values()))
        if corrupt:
            self._drop_corrupt(corrupt)
        return statuses

    def get(self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]) -> list[ReadResult]:
        if not addresses:
            return []
        self._check_master("reading")
        mkeys = object_keys(namespace_id, addresses)
        values = self._fetch(mkeys)
        results: list[ReadResult] = []
        corrupt: list[str] = []
        seen: dict[str, str] = {}
        for (group, key), mkey, value in zip(addresses, mkeys, values, strict=True):
            if not value:
                results.append(ReadResult(KeyStatus.MISS))
                continue
            try:
                header = decode_header(value, namespace_id, group, key)
                seen[mkey] = header.mode_id
                if header.mode_id != mode_id:
                    results.append(ReadResult(KeyStatus.MODE_MISMATCH))
                    continue
                payload = verify_payload(header, value)
            except FormatError:
                corrupt.append(mkey)
                results.append(ReadResult(KeyStatus.MISS))
                continue
            results.append(ReadResult(KeyStatus.HIT, bytes(payload)))
        self._tags.learn(list(seen), list(seen.values()))
        if corrupt:
            self._drop_corrupt(corrupt)
        return results

    def _fetch(self, mkeys: list[str]) -> list[bytes]:
        """Whole values of the keys that exist (b"" for the rest), within one deadline per Get.

        get_batch returns b"" alike for a missing key, an unreachable storage
        process and a failed master (after seconds of retries), so an existence
        check comes first: it fails fast when the master is down, spares the
        transfer for misses, and a key that exists but reads empty is a transfer
        failure. The replica list then gives each value's size and storage
        process: reads go in chunks that fit the local buffer, and values held
        only by a process that failed a transfer moments ago are not read.
        A dead process makes a call fail at once (connection refused) or wait
        out Mooncake's ~1 s transfer timeout, whatever the number of keys, so
        one Get costs at most about one timeout: a slow failure is never
        retried, and once one happened no new chunk starts past
        _GET_DEADLINE_S. A fast failure (perhaps the buffer busy with
        concurrent calls) is retried once; whatever still fails marks its
        storage process suspect.
        """
        exists = self._exists(mkeys, "reading blocks")
        values = [b""] * len(mkeys)
        present = [i for i, code in enumerate(exists) if code == 1]
        if not present:
            return values
        placements = self._client.batch_get_replica_desc([mkeys[i] for i in present])
        suspects = self._suspects.current()
        readable: list[tuple[int, int, frozenset[str]]] = []
        failed = 0
        for i in present:
            size, where = _placement(placements.get(mkeys[i], ()))
            if where and where <= suspects:
                failed += 1  # on a storage process that just failed: a miss without the wait
            elif size:
                readable.append((i, size, where))
        started = time.monotonic()
        for chunk in _chunks(readable, self._settings.local_buffer_bytes // 4):
            if failed and time.monotonic() - started > _GET_DEADLINE_S:
                failed += len(chunk)
                continue
            missing, slow = self._read_chunk(mkeys, chunk, values)
            if missing and not slow:
                missing, _ = self._read_chunk(mkeys, missing, values)
            if missing:
                self._suspects.mark(frozenset().union(*(where for _, _, where in missing)))
            failed += len(missing)
        if failed:
            # Listed by the master, unreadable from its storage process (killed or cut off).
            self.errors.add(MooncakeCode.TRANSFER_FAIL, failed)
        return values

    def _read_chunk(
        self, mkeys: list[str], chunk: list[tuple[int, int, frozenset[str]]], values: list[bytes]
    ) -> tuple[list[tuple[int, int, frozenset[str]]], bool]:
        """Read one chunk into values: the entries that came back empty, and whether that took a
        transfer timeout (a dead process) rather than failing at once (a busy buffer)."""
        started = time.monotonic()
        got = self._client.get_batch([mkeys[entry[0]] for entry in chunk])
        missing = []
        for entry, value in zip(chunk, got, strict=True):
            if value:
                values[entry[0]] = value
            else:
                missing.append(entry)
        return missing, time.monotonic() - started >= _SLOW_FAILURE_S

    # -- shared memory (same-host clients; see mooncake.staging) -------------

    def assign_tenant(self, namespace_id: str, tenant: str) -> None:
        """The namespace's tenant, whose staging arena its shared-memory values pass through."""
        if self._staging is not None:
            self._staging.assign_tenant(namespace_id, tenant)

    def shared_arena(self, namespace_id: str) -> Arena | None:
        """The staging arena a same-host client of the namespace maps, or None (inline path only)."""
        return self._staging.arena(namespace_id) if self._staging is not None else None

    def reserve(
        self, namespace_id: str, mode_id: str, items: Sequence[tuple[BlockAddress, int]]
    ) -> list[SlotReference | PutResult]:
        """Shared-memory Put, step 1: a staging slot per item, or the outcome already known. A block
        already stored answers ALREADY_PRESENT or CONFLICT now (one existence check for the batch),
        so the client does not copy it for nothing."""
        if self._staging is None:
            return [PutResult(PutOutcome.REJECTED, "no shared-memory staging (--shm-dir)")] * len(items)
        self._check_master("storing")
        out: list[SlotReference | PutResult | None] = [None] * len(items)
        mkeys = [object_key(namespace_id, *address) for address, _ in items]
        exists = self._exists(mkeys, "checking blocks before a put")
        stored = [i for i, code in enumerate(exists) if code == 1]
        for i, found in zip(stored, self._headers.read([mkeys[i] for i in stored]), strict=True):
            if not isinstance(found, bytes):
                continue  # gone meanwhile, or unreadable: the put will tell
            try:
                header = decode_header(found, namespace_id, *items[i][0])
            except FormatError:
                self._drop_corrupt([mkeys[i]])
                continue
            out[i] = (
                _ALREADY_PRESENT
                if header.mode_id == mode_id
                else PutResult(PutOutcome.CONFLICT, f"key is held by mode {header.mode_id}")
            )
        for i, (_, length) in enumerate(items):
            if out[i] is None and length > self.max_value_bytes:
                out[i] = PutResult(
                    PutOutcome.REJECTED,
                    f"value of {length} bytes exceeds the Mooncake backend limit of {self.max_value_bytes} "
                    "bytes (a quarter of --mooncake-local-buffer); raise the local buffer",
                )
        todo = [i for i in range(len(items)) if out[i] is None]
        granted = self._staging.allocate(namespace_id, [items[i][1] for i in todo])
        with self._reserved_lock:
            for i, staged in zip(todo, granted, strict=True):
                if staged is None:
                    out[i] = _STAGING_FULL
                    continue
                self._reservations[staged.generation] = (namespace_id, items[i][0], staged)
                out[i] = SlotReference(
                    staged.arena.segment, staged.payload_offset, staged.length, staged.generation
                )
        return [r if r is not None else _STAGING_FULL for r in out]

    def reserve_spare(self, namespace_id: str, lengths: Sequence[int]) -> list[SlotReference | PutResult]:
        """None granted (_NO_SPARES): the client keeps reserving with ReserveSlots."""
        return [_NO_SPARES] * len(lengths)

    def commit(
        self,
        namespace_id: str,
        mode_id: str,
        generations: Sequence[int],
        digests: Sequence[int] | None = None,
        addresses: Sequence[BlockAddress] | None = None,
    ) -> tuple[list[PutResult], int]:
        """Shared-memory Put, step 2: each written slot is checksummed, given its header in place and put
        into the cluster straight from the arena (one batch_put_from_multi_buffers), then judged by
        its stored header like any put. The slots are free again afterwards, whatever happened.
        Client `digests` are not used: the stored header carries this backend's own CRC. Keys sent
        with `addresses` are for spare slots, which this backend never grants: such a commit frees the
        slots it names and stores nothing."""
        if addresses is not None:
            self.cancel(generations)
            return [_NO_SPARES] * len(generations), 0
        taken: list[tuple[str, BlockAddress, Staged] | None] = []
        with self._reserved_lock:
            for generation in generations:
                reservation = self._reservations.get(generation)
                if reservation is None or reservation[0] != namespace_id:
                    taken.append(None)
                    continue
                del self._reservations[generation]
                taken.append(reservation)
        live = [r for r in taken if r is not None]
        try:
            outcomes = iter(self._put_staged(namespace_id, mode_id, live) if live else [])
        finally:
            if self._staging is not None:
                self._staging.free([staged for _, _, staged in live])
        results = [next(outcomes) if r is not None else _NO_RESERVATION for r in taken]
        stored = sum(
            r[2].length
            for r, result in zip(taken, results, strict=True)
            if r is not None and result.outcome is PutOutcome.STORED
        )
        return results, stored

    def _put_staged(
        self, namespace_id: str, mode_id: str, entries: list[tuple[str, BlockAddress, Staged]]
    ) -> list[PutResult]:
        self._check_master("storing")
        results: list[PutResult | None] = [None] * len(entries)
        sent: list[int] = []
        mkeys: list[str] = []
        nonces: list[bytes] = []
        pointers: list[list[int]] = []
        sizes: list[list[int]] = []
        for n, (_, (group, key), staged) in enumerate(entries):
            nonce = os.urandom(8)
            try:
                header = encode_header(namespace_id, mode_id, group, key, staged.payload(), nonce)
            except ValueError as exc:
                results[n] = PutResult(PutOutcome.REJECTED, str(exc))
                continue
            staged.header()[:] = header
            ptrs, lengths = staged.buffers()
            sent.append(n)
            mkeys.append(object_key(namespace_id, group, key))
            nonces.append(nonce)
            pointers.append(ptrs)
            sizes.append(lengths)
        if sent:
            codes = self._client.batch_put_from_multi_buffers(mkeys, pointers, sizes)
            if _RPC_FAIL in codes:
                self.errors.add(_RPC_FAIL)
                raise self._unavailable("storing blocks", _RPC_FAIL)
            for code in codes:
                if code not in _PUT_ACCEPTED:
                    self.errors.add(code)
            addresses = [entries[n][1] for n in sent]
            judged = self._judge_stored(namespace_id, mode_id, addresses, mkeys, nonces, codes)
            for n, result in zip(sent, judged, strict=True):
                # None: only the single path can tell (it waits for an in-flight writer), from a copy.
                results[n] = result or self.put(
                    namespace_id, mode_id, entries[n][1], bytes(entries[n][2].payload())
                )
        missing = PutResult(PutOutcome.REJECTED, "internal: no outcome")
        return [r if r is not None else missing for r in results]

    def cancel(self, generations: Iterable[int]) -> None:
        """Free reserved slots that were never committed (their session ended)."""
        with self._reserved_lock:
            dropped = [r for g in generations if (r := self._reservations.pop(g, None)) is not None]
        if dropped and self._staging is not None:
            self._staging.free([staged for _, _, staged in dropped])

    def _reserved_bytes(self) -> int:
        with self._reserved_lock:
            return sum(staged.length for _, _, staged in self._reservations.values())

    def get_references(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress], verify: bool = True
    ) -> tuple[list[KeyStatus], list[SlotReference | None], list[BlockAddress]]:
        """Shared-memory Get: each value read from the cluster straight into a staging slot (one
        batch_get_into_multi_buffers), verified there (tag, address, length, CRC) and referenced,
        whatever `verify` says: the header is checked as the value arrives, so references carry no
        digest for the reader. The pinned addresses carry their slots (StagedAddress): releasing the
        lease frees them. A value the staging arena has no room for is answered MISS; the engine
        recomputes it."""
        statuses = [KeyStatus.MISS] * len(addresses)
        references: list[SlotReference | None] = [None] * len(addresses)
        pinned: list[BlockAddress] = []
        if not addresses or self._staging is None:
            return statuses, references, pinned
        self._check_master("reading")
        mkeys = object_keys(namespace_id, addresses)
        exists = self._exists(mkeys, "reading blocks")
        present = [i for i, code in enumerate(exists) if code == 1]
        if not present:
            return statuses, references, pinned
        placements = self._client.batch_get_replica_desc([mkeys[i] for i in present])
        suspects = self._suspects.current()
        wanted: list[tuple[int, int, frozenset[str]]] = []
        corrupt: list[str] = []
        skipped = 0
        for i in present:
            size, where = _placement(placements.get(mkeys[i], ()))
            if where and where <= suspects:
                skipped += 1  # on a storage process that just failed: a miss without the wait
            elif size >= HEADER_BYTES:
                wanted.append((i, size - HEADER_BYTES, where))
            elif size:
                corrupt.append(mkeys[i])  # shorter than a header: not a kvtag value
        if skipped:
            self.errors.add(MooncakeCode.TRANSFER_FAIL, skipped)
        granted = self._staging.allocate(namespace_id, [length for _, length, _ in wanted])
        reading = [
            (i, where, staged) for (i, _, where), staged in zip(wanted, granted, strict=True) if staged
        ]
        kept: list[Staged] = []
        seen: dict[str, str] = {}
        try:
            for i, staged in self._read_staged(mkeys, reading):
                group, key = addresses[i]
                try:
                    header = decode_header(staged.header(), namespace_id, group, key)
                    seen[mkeys[i]] = header.mode_id
                    if header.mode_id != mode_id:
                        statuses[i] = KeyStatus.MODE_MISMATCH
                        continue
                    if header.payload_bytes != staged.length or (
                        payload_checksum(staged.payload()) != header.payload_crc
                    ):
                        raise FormatError("payload length or checksum mismatch")
                except FormatError:
                    corrupt.append(mkeys[i])
                    continue
                statuses[i] = KeyStatus.HIT
                references[i] = SlotReference(
                    staged.arena.segment, staged.payload_offset, staged.length, staged.generation
                )
                pinned.append(StagedAddress(addresses[i], staged))
                kept.append(staged)
        finally:
            held = {staged.generation for staged in kept}
            self._staging.free([staged for _, _, staged in reading if staged.generation not in held])
        self._tags.learn(list(seen), list(seen.values()))
        if corrupt:
            self._drop_corrupt(corrupt)
        return statuses, references, pinned

    def _read_staged(
        self, mkeys: list[str], entries: list[tuple[int, frozenset[str], Staged]]
    ) -> list[tuple[int, Staged]]:
        """Read whole values into their slots: (index, slot) of those that arrived. Like _fetch, a read
        that failed slowly (a dead storage process: one transfer timeout for the whole call) is not
        retried and marks its process suspect; one that failed at once is retried once."""
        arrived: list[tuple[int, Staged]] = []
        todo = entries
        for attempt in range(2):
            if not todo:
                break
            started = time.monotonic()
            buffers = [staged.buffers() for _, _, staged in todo]
            codes = self._client.batch_get_into_multi_buffers(
                [mkeys[i] for i, _, _ in todo], [b[0] for b in buffers], [b[1] for b in buffers]
            )
            slow = time.monotonic() - started >= _SLOW_FAILURE_S
            if _RPC_FAIL in codes:
                self.errors.add(_RPC_FAIL)
                raise self._unavailable("reading blocks", _RPC_FAIL)
            failed = []
            for entry, code in zip(todo, codes, strict=True):
                if code == HEADER_BYTES + entry[2].length:
                    arrived.append((entry[0], entry[2]))
                elif code != _MISSING:  # evicted since the existence check: a plain miss
                    failed.append(entry)
            todo = failed
            if slow or attempt == 1:
                break
        if todo:
            self._suspects.mark(frozenset().union(*(where for _, where, _ in todo)))
            self.errors.add(MooncakeCode.TRANSFER_FAIL, len(todo))
        return arrived

    # -- leases -------------------------------------------------------------

    def pin(self, namespace_id: str, addresses: Sequence[BlockAddress]) -> None:
        # The lookup that found these blocks already took Mooncake leases; the keeper renews them.
        self._leases.pin(object_keys(namespace_id, addresses))

    def unpin(self, namespace_id: str, addresses: Sequence[BlockAddress]) -> None:
        if addresses and isinstance(addresses[0], StagedAddress):
            # A shared-memory Get's lease: its slots (the blocks were never pinned in Mooncake).
            if self._staging is not None:
                self._staging.free([a.staged for a in addresses if isinstance(a, StagedAddress)])
            return
        self._leases.unpin(object_keys(namespace_id, addresses))

    # -- reporting ----------------------------------------------------------

    def stats(self) -> BackendStats:
        """Cluster-wide figures from the master's metrics (they include other tenants' objects
        and kvtag's census records); leases and dropped values are this replica's."""
        metrics = read_master_metrics(self._settings.metrics)
        with self._count_lock:
            corrupted = self._corrupted
        return BackendStats(
            backend=self.name,
            capacity_bytes=int(metrics.get("master_total_capacity_bytes", 0)),
            used_bytes=int(metrics.get("master_allocated_bytes", 0)),
            keys=int(metrics.get("master_key_count", 0)),
            evictions=int(metrics.get("master_evicted_key_count", 0)),
            leased_keys=self._leases.count(),
            corrupted_dropped=corrupted,
            errors=self.errors.snapshot(),
            reserved_bytes=self._reserved_bytes(),
        )

    def close_first(self, close: Callable[[], None]) -> None:
        """Run close before this backend closes the client (for the census keeper sharing it)."""
        self._closers.append(close)

    def close(self) -> None:
        for close in self._closers:
            close()
        self._leases.close()
        self._headers.close()
        if self._staging is not None:
            self._staging.close()
        self._client.close()


class _SuspectProcesses:
    """Storage processes (transport endpoints) whose transfers just failed, remembered for a while:
    until the master's client TTL drops a dead one it still lists its objects, and reading each of
    them would wait out the transfer timeout again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: dict[str, float] = {}

    def mark(self, endpoints: frozenset[str]) -> None:
        now = time.monotonic()
        with self._lock:
            for endpoint in endpoints:
                self._since[endpoint] = now

    def current(self) -> frozenset[str]:
        now = time.monotonic()
        with self._lock:
            for endpoint, since in list(self._since.items()):
                if now - since > _SUSPECT_S:
                    del self._since[endpoint]
            return frozenset(self._since)


def _placement(replicas: Any) -> tuple[int, frozenset[str]]:
    """(value size, storage endpoints) from Mooncake's replica descriptors; (0, {}) if none."""
    size = 0
    endpoints = set()
    for replica in replicas:
        if replica.is_memory_replica():
            buffer = replica.get_memory_descriptor().buffer_descriptor
            size = max(size, int(buffer.size))
            endpoints.add(str(buffer.transport_endpoint))
        else:
            size = max(size, int(replica.get_disk_descriptor().object_size))
    return size, frozenset(endpoints)


def _chunks(
    entries: list[tuple[int, int, frozenset[str]]], budget: int
) -> list[list[tuple[int, int, frozenset[str]]]]:
    """Consecutive runs of (index, size, endpoints) whose sizes fit the budget together (a larger
    value goes alone: Mooncake's put refused it already unless the buffer grew since)."""
    chunks: list[list[tuple[int, int, frozenset[str]]]] = []
    used = budget
    for entry in entries:
        if used + entry[1] > budget:
            chunks.append([])
            used = 0
        chunks[-1].append(entry)
        used += entry[1]
    return chunks


def read_master_metrics(address: str, timeout_s: float = 2.0) -> dict[str, float]:
    """Unlabelled samples of the master's Prometheus text endpoint (http://ADDRESS/metrics)."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as response:
            text = response.read().decode()
    except OSError as exc:
        raise BackendUnavailable(
            f"Mooncake master metrics at {address} unreachable ({exc}); check --mooncake-metrics"
        ) from exc
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or "{" in line:
            continue
        name, _, number = line.partition(" ")
        try:
            samples[name] = float(number)
        except ValueError:
            continue
    return samples
