"""The caller every store call goes through: the live session or a counted degraded call, one re-open
when the session expired, errors sorted into outages, busy answers and rejected requests, and the
server's limits that size each request."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag_proto.errors import parse_error

from kvtag_client.deadlines import Deadline
from kvtag_client.errors import AUTH_CODES, OUTAGE_CODES, CallFailed, is_session_gone, status_code
from kvtag_client.logs import log
from kvtag_client.session import Session

_T = TypeVar("_T")
# The read leases a lookup holds on its hits: one per Lookup message that leased any, () for none.
Leases = tuple[str, ...]

# Room left in each message for framing, session id and per-item overhead.
_MESSAGE_MARGIN = 64 << 10


class Caller:
    """Deadlines, the one retry after an expired session, and the limits, for the lookup and transfer
    paths."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def call(self, deadline: Deadline, rpc: Callable[[str, float], _T]) -> _T:
        """Run rpc(session_id, timeout); re-open transparently once if the session expired. Raises
        CallFailed (already counted and logged) when the call cannot be answered."""
        session = self.session
        session_id = session.id_for_call()
        if session_id is None:
            raise CallFailed("not connected")
        for attempt in (0, 1):
            try:
                timeout = deadline.remaining()
            except CallFailed:  # the batch's deadline ran out before this call: a failed call too
                with session.counting() as counters:
                    counters.degraded_calls += 1
                raise
            try:
                return rpc(session_id, timeout)
            except grpc.RpcError as err:
                if attempt == 0 and is_session_gone(err):
                    try:
                        session_id = session.open_session(deadline, stale_session=session_id)
                    except CallFailed:
                        with session.counting() as counters:
                            counters.degraded_calls += 1
                        raise
                    continue
                self.on_call_error(err)
                raise CallFailed(status_code(err).name) from err
        raise AssertionError("unreachable")

    def on_call_error(self, err: grpc.RpcError) -> None:
        code = status_code(err)
        with self.session.counting() as counters:
            counters.degraded_calls += 1
        detail = parse_error(err)
        if detail is not None and detail.reason == "SERVER_BUSY":
            # The store is up but at its admission limit: this call is a miss/drop, the session stays.
            log.debug("kvtag store %s busy: %s", self.session.endpoint, detail.message)
            return
        if code in OUTAGE_CODES or code in AUTH_CODES:
            self.session.mark_outage(code, err)
        else:
            # A request the store rejected as malformed: a client bug, not an outage.
            log.error("kvtag store %s rejected a request (%s): %s", self.session.endpoint, code.name, err)

    def count_put_results(self, results: Sequence[int]) -> None:
        """Count a put's final per-item statuses once (UNSPECIFIED: dropped), whichever path sent it."""
        with self.session.counting() as c:
            c.put_stored += results.count(pb.STORED)
            c.put_present += results.count(pb.ALREADY_PRESENT)
            c.put_conflict += results.count(pb.CONFLICT)
            c.put_rejected += results.count(pb.REJECTED)
            c.put_dropped += results.count(pb.PUT_STATUS_UNSPECIFIED)

    def transfer_deadline(self, nbytes: int) -> Deadline:
        """The deadline of a transfer of nbytes: rpc_timeout_s, stretched at min_transfer_bytes_per_s."""
        return Deadline(self.session.rpc_timeout_s + nbytes / self.session.min_transfer_bytes_per_s)

    def deadline(self) -> Deadline:
        return Deadline(self.session.rpc_timeout_s)

    def batch_size(self) -> int:
        return max(1, self.session.limits.max_batch_items)

    def message_budget(self) -> int:
        limit = self.session.limits.max_message_bytes
        return max(limit // 2, limit - _MESSAGE_MARGIN)

    def valid_key(self, key: bytes) -> bool:
        return 0 < len(key) <= self.session.limits.max_key_bytes

    def set_block(self, block: pb.BlockRef, group: int, key: bytes, base_key: bytes = b"") -> None:
        """Fill a request's own BlockRef in place: building one and copying it in costs twice as much
        (upb copies nested messages), and a batch has hundreds."""
        block.key = key
        if group:
            block.group = group
        base_key = self.base_key(base_key)
        if base_key:
            block.base_key = base_key

    def block_ref(self, group: int, key: bytes, base_key: bytes = b"") -> pb.BlockRef:
        block = pb.BlockRef()
        self.set_block(block, group, key, base_key)
        return block

    def base_key(self, base_key: bytes) -> bytes:
        """A base key as sent: an invalid one only feeds diagnostics, so it is dropped, not refused."""
        return base_key if base_key and self.valid_key(base_key) else b""

    def release(self, leases: Leases) -> None:
        """Release lookup leases early (best effort; leases also expire on their own)."""
        lease_ids = [lid for lid in leases if lid]
        if not lease_ids:
            return
        session_id = self.session.connected_id()
        if session_id is None:
            return
        try:
            self.session.stub.ReleaseLeases(
                pb.ReleaseLeasesRequest(session_id=session_id, lease_ids=lease_ids),
                timeout=self.session.rpc_timeout_s,
            )
        except grpc.RpcError as err:
            if not is_session_gone(err):  # a gone session has no leases left to release
                self.on_call_error(err)
