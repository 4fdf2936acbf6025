"""The OpenSession warnings that say where blocks an engine can never read sit: MODE_SPLIT (its own
namespace holds another mode's blocks) and LAYOUT_SPLIT (a sibling namespace of its model, in another
KV layout, dtype, block size or sharding, holds the model's blocks).

Both name the other side and the fields that differ, so a 0% hit rate is never silent. What holds
blocks comes from the backend (ModeHoldings) where it can say, so a replica that never saw the
producer (another replica, a restart) still tells; the fields come from the census's descriptions
(CensusStore.describe).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator, Mapping

from kvtag.v1 import store_pb2 as pb

from kvtag_store.policy import mode_diff

# Sibling namespaces named at one OpenSession, at most (one per distinct layout).
MAX_SIBLINGS = 4
# Descriptor fields that make a sibling: the model's identity (model_name, weights_fingerprint,
# tenant) is the same, one of these differs.
LAYOUT_FIELDS = ("kv_dtype", "kv_layout", "block_size", "parallel_sharding")
_RANK = re.compile(r"/rank=\d+")


def model_key(ns: pb.NamespaceDescriptor) -> str:
    """What a model's namespaces share: its name, weights and tenant (each length-prefixed)."""
    digest = hashlib.sha256(b"kvtag.model.v1\x00")
    for value in (ns.model_name, ns.weights_fingerprint, ns.tenant):
        raw = value.encode("utf-8")
        digest.update(len(raw).to_bytes(4, "big") + raw)
    return "mdl-" + digest.hexdigest()[:16]


def mode_split(
    engine_id: str,
    ns_text: str,
    mode_id: str,
    mode: pb.HashingMode,
    other_id: str,
    other_mode: pb.HashingMode | None,
    live: bool,
) -> pb.CensusWarning:
    """MODE_SPLIT for one other mode: live engines hash in it, or its blocks sit in the namespace.
    `other_mode` is None when the store no longer knows that mode's fields."""
    diffs = mode_diff.mode_diff(other_mode, mode) if other_mode is not None else []
    fields = (
        ", ".join(f"{d.field} {d.established} there, {d.requested} here" for d in diffs)
        if other_mode is not None
        else "its fields were not recorded"
    )
    where = (
        f"live engines there hash in mode {other_id} ({fields}); the two modes never share "
        "blocks, so each loses the other's hits"
        if live
        else f"its blocks were stored in mode {other_id} ({fields}), which this mode can never "
        "read, so they are misses here"
    )
    return pb.CensusWarning(
        kind="MODE_SPLIT",
        other_mode_id=other_id,
        diffs=diffs,
        message=(
            f"engine `{engine_id}` joins namespace {ns_text} in mode {mode_id}, but {where}; "
            "align the engines' hashing or split them into separate namespaces (`kvtag-store "
            "diagnose` counts the cross-mode misses)"
        ),
    )


def layout_splits(
    engine_id: str,
    namespace_id: str,
    ns: pb.NamespaceDescriptor,
    described: Mapping[str, bytes],
    holds_blocks: Callable[[str], bool],
) -> Iterator[pb.CensusWarning]:
    """LAYOUT_SPLIT for each sibling layout of the model that holds blocks (`described`: namespace
    id -> serialized descriptor, the model's namespaces the census knows). Another shard of the same
    layout (the TP or PP rank alone differs) is no sibling: those namespaces hold the model's other
    shards. One warning per layout, naming the namespace sharded like this one where there is one."""
    chosen: dict[tuple[object, ...], tuple[str, pb.NamespaceDescriptor]] = {}
    ours = _layout(ns)
    for other_id, raw in sorted(described.items()):
        if other_id == namespace_id:
            continue
        other = pb.NamespaceDescriptor.FromString(raw)
        identity = (other.model_name, other.weights_fingerprint, other.tenant)
        if identity != (ns.model_name, ns.weights_fingerprint, ns.tenant) or _layout(other) == ours:
            continue
        layout = _layout(other)
        kept = chosen.get(layout)
        if kept is not None and kept[1].parallel_sharding == ns.parallel_sharding:
            continue
        if len(chosen) >= MAX_SIBLINGS and kept is None:
            continue
        if holds_blocks(other_id):
            chosen[layout] = (other_id, other)
    for other_id, other in chosen.values():
        yield _layout_warning(engine_id, namespace_id, ns, other_id, other)


def _layout(ns: pb.NamespaceDescriptor) -> tuple[object, ...]:
    """The layout fields, with the shard's ranks left out of the sharding."""
    return (ns.kv_dtype, ns.kv_layout, ns.block_size, _RANK.sub("", ns.parallel_sharding))


def _layout_warning(
    engine_id: str,
    namespace_id: str,
    ns: pb.NamespaceDescriptor,
    other_id: str,
    other: pb.NamespaceDescriptor,
) -> pb.CensusWarning:
    diffs = [
        pb.FieldDiff(field=name, established=str(getattr(other, name)), requested=str(getattr(ns, name)))
        for name in LAYOUT_FIELDS
        if getattr(other, name) != getattr(ns, name)
        and not (
            name == "parallel_sharding"
            and _RANK.sub("", other.parallel_sharding) == _RANK.sub("", ns.parallel_sharding)
        )
    ]
    fields = "; ".join(f"{d.field} `{d.established}` there, `{d.requested}` here" for d in diffs)
    hint = (
        " (an EAGLE-family drafter adds its layers to the KV layout: engines with and without it never "
        "share blocks)"
        if any(d.field == "kv_layout" for d in diffs)
        else ""
    )
    warning = pb.CensusWarning(
        kind="LAYOUT_SPLIT",
        message=(
            f"engine `{engine_id}` opens namespace {mode_diff.describe_namespace(namespace_id, ns)}, but "
            f"this model's blocks sit in sibling namespace `{other_id}` in another layout ({fields}){hint}; "
            "namespaces never share blocks, so this engine's hits cannot come from there: give the engines "
            "the same layout to share, or expect them to fill their own namespaces"
        ),
        other_namespace_id=other_id,
        diffs=diffs,
    )
    warning.other_namespace.CopyFrom(other)
    return warning
