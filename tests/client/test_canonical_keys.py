"""The canonical key scheme: known-answer vectors, the doc/JSON/implementations agreeing, and invariants."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtag_client import keys
from kvtag_client.keys import ExtraKeys, KeyChain, UnencodableExtraKeys, block_keys
from kvtag_proto.ids import mode_id, probe_tokens

from . import canonical_reference as reference

DOCS = Path(__file__).resolve().parents[2] / "docs"
VECTORS = json.loads((DOCS / "canonical-key-vectors.json").read_text(encoding="utf-8"))


def _extras(raw: dict[str, Any]) -> ExtraKeys:
    return ExtraKeys(
        lora_name=raw["lora_name"],
        cache_salt=raw["cache_salt"],
        mm_items=tuple((i, o, n) for i, o, n in raw["mm_items"]),
    )


def _doc_vectors() -> list[dict[str, Any]]:
    """The ```kvtag-vector blocks of docs/canonical-keys.md, parsed back into the JSON shape."""
    text = (DOCS / "canonical-keys.md").read_text(encoding="utf-8")
    out = []
    for body in re.findall(r"```kvtag-vector\n(.*?)```", text, flags=re.S):
        fields: dict[str, str] = dict(line.split(": ", 1) for line in body.strip().splitlines())
        out.append(
            {
                "name": fields["name"],
                "hash_block_size": int(fields["hash_block_size"]),
                "lookahead_tokens": int(fields["lookahead_tokens"]),
                "token_ids": json.loads(fields["token_ids"]),
                "extras": json.loads(fields["extras"]),
                "keys": [fields[f"key[{i}]"] for i in range(sum(k.startswith("key[") for k in fields))],
            }
        )
    return out


@pytest.mark.parametrize("vector", VECTORS["vectors"], ids=lambda v: v["name"])
def test_block_keys_match_published_vector(vector: dict[str, Any]) -> None:
    got = block_keys(
        vector["token_ids"], vector["hash_block_size"], vector["lookahead_tokens"], _extras(vector["extras"])
    )
    assert [k.hex() for k in got] == vector["keys"]


@pytest.mark.parametrize("vector", VECTORS["vectors"], ids=lambda v: v["name"])
def test_naive_second_implementation_matches_published_vector(vector: dict[str, Any]) -> None:
    assert reference.keys_of_vector(vector) == vector["keys"]


def test_doc_publishes_exactly_the_json_vectors() -> None:
    from_json = [{k: v for k, v in vec.items() if k != "note"} for vec in VECTORS["vectors"]]
    assert _doc_vectors() == from_json


def test_doc_states_the_worked_example_values() -> None:
    text = (DOCS / "canonical-keys.md").read_text(encoding="utf-8")
    example = VECTORS["worked_example"]
    for field in ("root", "chain_0", "key_0"):
        assert example[field] in text, f"worked example {field} missing from the doc"
    assert reference.root(2, None, None).hex() == example["root"]
    assert bytes.fromhex(example["root_input"])[-6:] == bytes.fromhex("000000020000")
    assert block_keys([1, 2, 3], 2, 1)[0].hex() == example["key_0"]


def test_vectors_cover_both_geometries_and_every_kind_of_extra_key() -> None:
    vecs = VECTORS["vectors"]
    assert {v["lookahead_tokens"] for v in vecs} >= {0, 1}
    assert any(v["extras"]["lora_name"] for v in vecs)
    assert any(v["extras"]["cache_salt"] is not None for v in vecs)
    assert any(v["extras"]["mm_items"] for v in vecs)


def test_lookahead_key_differs_from_base_key_of_the_same_block() -> None:
    tokens = list(range(41))
    base = block_keys(tokens, 8, 0)[:5]
    ahead = block_keys(tokens, 8, 1)
    assert len(ahead) == len(base) == 5
    assert not set(base) & set(ahead)


def test_lookahead_keys_lag_one_block_on_aligned_prompt() -> None:
    assert len(block_keys(list(range(32)), 16, 1)) == 1
    assert len(block_keys(list(range(33)), 16, 1)) == 2
    assert len(block_keys(list(range(32)), 16, 0)) == 2


def test_keys_chain_over_earlier_blocks() -> None:
    a = block_keys([1] * 4 + [2] * 4, 4, 0)
    b = block_keys([9] * 4 + [2] * 4, 4, 0)
    assert a[1] != b[1]


def test_each_extra_key_changes_every_key() -> None:
    tokens = list(range(12))
    plain = block_keys(tokens, 4, 1)
    for extras in (ExtraKeys(lora_name="a"), ExtraKeys(cache_salt="s"), ExtraKeys(cache_salt="")):
        changed = block_keys(tokens, 4, 1, extras)
        assert all(x != y for x, y in zip(plain, changed, strict=True)), extras


def test_mm_item_affects_only_overlapping_block_and_later_ones() -> None:
    tokens = [7] * 16
    plain = block_keys(tokens, 4, 0)
    with_item = block_keys(tokens, 4, 0, ExtraKeys(mm_items=(("img", 5, 2),)))
    assert plain[0] == with_item[0]
    assert all(x != y for x, y in zip(plain[1:], with_item[1:], strict=True))


def test_mm_item_identifier_distinguishes_same_placeholder_tokens() -> None:
    tokens = [7] * 8
    one = block_keys(tokens, 4, 0, ExtraKeys(mm_items=(("img-a", 0, 4),)))
    two = block_keys(tokens, 4, 0, ExtraKeys(mm_items=(("img-b", 0, 4),)))
    assert one[0] != two[0]


@pytest.mark.parametrize(
    "extras",
    [
        ExtraKeys(lora_name=b"bytes"),  # type: ignore[arg-type]
        ExtraKeys(cache_salt=7),  # type: ignore[arg-type]
        ExtraKeys(lora_name="\ud800"),
        ExtraKeys(mm_items=(("", 0, 1),)),
        ExtraKeys(mm_items=((b"img", 0, 1),)),  # type: ignore[arg-type]
        ExtraKeys(mm_items=(("img", -1, 1),)),
        ExtraKeys(mm_items=(("img", 0, 0),)),
        ExtraKeys(mm_items=(("img", True, 1),)),
        ExtraKeys(mm_items=(("img", 1.0, 1),)),  # type: ignore[arg-type]
        ExtraKeys(mm_items=(("img", 2**32 - 2, 2),)),
        ExtraKeys(mm_items=(("img", 0),)),  # type: ignore[arg-type]
    ],
    ids=repr,
)
def test_unencodable_extra_keys_raise(extras: ExtraKeys) -> None:
    with pytest.raises(UnencodableExtraKeys):
        block_keys(list(range(8)), 4, 0, extras)
    with pytest.raises(UnencodableExtraKeys):
        KeyChain(4, 1, extras)


def test_invalid_token_ids_raise_value_error_without_changing_the_chain() -> None:
    chain = KeyChain(2, 0)
    chain.extend([1])
    with pytest.raises(ValueError):
        chain.extend([2, -1])
    chain.extend([2])
    assert chain.keys == block_keys([1, 2], 2, 0)


def test_probe_keys_are_the_keys_of_the_probe_tokens() -> None:
    for la in (0, 1):
        probe = keys.probe_keys(16, la)
        assert len(probe) == 2
        assert probe == block_keys(probe_tokens(16, la), 16, la)
        vector = next(v for v in VECTORS["vectors"] if v["name"] == f"probe-H16-L{la}")
        assert [k.hex() for k in probe] == vector["keys"]


def test_mode_declares_canonical_sha256_without_seed() -> None:
    m = keys.mode(16, 1)
    assert (m.key_scheme, m.scheme_version, m.hash_algorithm) == ("canonical", "1", "sha256")
    assert (m.hash_block_size, m.lookahead_tokens, m.seed_fingerprint) == (16, 1, "")
    assert mode_id(keys.mode(16, 0)) != mode_id(m)


def test_keys_do_not_depend_on_python_hash_seed() -> None:
    script = (
        "from kvtag_client.keys import block_keys, ExtraKeys;"
        "print(block_keys(list(range(20)), 4, 1, ExtraKeys('l', 's', (('i', 3, 4),)))[-1].hex())"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": seed},
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        for seed in ("0", "1", "random")
    }
    expected = block_keys(list(range(20)), 4, 1, ExtraKeys("l", "s", (("i", 3, 4),)))[-1].hex()
    assert outputs == {expected}


_mm_items = st.lists(
    st.tuples(st.text(min_size=1, max_size=4), st.integers(0, 40), st.integers(1, 12)), max_size=3
).map(tuple)
_extras_strategy = st.builds(
    ExtraKeys,
    lora_name=st.none() | st.text(max_size=5),
    cache_salt=st.none() | st.text(max_size=5),
    mm_items=_mm_items,
)


def _encodable(extras: ExtraKeys) -> bool:
    try:
        block_keys([], 1, 0, extras)
    except UnencodableExtraKeys:
        return False
    return True


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=8),
    hash_block_size=st.integers(1, 7),
    lookahead_tokens=st.integers(0, 3),
    extras=_extras_strategy.filter(_encodable),
)
def test_key_chain_extended_in_any_pieces_equals_block_keys(
    tokens: list[int], cuts: list[int], hash_block_size: int, lookahead_tokens: int, extras: ExtraKeys
) -> None:
    chain = KeyChain(hash_block_size, lookahead_tokens, extras)
    bounds = [0, *sorted(c for c in cuts if c <= len(tokens)), len(tokens)]
    for start, end in itertools.pairwise(bounds):
        chain.extend(tokens[start:end])
        assert chain.keys == block_keys(tokens[:end], hash_block_size, lookahead_tokens, extras)
        assert chain.base_keys == block_keys(tokens[:end], hash_block_size, 0, extras)
        assert len(chain.base_keys) >= len(chain.keys)
    items = [(i, o, n) for i, o, n in extras.mm_items]
    assert chain.keys == reference.keys(
        tokens, hash_block_size, lookahead_tokens, extras.lora_name, extras.cache_salt, items
    )


@settings(max_examples=50, deadline=None)
@given(items=_mm_items.filter(lambda t: _encodable(ExtraKeys(mm_items=t))), data=st.data())
def test_mm_item_order_does_not_change_keys(
    items: tuple[tuple[str, int, int], ...], data: st.DataObject
) -> None:
    shuffled = tuple(data.draw(st.permutations(items)))
    tokens = list(range(64))
    assert block_keys(tokens, 5, 1, ExtraKeys(mm_items=items)) == block_keys(
        tokens, 5, 1, ExtraKeys(mm_items=shuffled)
    )
