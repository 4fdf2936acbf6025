"""Lookup: block keys packed into runs (no message per key), chunked within the server's limits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import repeat

from kvtag.v1 import store_pb2 as pb

from kvtag_client.calls import Caller, Leases
from kvtag_client.deadlines import Deadline
from kvtag_client.errors import CallFailed
from kvtag_client.logs import log
from kvtag_client.packed_keys import PackedKeys, add_runs, chunked, pack_blocks

_HIT_BYTE = bytes([pb.HIT])
_MISS_BYTE = bytes([pb.MISS])


@dataclass(frozen=True, slots=True)
class LookupResult:
    prefix_length: int  # leading HIT count (0 when degraded)
    statuses: list[int]  # kvtag.v1.KeyStatus per block; UNSPECIFIED for blocks not asked
    leases: Leases  # () when nothing leased


class Lookups:
    """StoreClient's lookup calls."""

    def __init__(self, caller: Caller) -> None:
        self.caller = caller
        self.session = caller.session
        self._v1_lookup_logged = False

    def lookup(self, blocks: Sequence[tuple[int, bytes, bytes]], lease_ms: int = 0) -> LookupResult:
        """Leading HIT count, a status per (group, key, base_key) block and a read lease on the hits;
        misses when degraded. Sent in the packed form (see lookup_packed)."""
        return self.lookup_packed(pack_blocks(blocks), lease_ms)

    def lookup_packed(self, runs: Sequence[PackedKeys], lease_ms: int = 0) -> LookupResult:
        """lookup() over runs of concatenated keys: no Python object per key on either side.

        Statuses follow the runs' concatenation. A run with an invalid key length is
        answered MISS locally; invalid base keys are dropped (they only feed diagnostics).
        """
        with self.session.counting() as counters:
            counters.lookups += 1
        total = sum(run.count for run in runs)
        if not total:
            return LookupResult(0, [], ())
        statuses = bytearray(total)  # KEY_STATUS_UNSPECIFIED until answered
        leases: list[str] = []
        deadline = self.caller.deadline()
        try:
            for offset, chunk in chunked(runs, self.caller.batch_size()):
                size = sum(run.count for run in chunk)
                sendable = [self._sendable(run) for run in chunk]
                sent = [run for run in sendable if run is not None]
                answered = self._lookup_chunk(deadline, sent, lease_ms, leases) if sent else b""
                if len(sent) != len(chunk):  # MISS in place of the runs not sent
                    parts, position = [], 0
                    for run, maybe in zip(chunk, sendable, strict=True):
                        if maybe is None:
                            parts.append(_MISS_BYTE * run.count)
                        else:
                            parts.append(answered[position : position + run.count])
                            position += run.count
                    answered = b"".join(parts)
                statuses[offset : offset + size] = answered
                # Later chunks cannot extend a prefix that already broke.
                if answered.count(pb.HIT) != size:
                    break
        except CallFailed:
            if leases:
                self.caller.release(tuple(leases))
            return LookupResult(0, [int(pb.KEY_STATUS_UNSPECIFIED)] * total, ())
        prefix = total - len(statuses.lstrip(_HIT_BYTE))
        with self.session.counting() as counters:
            counters.hit_blocks += statuses.count(pb.HIT)
            counters.miss_blocks += statuses.count(pb.MISS)
            counters.mode_mismatch_blocks += statuses.count(pb.MODE_MISMATCH)
        return LookupResult(prefix, list(statuses), tuple(leases))

    def _sendable(self, run: PackedKeys) -> PackedKeys | None:
        """The run as sent: None when its keys are invalid; base keys that are not one valid length
        per key are dropped (they only feed diagnostics), as Caller.block_ref does."""
        if not run.key_length or not self.caller.valid_key(run.keys[: run.key_length]):
            return None
        base = len(run.base_keys)
        if base and (base % run.count or not 0 < base // run.count <= self.session.limits.max_key_bytes):
            return replace(run, base_keys=b"")
        return run

    def _lookup_chunk(
        self, deadline: Deadline, runs: list[PackedKeys], lease_ms: int, leases: list[str]
    ) -> bytes:
        """One Lookup RPC over at most max_batch_items keys: their statuses, one byte each."""
        request = pb.LookupRequest(lease_ms=lease_ms)
        add_runs(request.packed_blocks, runs)
        wanted = sum(r.count for r in runs)

        def rpc(sid: str, timeout: float) -> pb.LookupResponse:
            request.session_id = sid
            response: pb.LookupResponse = self.session.stub.Lookup(request, timeout=timeout)
            return response

        response = self.caller.call(deadline, rpc)
        if response.lease.lease_id:
            leases.append(response.lease.lease_id)
        answered: bytes = response.packed_statuses
        if len(answered) == wanted:
            return answered
        # A store older than the packed form saw no blocks: ask again in the v1 form.
        if not self._v1_lookup_logged:
            self._v1_lookup_logged = True
            log.warning(
                "kvtag store %s does not answer packed Lookups; using the v1 form", self.session.endpoint
            )
        refs = [
            self.caller.block_ref(r.group, key, base)
            for r in runs
            for key, base in zip(r.split_keys(), r.split_base_keys() or repeat(b""), strict=False)
        ]

        def rpc_v1(sid: str, timeout: float) -> pb.LookupResponse:
            request = pb.LookupRequest(session_id=sid, blocks=refs, lease_ms=lease_ms)
            response: pb.LookupResponse = self.session.stub.Lookup(request, timeout=timeout)
            return response

        response = self.caller.call(deadline, rpc_v1)
        if response.lease.lease_id:
            leases.append(response.lease.lease_id)
        return bytes(response.statuses).ljust(wanted, _MISS_BYTE)
