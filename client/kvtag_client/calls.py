"""The plumbing every store call goes through: the live session or a counted degraded call, one
re-open when the session expired, errors sorted into outages, busy answers and rejected requests,
and the server's limits that size each request."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag_proto.errors import parse_error

from kvtag_client.session import (
    _AUTH_CODES,
    _OUTAGE_CODES,
    Session,
    StoreState,
    _CallFailed,
    _Deadline,
    log,
)

_T = TypeVar("_T")
# The read leases a lookup holds on its hits: one per Lookup message that leased any, () for none.
Leases = tuple[str, ...]

# Room left in each message for framing, session id and per-item overhead.
_MESSAGE_MARGIN = 64 << 10


class Calls(Session):
    """Session plus the call plumbing the lookup and transfer calls share."""

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
                timeout = deadline.remaining()
            except _CallFailed:  # the batch's deadline ran out before this call: a failed call too
                with self._lock:
                    self.counters.degraded_calls += 1
                raise
            try:
                return rpc(session_id, timeout)
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

    def _count_put_results(self, results: Sequence[int]) -> None:
        """Count a put's final per-item statuses once (UNSPECIFIED: dropped), whichever path sent it."""
        with self._lock:
            c = self.counters
            c.put_stored += results.count(pb.STORED)
            c.put_present += results.count(pb.ALREADY_PRESENT)
            c.put_conflict += results.count(pb.CONFLICT)
            c.put_rejected += results.count(pb.REJECTED)
            c.put_dropped += results.count(pb.PUT_STATUS_UNSPECIFIED)

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
        block = pb.BlockRef()
        self._set_block(block, group, key, base_key)
        return block

    def _set_block(self, block: pb.BlockRef, group: int, key: bytes, base_key: bytes = b"") -> None:
        """Fill a request's own BlockRef in place: building one and copying it in costs twice as much
        (upb copies nested messages), and a batch has hundreds."""
        block.key = key
        if group:
            block.group = group
        base_key = self._base_key(base_key)
        if base_key:
            block.base_key = base_key

    def _base_key(self, base_key: bytes) -> bytes:
        """A base key as sent: an invalid one only feeds diagnostics, so it is dropped, not refused."""
        return base_key if base_key and self._valid_key(base_key) else b""

    def release(self, leases: Leases) -> None:
        """Release lookup leases early (best effort; leases also expire on their own)."""
        lease_ids = [lid for lid in leases if lid]
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
