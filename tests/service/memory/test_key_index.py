"""The packed Lookup's fingerprint index (kvtag_store.backends.key_index) answers like the exact entries."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtag.v1 import store_pb2 as pb
from kvtag_store.backends import key_index
from kvtag_store.backends.base import BlockAddress, BlockKey
from kvtag_store.backends.memory import MemoryBackend

_STATUS: dict[int, str] = {pb.HIT: "hit", pb.MISS: "miss", pb.MODE_MISMATCH: "mismatch"}

# Fingerprints whose low bits (the slot) come from a small range, so probe sequences collide,
# wrap around the table's end and run over deleted slots.
fingerprint = st.builds(
    lambda high, low: np.uint64((1 << 63) | (high << 12) | low),
    st.integers(0, 2**40),
    st.sampled_from([0, 1, 2, 3, 1021, 1022, 1023]),
)
operation = st.tuples(
    st.sampled_from(["set", "remove"]), st.lists(fingerprint, max_size=40), st.integers(0, 3)
)


@settings(max_examples=150, deadline=None)
@given(st.lists(operation, max_size=60), st.lists(fingerprint, max_size=20))
def test_index_agrees_with_a_dict(
    operations: list[tuple[str, list[np.uint64], int]], probes: list[np.uint64]
) -> None:
    index = key_index.KeyIndex()
    model: dict[int, int] = {}
    for kind, fps, mode in operations:
        unique = np.unique(np.array(fps, np.uint64))
        if kind == "set":
            index.set(unique, np.full(len(unique), mode, np.int32))
            model.update(dict.fromkeys(map(int, unique), mode))
        else:
            index.remove(unique)
            for fp in map(int, unique):
                model.pop(fp, None)
        assert len(index) == len(model)
    asked = np.array(list(model) + [int(p) for p in probes], np.uint64)
    expected = [model.get(int(fp), key_index.NOT_FOUND) for fp in asked]
    assert index.find(asked).tolist() == expected


def test_index_grows_and_reclaims_deleted_slots() -> None:
    rng = np.random.default_rng(7)
    fps = np.unique(rng.integers(0, 2**63, 50_000, dtype=np.uint64) | np.uint64(1 << 63))
    index = key_index.KeyIndex()
    for start in range(0, len(fps), 4096):
        index.set(fps[start : start + 4096], np.full(len(fps[start : start + 4096]), 1, np.int32))
    assert len(index) == len(fps)
    assert (index.find(fps) == 1).all()
    # Remove and re-add in rounds: deleted slots must be reused or rebuilt away, not pile up.
    for _ in range(8):
        gone, kept = fps[::2], fps[1::2]
        index.remove(gone)
        assert (index.find(gone) == key_index.NOT_FOUND).all()
        assert (index.find(kept) == 1).all()
        index.set(gone, np.full(len(gone), 2, np.int32))
    assert len(index) == len(fps)
    assert (index.find(fps[::2]) == 2).all()
    assert index._fps.size <= 8 * len(fps)
    # Mass removal gives the memory back; what is left still answers.
    index.remove(fps[100:])
    assert len(index) == 100
    assert index._fps.size <= 1024
    assert (index.find(fps[:100]) != key_index.NOT_FOUND).all()
    assert (index.find(fps[100:200]) == key_index.NOT_FOUND).all()


@given(st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=30, unique=True))
def test_fingerprints_are_one_function_of_the_key_bytes(keys: list[bytes]) -> None:
    of_keys = key_index.fingerprints_of(keys)
    assert len(of_keys) == len(keys)
    for key, fp in zip(keys, of_keys, strict=True):
        assert key_index.fingerprints(key, len(key))[0] == fp
        assert fp >= np.uint64(1 << 63)  # never the empty or deleted marker
    assert len(set(of_keys.tolist())) == len(keys)  # 63 bits: distinct keys, distinct fingerprints here


def _address(i: int, group: int = 0) -> BlockAddress:
    return group, BlockKey(i.to_bytes(4, "big") * 8)


def _both_lookups(
    backend: MemoryBackend, mode_id: str, addresses: list[BlockAddress]
) -> tuple[list[str], list[str]]:
    exact = backend.lookup("ns", mode_id, addresses)
    runs = [(g, b"".join(k for gg, k in addresses if gg == g), 32) for g in sorted({g for g, _ in addresses})]
    packed, lease = backend.lookup_packed_and_pin("ns", mode_id, runs)
    if lease is not None:
        backend.unpin("ns", lease)
    in_run_order = [a for g, _, _ in runs for a in addresses if a[0] == g]
    by_address = dict(zip(in_run_order, packed, strict=True))
    return [_STATUS[s] for s in exact], [_STATUS[by_address[a]] for a in addresses]


@pytest.mark.parametrize("lag", [1, 7, 100_000])
def test_packed_lookup_follows_stores_evictions_and_modes(lag: int) -> None:
    """Whether the index catches up on every change, every few, or only at the Lookup, it answers as
    the exact entries do: evicted keys read as misses, other modes' keys as mismatches."""
    backend = MemoryBackend(40 * 1024, key_index_lag=lag)  # 40 values of 1 KiB: the puts below evict
    value = b"x" * 1024
    addresses = [_address(i, group=i % 2) for i in range(120)]
    for round_ in range(6):
        mode_id = "mode-a" if round_ % 2 else "mode-b"
        batch = addresses[round_ * 20 : round_ * 20 + 20]
        assert all(
            r.outcome.name == "STORED" for r in backend.put_many("ns", mode_id, [(a, value) for a in batch])
        )
        for asking in ("mode-a", "mode-b", "mode-c"):
            exact, packed = _both_lookups(backend, asking, addresses)
            assert packed == exact
    exact, _ = _both_lookups(backend, "mode-a", addresses)
    assert {"hit", "miss", "mismatch"} <= set(exact)  # the scenario reached all three answers


def test_packed_lookup_pins_exactly_its_hits() -> None:
    backend = MemoryBackend(4 * 1024)
    value = b"y" * 1024
    stored = [_address(i) for i in range(3)]
    backend.put_many("ns", "m", [(a, value) for a in stored])
    asked = [stored[0], _address(99), stored[2]]
    packed, lease = backend.lookup_packed_and_pin("ns", "m", [(0, b"".join(k for _, k in asked), 32)])
    assert [_STATUS[s] for s in packed] == ["hit", "miss", "hit"]
    assert lease is not None and len(lease) == 2 and list(lease) == [stored[0], stored[2]]
    assert lease.holds(stored[0]) and lease.holds(stored[2])
    assert not lease.holds(stored[1]) and not lease.holds(_address(99))
    # Room for one more, and the unpinned stored[1] can be evicted for a second: the third is refused.
    results = backend.put_many("ns", "m", [(_address(i), value) for i in (10, 11, 12)])
    assert [r.outcome.name for r in results].count("STORED") == 2
    assert [_STATUS[s] for s in backend.lookup("ns", "m", stored)] == ["hit", "miss", "hit"]
    backend.unpin("ns", lease)
