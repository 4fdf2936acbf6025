"""Request bytes to request objects, cheapest checks first.

Every KvStore method is registered with no request deserializer, so gRPC hands
the handler the raw bytes and nothing can fail inside gRPC (a deserializer that
raises can leave a stream gRPC never finishes, and its shutdown then hangs on
it). The handler then, in order: counts the batch without building it
(BATCH_TOO_LARGE), charges the admission limit (SERVER_BUSY), and parses
(MALFORMED_REQUEST); only a request that passed all three costs memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError, Message
from kvtag.v1 import store_pb2 as pb

from kvtag_store import errors
from kvtag_store.api import codec, framing
from kvtag_store.api.inflight import InflightBudget, request_cost

# A Lookup block in the common shape is at least 5 wire bytes (0x12 len 0x0a len key).
_MIN_LOOKUP_BLOCK = 5
# Generated messages without a batch field: the upb arena's worst case is a few times the wire size.
_CONTROL_ITEMS = 0


@dataclass(frozen=True)
class Intake:
    type_name: str
    batch_field: str
    # (data, max_items) -> an upper bound of the batch items, without building them.
    count: Callable[[bytes, int], int]
    # (data, max_items) -> the request; raises framing.TooManyItems before building past max_items.
    parse: Callable[[bytes, int], Any]


def _generated(message_type: type[Message]) -> Callable[[bytes, int], Any]:
    def parse(data: bytes, max_items: int) -> Any:
        return message_type.FromString(data)

    return parse


def _no_batch(data: bytes, max_items: int) -> int:
    return _CONTROL_ITEMS


def _lookup_estimate(data: bytes, max_items: int) -> int:
    """Lookup is the hot path: its batch is counted exactly by codec.parse_lookup before any key is
    cut, so the admission charge uses a bound from the size instead of a walk."""
    return min(len(data) // _MIN_LOOKUP_BLOCK, max_items)


def _control(name: str) -> Intake:
    return Intake(name, "", _no_batch, _generated(getattr(pb, name)))


OPEN_SESSION = _control("OpenSessionRequest")
HEARTBEAT = _control("HeartbeatRequest")
CLOSE_SESSION = _control("CloseSessionRequest")
DIAGNOSE = _control("DiagnoseRequest")
GET_STATS = _control("GetStatsRequest")
LOOKUP = Intake("LookupRequest", "blocks", _lookup_estimate, codec.parse_lookup)
PUT = Intake("PutRequest", "items", framing.count_items, codec.parse_put)
GET = Intake("GetRequest", "blocks", framing.count_items, _generated(pb.GetRequest))
ATTACH_SHARED_MEMORY = _control("AttachSharedMemoryRequest")
COMMIT_SLOTS = Intake("CommitSlotsRequest", "generations", _no_batch, _generated(pb.CommitSlotsRequest))
RESERVE_SLOTS = Intake(
    "ReserveSlotsRequest", "items", framing.count_items, _generated(pb.ReserveSlotsRequest)
)
RELEASE_LEASES = Intake(
    "ReleaseLeasesRequest", "lease_ids", framing.count_items, _generated(pb.ReleaseLeasesRequest)
)


@contextmanager
def admitted(intake: Intake, data: bytes, max_items: int, admission: InflightBudget) -> Iterator[Any]:
    """The parsed request, with its cost held against the admission limit for the block."""
    try:
        items = intake.count(data, max_items)
    except framing.TooManyItems as exc:
        raise errors.batch_too_large(intake.batch_field, exc.count, max_items) from None
    except framing.Malformed as exc:
        raise errors.malformed_request(intake.type_name, str(exc)) from None
    with admission.hold(request_cost(len(data), items)):
        yield parse(intake, data, max_items)


def parse(intake: Intake, data: bytes, max_items: int) -> Any:
    try:
        return intake.parse(data, max_items)
    except framing.TooManyItems as exc:
        raise errors.batch_too_large(intake.batch_field, exc.count, max_items) from None
    except (DecodeError, framing.Malformed) as exc:
        raise errors.malformed_request(intake.type_name, str(exc) or "not a protobuf message") from None
