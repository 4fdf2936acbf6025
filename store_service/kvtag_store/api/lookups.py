"""Lookup: which keys the store holds in the caller's mode, with the hits pinned under a read lease."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvtag.v1 import store_pb2 as pb

from kvtag_store.api import replies
from kvtag_store.api.codec import KeyBatch
from kvtag_store.api.counting import Counting, KeyTally
from kvtag_store.api.leases import Leases
from kvtag_store.backends.base import BlockAddress, BlockBackend, Capabilities, KeyStatus
from kvtag_store.config import ServiceConfig
from kvtag_store.policy.base_keys import BaseKeyIndex
from kvtag_store.policy.sessions import Session

_HIT, _MISS = KeyStatus.HIT, KeyStatus.MISS


class Lookups:
    def __init__(
        self,
        backend: BlockBackend,
        capabilities: Capabilities,
        leases: Leases,
        counting: Counting,
        base_index: BaseKeyIndex,
        config: ServiceConfig,
    ) -> None:
        self.backend = backend
        self.capabilities = capabilities
        self.leases = leases
        self.counting = counting
        self.base_index = base_index
        self.config = config

    def lookup(self, session: Session, batch: KeyBatch) -> pb.LookupResponse:
        batch.check(self.config.limits, "Lookup")
        statuses, pinned = self.find_and_pin(session.namespace_id, session.mode_id, batch)
        tally = KeyTally.of(statuses)
        cross = self._cross_mode_misses(session, batch, statuses) if tally.misses else None
        response = replies.lookup(batch.packed, statuses, tally.prefix_length(statuses))
        if pinned:
            lease_ms = min(batch.lease_ms or self.config.default_lease_ms, self.config.max_lease_ms)
            self.leases.grant(response.lease, session, pinned, lease_ms)
        self.counting.looked_up(session, tally, cross)
        return response

    def find_and_pin(
        self, ns_id: str, mode_id: str, batch: KeyBatch
    ) -> tuple[Sequence[int], Sequence[BlockAddress]]:
        """A status per key (a list, or a byte per key) and the pinned hits. Packed keys go to a backend
        that answers on the key bytes as they are; one that looks up and pins atomically leaves no
        window for an eviction between the two."""
        runs = batch.runs
        packed = self.capabilities.packed_lookup
        if runs is not None and packed is not None:
            found, pinned = packed.lookup_packed_and_pin(ns_id, mode_id, runs)
            return found, pinned if pinned is not None else ()
        addresses = batch.addresses
        atomic = self.capabilities.atomic_lookup
        if atomic is not None:
            return atomic.lookup_and_pin(ns_id, mode_id, addresses)
        statuses = self.backend.lookup(ns_id, mode_id, addresses)
        hits = statuses.count(_HIT)
        if not hits:
            return statuses, []
        hit = (
            addresses
            if hits == len(addresses)
            else [a for a, s in zip(addresses, statuses, strict=True) if s == _HIT]
        )
        self.backend.pin(ns_id, hit)
        return statuses, hit

    def _cross_mode_misses(
        self, session: Session, batch: KeyBatch, statuses: Sequence[int]
    ) -> Counter[str] | None:
        """Misses another mode holds, by base key. Clients send base keys for all items or none, so the
        first miss tells whether to look (reading every item's base_key would cost more than the
        lookup itself)."""
        missed = [i for i, s in enumerate(statuses) if s == _MISS]
        items = batch.base_keys(missed)
        if not items:
            return None
        return self.base_index.other_holders(session.namespace_id, session.mode_id, items) or None
