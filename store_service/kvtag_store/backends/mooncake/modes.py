"""A namespace's mode directory in the cluster: which modes may hold its blocks.

Blocks are keyed by mode (format.object_key), so whether a block is there in mode M is one
existence check. The directory says which *other* modes to check, for the answers that need
them: a put in mode B of a key mode A holds is CONFLICT, and a Lookup or Get in mode B of it is
MODE_MISMATCH. Slot i of a namespace (format.directory_key) holds one mode's name, first writer
wins (Mooncake's put keeps an existing value; the stored one is read back). Slots are
hard-pinned and kept on two storage nodes where two exist, like census records, and a replica
puts back a mode it knows whose slot vanished.

Every call that asks about blocks checks the directory in the same existence check (`probe`:
the known slots and the first free one), so a mode another replica registered is seen by the
next call. Why a put cannot miss a conflict: each writer registers its mode before its put and,
after its put, reads the directory and checks the other modes' keys; of two writers of one key
in two modes, the one whose check comes second sees the other's mode and block, and yields.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kvtag_store.backends.mooncake.client import MooncakeClient, pinned_config
from kvtag_store.backends.mooncake.errors import MooncakeCode, describe
from kvtag_store.backends.mooncake.format import FormatError, decode_record, directory_key, encode_record

# Modes one namespace can hold (a namespace is one model's weights; its modes are hashing setups).
MAX_MODES = 16
# A lookup's probe that finds the directory changed rescans it at most this often; a put always does.
_RESCAN_MIN_S = 0.5
_READ_TRIES = 5
_READ_BACKOFF_S = 0.02
_SLOW_READ_S = 0.5

Exists = Callable[[list[str], str], list[int]]


class Unregistered(Exception):
    """A mode could not be registered: the directory is full, or the cluster refused the slot's
    put (`code`, a Mooncake return code)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class Probe(NamedTuple):
    """Directory slots to check beside a call's keys, and whether each is expected present."""

    keys: list[str]
    expected: list[bool]


