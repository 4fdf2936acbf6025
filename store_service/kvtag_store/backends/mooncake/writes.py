"""The Mooncake backend's puts: inline values (one or a batch) and values staged in shared memory.

Every put registers its mode in the namespace's mode directory first, then checks which of its
blocks are there already (in its mode: ALREADY_PRESENT; in another: CONFLICT) with existence
checks alone, and puts the rest. After the put one more existence check settles each block
(`ClusterWriter._outcomes`) and checks the other modes' keys again: a block another mode stored
meanwhile makes ours go (removed) and answer CONFLICT, so one address never stays held by two
modes (mooncake.modes says why this cannot miss). No header is read back on that path, which
leaves one race open: two writers of one key in the *same* mode whose puts both start within
one existence check of each other can both answer STORED (Mooncake keeps the first value and
returns 0 to both); the stored value is one of theirs, in their mode. A batch put whose single
return code is ambiguous is judged by the stored headers instead (our writer nonce).
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Sequence
from typing import Literal, NamedTuple

from kvtag_store.backends.base import BackendUnavailable, BlockAddress, Payload, PutOutcome, PutResult
from kvtag_store.backends.mooncake.client import read_master_metrics
from kvtag_store.backends.mooncake.cluster import Cluster
from kvtag_store.backends.mooncake.errors import MooncakeCode, describe
from kvtag_store.backends.mooncake.format import (
    HEADER_BYTES,
    FormatError,
    decode_header,
    encode_header,
    object_key,
)
from kvtag_store.backends.mooncake.modes import Unregistered
from kvtag_store.backends.mooncake.staging import Staged

# Put codes after which the stored header, not the code, says what happened.
PUT_ACCEPTED = (MooncakeCode.OK, MooncakeCode.OBJECT_ALREADY_EXISTS)
# Read-back codes of a value another writer is still putting (it is not readable yet).
_IN_FLIGHT = (MooncakeCode.OBJECT_NOT_FOUND, MooncakeCode.OBJECT_ALREADY_EXISTS)
# A put that returned 0 but whose header is not readable yet may be another writer's in-flight put.
_VERIFY_ATTEMPTS = 5
_VERIFY_BACKOFF_S = 0.02
_NO_OUTCOME = PutResult(PutOutcome.REJECTED, "internal: no outcome")
_ALREADY_PRESENT = PutResult(PutOutcome.ALREADY_PRESENT)
_STORED = PutResult(PutOutcome.STORED)


def conflict(holder: str) -> PutResult:
    return PutResult(PutOutcome.CONFLICT, f"key is held by mode {holder}")


class Undecided(enum.Enum):
    """A read-back that proves nothing yet; only the single-value path can settle it."""

    IN_FLIGHT = "another writer's put of the key is still in flight: read it back again"
    DROPPED = "the key held a corrupt value, now dropped: put again"


class _Sent(NamedTuple):
    """The values one put call sent, as parallel lists (no object per value): where, under which
    writer nonce, and the code the call returned for each."""

    addresses: Sequence[BlockAddress]
    mkeys: list[str]
    nonces: list[bytes]
    codes: Sequence[int]


class ClusterWriter:
    """Puts into the cluster, each judged by the header it left."""

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self._client = cluster.client
        self._capacity_seen: tuple[float, int | None] = (float("-inf"), None)

    def too_large(self, length: int) -> PutResult | None:
        """The refusal of a value larger than a put can stage, None if it fits."""
        limit = self._cluster.max_value_bytes
        if length <= limit:
            return None
        return PutResult(
            PutOutcome.REJECTED,
            f"value of {length} bytes exceeds the Mooncake backend limit of {limit} "
            "bytes (a quarter of --mooncake-local-buffer); raise the local buffer",
        )

    def put(self, namespace_id: str, mode_id: str, address: BlockAddress, value: Payload) -> PutResult:
        refused = self.too_large(len(value))
        if refused is not None:
            return refused
        self._cluster.breaker.check("storing")
        group, key = address
        mkey = object_key(namespace_id, mode_id, group, key)
        nonce = os.urandom(8)
        try:
            header = encode_header(namespace_id, mode_id, group, key, value, nonce)
        except ValueError as exc:
            return PutResult(PutOutcome.REJECTED, str(exc))
        [known] = self.check(namespace_id, mode_id, [address])
        if known is not None:
            return known
        for _attempt in range(2):
            rc = self._client.put_parts(mkey, header, value)
            if rc == MooncakeCode.BUFFER_OVERFLOW:
                # The local buffer is busy with concurrent transfers: one short retry.
                time.sleep(_VERIFY_BACKOFF_S)
                rc = self._client.put_parts(mkey, header, value)
            self._cluster.breaker.screen([rc], "storing a block", counted_unless=PUT_ACCEPTED)
            if rc not in PUT_ACCEPTED:
                return PutResult(PutOutcome.REJECTED, self._put_failure(rc))
            verdict = self._confirm(namespace_id, mode_id, _Sent([address], [mkey], [nonce], [rc]))
            if verdict is not Undecided.DROPPED:
                return verdict
        return PutResult(PutOutcome.REJECTED, "the key held a corrupt value; it was dropped, retry the put")

    def check(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]
    ) -> list[PutResult | None]:
        """Before a put: the mode registered in the directory, then per block the outcome already
        known from existence checks (ALREADY_PRESENT, CONFLICT), None where the put must go on."""
        refused = self.register(namespace_id, mode_id)
        if refused is not None:
            return [refused] * len(addresses)
        found = self._cluster.presence(
            namespace_id, mode_id, addresses, "checking blocks before a put", writing=True
        )
        return [
            _ALREADY_PRESENT if here else conflict(holder) if holder else None
            for here, holder in zip(found.present, found.holders, strict=True)
        ]

    def register(self, namespace_id: str, mode_id: str) -> PutResult | None:
        """The mode in the namespace's directory (mooncake.modes), or the refusal of the put."""
        try:
            self._cluster.modes.register(namespace_id, mode_id)
        except Unregistered as exc:
            reason = self._put_failure(exc.code) if exc.code is not None else str(exc)
            return PutResult(PutOutcome.REJECTED, reason)
        return None

    def _yield(
        self,
        namespace_id: str,
        mode_id: str,
        addresses: Sequence[BlockAddress],
        mkeys: Sequence[str],
        results: list[PutResult | None],
    ) -> None:
        """After a put: each block this put stored that another mode holds too is removed and
        answered CONFLICT (the directory read again first, so a mode registered meanwhile counts)."""
        stored = [i for i, r in enumerate(results) if r is not None and r.outcome is PutOutcome.STORED]
        what = "checking other modes after a put"
        holders = self._cluster.other_holders(
            namespace_id, mode_id, [addresses[i] for i in stored], what, writing=True
        )
        lost = [(i, holder) for i, holder in zip(stored, holders, strict=True) if holder]
        if lost:
            self._client.batch_remove([mkeys[i] for i, _ in lost], True)
            for i, holder in lost:
                results[i] = conflict(holder)

    def _confirm(
        self, namespace_id: str, mode_id: str, sent: _Sent
    ) -> PutResult | Literal[Undecided.DROPPED]:
        """What one put really did, read back until another writer's in-flight put has landed."""
        for attempt in range(_VERIFY_ATTEMPTS):
            [verdict] = self._outcomes(namespace_id, mode_id, sent, per_key=True)
            if verdict is not Undecided.IN_FLIGHT:
                return verdict
            time.sleep(_VERIFY_BACKOFF_S * (attempt + 1))
        self._cluster.errors.add(MooncakeCode.OBJECT_NOT_FOUND)
        return PutResult(
            PutOutcome.REJECTED,
            "Mooncake accepted the put but the value was not readable afterwards "
            "(a concurrent writer or an immediate eviction); not counted as stored",
        )

    def put_many(
        self, namespace_id: str, mode_id: str, items: Sequence[tuple[BlockAddress, Payload]]
    ) -> list[PutResult]:
        """`put` for a batch: one Mooncake put_batch and one header read-back per chunk instead of a
        round trip pair per item. Per-item truth still comes from each item's stored header."""
        self._cluster.breaker.check("storing")
        results: list[PutResult | None] = [None] * len(items)
        if not items:
            return []
        for index, known in enumerate(self.check(namespace_id, mode_id, [address for address, _ in items])):
            results[index] = known
        budget = self._cluster.settings.local_buffer_bytes // 4
        chunk: list[int] = []
        chunk_keys: set[str] = set()
        chunk_bytes = 0
        single: list[int] = []
        for index, (address, value) in enumerate(items):
            if results[index] is not None:
                continue
            mkey = object_key(namespace_id, mode_id, *address)
            if len(value) > self._cluster.max_value_bytes or mkey in chunk_keys:
                single.append(index)  # refused by put with its reason / a duplicate judged after
                continue
            if chunk and chunk_bytes + len(value) + HEADER_BYTES > budget:
                self._put_chunk(namespace_id, mode_id, items, chunk, results, single)
                chunk, chunk_keys, chunk_bytes = [], set(), 0
            chunk.append(index)
            chunk_keys.add(mkey)
            chunk_bytes += len(value) + HEADER_BYTES
        if chunk:
            self._put_chunk(namespace_id, mode_id, items, chunk, results, single)
        for index in single:
            results[index] = self.put(namespace_id, mode_id, *items[index])
        return [r if r is not None else _NO_OUTCOME for r in results]

    def _put_chunk(
        self,
        namespace_id: str,
        mode_id: str,
        items: Sequence[tuple[BlockAddress, Payload]],
        chunk: list[int],
        results: list[PutResult | None],
        single: list[int],
    ) -> None:
        """One put_batch; items it cannot settle are left to `single`."""
        mkeys: list[str] = []
        nonces: list[bytes] = []
        blobs: list[bytes] = []
        for index in chunk:
            (group, key), value = items[index]
            nonce = os.urandom(8)
            try:
                header = encode_header(namespace_id, mode_id, group, key, value, nonce)
            except ValueError as exc:
                results[index] = PutResult(PutOutcome.REJECTED, str(exc))
                continue
            mkeys.append(object_key(namespace_id, mode_id, group, key))
            nonces.append(nonce)
            blobs.append(header + value)
        chunk = [i for i in chunk if results[i] is None]
        if not chunk:
            return
        rc = self._client.put_batch(mkeys, blobs)
        self._cluster.breaker.screen([rc], "storing blocks", counted_unless=PUT_ACCEPTED)
        sent = _Sent([items[index][0] for index in chunk], mkeys, nonces, [rc] * len(chunk))
        for index, verdict in zip(
            chunk, self._outcomes(namespace_id, mode_id, sent, per_key=False), strict=True
        ):
            if isinstance(verdict, Undecided):
                single.append(index)
            else:
                results[index] = verdict

    def put_staged(
        self,
        namespace_id: str,
        mode_id: str,
        entries: Sequence[tuple[BlockAddress, Staged]],
        digests: Sequence[int | None] | None = None,
    ) -> list[PutResult]:
        """Put values written into staging slots: each slot gets its header in place (under the
        writer's digest where given) and the cluster takes the object straight from the arena (one
        batch_put_from_multi_buffers)."""
        self._cluster.breaker.check("storing")
        results: list[PutResult | None] = [None] * len(entries)
        taken: list[int] = []
        addresses: list[BlockAddress] = []
        mkeys: list[str] = []
        nonces: list[bytes] = []
        pointers: list[list[int]] = []
        sizes: list[list[int]] = []
        for n, ((group, key), staged) in enumerate(entries):
            nonce = os.urandom(8)
            try:
                digest = digests[n] if digests is not None else None
                header = encode_header(namespace_id, mode_id, group, key, staged.payload(), nonce, digest)
            except ValueError as exc:
                results[n] = PutResult(PutOutcome.REJECTED, str(exc))
                continue
            staged.header()[:] = header
            ptrs, lengths = staged.buffers()
            taken.append(n)
            addresses.append((group, key))
            mkeys.append(object_key(namespace_id, mode_id, group, key))
            nonces.append(nonce)
            pointers.append(ptrs)
            sizes.append(lengths)
        if taken:
            try:
                refused = self.register(namespace_id, mode_id)
                if refused is not None:
                    return [refused] * len(entries)
                codes = self._client.batch_put_from_multi_buffers(mkeys, pointers, sizes)
            finally:  # the headers are sent (or never will be): the generation words go back
                for n in taken:
                    entries[n][1].restore_generation()
            self._cluster.breaker.screen(codes, "storing blocks", counted_unless=PUT_ACCEPTED)
            sent = _Sent(addresses, mkeys, nonces, codes)
            for n, verdict in zip(
                taken, self._outcomes(namespace_id, mode_id, sent, per_key=True), strict=True
            ):
                # Undecided: only the single path can tell (it waits for an in-flight writer), from a copy.
                if isinstance(verdict, Undecided):
                    address, staged = entries[n]
                    verdict = self.put(namespace_id, mode_id, address, bytes(staged.payload()))
                results[n] = verdict
        return [r if r is not None else _NO_OUTCOME for r in results]

    def _outcomes(
        self, namespace_id: str, mode_id: str, sent: _Sent, *, per_key: bool
    ) -> list[PutResult | Undecided]:
        """Each sent value's outcome: the one place a put is judged. With a code per key, one
        existence check after the put settles it (the check before it already answered the blocks
        that were there): accepted with 0 and there is STORED, -703 (another writer's put was in
        flight) and there is ALREADY_PRESENT; a block another mode holds too is removed and
        CONFLICT; accepted and not there yet is waited for, like -703 (another writer's put may be in
        flight). `put_batch` returns one code for the whole batch, so a -703 there cannot say which
        key it was about: those batches are judged by their stored headers (our nonce)."""
        if not per_key and any(code == MooncakeCode.OBJECT_ALREADY_EXISTS for code in sent.codes):
            verdicts = self._judge(namespace_id, mode_id, sent)
            judged = [v if isinstance(v, PutResult) else None for v in verdicts]
            self._yield(namespace_id, mode_id, sent.addresses, sent.mkeys, judged)
            return [j if j is not None else v for j, v in zip(judged, verdicts, strict=True)]
        here, holders = self._cluster.after_put(
            namespace_id, mode_id, sent.addresses, sent.mkeys, "confirming a store"
        )
        out: list[PutResult | Undecided] = []
        lost: list[str] = []
        for mkey, code, present, holder in zip(sent.mkeys, sent.codes, here, holders, strict=True):
            if code not in PUT_ACCEPTED:
                out.append(PutResult(PutOutcome.REJECTED, self._put_failure(code)))
            elif code == MooncakeCode.OBJECT_ALREADY_EXISTS:
                out.append(_ALREADY_PRESENT if present else Undecided.IN_FLIGHT)
            elif not present:
                # Accepted, yet not there: Mooncake answers 0 to a put of a key whose put by another
                # writer is still in flight (and keeps that one), and put_batch's one code says even
                # less. That put may not be visible yet: waited for as after -703 (_confirm; after a
                # batch, the single path puts again first), and REJECTED only if it never shows.
                out.append(Undecided.IN_FLIGHT)
            elif holder is not None:
                lost.append(mkey)
                out.append(conflict(holder))
            else:
                out.append(_STORED)
        if lost:
            self._client.batch_remove(lost, True)
        return out

    def _judge(self, namespace_id: str, mode_id: str, sent: _Sent) -> list[PutResult | Undecided]:
        """Each sent value's outcome from its stored header, read back for all at once: the one place
        a put is judged. A header with our nonce is STORED, another writer's ALREADY_PRESENT (the
        key names the mode, so it is this mode's); a corrupt or misplaced one is dropped."""
        out: list[PutResult | Undecided] = []
        found = self._cluster.headers.read(sent.mkeys)
        for address, mkey, nonce, code, header in zip(*sent, found, strict=True):
            if isinstance(header, bytes):
                try:
                    stored = decode_header(header, namespace_id, *address, mode_id)
                except FormatError:
                    self._cluster.drop_corrupt([mkey])
                    out.append(Undecided.DROPPED)
                    continue
                out.append(PutResult(PutOutcome.STORED) if stored.nonce == nonce else _ALREADY_PRESENT)
                continue
            self._cluster.breaker.screen([header], "confirming a store")
            if code not in PUT_ACCEPTED:
                out.append(PutResult(PutOutcome.REJECTED, self._put_failure(code)))
            elif header in _IN_FLIGHT:
                out.append(Undecided.IN_FLIGHT)
            else:
                self._cluster.errors.add(header)
                out.append(
                    PutResult(
                        PutOutcome.REJECTED,
                        f"the store could not be confirmed: {describe(header)} on read-back",
                    )
                )
        return out

    def _put_failure(self, code: int) -> str:
        if code == MooncakeCode.NO_AVAILABLE_HANDLE:
            if self._mounted_bytes() == 0:
                return (
                    "no Mooncake storage segment is mounted (NO_AVAILABLE_HANDLE -200, cluster capacity "
                    "0 bytes); start a storage node (mooncake_client --global_segment_size=...) or give "
                    "a kvtag replica --mooncake-segment-size"
                )
            return (
                "Mooncake cluster full (NO_AVAILABLE_HANDLE -200): eviction has not freed room yet or "
                "everything is leased; retry later or add storage segments"
            )
        if code == MooncakeCode.TRANSFER_FAIL:
            return "transfer to the Mooncake storage process failed (TRANSFER_FAIL -800); not stored"
        if code == MooncakeCode.BUFFER_OVERFLOW:
            return "the Mooncake local buffer is busy (-600); retry or raise --mooncake-local-buffer"
        return f"Mooncake refused the put: {describe(code)}"

    def _mounted_bytes(self) -> int | None:
        """The cluster's mounted capacity from the master's metrics (None if they cannot be read),
        read at most once a second: a batch of refused puts asks once."""
        at, capacity = self._capacity_seen
        if time.monotonic() - at > 1.0:
            try:
                metrics = read_master_metrics(self._cluster.settings.metrics)
                capacity = int(metrics.get("master_total_capacity_bytes", -1))
            except BackendUnavailable:
                capacity = None
            self._capacity_seen = (time.monotonic(), capacity)
        return capacity
