"""The census: which engines hash how in each namespace, the policy decisions at OpenSession,
and the counters Diagnose reports.

First-writer-wins facts (a strict namespace's mode, a mode's reference probe)
go through the backend's CensusStore so replicas over one cluster agree; the
rest (engines, counters, refusals) is this replica's view.

The census is bounded: a namespace is admitted only under the namespace caps, it is forgotten once
it has had no live session, stored block or lease for the retention window (sweep), a namespace
keeps at most MAX_IDLE_MODES modes without live engines, and its records of the past (gone
engines, refusals) sit in bounded logs (records.py).
"""

from __future__ import annotations

import logging
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvtag.v1 import store_pb2 as pb
from kvtag_proto import ids

from kvtag_store import errors
from kvtag_store.backends.base import BackendUnavailable, CensusStore, ModeHoldings, ProbeRecord
from kvtag_store.config import Caps
from kvtag_store.policy import caps, mode_diff, split_warnings
from kvtag_store.policy.census_state import (
    DEFAULT_RETENTION_MS,
    MAX_IDLE_MODES,
    ModeState,
    NamespaceState,
    gone_record,
    namespace_report,
)
from kvtag_store.policy.records import RecordShelf
from kvtag_store.policy.sessions import Session, now_ms

log = logging.getLogger("kvtag_store.policy.census")


@runtime_checkable
class ForgettingCensusStore(Protocol):
    """A CensusStore that can drop a namespace's first-writer records (one replica's own store: a
    store shared by replicas must not, since another replica may still use them)."""

    def forget_namespace(self, namespace_id: str) -> None: ...


@dataclass(frozen=True)
class Admitted:
    namespace_id: str
    mode_id: str
    policy: int
    warnings: list[pb.CensusWarning]