class ModeDirectory:
    """Namespace -> {slot: mode}, as last read from the cluster or registered by this replica."""

    def __init__(self, client: MooncakeClient, exists: Exists) -> None:
        self._client = client
        self._exists = exists
        self._lock = threading.Lock()  # guards the maps
        self._scan_lock = threading.Lock()  # one scan or registration at a time (rare calls)
        self._slots: dict[str, dict[int, str]] = {}
        self._scanned_at: dict[str, float] = {}
        self._config: Any = None

    @property
    def entries(self) -> int:
        """Directory objects this replica knows of (they are objects of the cluster, not blocks)."""
        with self._lock:
            return sum(len(slots) for slots in self._slots.values())

    def known(self, namespace_id: str) -> list[str]:
        """The modes known for the namespace, without asking the cluster."""
        with self._lock:
            return list(dict.fromkeys(self._slots.get(namespace_id, {}).values()))

    def others(self, namespace_id: str, mode_id: str) -> list[str]:
        return [m for m in self.known(namespace_id) if m != mode_id]

    def current(self, namespace_id: str) -> list[str]:
        """The modes the cluster's directory names now, with those this replica knows (OpenSession
        asks: another replica may have registered one). A read beside the data path's view: it leaves
        that view and its rescan rate limit as they are, so the next call's probe still sees a mode
        registered since and rescans."""
        keys = [directory_key(namespace_id, i) for i in range(MAX_MODES)]
        codes = self._exists(keys, "reading the namespace's mode directory")
        with self._lock:
            slots = dict(self._slots.get(namespace_id, {}))
        modes = dict.fromkeys(slots.values())
        for slot, code in enumerate(codes):
            if code == 1:
                mode = slots.get(slot) or self._read_slot(keys[slot])
                if mode is not None:
                    modes[mode] = None
        return list(modes)

    def probe(self, namespace_id: str) -> Probe:
        """The slots to check beside a call's keys (read from the cluster first if never read)."""
        if namespace_id not in self._scanned_at:
            self.rescan(namespace_id)
        with self._lock:
            taken = sorted(self._slots.get(namespace_id, {}))
        free = next((i for i in range(MAX_MODES) if i not in taken), None)
        slots = taken + ([free] if free is not None else [])
        return Probe([directory_key(namespace_id, i) for i in slots], [i in taken for i in slots])

    def notice(self, namespace_id: str, probe: Probe, codes: Sequence[int], *, writing: bool) -> bool:
        """Whether the probed slots differ from what is known (then the directory is read again;
        for a lookup at most every _RESCAN_MIN_S, for a put always)."""
        changed = any((code == 1) != want for code, want in zip(codes, probe.expected, strict=True))
        if changed and (writing or time.monotonic() - self._scanned_at.get(namespace_id, 0) > _RESCAN_MIN_S):
            self.rescan(namespace_id)
        return changed

    def register(self, namespace_id: str, mode_id: str) -> None:
        """Make sure the directory names mode_id before a block of it is put (Unregistered if it
        cannot)."""
        if namespace_id not in self._scanned_at:
            self.rescan(namespace_id)
        if mode_id in self.known(namespace_id):
            return
        with self._scan_lock:
            self._register_locked(namespace_id, mode_id)

    def rescan(self, namespace_id: str) -> None:
        """Read every slot of the namespace; put back a known mode whose slot vanished (one that
        cannot be put back yet stays known at its old slot, so the next probe tries again)."""
        with self._scan_lock:
            keys = [directory_key(namespace_id, i) for i in range(MAX_MODES)]
            codes = self._exists(keys, "reading the namespace's mode directory")
            with self._lock:
                before = dict(self._slots.get(namespace_id, {}))
            found: dict[int, str] = {}
            for slot, code in enumerate(codes):
                if code != 1:
                    continue
                mode = self._read_slot(keys[slot])
                if mode is not None:
                    found[slot] = mode
            with self._lock:
                self._slots[namespace_id] = found
                self._scanned_at[namespace_id] = time.monotonic()
            for slot, mode in before.items():
                if mode in found.values():
                    continue
                try:
                    self._register_locked(namespace_id, mode)
                except Unregistered:
                    with self._lock:
                        self._slots[namespace_id].setdefault(slot, mode)

    def _register_locked(self, namespace_id: str, mode_id: str) -> None:
        for slot in range(MAX_MODES):
            with self._lock:
                slots = self._slots.setdefault(namespace_id, {})
                holder = slots.get(slot)
            if holder == mode_id:
                return
            if holder is not None:
                continue
            key = directory_key(namespace_id, slot)
            rc = self._client.put(key, encode_record(mode_id.encode("ascii")), self._pinned())
            if rc not in (MooncakeCode.OK, MooncakeCode.OBJECT_ALREADY_EXISTS):
                # Screened like an existence check: a master failure raises UNAVAILABLE.
                self._exists([key], "registering a mode in the namespace's mode directory")
                raise Unregistered(f"the mode directory slot could not be stored ({describe(rc)})", rc)
            winner = self._read_slot(key)
            if winner is None:
                continue  # unreadable (a put in flight or a dead node): try the next slot
            with self._lock:
                self._slots[namespace_id][slot] = winner
            if winner == mode_id:
                return
        raise Unregistered(
            f"namespace {namespace_id} already holds {MAX_MODES} modes in the Mooncake cluster; "
            "no block of another mode can be stored there"
        )

    def _read_slot(self, key: str) -> str | None:
        """The mode a slot names, None if it is unreadable; a damaged slot is removed. An empty read
        is retried (a put in flight) unless it was slow (a dead storage process's timeout)."""
        for attempt in range(_READ_TRIES):
            started = time.monotonic()
            raw = self._client.get(key)
            if not raw and time.monotonic() - started > _SLOW_READ_S:
                return None
            if raw:
                try:
                    return decode_record(raw).decode("ascii")
                except (FormatError, UnicodeDecodeError):
                    self._client.batch_remove([key], True)
                    return None
            time.sleep(_READ_BACKOFF_S * (attempt + 1))
        return None

    def _pinned(self) -> Any:
        if self._config is None:
            self._config = pinned_config()
        return self._config
