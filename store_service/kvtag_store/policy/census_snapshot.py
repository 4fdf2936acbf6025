"""The census's first-writer records on disk (`DIR/census.json`), so admission after a restart on a
`--disk-dir` is what it was before: a strict namespace keeps refusing the modes it refused.

What admission reads across sessions is only the CensusStore's records: a strict namespace's
established mode, each mode's reference probe keys, and the descriptions of namespaces and modes
that name what a gone engine left (MODE_SPLIT's field diff, LAYOUT_SPLIT's sibling; policy/census.py);
engines, counters and refusal logs are this process's view and start empty. The records change once
per new namespace or mode, so every change rewrites the whole snapshot synchronously (tmp + fsync +
rename + fsync of the directory): a record admitted is a record that survives a crash. The cost is a
small file write or two per first session of a namespace or mode, bounded by --max-namespaces.

The blocks on disk are a second witness: a namespace whose restored blocks carry modes {A} but no
established mode in the snapshot (a snapshot lost or corrupt) admits only those modes under strict,
so a snapshot older than the blocks can never let another mode in.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError
from kvtag.v1 import store_pb2 as pb
from kvtag_proto import ids

from kvtag_store import errors
from kvtag_store.backends.base import ProbeRecord
from kvtag_store.backends.descriptions import Descriptions
from kvtag_store.policy import mode_diff

log = logging.getLogger("kvtag_store.policy.census_snapshot")

SNAPSHOT_NAME = "census.json"
FORMAT = "kvtag.census/v1"

# namespace_id -> (tenant, mode ids of its blocks on disk), as MemoryBackend.restored() answers.
Restored = Mapping[str, tuple[str | None, frozenset[str]]]


class SnapshotCensus:
    """A CensusStore (and ForgettingCensusStore) for one replica, like MemoryCensus, that writes
    every change to `path` before answering, and starts from what `path` and the restored blocks say."""

    def __init__(self, path: Path, restored: Restored | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._modes: dict[str, bytes] = {}
        self._probes: dict[str, dict[str, ProbeRecord]] = {}
        self._descriptions = Descriptions()
        self._load()
        # Strict namespaces without an established record admit only their disk blocks' modes.
        self._disk_modes = {
            ns_id: modes for ns_id, (_tenant, modes) in (restored or {}).items() if ns_id not in self._modes
        }

    # -- CensusStore ---------------------------------------------------------

    def establish_mode(self, namespace_id: str, mode_encoding: bytes) -> bytes:
        with self._lock:
            known = self._modes.get(namespace_id)
            if known is not None:
                return known
            on_disk = self._disk_modes.get(namespace_id)
            if on_disk is not None:
                requested = ids.mode_id(mode_diff.decode_mode(mode_encoding))
                if requested not in on_disk:
                    raise _refused_by_blocks(namespace_id, requested, on_disk)
            self._modes[namespace_id] = mode_encoding
            self._write_locked()
            return mode_encoding

    def reference_probe(self, namespace_id: str, mode_id: str, record: ProbeRecord) -> ProbeRecord:
        with self._lock:
            by_mode = self._probes.setdefault(namespace_id, {})
            known = by_mode.get(mode_id)
            if known is not None:
                return known
            by_mode[mode_id] = record
            self._write_locked()
            return record

    def describe(
        self, namespace_id: str, model_key: str, namespace: bytes, mode_id: str, mode: bytes
    ) -> None:
        with self._lock:
            if self._descriptions.describe(namespace_id, model_key, namespace, mode_id, mode):
                self._write_locked()

    def described_modes(self, namespace_id: str, mode_ids: Iterable[str]) -> dict[str, bytes]:
        return self._descriptions.described_modes(namespace_id, mode_ids)

    def namespaces_of(self, model_key: str) -> dict[str, bytes]:
        return self._descriptions.namespaces_of(model_key)

    def forget_namespace(self, namespace_id: str) -> None:
        """The census forgets a namespace only once it holds no block in either tier: nothing is
        left for its records to keep consistent."""
        with self._lock:
            dropped = self._modes.pop(namespace_id, None) is not None
            dropped |= self._probes.pop(namespace_id, None) is not None
            dropped |= self._descriptions.forget(namespace_id)
            self._disk_modes.pop(namespace_id, None)
            if dropped:
                self._write_locked()

    def namespaces_held(self) -> int:
        with self._lock:
            return len(self._modes.keys() | self._probes.keys())

    # -- the file --------------------------------------------------------------

    def _load(self) -> None:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        try:
            document = json.loads(text)
            modes, probes = _decode(document)
            descriptions = _decode_descriptions(document)
        except (ValueError, KeyError, TypeError, AttributeError, DecodeError) as exc:
            aside = self.path.with_name(self.path.name + ".corrupt")
            os.replace(self.path, aside)
            log.warning(
                "census snapshot %s is unreadable (%s); kept as %s, starting from the blocks on disk: "
                "strict namespaces with blocks admit only their blocks' modes, others start afresh",
                self.path,
                exc,
                aside,
            )
            return
        self._modes, self._probes, self._descriptions = modes, probes, descriptions

    def _write_locked(self) -> None:
        document = {
            "format": FORMAT,
            "modes": {ns_id: encoding.hex() for ns_id, encoding in sorted(self._modes.items())},
            "probes": {
                ns_id: {
                    mode_id: {"engine_id": r.engine_id, "probe_keys": [k.hex() for k in r.probe_keys]}
                    for mode_id, r in sorted(by_mode.items())
                }
                for ns_id, by_mode in sorted(self._probes.items())
            },
            # Optional in the format (a snapshot written before they were kept has none).
            "namespaces": {
                ns_id: {"model": model_key, "descriptor": descriptor.hex()}
                for ns_id, (model_key, descriptor) in sorted(self._descriptions.namespaces.items())
            },
            "hashings": {
                ns_id: {mode_id: encoding.hex() for mode_id, encoding in sorted(by_mode.items())}
                for ns_id, by_mode in sorted(self._descriptions.modes.items())
            },
        }
        write_atomically(self.path, json.dumps(document, separators=(",", ":")).encode())


def write_atomically(path: Path, payload: bytes) -> None:
    """tmp + fsync + rename + fsync of the directory: a reader finds the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _decode(document: Any) -> tuple[dict[str, bytes], dict[str, dict[str, ProbeRecord]]]:
    if document.get("format") != FORMAT:
        raise ValueError(f"format {document.get('format')!r}, expected {FORMAT!r}")
    modes = {str(ns_id): bytes.fromhex(encoding) for ns_id, encoding in document["modes"].items()}
    for encoding in modes.values():
        mode_diff.decode_mode(encoding)  # a damaged encoding fails here, not at a session
    probes = {
        str(ns_id): {
            str(mode_id): ProbeRecord(
                engine_id=str(r["engine_id"]), probe_keys=tuple(bytes.fromhex(k) for k in r["probe_keys"])
            )
            for mode_id, r in by_mode.items()
        }
        for ns_id, by_mode in document["probes"].items()
    }
    return modes, probes


