"""CensusStore in Mooncake: first-writer-wins records shared by every kvtag replica of a cluster.

Mooncake's put keeps an existing value, which is exactly first-writer-wins:
each replica puts its candidate and then reads back whichever record won. The
records are hard-pinned so eviction never forgets a strict namespace's mode.
"""

from __future__ import annotations

import json
import time
from typing import Any

from kvtag_store.backends.base import BackendUnavailable, ProbeRecord
from kvtag_store.backends.mooncake import MooncakeClient
from kvtag_store.backends.mooncake_errors import MooncakeCode, describe
from kvtag_store.backends.mooncake_format import FormatError, census_key, decode_record, encode_record

# How long a replica waits for a competing writer's in-flight record before giving up.
_SETTLE_S = 3.0


class MooncakeCensus:
    def __init__(self, client: MooncakeClient, master: str) -> None:
        self._client = client
        self._master = master
        self._pin = _hard_pin_config()

    def establish_mode(self, namespace_id: str, mode_encoding: bytes) -> bytes:
        return self._first_writer(census_key(namespace_id, "mode"), mode_encoding)

    def reference_probe(self, namespace_id: str, mode_id: str, record: ProbeRecord) -> ProbeRecord:
        body = json.dumps(
            {"engine_id": record.engine_id, "probe_keys": [k.hex() for k in record.probe_keys]},
            sort_keys=True,
        ).encode()
        won = json.loads(self._first_writer(census_key(namespace_id, f"probe/{mode_id}"), body))
        return ProbeRecord(str(won["engine_id"]), tuple(bytes.fromhex(k) for k in won["probe_keys"]))

    def _first_writer(self, key: str, body: bytes) -> bytes:
        """Put our record unless one exists; return the record that won."""
        deadline = time.monotonic() + _SETTLE_S
        candidate = encode_record(body)
        while True:
            rc = self._client.put(key, candidate, self._pin)
            if rc == MooncakeCode.RPC_FAIL:
                raise BackendUnavailable(
                    f"Mooncake master {self._master} unreachable while recording the census "
                    f"({describe(rc)}); retry with backoff"
                )
            stored = self._client.get(key)
            if stored:
                try:
                    return decode_record(stored)
                except FormatError:
                    # A damaged record cannot be trusted by any replica: replace it with ours.
                    self._client.batch_remove([key], True)
                    continue
            if time.monotonic() > deadline:
                raise BackendUnavailable(
                    f"census record {key} unreadable in Mooncake after put returned {describe(rc)}; "
                    "is a storage process with a global segment running?"
                )
            time.sleep(0.05)


def _hard_pin_config() -> Any:
    """Census records must never be evicted: a forgotten strict mode would let another mode win."""
    from mooncake.store import ReplicateConfig

    config = ReplicateConfig()
    config.with_hard_pin = True
    return config
