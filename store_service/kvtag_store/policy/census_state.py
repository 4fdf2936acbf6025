"""What the census holds per namespace and mode, the bounds on it, and the reports built from it.

Kept apart from census.py, which decides (admission, sweeps, counting): this is the data those
decisions read and the Diagnose records rendered from it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvtag.v1 import store_pb2 as pb

from kvtag_store.policy.records import RecordLog
from kvtag_store.policy.sessions import Session

# Gone engines listed per mode (the rest are counted in engines_forgotten).
RECENT_ENGINES = 16
# Refusals and probe disagreements listed per namespace.
RECENT_EVENTS = 32
# Modes without a live engine kept per namespace (the least recently active leave first).
MAX_IDLE_MODES = 8
# What a gone engine's record keeps of its labels: the first labels, values cut short.
GONE_LABELS = 16
GONE_TEXT = 256
DEFAULT_RETENTION_MS = 600_000


@dataclass
class ModeState:
    mode: pb.HashingMode
    live: dict[str, Session] = field(default_factory=dict)
    # Closed or expired engines, newest last.
    recent: RecordLog[pb.EngineRecord] = field(default_factory=lambda: RecordLog(RECENT_ENGINES))
    hits: int = 0
    misses: int = 0
    mode_mismatches: int = 0
    conflicts: int = 0
    stored: int = 0
    # Of `stored`, the blocks a companion engine reported storing on its own data path (vLLM's
    # MooncakeStoreConnector): no backend of this store can count or forget those.
    stored_elsewhere: int = 0
    cross_mode: Counter[str] = field(default_factory=Counter)
    last_active_ms: int = 0


@dataclass
class NamespaceState:
    namespace_id: str
    descriptor: pb.NamespaceDescriptor
    policy: int
    established_mode_id: str = ""
    modes: dict[str, ModeState] = field(default_factory=dict)
    refused: RecordLog[pb.RefusedSession] = field(default_factory=lambda: RecordLog(RECENT_EVENTS))
    disagreements: RecordLog[pb.ProbeDisagreement] = field(default_factory=lambda: RecordLog(RECENT_EVENTS))
    last_active_ms: int = 0
    modes_forgotten: int = 0
    # The namespace's stored blocks at the last sweep; None until known (or when the backend cannot
    # say), and then a mode that stored blocks is taken to still hold them.
    held_blocks: int | None = None

    @property
    def tenant(self) -> str:
        return self.descriptor.tenant

    def split(self) -> bool:
        """Its modes lose each other's hits: mismatches, cross-mode misses, or two live modes."""
        live_modes = 0
        for m in self.modes.values():
            if m.mode_mismatches or m.cross_mode:
                return True
            live_modes += bool(m.live)
        return live_modes > 1

    def prune_idle_modes(self, horizon: int) -> None:
        """Drop idle modes that no block needs remembered, then the least recently active idle modes
        past MAX_IDLE_MODES. A strict namespace's established mode stays while the namespace does.
        Caller holds the census lock."""
        holds = self.holds_blocks()
        idle = [
            (m.last_active_ms, mode_id)
            for mode_id, m in self.modes.items()
            if not m.live and mode_id != self.established_mode_id
        ]
        drop = {
            mode_id for at, mode_id in idle if at <= horizon and not (holds and self.modes[mode_id].stored)
        }
        kept = sorted((entry for entry in idle if entry[1] not in drop), reverse=True)
        drop.update(mode_id for _, mode_id in kept[MAX_IDLE_MODES:])
        for mode_id in drop:
            self.modes.pop(mode_id).recent.close()
            self.modes_forgotten += 1

    def holds_blocks_elsewhere(self) -> bool:
        """A companion engine of it reported storing blocks, which no backend of this store holds."""
        return any(m.stored_elsewhere for m in self.modes.values())

    def holds_blocks(self) -> bool:
        if self.holds_blocks_elsewhere():
            return True
        if self.held_blocks is not None:
            return self.held_blocks > 0
        return any(m.stored for m in self.modes.values())


def namespace_report(ns_id: str, state: NamespaceState) -> pb.NamespaceReport:
    """Caller holds the census lock."""
    ns_report = pb.NamespaceReport(
        namespace_id=ns_id,
        policy=state.policy,  # type: ignore[arg-type]
        established_mode_id=state.established_mode_id,
        refused=list(state.refused),
        probe_disagreements=list(state.disagreements),
        last_active_unix_ms=state.last_active_ms,
        modes_forgotten=state.modes_forgotten,
    )
    ns_report.namespace.CopyFrom(state.descriptor)
    for mode_id, mode_state in sorted(state.modes.items()):
        mode_report = ns_report.modes.add(mode_id=mode_id, engines_forgotten=mode_state.recent.forgotten)
        mode_report.mode.CopyFrom(mode_state.mode)
        for session in mode_state.live.values():
            mode_report.engines.append(engine_record(session, live=True))
        mode_report.engines.extend(reversed(mode_state.recent))
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
    return ns_report


def gone_record(session: Session) -> pb.EngineRecord:
    """What the census keeps of an engine that left: its record, labels trimmed (GONE_LABELS,
    GONE_TEXT) so a log of gone engines stays small whatever the engines declared."""
    record = engine_record(session, live=False)
    record.engine_id = record.engine_id[:GONE_TEXT]
    if len(session.labels) > GONE_LABELS or any(
        len(k) > GONE_TEXT or len(v) > GONE_TEXT for k, v in session.labels.items()
    ):
        record.ClearField("labels")
        for key in sorted(session.labels)[:GONE_LABELS]:
            record.labels[key[:GONE_TEXT]] = session.labels[key][:GONE_TEXT]
    return record


def engine_record(session: Session, *, live: bool) -> pb.EngineRecord:
    record = pb.EngineRecord(
        engine_id=session.engine_id,
        session_id=session.session_id,
        live=live,
        opened_unix_ms=session.opened_unix_ms,
        last_seen_unix_ms=session.last_seen_unix_ms,
    )
    # Not labels= in the constructor: protobuf's upb keeps a few of the objects a map keyword makes
    # (docs/benchmarks.md), each pinning an interpreter arena after the rest are gone.
    record.labels.update(session.labels)
    return record
