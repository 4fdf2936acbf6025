"""Tokens files, callers that present a token, and secured in-process servers for the security tests."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_proto.errors import KvtagError, parse_error
from kvtag_store.security.tokens import hash_token, new_token

from tests.descriptors import PROBE, mode, namespace

# (name, role, tenants)
Grant = tuple[str, str, Sequence[str]]


def write_tokens(path: Path, grants: Iterable[Grant], tokens: dict[str, str] | None = None) -> dict[str, str]:
    """Write a tokens file (TOML, or JSON for a .json path) of fresh tokens, or the given ones by name;
    return name -> token. The file holds only digests."""
    tokens = dict(tokens or {})
    entries = []
    for name, role, tenants in grants:
        token = tokens.setdefault(name, new_token())
        entries.append({"name": name, "sha256": hash_token(token), "role": role, "tenants": list(tenants)})
    if path.suffix == ".json":
        path.write_text(json.dumps({"tokens": entries}))
    else:
        path.write_text(
            "".join(
                f'[[tokens]]\nname = "{e["name"]}"\nsha256 = "{e["sha256"]}"\nrole = "{e["role"]}"\n'
                f"tenants = {json.dumps(e['tenants'])}\n\n"
                for e in entries
            )
        )
    return {name: tokens[name] for name, _, _ in grants}


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def failure(call: Any) -> KvtagError:
    """Run `call()`, which must fail with a kvtag error, and return it decoded."""
    try:
        result = call()
        if hasattr(result, "__next__"):
            list(result)
    except grpc.RpcError as err:
        detail = parse_error(err)
        assert detail is not None, f"no kvtag ErrorInfo on {err}"
        return detail
    raise AssertionError("the call succeeded but should have been refused")


@dataclass
class Caller:
    """The real stub, every call carrying one token (or none)."""

    channel: grpc.Channel
    token: str | None
    stub: Any = field(init=False)

    def __post_init__(self) -> None:
        self.stub = store_pb2_grpc.KvStoreStub(self.channel)  # type: ignore[no-untyped-call]

    def call(self, method: str, request: Any, **kwargs: Any) -> Any:
        metadata = bearer(self.token) if self.token is not None else None
        return getattr(self.stub, method)(request, metadata=metadata, timeout=10, **kwargs)

    def open(self, tenant: str, engine_id: str = "engine", model: str = "llama-8b") -> pb.OpenSessionResponse:
        request = pb.OpenSessionRequest(
            engine_id=engine_id,
            namespace=namespace(model=model, tenant=tenant),
            mode=mode(),
            probe_keys=list(PROBE),
        )
        response: pb.OpenSessionResponse = self.call("OpenSession", request)
        return response

    def put(self, session_id: str, pairs: Sequence[tuple[bytes, bytes]]) -> list[int]:
        request = pb.PutRequest(
            session_id=session_id, items=[pb.PutItem(block=pb.BlockRef(key=k), value=v) for k, v in pairs]
        )
        return [r.status for r in self.call("Put", request).results]

    def get(self, session_id: str, keys: Sequence[bytes], lease_id: str = "") -> list[bytes | None]:
        request = pb.GetRequest(
            session_id=session_id, blocks=[pb.BlockRef(key=k) for k in keys], lease_id=lease_id
        )
        return [r.value if r.status == pb.HIT else None for r in self.call("Get", request).results]

    def lookup(self, session_id: str, keys: Sequence[bytes]) -> pb.LookupResponse:
        request = pb.LookupRequest(session_id=session_id, blocks=[pb.BlockRef(key=k) for k in keys])
        response: pb.LookupResponse = self.call("Lookup", request)
        return response
