"""The Mooncake cluster as the backend's read, write and shared-memory paths all see it.

`Cluster` bundles what they share (the client, the header reader, the mode directory, the
breaker, suspect processes and counters) with the calls every path makes: which blocks exist in
a mode and which other mode holds the rest (existence checks only), and dropping a value that
failed verification.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import NamedTuple

from kvtag_store.backends.base import BackendUnavailable, BlockAddress
from kvtag_store.backends.mooncake.client import MooncakeClient, MooncakeSettings
from kvtag_store.backends.mooncake.errors import ErrorCounters, describe
from kvtag_store.backends.mooncake.format import HEADER_BYTES, KEY_PREFIX, object_keys
from kvtag_store.backends.mooncake.health import MASTER_DOWN, MasterBreaker, SuspectProcesses
from kvtag_store.backends.mooncake.modes import ModeDirectory

# Header reads per get_into_ranges call; the registered arena holds this many headers.
HEADER_SLOTS = 1024
# The key whose existence the breaker's prober checks: never stored (every kvtag key has at least
# three parts after the prefix), so the check is one small master call and leases nothing.
_PROBE_KEY = f"{KEY_PREFIX}/master-probe"
# batch_is_exist answers -1 for a key when its RPC failed.
EXISTS_DOWN = (*MASTER_DOWN, -1)


def master_breaker(client: MooncakeClient, master: str, errors: ErrorCounters) -> MasterBreaker:
    """The breaker of every call through `client` (the backend's paths and the census): its probe
    is the existence check every path starts with, of one never-stored key."""

    def answers() -> bool:
        return not any(code in EXISTS_DOWN for code in client.batch_is_exist([_PROBE_KEY]))

    return MasterBreaker(master, errors, answers)


class HeaderReader:
    """Reads only the headers of many objects into one registered arena (get_into_ranges)."""

    def __init__(self, client: MooncakeClient) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._arena = ctypes.create_string_buffer(HEADER_BYTES * HEADER_SLOTS)
        self._ptr = ctypes.addressof(self._arena)
        rc = client.register_buffer(self._ptr, HEADER_BYTES * HEADER_SLOTS)
        if rc != 0:
            raise BackendUnavailable(f"cannot register the header buffer with Mooncake: {describe(rc)}")

    def read(self, keys: Sequence[str]) -> list[bytes | int]:
        """Per key: the header bytes, or a negative Mooncake code (-704 missing, -600 too short...)."""
        out: list[bytes | int] = []
        for start in range(0, len(keys), HEADER_SLOTS):
            chunk = list(keys[start : start + HEADER_SLOTS])
            n = len(chunk)
            with self._lock:
                codes = self._client.get_into_ranges(
                    [self._ptr],
                    [chunk],
                    [[[i * HEADER_BYTES] for i in range(n)]],
                    [[[0]] * n],
                    [[[HEADER_BYTES]] * n],
                )[0]
                raw = ctypes.string_at(self._ptr, n * HEADER_BYTES)
            for i, per_range in enumerate(codes):
                code = per_range[0]
                out.append(raw[i * HEADER_BYTES : (i + 1) * HEADER_BYTES] if code >= 0 else code)
        return out

    def close(self) -> None:
        self._client.unregister_buffer(self._ptr)


class Presence(NamedTuple):
    """Blocks of one call: their object keys in the asked mode, whether each exists there, and
    for the others the mode that holds it (None: no mode does)."""

    mkeys: list[str]
    present: list[bool]
    holders: list[str | None]


class Cluster:
    """The client and what every path of the backend shares over it."""

    def __init__(self, client: MooncakeClient, settings: MooncakeSettings) -> None:
        self.client = client
        self.settings = settings
        self.errors = ErrorCounters()
        self.breaker = master_breaker(client, settings.master, self.errors)
        self.suspects = SuspectProcesses()
        self.headers = HeaderReader(client)
        self.modes = ModeDirectory(client, self.exists)
        self._count_lock = threading.Lock()
        self._corrupted = 0

    @property
    def max_value_bytes(self) -> int:
        # put_parts and get_batch stage values in the local buffer; leave room for concurrent calls.
        return self.settings.local_buffer_bytes // 4 - HEADER_BYTES

    @property
    def corrupted(self) -> int:
        """Values this replica dropped because they failed verification."""
        with self._count_lock:
            return self._corrupted

    def exists(self, mkeys: list[str], what: str) -> list[int]:
        """batch_is_exist's code per key (1 present); UNAVAILABLE when the master did not answer."""
        exists = self.client.batch_is_exist(mkeys)
        self.breaker.screen(exists, what, master_down=EXISTS_DOWN)
        return exists

    def presence(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress], what: str, *, writing: bool
    ) -> Presence:
        """Which blocks exist in mode_id, and which other mode holds each of the rest: one existence
        check with the directory probed in it, and a second for the other modes' keys only when
        the namespace has other modes and some blocks are not there in this one."""
        mkeys = object_keys(namespace_id, mode_id, addresses)
        probe = self.modes.probe(namespace_id)
        codes = self.exists(mkeys + probe.keys, what)
        self.modes.notice(namespace_id, probe, codes[len(mkeys) :], writing=writing)
        present = [code == 1 for code in codes[: len(mkeys)]]
        absent = [i for i, here in enumerate(present) if not here]
        holders: list[str | None] = [None] * len(mkeys)
        if absent and self.modes.others(namespace_id, mode_id):
            found = self.other_holders(
                namespace_id, mode_id, [addresses[i] for i in absent], what, writing=writing
            )
            for i, holder in zip(absent, found, strict=True):
                holders[i] = holder
        return Presence(mkeys, present, holders)

    def other_holders(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress], what: str, *, writing: bool
    ) -> list[str | None]:
        """For each block, a mode other than mode_id that holds it (None if none does), the
        directory probed in the same existence check and read again if it changed."""
        for attempt in range(2):
            probe = self.modes.probe(namespace_id)
            others = self.modes.others(namespace_id, mode_id)
            keys = [k for other in others for k in object_keys(namespace_id, other, addresses)]
            if not keys and not writing:
                return [None] * len(addresses)
            codes = self.exists(keys + probe.keys, what)
            changed = self.modes.notice(namespace_id, probe, codes[len(keys) :], writing=writing)
            if changed and attempt == 0:
                continue  # read again: a mode registered meanwhile may hold some of them
            holders: list[str | None] = [None] * len(addresses)
            n = len(addresses)
            for j, other in enumerate(others):
                for i in range(n):
                    if holders[i] is None and codes[j * n + i] == 1:
                        holders[i] = other
            return holders
        raise AssertionError("unreachable")

    def after_put(
        self,
        namespace_id: str,
        mode_id: str,
        addresses: Sequence[BlockAddress],
        mkeys: Sequence[str],
        what: str,
    ) -> tuple[list[bool], list[str | None]]:
        """After a put, in one existence check (which also takes Mooncake's read lease on the new
        blocks): whether each block is there in mode_id, and which other mode holds it too (None:
        none). The directory is probed in the same call and read again if it changed."""
        for attempt in range(2):
            probe = self.modes.probe(namespace_id)
            others = self.modes.others(namespace_id, mode_id)
            keys = list(mkeys) + [k for other in others for k in object_keys(namespace_id, other, addresses)]
            codes = self.exists(keys + probe.keys, what)
            if self.modes.notice(namespace_id, probe, codes[len(keys) :], writing=True) and attempt == 0:
                continue  # read again: a mode registered meanwhile may hold some of them
            n = len(mkeys)
            holders: list[str | None] = [None] * n
            for j, other in enumerate(others):
                for i in range(n):
                    if holders[i] is None and codes[n + j * n + i] == 1:
                        holders[i] = other
            return [code == 1 for code in codes[:n]], holders
        raise AssertionError("unreachable")

    def drop_corrupt(self, keys: Sequence[str]) -> None:
        """Remove values that fail verification so a correct put can take their place."""
        with self._count_lock:
            self._corrupted += len(keys)
        self.client.batch_remove(list(keys), True)
