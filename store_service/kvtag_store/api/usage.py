"""A companion engine's UsageReport (HeartbeatRequest.usage): its counts, and the base keys that let
the census count its cross-mode misses as a Lookup's are counted (policy/base_keys.py)."""

from __future__ import annotations

from kvtag.v1 import store_pb2 as pb
from kvtag_proto.usage import MAX_USAGE_BASE_KEYS

from kvtag_store import errors
from kvtag_store.api.counting import Counting
from kvtag_store.policy.base_keys import BaseKeyIndex
from kvtag_store.policy.sessions import Session


def check(usage: pb.UsageReport, max_key_bytes: int) -> None:
    """Refuse the whole report (INVALID_ARGUMENT, nothing counted) when a list is over its bound or a
    base key is empty or too long, as the proto says: a client within the bounds never sees this."""
    for name in ("stored_base_keys", "missed_base_keys"):
        blocks = getattr(usage, name)
        if len(blocks) > MAX_USAGE_BASE_KEYS:
            raise errors.invalid_request(
                f"usage.{name} has {len(blocks)} entries; at most {MAX_USAGE_BASE_KEYS} per report",
                f"usage.{name}",
            )
        for block in blocks:
            if not 0 < len(block.base_key) <= max_key_bytes:
                raise errors.invalid_request(
                    f"usage.{name} holds a base key of {len(block.base_key)} bytes; each is "
                    f"1..{max_key_bytes} bytes",
                    f"usage.{name}.base_key",
                )


class UsageReports:
    def __init__(self, counting: Counting, base_index: BaseKeyIndex, max_key_bytes: int) -> None:
        self.counting = counting
        self.base_index = base_index
        self.max_key_bytes = max_key_bytes

    def report(self, session: Session, usage: pb.UsageReport) -> None:
        """Stored base keys enter the index as the session's mode's; missed ones another mode stored
        count as cross-mode misses. Checked before anything is counted."""
        check(usage, self.max_key_bytes)
        ns, mode = session.namespace_id, session.mode_id
        if usage.stored_base_keys:
            self.base_index.record(ns, mode, [(b.group, b.base_key) for b in usage.stored_base_keys])
        cross = None
        if usage.missed_base_keys:
            missed = [(b.group, b.base_key) for b in usage.missed_base_keys]
            cross = self.base_index.other_holders(ns, mode, missed) or None
        self.counting.reported(session, usage, cross)
