"""The mode-diagnostics scenario the status page, its JSON and the dashboard tests share.

Two namespaces on one real server with its HTTP port open:
- `team-split` (isolate): engines in two modes (lookahead 1 and legacy), so the lookahead mode's
  misses are partly blocks the legacy mode held (cross-mode misses); one engine whose probe keys
  drift from its mode's reference (a probe disagreement), since gone.
- `team-strict` (strict, a 1 MiB tenant quota): the first engine wins; a second in another mode is
  refused with a diff.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from typing import Any

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_proto import ids
from kvtag_proto.channels import ChannelSecurity, open_channel
from kvtag_store.app.server import start_server
from kvtag_store.backends.memory import MemoryBackend, MemoryCensus
from kvtag_store.config import ServiceConfig

from tests.descriptors import mode, namespace

from .helpers import Store

SPLIT_NS = namespace(tenant="team-split")
STRICT_NS = namespace(tenant="team-strict")
LOOKAHEAD = mode(lookahead=1)
LEGACY = mode(lookahead=0)
# The refused engine differs in two fields, so its diff has two rows.
REFUSED_MODE = mode(lookahead=0, algorithm="xxh3-128")
CROSS_MODE_MISSES = 3
# The strict tenant has a quota of its own; the split tenant shares the rest of the 16 MiB.
STRICT_QUOTA = 1 << 20


@dataclass
class Scenario:
    store: Store
    channel: grpc.Channel
    http: str  # http://127.0.0.1:PORT
    split_ns: str
    strict_ns: str
    lookahead_mode: str
    legacy_mode: str
    refused_mode: str

    def fetch(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, str, str]:
        """(status, content type, body) of a GET on the HTTP port; HTTP errors are returned, not raised."""
        request = urllib.request.Request(self.http + path, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, answer.headers["Content-Type"], answer.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers["Content-Type"], exc.read().decode()

    def status(self, query: str = "") -> dict[str, Any]:
        code, kind, body = self.fetch("/api/v1/status" + query)
        assert (code, kind) == (200, "application/json"), body
        document: dict[str, Any] = json.loads(body)
        return document

    def status_as(self, token: str) -> dict[str, Any]:
        code, _, body = self.fetch("/api/v1/status", {"Authorization": f"Bearer {token}"})
        assert code == 200, body
        document: dict[str, Any] = json.loads(body)
        return document

    def close(self) -> None:
        self.channel.close()
        self.store.server.stop(grace=0)


def start(
    history_interval_s: float = 60.0, channel_security: ChannelSecurity | None = None, **serve: Any
) -> Scenario:
    """A server with the HTTP port on 127.0.0.1:0, the strict namespace configured, scenario not run.
    `channel_security` is how the scenario's engines call it (a token when `serve` has security)."""
    strict_id = ids.namespace_id(STRICT_NS)
    backend = MemoryBackend(16 << 20, tenant_quotas={STRICT_NS.tenant: STRICT_QUOTA})
    server = start_server(
        backend,
        MemoryCensus(),
        ServiceConfig(namespace_policies={strict_id: pb.POLICY_STRICT}),
        listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        history_interval_s=history_interval_s,
        **serve,
    )
    channel = open_channel(server.address, channel_security or ChannelSecurity(use_env_token=False))
    store = Store(server=server, stub=store_pb2_grpc.KvStoreStub(channel), backend=backend)  # type: ignore[no-untyped-call]
    return Scenario(
        store=store,
        channel=channel,
        http=f"http://{server.metrics_address}",
        split_ns=ids.namespace_id(SPLIT_NS),
        strict_ns=strict_id,
        lookahead_mode=ids.mode_id(LOOKAHEAD),
        legacy_mode=ids.mode_id(LEGACY),
        refused_mode=ids.mode_id(REFUSED_MODE),
    )


def run(s: Scenario) -> None:
    """The traffic: a split with cross-mode misses, a probe disagreement and a strict refusal."""
    store = s.store
    legacy = store.open("engine-legacy", LEGACY, SPLIT_NS, labels={"host": "node-2", "vllm": "0.32.0"})
    ahead = store.open("engine-lookahead", LOOKAHEAD, SPLIT_NS, labels={"host": "node-1", "vllm": "0.32.0"})
    bases = [b"base-%d" % i for i in range(4)]
    store.put(legacy.session_id, *[(b"legacy-%d" % i, b"v" * 512) for i in range(3)], base=bases[:3])
    # The lookahead engine misses all four; the legacy mode held three of them.
    store.lookup(ahead.session_id, *[b"ahead-%d" % i for i in range(4)], base=bases)
    store.put(ahead.session_id, *[(b"ahead-%d" % i, b"w" * 512) for i in range(4)], base=bases)
    store.lookup(ahead.session_id, b"ahead-0", b"ahead-1", base=bases[:2])
    store.lookup(legacy.session_id, b"legacy-0", b"legacy-1", b"legacy-2", base=bases[:3])
    drifted = store.open(
        "engine-drifted", LEGACY, SPLIT_NS, probe=[b"drift-0", b"drift-1"], labels={"host": "node-3"}
    )
    store.stub.CloseSession(pb.CloseSessionRequest(session_id=drifted.session_id), timeout=5)
    store.open("engine-strict-a", LOOKAHEAD, STRICT_NS, labels={"host": "node-4"})
    try:
        store.open("engine-strict-b", REFUSED_MODE, STRICT_NS, labels={"host": "node-5"})
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc
    else:
        raise AssertionError("the strict namespace admitted a second mode")
