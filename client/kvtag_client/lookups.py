"""Lookup: block keys packed into runs (no message per key), chunked within the server's limits."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import groupby, repeat
from operator import itemgetter

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from kvtag.v1 import store_pb2 as pb

from kvtag_client.calls import Calls, Leases
from kvtag_client.session import _CallFailed, _Deadline, log

_HIT_BYTE = bytes([pb.HIT])
_MISS_BYTE = bytes([pb.MISS])


@dataclass(frozen=True, slots=True)
class PackedKeys:
    """A run of block keys of one length in one group, concatenated: Lookup's packed form.

    Why: a BlockRef message per key was most of a long lookup's client time (docs/benchmarks.md,
    "Figures behind choices in the code"); a run is one message whatever its length, and the server
    cuts it in one C call.
    """

    group: int
    keys: bytes  # count * key_length bytes
    key_length: int
    base_keys: bytes = b""  # empty, or count legacy base keys of one length, concatenated

    @property
    def count(self) -> int:
        """Blocks in the run; a run with key_length 0 stands for one block with an empty key."""
        return len(self.keys) // self.key_length if self.key_length else 1

    def split_keys(self) -> list[bytes]:
        k = self.key_length
        return [self.keys[i : i + k] for i in range(0, self.count * k, k)]

    def split_base_keys(self) -> list[bytes]:
        if not self.base_keys or not self.count:
            return []
        k = len(self.base_keys) // self.count
        return [self.base_keys[i : i + k] for i in range(0, self.count * k, k)]

    def sliced(self, start: int, end: int) -> PackedKeys:
        """Keys [start, end) of the run."""
        k = self.key_length
        base = b""
        if self.base_keys and self.count:
            b = len(self.base_keys) // self.count
            base = self.base_keys[start * b : end * b]
        return PackedKeys(self.group, self.keys[start * k : end * k], k, base)


def pack_blocks(blocks: Sequence[tuple[int, bytes, bytes]]) -> list[PackedKeys]:
    """(group, key, base_key) blocks as runs of consecutive blocks sharing a group, a key length and a
    base key length. The common case (one group, one length) is checked with C-level passes."""
    if not blocks:
        return []
    groups = list(map(itemgetter(0), blocks))
    keys = list(map(itemgetter(1), blocks))
    bases = list(map(itemgetter(2), blocks))
    key_lengths = list(map(len, keys))
    base_lengths = list(map(len, bases))
    n = len(blocks)
    shape = (groups[0], key_lengths[0], base_lengths[0])
    if (
        groups.count(shape[0]) == n
        and key_lengths.count(shape[1]) == n
        and base_lengths.count(shape[2]) == n
        and shape[1]
    ):
        return [PackedKeys(shape[0], b"".join(keys), shape[1], b"".join(bases))]
    runs: list[PackedKeys] = []
    position = 0
    for (group, key_length, _), members in groupby(zip(groups, key_lengths, base_lengths, strict=True)):
        count = len(list(members))
        end = position + count
        if key_length == 0:  # keyless blocks: one run each, answered MISS locally
            runs.extend(PackedKeys(group, b"", 0) for _ in range(count))
        else:
            runs.append(
                PackedKeys(group, b"".join(keys[position:end]), key_length, b"".join(bases[position:end]))
            )
        position = end
    return runs


def add_runs(field: RepeatedCompositeFieldContainer[pb.PackedBlocks], runs: Iterable[PackedKeys]) -> None:
    """Append runs to a request's repeated PackedBlocks field, each filled in place (a message built
    apart would be copied in)."""
    add = field.add
    for run in runs:
        add(key_length=run.key_length, keys=run.keys, group=run.group, base_keys=run.base_keys)


def _chunked(runs: Sequence[PackedKeys], limit: int) -> Iterator[tuple[int, list[PackedKeys]]]:
    """(offset, runs) of at most `limit` keys each, cutting runs where needed."""
    chunk: list[PackedKeys] = []
    size = 0
    offset = 0
    for run in runs:
        count = run.count
        start = 0
        while start < count:
            take = min(count - start, limit - size)
            chunk.append(run if take == count else run.sliced(start, start + take))
            size += take
            start += take
            if size == limit:
                yield offset, chunk
                offset += size
                chunk, size = [], 0
    if chunk:
        yield offset, chunk


@dataclass(frozen=True, slots=True)
class LookupResult:
    prefix_length: int  # leading HIT count (0 when degraded)
    statuses: list[int]  # kvtag.v1.KeyStatus per block; UNSPECIFIED for blocks not asked
    leases: Leases  # () when nothing leased


class Lookups(Calls):
    """StoreClient's lookup calls."""

    def lookup(self, blocks: Sequence[tuple[int, bytes, bytes]], lease_ms: int = 0) -> LookupResult:
        """Leading HIT count, a status per (group, key, base_key) block and a read lease on the hits;
        misses when degraded. Sent in the packed form (see lookup_packed)."""
        return self.lookup_packed(pack_blocks(blocks), lease_ms)

    def lookup_packed(self, runs: Sequence[PackedKeys], lease_ms: int = 0) -> LookupResult:
        """lookup() over runs of concatenated keys: no Python object per key on either side.

        Statuses follow the runs' concatenation. A run with an invalid key length is
        answered MISS locally; invalid base keys are dropped (they only feed diagnostics).
        """
        with self._lock:
            self.counters.lookups += 1
        total = sum(run.count for run in runs)
        if not total:
            return LookupResult(0, [], ())
        statuses = bytearray(total)  # KEY_STATUS_UNSPECIFIED until answered
        leases: list[str] = []
        deadline = _Deadline(self.rpc_timeout_s)
        try:
            for offset, chunk in _chunked(runs, self._batch_size()):
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
        except _CallFailed:
            if leases:
                self.release(tuple(leases))
            return LookupResult(0, [int(pb.KEY_STATUS_UNSPECIFIED)] * total, ())
        prefix = total - len(statuses.lstrip(_HIT_BYTE))
        with self._lock:
            self.counters.hit_blocks += statuses.count(pb.HIT)
            self.counters.miss_blocks += statuses.count(pb.MISS)
            self.counters.mode_mismatch_blocks += statuses.count(pb.MODE_MISMATCH)
        return LookupResult(prefix, list(statuses), tuple(leases))

    def _sendable(self, run: PackedKeys) -> PackedKeys | None:
        """The run as sent: None when its keys are invalid; base keys that are not one valid length
        per key are dropped (they only feed diagnostics), as _block_ref does."""
        if not run.key_length or not self._valid_key(run.keys[: run.key_length]):
            return None
        base = len(run.base_keys)
        if base and (base % run.count or not 0 < base // run.count <= self.limits.max_key_bytes):
            return replace(run, base_keys=b"")
        return run

    def _lookup_chunk(
        self, deadline: _Deadline, runs: list[PackedKeys], lease_ms: int, leases: list[str]
    ) -> bytes:
        """One Lookup RPC over at most max_batch_items keys: their statuses, one byte each."""
        request = pb.LookupRequest(lease_ms=lease_ms)
        add_runs(request.packed_blocks, runs)
        wanted = sum(r.count for r in runs)

        def rpc(sid: str, timeout: float) -> pb.LookupResponse:
            request.session_id = sid
            response: pb.LookupResponse = self._stub.Lookup(request, timeout=timeout)
            return response

        response = self._call(deadline, rpc)
        if response.lease.lease_id:
            leases.append(response.lease.lease_id)
        answered: bytes = response.packed_statuses
        if len(answered) == wanted:
            return answered
        # A store older than the packed form saw no blocks: ask again in the v1 form.
        if not self._v1_lookup_logged:
            self._v1_lookup_logged = True
            log.warning("kvtag store %s does not answer packed Lookups; using the v1 form", self.endpoint)
        refs = [
            self._block_ref(r.group, key, base)
            for r in runs
            for key, base in zip(r.split_keys(), r.split_base_keys() or repeat(b""), strict=False)
        ]

        def rpc_v1(sid: str, timeout: float) -> pb.LookupResponse:
            request = pb.LookupRequest(session_id=sid, blocks=refs, lease_ms=lease_ms)
            response: pb.LookupResponse = self._stub.Lookup(request, timeout=timeout)
            return response

        response = self._call(deadline, rpc_v1)
        if response.lease.lease_id:
            leases.append(response.lease.lease_id)
        return bytes(response.statuses).ljust(wanted, _MISS_BYTE)
