"""Diagnose and the status JSON a page at a time, however many namespaces the census holds.

The first page fixes the order (census.order: splits, refusals, activity) in a snapshot of
namespace ids; the page token names the snapshot and the position in it, so following the tokens
visits every namespace that still exists exactly once even while the census changes. Snapshots are
few and short-lived (SNAPSHOTS, SNAPSHOT_TTL_S), and hold ids only, packed into one string: their
memory is bounded by SNAPSHOTS x --max-namespaces ids, and it goes back to the system whole.
"""

from __future__ import annotations

import secrets
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvtag.v1 import store_pb2 as pb

from kvtag_store import errors
from kvtag_store.policy.census import Census
from kvtag_store.policy.census_state import NamespaceState

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
SNAPSHOTS = 8
SNAPSHOT_TTL_S = 300.0
# Bytes a repeated message field adds around each namespace report (tag and length).
_FRAMING = 8


class _PackedIds:
    """Namespace ids in one string and an array of their ends. A tuple of the census's own id
    strings would keep them alive after their namespaces are forgotten, for the snapshot's five
    minutes, and with them the interpreter's small-object arenas they sit in (20,000 namespaces and a
    page walk, in process: 101.4 MiB anonymous after the window with the tuple, 88.3 packed)."""

    __slots__ = ("_ends", "_text")

    def __init__(self, ids: Iterable[str]) -> None:
        parts: list[str] = []
        self._ends = array("Q")
        end = 0
        for ns_id in ids:
            parts.append(ns_id)
            end += len(ns_id)
            self._ends.append(end)
        self._text = "".join(parts)

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, index: int) -> str:
        return self._text[self._ends[index - 1] if index else 0 : self._ends[index]]


@dataclass(frozen=True)
class _Snapshot:
    query: tuple[str, str]  # (namespace_id, filter) it was made for
    namespace_ids: _PackedIds
    expires: float


class DiagnosePager:
    def __init__(
        self, census: Census, budget_bytes: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """`budget_bytes`: the most a page may encode to (the message limit less headroom)."""
        self._census = census
        self._budget = budget_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._snapshots: OrderedDict[str, _Snapshot] = OrderedDict()

    def page(
        self, request: pb.DiagnoseRequest, may_see: Callable[[str], bool] | None = None
    ) -> pb.DiagnoseResponse:
        """One page of the namespaces `may_see` allows (None: all). A namespace that became invisible
        or was forgotten since the first page is skipped."""
        query = (request.namespace_id, request.filter)
        if request.page_token:
            snapshot_id, snapshot, offset = self._resume(request.page_token, query)
        else:
            snapshot_id, snapshot, offset = self._start(query, may_see)
        size = min(request.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        response = pb.DiagnoseResponse(total_namespaces=len(snapshot.namespace_ids))
        used = response.ByteSize() + 64  # room for next_page_token
        ids = snapshot.namespace_ids
        while offset < len(ids) and len(response.namespaces) < size:
            report = next(self._census.reports([ids[offset]]), None)
            if report is not None and (may_see is None or may_see(report.namespace.tenant)):
                cost = report.ByteSize() + _FRAMING
                if used + cost > self._budget:
                    if response.namespaces:
                        break
                    report = _fit(report, self._budget - used)
                    cost = report.ByteSize() + _FRAMING
                response.namespaces.append(report)
                used += cost
            offset += 1
        if offset < len(ids):
            response.next_page_token = f"{snapshot_id}.{offset}"
        return response

    def tenants(self) -> dict[str, str]:
        """namespace_id -> tenant of every namespace in the census (for per-tenant sums)."""
        return self._census.tenants()

    def _start(
        self, query: tuple[str, str], may_see: Callable[[str], bool] | None
    ) -> tuple[str, _Snapshot, int]:
        namespace_id, text = query
        needle = text.lower()

        def wanted(ns_id: str, state: NamespaceState) -> bool:
            if namespace_id and ns_id != namespace_id:
                return False
            if may_see is not None and not may_see(state.tenant):
                return False
            return not needle or _matches(needle, ns_id, state)

        everything = not namespace_id and may_see is None and not needle
        ordered = self._census.order(None if everything else wanted)
        snapshot = _Snapshot(query, _PackedIds(ordered), self._clock() + SNAPSHOT_TTL_S)
        snapshot_id = secrets.token_hex(8)
        with self._lock:
            self._expire_locked()
            self._snapshots[snapshot_id] = snapshot
            while len(self._snapshots) > SNAPSHOTS:
                self._snapshots.popitem(last=False)
        return snapshot_id, snapshot, 0

    def _resume(self, token: str, query: tuple[str, str]) -> tuple[str, _Snapshot, int]:
        snapshot_id, _, position = token[:64].partition(".")
        with self._lock:
            self._expire_locked()
            snapshot = self._snapshots.get(snapshot_id)
        if snapshot is None or not position.isdigit():
            raise errors.invalid_request(
                "page_token is unknown or expired (tokens last a few minutes and a store keeps only the "
                f"{SNAPSHOTS} newest listings); ask again without page_token",
                "page_token",
            )
        if snapshot.query != query:
            raise errors.invalid_request(
                "page_token belongs to a Diagnose with another namespace_id or filter; repeat that "
                "query's namespace_id and filter, or start again without page_token",
                "page_token",
            )
        return snapshot_id, snapshot, int(position)

    def _expire_locked(self) -> None:
        now = self._clock()
        for snapshot_id in [k for k, s in self._snapshots.items() if s.expires <= now]:
            del self._snapshots[snapshot_id]


def _matches(needle: str, ns_id: str, state: NamespaceState) -> bool:
    d = state.descriptor
    return (
        needle in ns_id
        or needle in d.model_name.lower()
        or needle in d.tenant.lower()
        or any(needle in mode_id for mode_id in state.modes)
    )


def _fit(report: pb.NamespaceReport, budget: int) -> pb.NamespaceReport:
    """A single namespace larger than a page: drop, in turn, engines' labels, gone engines, and the
    refusal and probe logs until it fits (the counters and modes always stay)."""
    trimmed = pb.NamespaceReport()
    trimmed.CopyFrom(report)
    for step in range(4):
        if trimmed.ByteSize() + _FRAMING <= budget:
            break
        if step == 0:
            for m in trimmed.modes:
                for e in m.engines:
                    e.ClearField("labels")
        elif step == 1:
            for m in trimmed.modes:
                m.ClearField("engines")
        elif step == 2:
            trimmed.ClearField("refused")
        else:
            trimmed.ClearField("probe_disagreements")
    return trimmed
