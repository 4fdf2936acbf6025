"""The census: which engines hash how in each namespace, the policy decisions at OpenSession,
and the counters Diagnose reports.

First-writer-wins facts (a strict namespace's mode, a mode's reference probe)
go through the backend's CensusStore so replicas over one cluster agree; the
rest (engines, counters, refusals) is this replica's view.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass, field

from kvtag.v1 import store_pb2 as pb
from kvtag_proto import ids

from kvtag_store import errors
from kvtag_store.backends.base import CensusStore, ProbeRecord
from kvtag_store.policy import mode_diff
from kvtag_store.policy.sessions import Session, now_ms

RECENT_ENGINES = 16
RECENT_EVENTS = 32


@dataclass
class ModeState:
    mode: pb.HashingMode
    live: dict[str, Session] = field(default_factory=dict)
    # Closed or expired sessions, newest last: (session, closed_unix_ms).
    recent: deque[tuple[Session, int]] = field(default_factory=lambda: deque(maxlen=RECENT_ENGINES))
    hits: int = 0
    misses: int = 0
    mode_mismatches: int = 0
    conflicts: int = 0
    stored: int = 0
    cross_mode: Counter[str] = field(default_factory=Counter)


@dataclass
class NamespaceState:
    descriptor: pb.NamespaceDescriptor
    policy: int
    established_mode_id: str = ""
    modes: dict[str, ModeState] = field(default_factory=dict)
    refused: deque[pb.RefusedSession] = field(default_factory=lambda: deque(maxlen=RECENT_EVENTS))
    disagreements: deque[pb.ProbeDisagreement] = field(default_factory=lambda: deque(maxlen=RECENT_EVENTS))


@dataclass(frozen=True)
class Admission:
    namespace_id: str
    mode_id: str
    policy: int
    warnings: list[pb.CensusWarning]


class Census:
    def __init__(self, store: CensusStore, policy_for: dict[str, int], default_policy: int) -> None:
        self._store = store
        self._policy_for = policy_for
        self._default_policy = default_policy
        self._lock = threading.Lock()
        self._namespaces: dict[str, NamespaceState] = {}
        self.refusals_total: Counter[str] = Counter()

    # -- OpenSession --------------------------------------------------------

    def admit(self, request: pb.OpenSessionRequest) -> Admission:
        """Apply the namespace policy and the probe check; raise ApiError on refusal."""
        ns_id = ids.namespace_id(request.namespace)
        mode_id = ids.mode_id(request.mode)
        ns_text = mode_diff.describe_namespace(ns_id, request.namespace)
        with self._lock:
            state = self._namespaces.get(ns_id)
            if state is None:
                state = self._namespaces[ns_id] = NamespaceState(
                    descriptor=pb.NamespaceDescriptor(),
                    policy=self._policy_for.get(ns_id, self._default_policy),
                )
                state.descriptor.CopyFrom(request.namespace)
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
            with self._lock:
                others = [
                    other_id for other_id, other in state.modes.items() if other_id != mode_id and other.live
                ]
            for other_id in others:
                other_mode = state.modes[other_id].mode
                fields = ", ".join(
                    f"{d.field} {d.established} there, {d.requested} here"
                    for d in mode_diff.mode_diff(other_mode, request.mode)
                )
                warnings.append(
                    pb.CensusWarning(
                        kind="MODE_SPLIT",
                        other_mode_id=other_id,
                        message=(
                            f"engine `{request.engine_id}` joins namespace {ns_text} in mode {mode_id}, but "
                            f"live engines there hash in mode {other_id} ({fields}); the two modes never "
                            "share blocks, so each loses the other's hits; align the engines' hashing or "
                            "split them into separate namespaces (`kvtag-store diagnose` counts the "
                            "cross-mode misses)"
                        ),
                    )
                )
        probe = ProbeRecord(engine_id=request.engine_id, probe_keys=tuple(request.probe_keys))
        reference = self._store.reference_probe(ns_id, mode_id, probe)
        if reference.probe_keys != probe.probe_keys:
            warning = self._probe_disagreement(state, ns_id, ns_text, mode_id, request, reference)
            if state.policy == pb.POLICY_STRICT:
                raise warning
            warnings.append(warning.warning)
        return Admission(ns_id, mode_id, state.policy, warnings)

    def _record_refusal(
        self, state: NamespaceState, engine_id: str, message: str, refusal: pb.ModeRefusal | None
    ) -> None:
        record = pb.RefusedSession(engine_id=engine_id, reason=message, at_unix_ms=now_ms())
        if refusal is not None:
            record.refusal.CopyFrom(refusal)
        with self._lock:
            state.refused.append(record)
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
        reference_labels = self._labels_of(state, reference.engine_id)
        cause = mode_diff.likely_cause(request.mode, reference_labels, dict(request.labels))
        record = pb.ProbeDisagreement(
            namespace_id=ns_id,
            mode_id=mode_id,
            reference_engine_id=reference.engine_id,
            engine_id=request.engine_id,
            likely_cause=cause,
            at_unix_ms=now_ms(),
        )
        verdict = "refused" if state.policy == pb.POLICY_STRICT else "flagged"
        message = (
            f"engine `{request.engine_id}` declares mode {mode_id} in namespace {ns_text} but its probe keys "
            f"differ from engine `{reference.engine_id}`'s, so the two hash differently in fact and would "
            f"never share hits ({verdict}); {cause}"
        )
        with self._lock:
            state.disagreements.append(record)
        if state.policy == pb.POLICY_STRICT:
            self._record_refusal(state, request.engine_id, message, None)
        return _ProbeDrift(message, record)

    def _labels_of(self, state: NamespaceState, engine_id: str) -> dict[str, str]:
        with self._lock:
            for mode_state in state.modes.values():
                for session in mode_state.live.values():
                    if session.engine_id == engine_id:
                        return dict(session.labels)
                for session, _ in mode_state.recent:
                    if session.engine_id == engine_id:
                        return dict(session.labels)
        return {}

    def joined(self, session: Session, mode: pb.HashingMode) -> None:
        with self._lock:
            state = self._namespaces[session.namespace_id]
            mode_state = state.modes.get(session.mode_id)
            if mode_state is None:
                mode_state = state.modes[session.mode_id] = ModeState(mode=pb.HashingMode())
                mode_state.mode.CopyFrom(mode)
            mode_state.live[session.session_id] = session

    def left(self, session: Session) -> None:
        with self._lock:
            state = self._namespaces.get(session.namespace_id)
            mode_state = state.modes.get(session.mode_id) if state else None
            if mode_state is not None and mode_state.live.pop(session.session_id, None) is not None:
                mode_state.recent.append((session, now_ms()))

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
    ) -> None:
        with self._lock:
            state = self._namespaces.get(session.namespace_id)
            mode_state = state.modes.get(session.mode_id) if state else None
            if mode_state is None:
                return
            mode_state.hits += hits
            mode_state.misses += misses
            mode_state.mode_mismatches += mode_mismatches
            mode_state.conflicts += conflicts
            mode_state.stored += stored
            if cross_mode:
                mode_state.cross_mode.update(cross_mode)

    # -- reports ------------------------------------------------------------

    def report(self, namespace_id: str = "") -> pb.DiagnoseResponse:
        response = pb.DiagnoseResponse()
        with self._lock:
            for ns_id, state in sorted(self._namespaces.items()):
                if namespace_id and ns_id != namespace_id:
                    continue
                ns_report = response.namespaces.add(
                    namespace_id=ns_id,
                    policy=state.policy,
                    established_mode_id=state.established_mode_id,
                    refused=list(state.refused),
                    probe_disagreements=list(state.disagreements),
                )
                ns_report.namespace.CopyFrom(state.descriptor)
                for mode_id, mode_state in sorted(state.modes.items()):
                    mode_report = ns_report.modes.add(mode_id=mode_id)
                    mode_report.mode.CopyFrom(mode_state.mode)
                    for session in mode_state.live.values():
                        mode_report.engines.append(_engine_record(session, live=True))
                    for session, _closed in reversed(mode_state.recent):
                        mode_report.engines.append(_engine_record(session, live=False))
                    mode_report.counters.CopyFrom(
                        pb.ModeCounters(
                            hits=mode_state.hits,
                            misses=mode_state.misses,
                            mode_mismatches=mode_state.mode_mismatches,
                            cross_mode_misses=sum(mode_state.cross_mode.values()),
                            conflicts=mode_state.conflicts,
                            stored=mode_state.stored,
                        )
                    )
                    for held_by, count in mode_state.cross_mode.most_common():
                        mode_report.cross_mode_misses.add(held_by_mode_id=held_by, count=count)
        return response

    def tenants(self) -> dict[str, str]:
        """namespace_id -> tenant of every namespace this replica has admitted a session of."""
        with self._lock:
            return {ns_id: state.descriptor.tenant for ns_id, state in self._namespaces.items()}

    def live_sessions(self) -> int:
        with self._lock:
            return sum(len(m.live) for s in self._namespaces.values() for m in s.modes.values())


class _ProbeDrift(errors.ApiError):
    """A probe disagreement: raised as an error under strict, sent as a warning under isolate."""

    def __init__(self, message: str, record: pb.ProbeDisagreement) -> None:
        error = errors.probe_disagreement(message, record)
        super().__init__(error.code, error.reason, message, error.details)
        self.warning = pb.CensusWarning(
            kind="PROBE_DISAGREEMENT", message=message, other_mode_id=record.mode_id
        )


def _engine_record(session: Session, *, live: bool) -> pb.EngineRecord:
    return pb.EngineRecord(
        engine_id=session.engine_id,
        session_id=session.session_id,
        live=live,
        opened_unix_ms=session.opened_unix_ms,
        last_seen_unix_ms=session.last_seen_unix_ms,
        labels=session.labels,
    )
