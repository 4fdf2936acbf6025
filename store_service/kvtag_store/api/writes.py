"""The inline write path: Put and PutStream carry the values in the request."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

from kvtag.v1 import store_pb2 as pb

from kvtag_store import errors
from kvtag_store.api import intake, replies, validation
from kvtag_store.api.codec import PutBatch, PutItemView
from kvtag_store.api.counting import Counting
from kvtag_store.api.outcomes import NO_PAYLOAD, SETTLED, SHM_IN_PUT, SHM_REFUSED, ValueLimit
from kvtag_store.api.tokens import TokenSink
from kvtag_store.backends.base import BlockAddress, BlockBackend, BlockKey, Payload, PutOutcome, PutResult
from kvtag_store.config import ServiceLimits
from kvtag_store.policy.base_keys import BaseKeyIndex
from kvtag_store.policy.sessions import Session, SessionTable

# (session_id, rpc) -> the caller's live session, or the ApiError saying why not.
FindSession = Callable[[str, str], Session]
# (intake, raw bytes) -> the parsed request, held against admission while the block runs.
Admit = Callable[[intake.Intake, bytes], AbstractContextManager[Any]]


class Writes:
    def __init__(
        self,
        backend: BlockBackend,
        sessions: SessionTable,
        counting: Counting,
        base_index: BaseKeyIndex,
        value_limit: ValueLimit,
        limits: ServiceLimits,
        token_sink: TokenSink | None = None,
    ) -> None:
        self.backend = backend
        self.token_sink = token_sink or TokenSink()
        self.sessions = sessions
        self.counting = counting
        self.base_index = base_index
        self.value_limit = value_limit
        self.limits = limits

    def put(self, session: Session, batch: PutBatch) -> pb.PutResponse:
        self._check_keys(batch.items)
        response = pb.PutResponse()
        response.results.extend(replies.put_results(self._put_items(session, batch.items)))
        return response

    def put_stream(self, messages: Iterator[bytes], find: FindSession, admit: Admit) -> pb.PutResponse:
        """Messages are handled in order, each admitted on its own. When one fails, the error carries
        the results of the items of the earlier messages (they were handled), as a PutResponse."""
        session: Session | None = None
        results: list[PutResult] = []
        for data in messages:
            try:
                with admit(intake.PUT, data) as batch:
                    current = self._stream_session(session, batch, find)
                    self._check_keys(batch.items)
                    results.extend(self._put_items(current, batch.items))
                session = current  # the error of a later message carries these results
            except errors.ApiError as exc:
                if session is not None:
                    exc.details["put_results"] = pb.PutResponse(results=replies.put_results(results))
                raise
        if session is None:
            raise errors.invalid_request(
                "PutStream carried no message; send at least one PutRequest", "session_id"
            )
        response = pb.PutResponse()
        response.results.extend(replies.put_results(results))
        return response

    def _stream_session(self, session: Session | None, batch: PutBatch, find: FindSession) -> Session:
        """The stream's session: named by the first message; later ones omit it or repeat it."""
        if session is None:
            return find(batch.session_id, "PutStream")
        if batch.session_id and batch.session_id != session.session_id:
            raise errors.invalid_request(
                "a PutStream carries one session; later messages must omit session_id or repeat it",
                "session_id",
            )
        self.sessions.touch(session.session_id)
        return session

    def _check_keys(self, items: list[PutItemView]) -> None:
        validation.batch_size("items", len(items), self.limits)
        for index, item in enumerate(items):
            validation.key(item.key, f"items[{index}].block.key", self.limits)
            if item.token_ids:
                validation.token_ids(item.token_ids, f"items[{index}].block.token_ids")

    def _put_items(self, session: Session, items: Sequence[PutItemView]) -> list[PutResult]:
        """All value items go to the backend in one put_many call (a batch backend amortises its round
        trips); items without an inline value are refused in place."""
        ns_id, mode_id = session.namespace_id, session.mode_id
        max_value_bytes = self.value_limit.max_value_bytes
        outcomes: list[PutResult | None] = [None] * len(items)
        batch: list[tuple[BlockAddress, Payload]] = []
        batch_index: list[int] = []
        for index, item in enumerate(items):
            payload = item.payload
            if payload == "value" and len(item.value) > max_value_bytes:
                outcomes[index] = self.value_limit.too_large(len(item.value))
            elif payload == "value":
                batch.append(((item.group, BlockKey(item.key)), item.value))
                batch_index.append(index)
            elif payload == "shared_memory":
                outcomes[index] = SHM_IN_PUT if session.shared_memory else SHM_REFUSED
            else:
                outcomes[index] = NO_PAYLOAD
        if batch:
            if self.token_sink.wanted:  # before the put: its BlockStored is published from another thread
                self.token_sink.keep(
                    ns_id, [(items[i].group, items[i].key, items[i].token_ids) for i in batch_index]
                )
            stored = self.backend.put_many(ns_id, mode_id, batch)
            if len(stored) != len(batch):
                raise RuntimeError(f"backend put_many returned {len(stored)} results for {len(batch)} items")
            for index, result in zip(batch_index, stored, strict=True):
                outcomes[index] = result
        results: list[PutResult] = []
        counts: Counter[PutOutcome] = Counter()
        base_keys: list[tuple[int, bytes]] = []
        stored_bytes = 0
        for item, maybe in zip(items, outcomes, strict=True):
            result = maybe if maybe is not None else NO_PAYLOAD
            outcome = result.outcome
            counts[outcome] += 1
            if outcome is PutOutcome.STORED:
                stored_bytes += len(item.value)
            if item.base_key and outcome in SETTLED:
                base_keys.append((item.group, item.base_key))
            results.append(result)
        if base_keys:
            self.base_index.record(ns_id, mode_id, base_keys)
        self.counting.puts(session, counts, stored_bytes)
        return results
