"""How kvtag lays its blocks out in Mooncake: object keys that name the mode, and a fixed value header.

A block's object key names its namespace, mode, group and key, so an existence check alone says
whether a block is there in a given mode (Mooncake keys carry no metadata, and reading anything
of a value costs a transfer per object). Everything kvtag must verify at read time still travels
in the value: a 104-byte header (magic, format version, mode tag, namespace digest, group, key
digest, payload length, writer nonce, payload XXH3-64, header CRC-32) followed by the payload.
Pure Python, importable without the Mooncake wheel, so the format is unit-tested on its own.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote

import xxhash

MAGIC = b"KVTG"
# Values: the mode is in the key and the payload digest is XXH3-64 (docs/mooncake.md has the
# versions before). Census records keep framing version 1.
FORMAT_VERSION = 2
RECORD_VERSION = 1
# magic, version, header length, mode_id (ASCII, NUL-padded), namespace digest, group,
# key digest, payload length, writer nonce, payload xxh3-64, header crc32 (over all before it).
_HEADER = struct.Struct(">4sHH32s16sI16sQ8sQI")
MAX_MODE_ID_BYTES = 32
HEADER_BYTES = _HEADER.size
_CRC_OFFSET = HEADER_BYTES - 4
# Blocks live under v2 (the mode in the key); census records keep their v1 keys. Blocks under
# kvtag/v1/<namespace>/g<group>/<key> are never looked at (docs/mooncake.md).
KEY_PREFIX = "kvtag/v2"
CENSUS_PREFIX = "kvtag/v1"


class FormatError(ValueError):
    """A stored value that must not be served: wrong magic/version, bad checksum, or another address."""


@dataclass(frozen=True, slots=True)
class Header:
    mode_id: str
    group: int
    key_digest: bytes
    payload_bytes: int
    nonce: bytes
    payload_digest: int


def object_key(namespace_id: str, mode_id: str, group: int, key: bytes) -> str:
    """The Mooncake key of a block in one mode. Read from the right it is unambiguous (the key is
    hex, the group g<digits>, the mode has no "/"), so two blocks never share an object key."""
    return f"{KEY_PREFIX}/{namespace_id}/{_mode_part(mode_id)}/g{group}/{key.hex()}"


def object_keys(namespace_id: str, mode_id: str, addresses: Iterable[tuple[int, bytes]]) -> list[str]:
    """object_key of each (group, key), the prefix built once per group: a Lookup keys thousands."""
    prefixes: dict[int, str] = {}
    mode = _mode_part(mode_id)
    out: list[str] = []
    for group, key in addresses:
        prefix = prefixes.get(group)
        if prefix is None:
            prefix = prefixes[group] = f"{KEY_PREFIX}/{namespace_id}/{mode}/g{group}/"
        out.append(prefix + key.hex())
    return out


def directory_key(namespace_id: str, slot: int) -> str:
    """Slot `slot` of a namespace's mode directory (mooncake.modes). Its second-last part is
    "modes", never g<digits>, so it is never a block's key."""
    return f"{KEY_PREFIX}/{namespace_id}/modes/{slot}"


def _mode_part(mode_id: str) -> str:
    return quote(mode_id, safe="-._~")


def census_key(namespace_id: str, record: str) -> str:
    return f"{CENSUS_PREFIX}/census/{namespace_id}/{record}"


def layout_key(model_key: str, slot: int) -> str:
    """Slot `slot` of a model's layout directory (mooncake.descriptions): one namespace of the model."""
    return f"{CENSUS_PREFIX}/census/models/{model_key}/layouts/{slot}"


def key_digest(key: bytes) -> bytes:
    """Binds a value to its block key: a value found under another key is refused."""
    return hashlib.blake2b(key, digest_size=16).digest()


@functools.lru_cache(maxsize=1024)
def namespace_digest(namespace_id: str) -> bytes:
    """Binds a value to its namespace whatever the id's length (cached: every header of a batch,
    written or checked, asks for the same one)."""
    return hashlib.blake2b(namespace_id.encode(), digest_size=16, person=b"kvtag-ns").digest()


# XXH3-64, the digest a shared-memory client already sends with its commit (and the memory
# backend's): taken from the client it costs the service nothing, and it is faster than CRC-32.
payload_checksum = xxhash.xxh3_64_intdigest


def encode_header(
    namespace_id: str,
    mode_id: str,
    group: int,
    key: bytes,
    payload: bytes | memoryview,
    nonce: bytes,
    digest: int | None = None,
) -> bytes:
    """The header of a value; `digest` is the payload's XXH3-64 when the writer sent it (a wrong
    one makes the value fail the first verified read, never serves wrong bytes)."""
    mode = mode_id.encode("ascii")
    if len(mode) > MAX_MODE_ID_BYTES:
        raise ValueError(f"mode id {mode_id!r} is longer than {MAX_MODE_ID_BYTES} bytes")
    body = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        mode,
        namespace_digest(namespace_id),
        group,
        key_digest(key),
        len(payload),
        nonce,
        payload_checksum(payload) if digest is None else digest,
        0,
    )
    return body[:_CRC_OFFSET] + struct.pack(">I", zlib.crc32(body[:_CRC_OFFSET]))


def decode_header(
    raw: bytes | memoryview, namespace_id: str, group: int, key: bytes, mode_id: str | None = None
) -> Header:
    """Parse and check a header against the address it was read from (and the mode whose key it
    was read under, if given); raise FormatError otherwise."""
    if len(raw) < HEADER_BYTES:
        raise FormatError(f"value is {len(raw)} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, version, length, mode, ns, grp, digest, size, nonce, crc, header_crc = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise FormatError("not a kvtag value (bad magic)")
    if version != FORMAT_VERSION or length != HEADER_BYTES:
        raise FormatError(f"unknown kvtag value format {version} (header {length} bytes)")
    if zlib.crc32(bytes(raw[:_CRC_OFFSET])) != header_crc:
        raise FormatError("header checksum mismatch")
    if ns != namespace_digest(namespace_id) or grp != group or digest != key_digest(key):
        raise FormatError("value belongs to another block address")
    stored_mode = mode.rstrip(b"\0").decode("ascii")
    if mode_id is not None and stored_mode != mode_id:
        raise FormatError(f"value of mode {stored_mode} under mode {mode_id}'s key")
    return Header(stored_mode, grp, digest, size, nonce, crc)


def verify_payload(header: Header, value: bytes) -> memoryview:
    """The payload of a whole stored value, after its length and checksum are checked."""
    payload = memoryview(value)[HEADER_BYTES:]
    if len(payload) != header.payload_bytes:
        raise FormatError(f"payload is {len(payload)} bytes, header says {header.payload_bytes}")
    if payload_checksum(payload) != header.payload_digest:
        raise FormatError("payload checksum mismatch")
    return payload


def encode_record(body: bytes) -> bytes:
    """A census record: magic, version, CRC-32, body."""
    return MAGIC + struct.pack(">HI", RECORD_VERSION, zlib.crc32(body)) + body


def decode_record(raw: bytes) -> bytes:
    if len(raw) < 10 or raw[:4] != MAGIC:
        raise FormatError("not a kvtag census record")
    version, crc = struct.unpack_from(">HI", raw, 4)
    body = raw[10:]
    if version != RECORD_VERSION or zlib.crc32(body) != crc:
        raise FormatError("census record fails its checksum or has an unknown version")
    return body