class Census:
    def __init__(
        self,
        store: CensusStore,
        policy_for: dict[str, int],
        default_policy: int,
        limits: Caps | None = None,
        retention_ms: int = DEFAULT_RETENTION_MS,
        holdings: ModeHoldings | None = None,
    ) -> None:
        """`holdings`: the backend, when it says which modes hold blocks in a namespace (MODE_SPLIT
        then names them whoever stored them); else the modes this census saw store are taken."""
        self._store = store
        self._holdings = holdings
        self._policy_for = policy_for
        self._default_policy = default_policy
        self._caps = limits or Caps()
        self.retention_ms = retention_ms
        self._lock = threading.Lock()
        # Kept in order of last activity, oldest first (_touch moves a namespace to the end), so the
        # Diagnose order needs no sort of every namespace.
        self._namespaces: dict[str, NamespaceState] = {}
        # Namespaces with a split (NamespaceState.split) and with refusals or probe disagreements.
        self._split: set[str] = set()
        self._troubled: set[str] = set()
        self._per_tenant: Counter[str] = Counter()
        self._shelf = RecordShelf()
        self.refusals_total: Counter[str] = Counter()
        self.namespaces_forgotten = 0
        self._next_sweep = 0.0

    # -- OpenSession --------------------------------------------------------

    def admit(self, request: pb.OpenSessionRequest) -> Admitted:
        """Apply the namespace policy and the probe check; raise ApiError on refusal."""
        ns_id = ids.namespace_id(request.namespace)
        mode_id = ids.mode_id(request.mode)
        ns_text = mode_diff.describe_namespace(ns_id, request.namespace)
        with self._lock:
            state = self._namespaces.get(ns_id)
            if state is None:
                capped = self._cap_reached(request.namespace.tenant)
                if capped is not None:
                    self.refusals_total[capped.reason] += 1
                    raise capped
                state = self._namespaces[ns_id] = NamespaceState(
                    namespace_id=ns_id,
                    descriptor=pb.NamespaceDescriptor(),
                    policy=self._policy_for.get(ns_id, self._default_policy),
                )
                state.descriptor.CopyFrom(request.namespace)
                self._per_tenant[state.tenant] += 1
            self._touch(ns_id, state)
        warnings: list[pb.CensusWarning] = []
        if state.policy == pb.POLICY_STRICT:
            established = self._store.establish_mode(ns_id, ids.mode_encoding(request.mode))
            established_mode = mode_diff.decode_mode(established)
            established_id = ids.mode_id(established_mode)
            with self._lock:
                state.established_mode_id = established_id
                state.modes.setdefault(established_id, ModeState(mode=established_mode))
            if established_id != mode_id:
                diffs = mode_diff.mode_diff(established_mode, request.mode)
                refusal = pb.ModeRefusal(
                    namespace_id=ns_id,
                    established_mode_id=established_id,
                    requested_mode_id=mode_id,
                    diffs=diffs,
                )
                message = mode_diff.refusal_message(request.engine_id, ns_text, established_id, diffs)
                self._record_refusal(state, request.engine_id, message, refusal)
                raise errors.mode_refused(message, refusal)
        else:
            warnings.extend(self._split_warnings(state, mode_id, request, ns_text))
        probe = ProbeRecord(engine_id=request.engine_id, probe_keys=tuple(request.probe_keys))
        reference = self._store.reference_probe(ns_id, mode_id, probe)
        if reference.probe_keys != probe.probe_keys:
            warning = self._probe_disagreement(state, ns_id, ns_text, mode_id, request, reference)
            if state.policy == pb.POLICY_STRICT:
                raise warning
            warnings.append(warning.warning)
        warnings.extend(self._described_and_siblings(ns_id, mode_id, request))
        return Admitted(ns_id, mode_id, state.policy, warnings)

    def _described_and_siblings(
        self, ns_id: str, mode_id: str, request: pb.OpenSessionRequest
    ) -> list[pb.CensusWarning]:
        """Describe the admitted namespace and mode (CensusStore.describe), and LAYOUT_SPLIT for the
        model's sibling layouts holding blocks. Best effort: a backend that cannot answer now costs
        the warnings, never the session."""
        key = split_warnings.model_key(request.namespace)
        try:
            self._store.describe(
                ns_id, key, request.namespace.SerializeToString(), mode_id, ids.mode_encoding(request.mode)
            )
            siblings = self._store.namespaces_of(key)
            return list(
                split_warnings.layout_splits(
                    request.engine_id, ns_id, request.namespace, siblings, self._holds_blocks
                )
            )
        except BackendUnavailable as exc:
            log.warning("namespace %s: sibling layouts not checked at OpenSession (%s)", ns_id, exc)
            return []

    def _holds_blocks(self, ns_id: str) -> bool:
        """Whether the namespace holds blocks, by the backend where it can say, else by the census; and
        by a companion engine's report either way (its blocks are in no backend of this store)."""
        if self._holdings is not None and self._holdings.modes_holding(ns_id):
            return True
        with self._lock:
            state = self._namespaces.get(ns_id)
            if state is None:
                return False
            if self._holdings is None:
                return state.holds_blocks()
            return state.holds_blocks_elsewhere()

    def _held_modes(self, ns_id: str) -> frozenset[str] | None:
        """The modes whose blocks the namespace holds, by the backend; None when it cannot say now."""
        if self._holdings is None:
            return None
        try:
            return self._holdings.modes_holding(ns_id)
        except BackendUnavailable as exc:
            log.warning("namespace %s: modes holding blocks not read at OpenSession (%s)", ns_id, exc)
            return None

    def short_of_room(self, request: pb.OpenSessionRequest) -> bool:
        """True if admitting `request` would open a namespace past a cap (checked again by admit)."""
        with self._lock:
            known = ids.namespace_id(request.namespace) in self._namespaces
            return not known and self._cap_reached(request.namespace.tenant) is not None

    def _cap_reached(self, tenant: str) -> errors.ApiError | None:
        """NAMESPACE_CAP_REACHED if one more namespace would pass a cap. Caller holds the lock."""
        if len(self._namespaces) >= self._caps.max_namespaces:
            return caps.namespace_cap("--max-namespaces", self._caps.max_namespaces, None)
        if self._per_tenant[tenant] >= self._caps.max_namespaces_per_tenant:
            return caps.namespace_cap(
                "--max-namespaces-per-tenant", self._caps.max_namespaces_per_tenant, tenant
            )
        return None

    def _split_warnings(
        self, state: NamespaceState, mode_id: str, request: pb.OpenSessionRequest, ns_text: str
    ) -> Iterator[pb.CensusWarning]:
        """MODE_SPLIT for each other mode with live engines, or whose blocks the namespace holds:
        whoever stored them, through any replica, however long ago, as the backend says (ModeHoldings);
        where it cannot, the modes this census saw store while the namespace holds blocks."""
        held = self._held_modes(state.namespace_id)
        with self._lock:
            holds = state.holds_blocks()
            others: dict[str, tuple[pb.HashingMode | None, bool]] = {
                other_id: (other.mode, bool(other.live))
                for other_id, other in state.modes.items()
                if other_id != mode_id
                and (
                    other.live
                    or other.stored_elsewhere
                    or (other_id in held if held is not None else holds and other.stored)
                )
            }
        unknown = sorted((held or frozenset()) - others.keys() - {mode_id})
        described = self._store.described_modes(state.namespace_id, unknown) if unknown else {}
        for other_id in unknown:
            others[other_id] = (_decoded(described.get(other_id)), False)
        for other_id, (other_mode, live) in sorted(others.items()):
            yield split_warnings.mode_split(
                request.engine_id, ns_text, mode_id, request.mode, other_id, other_mode, live
            )

    def _record_refusal(
        self, state: NamespaceState, engine_id: str, message: str, refusal: pb.ModeRefusal | None
    ) -> None:
        record = pb.RefusedSession(engine_id=engine_id, reason=message, at_unix_ms=now_ms())
        if refusal is not None:
            record.refusal.CopyFrom(refusal)
        with self._lock:
            self._shelf.add(state.refused, record, record.ByteSize())
            if self._namespaces.get(state.namespace_id) is state:
                self._troubled.add(state.namespace_id)
            self.refusals_total["MODE_REFUSED" if refusal is not None else "PROBE_DISAGREEMENT"] += 1

    def _probe_disagreement(
        self,
        state: NamespaceState,
        ns_id: str,
        ns_text: str,
        mode_id: str,
        request: pb.OpenSessionRequest,
        reference: ProbeRecord,
    ) -> _ProbeDrift:
        message, record = mode_diff.probe_disagreement(
            request,
            ns_text,
            mode_id,
            reference.engine_id,
            self._labels_of(state, reference.engine_id),
            strict=state.policy == pb.POLICY_STRICT,
        )
        with self._lock:
            self._shelf.add(state.disagreements, record, record.ByteSize())
            if self._namespaces.get(ns_id) is state:
                self._troubled.add(ns_id)
        if state.policy == pb.POLICY_STRICT:
            self._record_refusal(state, request.engine_id, message, None)
        return _ProbeDrift(message, record)

    def _labels_of(self, state: NamespaceState, engine_id: str) -> dict[str, str]:
        with self._lock:
            for mode_state in state.modes.values():
                for session in mode_state.live.values():
                    if session.engine_id == engine_id:
                        return dict(session.labels)
                for record in mode_state.recent:
                    if record.engine_id == engine_id:
                        return dict(record.labels)
        return {}

    def joined(self, session: Session, mode: pb.HashingMode) -> None:
        with self._lock:
            state = self._namespaces.get(session.namespace_id)
            if state is None:  # forgotten since admit: only with a retention shorter than the call
                return
            mode_state = state.modes.get(session.mode_id)
            if mode_state is None:
                mode_state = state.modes[session.mode_id] = ModeState(mode=pb.HashingMode())
                mode_state.mode.CopyFrom(mode)
            mode_state.live[session.session_id] = session
            mode_state.last_active_ms = self._touch(session.namespace_id, state)
            if state.split():
                self._split.add(session.namespace_id)

    def left(self, session: Session) -> None:
        with self._lock:
            state = self._namespaces.get(session.namespace_id)
            mode_state = state.modes.get(session.mode_id) if state else None
            if mode_state is not None and mode_state.live.pop(session.session_id, None) is not None:
                assert state is not None
                gone = gone_record(session)
                self._shelf.add(mode_state.recent, gone, gone.ByteSize())
                mode_state.last_active_ms = self._touch(session.namespace_id, state)
                if not state.split():
                    self._split.discard(session.namespace_id)

    # -- forgetting ---------------------------------------------------------

    def sweep_due(self, now: float) -> bool:
        """True at most every quarter retention window (between 0.1 s and 30 s): a sweep reads the
        backend's per-namespace figures, which is not free."""
        if now < self._next_sweep:
            return False
        self._next_sweep = now + min(30.0, max(0.1, self.retention_ms / 4000.0))
        return True

    def sweep(
        self, held: Mapping[str, int] | None, at_ms: int | None = None, idle_for_ms: int | None = None
    ) -> list[str]:
        """Forget namespaces with no live session, no stored block and no lease whose last activity
        is older than the retention window, or `idle_for_ms` (0 under a namespace cap: such a
        namespace holds nothing, and keeping it would refuse a new tenant); those named by
        --namespace-policy are kept. Prune idle modes of the others. `held`: namespace_id -> stored
        blocks, or None when the backend cannot say (then a namespace whose modes stored blocks is
        kept). Leases belong to sessions, so a namespace without a live session holds none. Returns
        the forgotten namespace ids."""
        now = now_ms() if at_ms is None else at_ms
        horizon = now - self.retention_ms
        idle_horizon = horizon if idle_for_ms is None else now - idle_for_ms
        forgotten: list[str] = []
        with self._lock:
            for ns_id, state in list(self._namespaces.items()):
                if held is not None:
                    state.held_blocks = held.get(ns_id, 0)
                live = any(m.live for m in state.modes.values())
                if (
                    not live
                    and state.last_active_ms <= idle_horizon
                    and ns_id not in self._policy_for
                    and not state.holds_blocks()
                ):
                    self._forget_locked(ns_id, state)
                    forgotten.append(ns_id)
                else:
                    state.prune_idle_modes(horizon)
            if forgotten:
                self._shelf.drop_closed()
        if forgotten and isinstance(self._store, ForgettingCensusStore):
            for ns_id in forgotten:
                self._store.forget_namespace(ns_id)
        return forgotten

    def _forget_locked(self, ns_id: str, state: NamespaceState) -> None:
        del self._namespaces[ns_id]
        self._split.discard(ns_id)
        self._troubled.discard(ns_id)
        left = self._per_tenant[state.tenant] - 1
        if left > 0:
            self._per_tenant[state.tenant] = left
        else:
            del self._per_tenant[state.tenant]
        state.refused.close()
        state.disagreements.close()
        for mode_state in state.modes.values():
            mode_state.recent.close()
        self.namespaces_forgotten += 1

    # -- counters -----------------------------------------------------------

    def count(
        self,
        session: Session,
        *,
        hits: int = 0,
        misses: int = 0,
        mode_mismatches: int = 0,
        conflicts: int = 0,
        stored: int = 0,
        cross_mode: Counter[str] | None = None,
        elsewhere: bool = False,
    ) -> None:
        """`elsewhere`: the counts are a companion engine's, whose blocks no backend here holds."""
        with self._lock:
            state = self._namespaces.get(session.namespace_id)
            mode_state = state.modes.get(session.mode_id) if state else None
            if mode_state is None:
                return
            assert state is not None
            mode_state.last_active_ms = self._touch(session.namespace_id, state)
            if mode_mismatches or cross_mode:
                self._split.add(session.namespace_id)
            mode_state.hits += hits
            mode_state.misses += misses
            mode_state.mode_mismatches += mode_mismatches
            mode_state.conflicts += conflicts
            mode_state.stored += stored
            mode_state.stored_elsewhere += stored if elsewhere else 0
            if cross_mode:
                mode_state.cross_mode.update(cross_mode)
                if len(mode_state.cross_mode) > 2 * MAX_IDLE_MODES:  # held_by modes long forgotten
                    mode_state.cross_mode = Counter(dict(mode_state.cross_mode.most_common(MAX_IDLE_MODES)))

    # -- reports ------------------------------------------------------------

    def report(self, namespace_id: str = "") -> pb.DiagnoseResponse:
        """Every namespace (or one), by id: what the history, the metrics and an unpaged status read."""
        with self._lock:
            chosen = [namespace_id] if namespace_id else sorted(self._namespaces)
        return pb.DiagnoseResponse(namespaces=list(self.reports(chosen)))

    def order(self, wanted: Callable[[str, NamespaceState], bool] | None = None) -> list[str]:
        """Namespace ids in the order an operator reads them: splits first, then refusals or probe
        disagreements, each group by last activity, newest first; `wanted` filters."""
        with self._lock:
            states = self._namespaces
            newest_first = list(reversed(states))
            split = sorted(self._split, key=lambda n: -states[n].last_active_ms)
            troubled = sorted(self._troubled - self._split, key=lambda n: -states[n].last_active_ms)
            if split or troubled:
                flagged = self._split | self._troubled
                newest_first = [n for n in newest_first if n not in flagged]
            ordered = split + troubled + newest_first
            if wanted is not None:
                ordered = [n for n in ordered if wanted(n, states[n])]
        return ordered

    def _touch(self, ns_id: str, state: NamespaceState) -> int:
        """Record activity now: the namespace moves to the newest end. Caller holds the lock."""
        state.last_active_ms = at = now_ms()
        del self._namespaces[ns_id]
        self._namespaces[ns_id] = state
        return at

    def reports(self, namespace_ids: Iterable[str]) -> Iterator[pb.NamespaceReport]:
        """The reports of those of `namespace_ids` still in the census, in the order given."""
        for ns_id in namespace_ids:
            with self._lock:
                state = self._namespaces.get(ns_id)
                if state is None:
                    continue
                yield namespace_report(ns_id, state)

    def tenants(self) -> dict[str, str]:
        """namespace_id -> tenant of every namespace this replica has admitted a session of."""
        with self._lock:
            return {ns_id: state.descriptor.tenant for ns_id, state in self._namespaces.items()}

    def live_sessions(self) -> int:
        with self._lock:
            return sum(len(m.live) for s in self._namespaces.values() for m in s.modes.values())

    def namespace_count(self, tenant: str | None = None) -> int:
        with self._lock:
            return len(self._namespaces) if tenant is None else self._per_tenant[tenant]


def _decoded(encoding: bytes | None) -> pb.HashingMode | None:
    """A described mode's fields; None when not described or unreadable (a damaged record)."""
    if not encoding:
        return None
    try:
        return mode_diff.decode_mode(encoding)
    except (ValueError, struct.error, UnicodeDecodeError):
        return None


class _ProbeDrift(errors.ApiError):
    """A probe disagreement: raised as an error under strict, sent as a warning under isolate."""

    def __init__(self, message: str, record: pb.ProbeDisagreement) -> None:
        error = errors.probe_disagreement(message, record)
        super().__init__(error.code, error.reason, message, error.details)
        self.warning = pb.CensusWarning(
            kind="PROBE_DISAGREEMENT", message=message, other_mode_id=record.mode_id
        )