def _decode_descriptions(document: Any) -> Descriptions:
    """The snapshot's descriptions of namespaces and modes (absent from older snapshots)."""
    descriptions = Descriptions()
    hashings = {
        str(ns_id): {str(mode_id): bytes.fromhex(encoding) for mode_id, encoding in by_mode.items()}
        for ns_id, by_mode in document.get("hashings", {}).items()
    }
    for by_mode in hashings.values():
        for encoding in by_mode.values():
            mode_diff.decode_mode(encoding)
    for ns_id, described in document.get("namespaces", {}).items():
        descriptor = bytes.fromhex(described["descriptor"])
        pb.NamespaceDescriptor.FromString(descriptor)  # a damaged descriptor fails here
        descriptions.namespaces[str(ns_id)] = (str(described["model"]), descriptor)
        descriptions.models.setdefault(str(described["model"]), set()).add(str(ns_id))
    descriptions.modes = hashings
    return descriptions


def _refused_by_blocks(namespace_id: str, requested: str, on_disk: frozenset[str]) -> errors.ApiError:
    held = ", ".join(sorted(on_disk))
    message = (
        f"namespace {namespace_id} is strict and its blocks on the disk tier were stored in mode {held}, "
        f"not {requested}; the census snapshot that named the mode's fields was lost, so only the blocks' "
        "mode is admitted: configure the engine to hash that way, or start a separate namespace"
    )
    refusal = pb.ModeRefusal(namespace_id=namespace_id, established_mode_id=held, requested_mode_id=requested)
    return errors.mode_refused(message, refusal)
