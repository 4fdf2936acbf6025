"""The inline data path: values in Put and Get messages, batched within the server's limits and
pipelined a few calls deep."""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import grpc
from kvtag.v1 import store_pb2 as pb

from kvtag_client.calls import Caller, Leases
from kvtag_client.errors import CallFailed
from kvtag_client.inline.get_decoding import Value, decode_get_response
from kvtag_client.inline.put_encoding import PutItemFields, encode_put_request

# Bytes a Put message spends on an item beside its key, base key and value (tags, lengths).
ITEM_OVERHEAD = 32
# Puts and gets travel as unary messages of about a quarter of the batch (between these bounds),
# up to IN_FLIGHT at a time, so the client's encoding or decoding of one overlaps the server's work
# on another. Messages stay well under the server limit: a fresh multi-MiB buffer costs page faults
# on both sides, and 4 MiB is also gRPC's default receive limit (docs/benchmarks.md, "Figures behind
# choices in the code").
MIN_MESSAGE = 256 << 10
MAX_MESSAGE = (1 << 20) + (64 << 10)
IN_FLIGHT = 4


class InlinePath:
    """StoreClient's puts and gets when values travel in gRPC messages."""

    def __init__(self, caller: Caller, block_bytes_hint: int) -> None:
        self.caller = caller
        self.session = caller.session
        # The largest value seen so far (or the hint): it sizes Get messages and their deadline.
        self._value_bytes_estimate = block_bytes_hint

    def put(self, items: Sequence[PutItemFields], token_ids: Sequence[bytes] = ()) -> list[int] | None:
        """put() in gRPC messages (see StoreClient.put)."""
        results: list[int] = [pb.PUT_STATUS_UNSPECIFIED] * len(items)
        if self.session.connected_id() is None:
            with self.session.counting() as counters:
                counters.degraded_calls += 1
                counters.put_dropped += len(items)
            return None
        caller = self.caller
        budget = caller.message_budget()
        valid_key = caller.valid_key
        sendable: list[int] = []
        for n, (_, key, value, _) in enumerate(items):
            if not valid_key(key) or len(value) + len(key) + ITEM_OVERHEAD > budget:
                results[n] = pb.REJECTED
            else:
                sendable.append(n)
                self._value_bytes_estimate = max(self._value_bytes_estimate, len(value))
        total = sum(len(items[n][2]) for n in sendable)
        deadline = caller.transfer_deadline(total)
        messages = list(self.put_messages(items, sendable, self.message_target(total)))
        answered = [False]

        def rpc(sid: str, timeout: float) -> None:
            encoded = (
                encode_put_request(
                    sid,
                    [self._put_fields(items[n]) for n in m],
                    [token_ids[n] for n in m] if token_ids else (),
                )
                for m in messages
            )
            for message, response in zip(
                messages, _pipelined(self.session.put_raw, encoded, timeout), strict=True
            ):
                for n, result in zip(message, response.results, strict=False):
                    results[n] = result.status
                answered[0] = True

        with contextlib.suppress(CallFailed):
            if messages:
                caller.call(deadline, rpc)
        caller.count_put_results(results)
        if not answered[0] and all(r == pb.PUT_STATUS_UNSPECIFIED for r in results):
            return None
        return [int(r) for r in results]

    def message_target(self, total_bytes: int) -> int:
        """Bytes per message for a transfer of total_bytes: about a share of the batch per call in flight."""
        share = -(-total_bytes // IN_FLIGHT)
        return max(1, min(self.caller.message_budget(), MAX_MESSAGE, max(MIN_MESSAGE, share)))

    def put_messages(
        self, items: Sequence[PutItemFields], sendable: list[int], target: int
    ) -> Iterator[list[int]]:
        """Item indices grouped into Put messages: <= max_batch_items items, ~target bytes (or one item)."""
        message: list[int] = []
        message_bytes = 0
        batch_size = self.caller.batch_size()
        for n in sendable:
            _, key, value, base_key = items[n]
            size = len(key) + len(base_key) + len(value) + ITEM_OVERHEAD
            if message and (message_bytes + size > target or len(message) == batch_size):
                yield message
                message, message_bytes = [], 0
            message.append(n)
            message_bytes += size
        if message:
            yield message

    def _put_fields(self, item: PutItemFields) -> PutItemFields:
        """(group, key, value, base_key) as sent: an invalid base key is dropped, as in Caller.block_ref."""
        group, key, value, base_key = item
        if base_key and not self.caller.valid_key(base_key):
            base_key = b""
        return group, key, value, base_key

    def get(self, blocks: Sequence[tuple[int, bytes]], leases: Leases) -> list[Value | None]:
        """get() in gRPC messages (see StoreClient.get)."""
        values: list[Value | None] = [None] * len(blocks)
        caller = self.caller
        if not blocks:
            if leases:
                caller.release(leases)
            return values
        estimate = self._value_bytes_estimate or max(1, self.session.limits.max_value_bytes)
        deadline = caller.transfer_deadline(min(estimate, 1 << 20) * len(blocks))
        valid = [n for n, (_, key) in enumerate(blocks) if caller.valid_key(key)]
        target = self.message_target(estimate * len(valid))
        per_message = max(1, min(caller.batch_size(), target // (estimate + ITEM_OVERHEAD)))
        chunks = [valid[i : i + per_message] for i in range(0, len(valid), per_message)]
        single_lease = leases[0] if len(chunks) == 1 and len(leases) == 1 else ""

        def rpc(sid: str, timeout: float) -> None:
            requests = (
                pb.GetRequest(
                    session_id=sid,
                    blocks=[pb.BlockRef(key=blocks[n][1], group=blocks[n][0]) for n in chunk],
                    lease_id=single_lease,
                ).SerializeToString()
                for chunk in chunks
            )
            for chunk, reply in zip(chunks, _pipelined(self.session.get_raw, requests, timeout), strict=True):
                for n, (status, value) in zip(chunk, decode_get_response(reply), strict=False):
                    if status == pb.HIT:
                        values[n] = value
                        if len(value) > self._value_bytes_estimate:
                            self._value_bytes_estimate = len(value)

        try:
            if chunks:
                caller.call(deadline, rpc)
            if leases and not single_lease:
                caller.release(leases)
        except CallFailed:
            if leases:
                caller.release(leases)
        with self.session.counting() as counters:
            counters.get_failed += sum(1 for v in values if v is None)
        return values


def _pipelined(
    call: grpc.UnaryUnaryMultiCallable, requests: Iterable[bytes], timeout: float
) -> Iterator[Any]:
    """Responses of call(request) in request order, with up to IN_FLIGHT calls outstanding. The next
    request is built (encoded) while earlier ones are on the wire. A failure cancels the rest."""
    pending: collections.deque[grpc.Future] = collections.deque()
    deadline = time.monotonic() + timeout
    try:
        for request in requests:
            pending.append(call.future(request, timeout=max(0.0, deadline - time.monotonic())))
            if len(pending) >= IN_FLIGHT:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
