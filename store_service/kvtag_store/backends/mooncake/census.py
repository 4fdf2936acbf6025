"""CensusStore in Mooncake: first-writer-wins records shared by every kvtag replica of a cluster.

Mooncake's put keeps an existing value, which is exactly first-writer-wins:
each replica puts its candidate and then reads back whichever record won. The
records are hard-pinned (eviction never forgets them) and kept on two storage
nodes where two exist, but a record can still be lost: with the only node that
held it, or with a master restart (no HA). Strict enforcement survives that
because every replica keeps the records it has read and restores them:

- a keeper thread re-reads them every _WATCH_S and puts back a missing one;
  a record it finds replaced by a *younger* one (written after the loss, by a
  replica that did not know) is removed and its own put back: the older record
  was established first and its engines may still be connected;
- a record written fresh is not trusted until _SETTLE_S after it was written,
  long enough for any replica that knows an older one to restore it, so the
  engine that would establish a new mode waits, and is refused if an older
  record came back meanwhile;
- after the census saw the master fail or its beacon object vanish (records
  were lost), it refuses to write a fresh mode record for _RECOVERY_S, with
  BackendUnavailable (UNAVAILABLE at OpenSession): it fails closed until the
  replicas that know have had time to restore theirs.

Records carry their writer's wall-clock time and a nonce, which order two
records of one key (the older wins); replicas' clocks are assumed to agree to
well within _SETTLE_S.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass

from kvtag_store.backends.base import BackendUnavailable, ProbeRecord
from kvtag_store.backends.descriptions import DescribedCensus
from kvtag_store.backends.mooncake.client import MooncakeClient, pinned_config
from kvtag_store.backends.mooncake.cluster import EXISTS_DOWN
from kvtag_store.backends.mooncake.descriptions import ClusterDescriptions
from kvtag_store.backends.mooncake.format import FormatError, census_key, decode_record, encode_record
from kvtag_store.backends.mooncake.health import MASTER_DOWN, MasterBreaker

log = logging.getLogger(__name__)

# How long a replica waits for a competing writer's in-flight record before giving up.
_PUT_WAIT_S = 3.0
# The keeper's period, how long a fresh mode record must stand before it is trusted, and how long
# fresh mode records are refused after the census may have lost records.
_WATCH_S = 0.5
_SETTLE_S = 2.0
_RECOVERY_S = 5.0
_BEACON = census_key("_", "beacon")


@dataclass(frozen=True, slots=True)
class _Record:
    body: bytes
    at_ms: int
    nonce: str

    def encode(self) -> bytes:
        return encode_record(
            json.dumps({"body": self.body.hex(), "at_ms": self.at_ms, "nonce": self.nonce}).encode()
        )

    @staticmethod
    def decode(raw: bytes) -> _Record:
        try:
            fields = json.loads(decode_record(raw))
            return _Record(bytes.fromhex(fields["body"]), int(fields["at_ms"]), str(fields["nonce"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise FormatError(f"census record unreadable: {exc}") from exc

    def older_than(self, other: _Record) -> bool:
        return (self.at_ms, self.nonce) < (other.at_ms, other.nonce)

    def age_s(self) -> float:
        return time.time() - self.at_ms / 1000


def _fresh(body: bytes) -> _Record:
    return _Record(body, int(time.time() * 1000), os.urandom(8).hex())


class MooncakeCensus(DescribedCensus):
    def __init__(self, client: MooncakeClient, breaker: MasterBreaker) -> None:
        """`breaker`: the backend's (cluster.master_breaker over the same client), so an OpenSession
        while the master is down is answered UNAVAILABLE at once, not after seconds of retries in
        each of the census's calls."""
        self._client = client
        self._breaker = breaker
        self._config = pinned_config()
        self.descriptions = ClusterDescriptions(client, breaker, self._config)
        self._lock = threading.Lock()
        # Records this replica has read or written, by Mooncake key: what it restores.
        self._known: dict[str, _Record] = {}
        self._beacon_seen = False
        self._lost_at = float("-inf")
        self.restored = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, name="kvtag-mooncake-census", daemon=True)
        self._thread.start()

    # -- CensusStore --------------------------------------------------------

    def establish_mode(self, namespace_id: str, mode_encoding: bytes) -> bytes:
        return self._agree(census_key(namespace_id, "mode"), mode_encoding, settle=True).body

    def reference_probe(self, namespace_id: str, mode_id: str, record: ProbeRecord) -> ProbeRecord:
        body = json.dumps(
            {"engine_id": record.engine_id, "probe_keys": [k.hex() for k in record.probe_keys]},
            sort_keys=True,
        ).encode()
        key = census_key(namespace_id, f"probe/{mode_id}")
        # Probe records of strict namespaces (whose mode record this replica knows) are kept too.
        keep = census_key(namespace_id, "mode") in self._known_copy()
        won = json.loads(self._agree(key, body, settle=False, keep=keep).body)
        return ProbeRecord(str(won["engine_id"]), tuple(bytes.fromhex(k) for k in won["probe_keys"]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    # -- agreement ----------------------------------------------------------

    def _agree(self, key: str, body: bytes, *, settle: bool, keep: bool = True) -> _Record:
        """The record of key every replica must use: the one this replica knows (restored if lost),
        else the stored one, else ours; a fresh mode record only once it has stood _SETTLE_S.
        While the master is down a known record answers at once (it is the one this replica will
        restore) and an unknown one is UNAVAILABLE at once, not after seconds of Mooncake retries."""
        known = self._known_copy().get(key)
        if known is not None:
            return known if self._breaker.is_open else self._reconcile(key, known)
        self._breaker.check("recording the census")
        deadline = time.monotonic() + _PUT_WAIT_S
        while True:
            stored = self._read(key)
            if stored is None:
                if settle and time.monotonic() - self._lost_at < _RECOVERY_S:
                    raise BackendUnavailable(
                        "the Mooncake census may have lost records moments ago (master restart or a "
                        "storage node lost); new modes are refused for "
                        f"{_RECOVERY_S:.0f} s while replicas restore the ones they know; retry"
                    )
                self._put(key, _fresh(body))
                stored = self._read(key)
            if stored is not None:
                break
            if time.monotonic() > deadline:
                raise BackendUnavailable(
                    f"census record {key} unreadable in Mooncake; is a storage node with a global "
                    "segment mounted?"
                )
            time.sleep(0.05)
        settled_by = time.monotonic() + _SETTLE_S  # a writer's clock ahead of ours waits no longer
        while settle and stored.age_s() < _SETTLE_S and time.monotonic() < settled_by:
            time.sleep(max(0.0, min(_SETTLE_S - stored.age_s(), settled_by - time.monotonic())) + 0.01)
            again = self._read(key)
            if again is None:
                raise BackendUnavailable(f"census record {key} was lost while it settled; retry with backoff")
            stored = again
        if keep:
            with self._lock:
                self._known.setdefault(key, stored)
        return stored

    def _reconcile(self, key: str, known: _Record) -> _Record:
        """Make the stored record agree with the known one; the one that wins."""
        stored = self._read(key)
        if stored is None:
            # Lost (or unreadable: its storage node died and the master still lists it).
            if self._exists(key) is False:
                self._restore(key, known, "lost")
            return known
        if stored == known:
            return known
        if known.older_than(stored):
            # Written after ours was lost, by a replica that did not know ours: ours came first.
            self._client.batch_remove([key], True)
            self._restore(key, known, "replaced by a younger record")
            return known
        log.warning("census record %s is older than the one this replica knew; adopting it", key)
        with self._lock:
            self._known[key] = stored
        return stored

    def _restore(self, key: str, known: _Record, why: str) -> None:
        self._put(key, known)
        self._lost_at = time.monotonic()
        self.restored += 1
        log.warning("census record %s was %s; restored the one this replica knows", key, why)

    # -- Mooncake calls -----------------------------------------------------

    def _put(self, key: str, record: _Record) -> None:
        rc = self._client.put(key, record.encode(), self._config)
        if rc in MASTER_DOWN:
            self._lost_at = time.monotonic()
            self._breaker.screen([rc], "recording the census")

    def _read(self, key: str) -> _Record | None:
        """The stored record, None if absent or unreadable; a damaged one is removed."""
        raw = self._client.get(key)
        if not raw:
            return None
        try:
            return _Record.decode(raw)
        except FormatError:
            # A damaged record cannot be trusted by any replica: drop it so a good one replaces it.
            self._client.batch_remove([key], True)
            return None

    def _exists(self, key: str) -> bool | None:
        [code] = self._client.batch_is_exist([key])
        if code in EXISTS_DOWN:
            self._lost_at = time.monotonic()
            # Opens the breaker and counts the failure; the caller takes None for "cannot tell".
            with contextlib.suppress(BackendUnavailable):
                self._breaker.screen([code], "checking the census", master_down=EXISTS_DOWN)
            return None
        return bool(code == 1)

    def _known_copy(self) -> dict[str, _Record]:
        with self._lock:
            return dict(self._known)

    # -- keeper -------------------------------------------------------------

    def _keep(self) -> None:
        while not self._stop.wait(_WATCH_S):
            try:
                self._watch_once()
            except BackendUnavailable:
                self._lost_at = time.monotonic()
            except Exception:  # the keeper must outlive any one bad round
                log.exception("census keeper round failed")

    def _watch_once(self) -> None:
        """Notice lost records (beacon gone, master down) and restore the ones this replica knows."""
        if self._breaker.is_open:
            self._lost_at = time.monotonic()  # records may be going with the master: stay closed
            return
        beacon = self._exists(_BEACON)
        if beacon is None:
            return  # master down: _exists noted it
        if not beacon:
            if self._beacon_seen:
                self._lost_at = time.monotonic()
                log.warning("the census beacon vanished: Mooncake lost objects (master restart or node)")
            if self._client.put(_BEACON, b"kvtag census beacon", self._config) != 0:
                return
        self._beacon_seen = True
        for key, known in self._known_copy().items():
            self._reconcile(key, known)
