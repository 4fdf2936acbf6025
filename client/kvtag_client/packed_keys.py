"""Block keys packed into runs: one message per run of keys, whatever its length, for Lookup and for
the shared-memory path's ReserveSlots, CommitSlots and GetReferences."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import groupby
from operator import itemgetter

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from kvtag.v1 import store_pb2 as pb


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
    token_ids: bytes = b""  # empty, or count blocks' token ids (uint32 LE), as many per block

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
        base = tokens = b""
        if self.base_keys and self.count:
            b = len(self.base_keys) // self.count
            base = self.base_keys[start * b : end * b]
        if self.token_ids and self.count:
            t = len(self.token_ids) // self.count
            tokens = self.token_ids[start * t : end * t]
        return PackedKeys(self.group, self.keys[start * k : end * k], k, base, tokens)


def pack_blocks(
    blocks: Sequence[tuple[int, bytes, bytes]], token_ids: Sequence[bytes] = ()
) -> list[PackedKeys]:
    """(group, key, base_key) blocks as runs of consecutive blocks sharing a group, a key length and a
    base key length (and a token count, with `token_ids`, one per block). The common case (one group,
    one length) is checked with C-level passes."""
    if not blocks:
        return []
    if any(token_ids):
        return _pack_with_tokens(blocks, list(token_ids))
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


def _pack_with_tokens(blocks: Sequence[tuple[int, bytes, bytes]], tokens: list[bytes]) -> list[PackedKeys]:
    runs: list[PackedKeys] = []
    position = 0
    shapes = ((g, len(k), len(b), len(t)) for (g, k, b), t in zip(blocks, tokens, strict=True))
    for (group, key_length, _, _), members in groupby(shapes):
        end = position + len(list(members))
        if key_length == 0:  # keyless blocks: one run each, answered MISS locally
            runs.extend(PackedKeys(group, b"", 0) for _ in range(end - position))
        else:
            part = blocks[position:end]
            runs.append(
                PackedKeys(
                    group,
                    b"".join(k for _, k, _ in part),
                    key_length,
                    b"".join(b for _, _, b in part),
                    b"".join(tokens[position:end]),
                )
            )
        position = end
    return runs


def add_runs(field: RepeatedCompositeFieldContainer[pb.PackedBlocks], runs: Iterable[PackedKeys]) -> None:
    """Append runs to a request's repeated PackedBlocks field, each filled in place (a message built
    apart would be copied in)."""
    add = field.add
    for run in runs:
        add(
            key_length=run.key_length,
            keys=run.keys,
            group=run.group,
            base_keys=run.base_keys,
            token_ids=run.token_ids,
        )


def chunked(runs: Sequence[PackedKeys], limit: int) -> Iterator[tuple[int, list[PackedKeys]]]:
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
