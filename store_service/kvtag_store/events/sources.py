"""Discovery: `/kv_event_sources` on the status port answers a router's question, per namespace: which
hashing modes exist, their fields, the topic of each, and which live engines hash in each.

`publisher` has the fields of vLLM's KVEventsConfig (what vLLM's own `/kv_event_sources` lists per
data-parallel rank), so a router configures its subscriber from it as it would for an engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf import json_format
from kvtag.v1 import store_pb2 as pb

from kvtag_store.config import policy_name
from kvtag_store.events import wire
from kvtag_store.events.access import CurveAccess
from kvtag_store.events.publisher import EventPublisher


def _fields(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def event_sources(
    publisher: EventPublisher, access: CurveAccess | None, report: pb.DiagnoseResponse
) -> dict[str, Any]:
    """The discovery document (docs/kv-events.md has an example). `access`: the CURVE keys to hand
    out; only ever called for an admin (the route refuses everyone else)."""
    options = publisher.options
    namespaces = []
    for ns in report.namespaces:
        modes = []
        for mode in ns.modes:
            live = [e for e in mode.engines if e.live]
            modes.append(
                {
                    "mode_id": mode.mode_id,
                    "topic": wire.topic(ns.namespace_id, mode.mode_id),
                    "fields": _fields(mode.mode),
                    "block_size": mode.mode.hash_block_size,
                    "engines": [{"engine_id": e.engine_id, "labels": dict(e.labels)} for e in live],
                }
            )
        namespaces.append(
            {
                "namespace_id": ns.namespace_id,
                "namespace": _fields(ns.namespace),
                "policy": policy_name(ns.policy),
                "established_mode_id": ns.established_mode_id,
                "modes": modes,
            }
        )
    return {
        "publisher": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": publisher.endpoint,
            "replay_endpoint": publisher.replay_endpoint,
            "buffer_steps": options.replay_batches,
            "hwm": options.hwm,
            "max_queue_size": options.queue_events,
            "topic": wire.TOPIC_PREFIX,
        },
        "topic_format": wire.topic("{namespace_id}", "{mode_id}"),
        "store_topic": wire.STORE_TOPIC,
        "mediums": dict(wire.MEDIUMS),
        "curve": access.for_admins() if access is not None else None,
        "namespaces": namespaces,
    }


def census_block_sizes(report: Callable[[str], pb.DiagnoseResponse]) -> Callable[[str, str], int | None]:
    """The publisher's BlockSizeOf over the census: a mode's hash block size, None if not described."""

    def block_size_of(namespace_id: str, mode_id: str) -> int | None:
        for ns in report(namespace_id).namespaces:
            for mode in ns.modes:
                if mode.mode_id == mode_id and mode.mode.hash_block_size:
                    return int(mode.mode.hash_block_size)
        return None

    return block_size_of
