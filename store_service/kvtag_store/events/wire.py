"""vLLM's KV-event wire format, as kvtag speaks it: the msgpack structures, the topic names, the
frames of a published batch and of a replay answer.

The structures are written here to match `vllm/distributed/kv_events.py` (0.32 to 0.34) field for
field, so that a subscriber decoding with vLLM's own classes reads them unchanged: an `EventBatch` is
a msgpack array `[ts, events, data_parallel_rank]`, each event a map tagged `"type"` with its class
name. kvtag sets only fields every one of those versions has; the hashing mode travels in the topic,
never in an event.
"""

from __future__ import annotations

from typing import Any

import msgspec

# A block's hash as it travels: the key bytes under which the block is stored (vLLM's
# ExternalBlockHash is `bytes | int`; kvtag's keys are bytes).
BlockHash = bytes

# Medium per tier (BlockStored.medium, BlockRemoved.medium). vLLM's engines say "GPU", "CPU" and
# "STORAGE"; kvtag's memory tier is host DRAM, "CPU" as vLLM's CPU offloading says it. The disk
# tier and Mooncake have names of their own, so a router can weigh them apart.
MEDIUMS: dict[str, str] = {"memory": "CPU", "disk": "DISK", "mooncake": "MOONCAKE"}

# Every kvtag topic starts with this; a subscriber to it sees the whole store.
TOPIC_PREFIX = "kvtag/"
# The store-wide topic: an AllBlocksCleared here at start-up clears every topic of this store.
STORE_TOPIC = "kvtag/*"
# The sequence number of the frame that ends a replay answer (as vLLM's publisher sends it).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def topic(namespace_id: str, mode_id: str) -> str:
    """The topic of one namespace's blocks in one hashing mode."""
    return f"{TOPIC_PREFIX}{namespace_id}/{mode_id}"


def parse_topic(name: str) -> tuple[str, str] | None:
    """(namespace_id, mode_id) of a mode's topic; None for the store topic or another publisher's."""
    if not name.startswith(TOPIC_PREFIX):
        return None
    namespace_id, sep, mode_id = name[len(TOPIC_PREFIX) :].partition("/")
    if not sep or namespace_id == "*" or not mode_id:
        return None
    return namespace_id, mode_id


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One event: a msgpack map whose "type" is the class name (vLLM's tagging)."""


class BlockStored(KVCacheEvent):
    """Blocks entered a medium. kvtag sends one block per event (its puts are not hash chains), with
    the KV cache group in group_idx; token_ids stay empty (the store never sees tokens)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """Everything published before on the batch's topic (all topics, on STORE_TOPIC) is gone."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """`[ts, events, data_parallel_rank]`; kvtag leaves the rank out (it has none)."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(EventBatch)


def encode(batch: EventBatch) -> bytes:
    return ENCODER.encode(batch)


def decode(payload: bytes) -> EventBatch:
    """A batch as kvtag's own subscriber reads it (msgspec.ValidationError / DecodeError if not one)."""
    return _DECODER.decode(payload)


def as_json(event: Event) -> dict[str, Any]:
    """An event for people and scripts: hashes as hex."""
    doc: dict[str, Any] = {"type": type(event).__name__}
    for name in event.__struct_fields__:
        value = getattr(event, name)
        if name == "block_hashes":
            value = [h.hex() if isinstance(h, bytes) else h for h in value]
        elif name == "parent_block_hash" and isinstance(value, bytes):
            value = value.hex()
        doc[name] = value
    return doc
