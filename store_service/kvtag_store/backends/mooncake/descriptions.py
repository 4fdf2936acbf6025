"""What namespaces and modes are, kept in the cluster (CensusStore.describe over Mooncake), so a
replica names what engines of another replica left: the fields a gone producer's mode differs in
(MODE_SPLIT), the namespaces of the same model in another layout (LAYOUT_SPLIT).

A mode's encoding is one record per (namespace, mode): its content is fixed by the mode id, so any
writer's put is the right one. A model's namespaces sit in its layout directory, slots 0..MAX_LAYOUTS
of `format.layout_key`, one namespace each, first writer wins (Mooncake's put keeps an existing
value; the stored one is read back), like the mode directory (mooncake.modes). Records are
hard-pinned. They are best effort: lost with a master restart (without HA) or a full directory, they
cost a warning its detail, never a decision, so unlike the census's mode records they are not
restored. Slots are never freed: a model whose namespaces came and went more than MAX_LAYOUTS times
stops being described, and its sibling warnings stop.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from typing import Any

from kvtag_store.backends.mooncake.client import MooncakeClient
from kvtag_store.backends.mooncake.cluster import EXISTS_DOWN
from kvtag_store.backends.mooncake.format import (
    FormatError,
    census_key,
    decode_record,
    encode_record,
    layout_key,
)
from kvtag_store.backends.mooncake.health import MASTER_DOWN, MasterBreaker

log = logging.getLogger(__name__)

# Namespaces one model (and tenant) can have described: TP ranks x layouts x dtypes.
MAX_LAYOUTS = 64


class ClusterDescriptions:
    def __init__(self, client: MooncakeClient, breaker: MasterBreaker, config: Any) -> None:
        """`config`: the pinned ReplicateConfig the census's records are put with."""
        self._client = client
        self._breaker = breaker
        self._config = config
        self._lock = threading.Lock()
        self._modes: dict[tuple[str, str], bytes] = {}  # (namespace, mode) -> encoding, read or written
        self._registered: set[str] = set()  # namespaces this replica found in their model's directory
        self._slots: dict[str, dict[int, tuple[str, bytes]]] = {}  # model -> slot -> (namespace, descriptor)

    def describe(
        self, namespace_id: str, model_key: str, namespace: bytes, mode_id: str, mode: bytes
    ) -> None:
        with self._lock:
            mode_known = (namespace_id, mode_id) in self._modes
            registered = namespace_id in self._registered
        if not mode_known:
            self._put(census_key(namespace_id, f"hashing/{mode_id}"), mode)
            with self._lock:
                self._modes[(namespace_id, mode_id)] = mode
        if not registered and self._register(model_key, namespace_id, namespace):
            with self._lock:
                self._registered.add(namespace_id)

    def described_modes(self, namespace_id: str, mode_ids: Iterable[str]) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        for mode_id in mode_ids:
            with self._lock:
                known = self._modes.get((namespace_id, mode_id))
            if known is None:
                known = self._read(census_key(namespace_id, f"hashing/{mode_id}"))
                if known is None:
                    continue
                with self._lock:
                    self._modes[(namespace_id, mode_id)] = known
            found[mode_id] = known
        return found

    def namespaces_of(self, model_key: str) -> dict[str, bytes]:
        slots, _ = self._scan(model_key)
        return dict(slots.values())

    # -- the layout directory ----------------------------------------------------

    def _register(self, model_key: str, namespace_id: str, namespace: bytes) -> bool:
        """Put the namespace in a free slot of its model's directory unless a slot names it; False
        when the directory is full."""
        slots, free = self._scan(model_key)
        if any(holder == namespace_id for holder, _ in slots.values()):
            return True
        body = json.dumps({"namespace_id": namespace_id, "descriptor": namespace.hex()}).encode()
        for slot in free:
            key = layout_key(model_key, slot)
            self._put(key, body)
            winner = self._slot(model_key, slot)
            if winner is not None and winner[0] == namespace_id:
                return True
        log.info(
            "model %s: its layout directory is full; namespace %s is not described", model_key, namespace_id
        )
        return False

    def _scan(self, model_key: str) -> tuple[dict[int, tuple[str, bytes]], list[int]]:
        """The directory's slots as stored now (present ones read once, then kept: a slot's value never
        changes), and the free slots."""
        keys = [layout_key(model_key, slot) for slot in range(MAX_LAYOUTS)]
        codes = self._client.batch_is_exist(keys)
        self._breaker.screen(codes, "reading a model's layout directory", master_down=EXISTS_DOWN)
        slots: dict[int, tuple[str, bytes]] = {}
        free: list[int] = []
        for slot, code in enumerate(codes):
            if code != 1:
                free.append(slot)
                continue
            held = self._slot(model_key, slot)
            if held is not None:
                slots[slot] = held
        return slots, free

    def _slot(self, model_key: str, slot: int) -> tuple[str, bytes] | None:
        """The (namespace, descriptor) a present slot holds, read once; None when unreadable."""
        with self._lock:
            held = self._slots.get(model_key, {}).get(slot)
        if held is not None:
            return held
        raw = self._read(layout_key(model_key, slot))
        if raw is None:
            return None
        try:
            fields = json.loads(raw)
            held = (str(fields["namespace_id"]), bytes.fromhex(fields["descriptor"]))
        except (ValueError, KeyError, TypeError):
            return None
        with self._lock:
            self._slots.setdefault(model_key, {})[slot] = held
        return held

    # -- Mooncake calls ------------------------------------------------------------

    def _put(self, key: str, body: bytes) -> None:
        """Put a record (kept if one is there: first writer wins); UNAVAILABLE if the master is down."""
        rc = self._client.put(key, encode_record(body), self._config)
        if rc in MASTER_DOWN:
            self._breaker.screen([rc], "describing a namespace")

    def _read(self, key: str) -> bytes | None:
        raw = self._client.get(key)
        if not raw:
            return None
        try:
            return decode_record(raw)
        except FormatError:
            return None
