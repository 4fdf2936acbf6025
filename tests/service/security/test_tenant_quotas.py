"""Per-tenant quotas (--tenant-quota): LRU within a tenant over its quota, no tenant evicting another
pool's blocks, per-tenant figures; then the same under a multi-process load, every byte checked."""

from __future__ import annotations

import multiprocessing
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag_store.app.server import RunningServer, start_server
from kvtag_store.backends.memory import MemoryBackend, MemoryCensus
from kvtag_store.config import ServiceConfig
from kvtag_store.observe import report
from prometheus_client import generate_latest

from tests.store_process import StoreProcess, store_bin

from ..quota_load import VALUE_BYTES, run_engine
from ..security_harness import Caller

KIB = 1 << 10


@pytest.fixture
def quota_store() -> Iterator[tuple[RunningServer, Caller]]:
    """64 KiB: tenant a and b get 16 KiB each, everyone else shares the other 32 KiB."""
    backend = MemoryBackend(64 * KIB, {"a": 16 * KIB, "b": 16 * KIB})
    server = start_server(backend, MemoryCensus(), ServiceConfig())
    channel = grpc.insecure_channel(server.address)
    yield server, Caller(channel, None)
    channel.close()
    server.stop(grace=0)


def _fill(caller: Caller, tenant: str, count: int, size: int = 4 * KIB) -> tuple[str, list[bytes]]:
    session = caller.open(tenant, engine_id=f"engine-{tenant}").session_id
    keys = [b"%s-%d" % (tenant.encode(), i) for i in range(count)]
    for key in keys:
        assert caller.put(session, [(key, key.ljust(size, b"."))]) == [pb.STORED]
    return session, keys


def _present(caller: Caller, session: str, keys: list[bytes]) -> list[bytes]:
    values = caller.get(session, keys)
    for key, value in zip(keys, values, strict=True):
        assert value is None or value.startswith(key), f"{key!r} came back with another block's bytes"
    return [key for key, value in zip(keys, values, strict=True) if value is not None]


def _tenants(caller: Caller) -> dict[str, pb.TenantStats]:
    return {t.tenant: t for t in caller.call("GetStats", pb.GetStatsRequest()).tenants}


def test_a_tenant_over_its_quota_evicts_its_own_oldest_blocks_and_nobody_else_s(
    quota_store: tuple[RunningServer, Caller],
) -> None:
    server, caller = quota_store
    session_b, keys_b = _fill(caller, "b", 3)
    session_c, keys_c = _fill(caller, "c", 3)  # the shared pool
    session_a, keys_a = _fill(caller, "a", 10)  # 40 KiB into a 16 KiB quota
    assert _present(caller, session_a, keys_a) == keys_a[-4:]
    assert _present(caller, session_b, keys_b) == keys_b
    assert _present(caller, session_c, keys_c) == keys_c
    tenants = _tenants(caller)
    assert (tenants["a"].used_bytes, tenants["a"].quota_bytes, tenants["a"].evictions) == (
        16 * KIB,
        16 * KIB,
        6,
    )
    assert (tenants["b"].evictions, tenants["c"].evictions, tenants["c"].quota_bytes) == (0, 0, 0)
    scraped = generate_latest(server.service.metrics.registry).decode()
    assert 'kvtag_tenant_evictions_total{tenant="a"} 6.0' in scraped
    assert f'kvtag_tenant_quota_bytes{{tenant="b"}} {16 * KIB}.0' in scraped


def test_stats_table_lists_each_tenant_with_its_quota_usage_and_evictions(
    quota_store: tuple[RunningServer, Caller],
) -> None:
    _, caller = quota_store
    _fill(caller, "a", 5)  # 20 KiB into a 16 KiB quota: one eviction
    _fill(caller, "c", 1)
    text = report.stats_table(caller.call("GetStats", pb.GetStatsRequest()))
    lines = text.splitlines()
    head = lines.index(next(line for line in lines if line.startswith("tenant ")))
    rows = {line.split()[0]: line.split() for line in lines[head + 2 :]}
    assert rows == {
        "a": ["a", "16.0", "KiB", "4", "16.0", "KiB", "1"],
        "b": ["b", "16.0", "KiB", "0", "0", "B", "0"],
        "c": ["c", "shared", "pool", "1", "4.0", "KiB", "0"],
    }


def test_tenants_of_the_shared_pool_never_evict_a_quota_tenant(
    quota_store: tuple[RunningServer, Caller],
) -> None:
    _, caller = quota_store
    session_a, keys_a = _fill(caller, "a", 4)  # exactly its quota
    session_c, keys_c = _fill(caller, "c", 6)
    session_d, keys_d = _fill(caller, "d", 6)  # c and d: 48 KiB into the 32 KiB shared pool
    assert _present(caller, session_a, keys_a) == keys_a
    shared = _present(caller, session_c, keys_c) + _present(caller, session_d, keys_d)
    assert shared == keys_c[-2:] + keys_d  # LRU across the shared pool: c's oldest went first
    stats = caller.call("GetStats", pb.GetStatsRequest())
    assert stats.used_bytes == 16 * KIB + 32 * KIB


def test_a_value_larger_than_the_quota_or_a_quota_full_of_leases_is_rejected_naming_the_quota(
    quota_store: tuple[RunningServer, Caller],
) -> None:
    _, caller = quota_store
    session, keys = _fill(caller, "a", 4)
    response = caller.call(
        "Put",
        pb.PutRequest(
            session_id=session, items=[pb.PutItem(block=pb.BlockRef(key=b"big"), value=bytes(17 * KIB))]
        ),
    )
    assert response.results[0].status == pb.REJECTED and "tenant 'a'" in response.results[0].reason
    assert caller.lookup(session, keys).lease.lease_id  # every block of the quota leased
    assert caller.put(session, [(b"more", bytes(KIB))]) == [pb.REJECTED]
    assert caller.put(caller.open("b").session_id, [(b"b-fits", bytes(4 * KIB))]) == [pb.STORED]


def test_quotas_larger_than_the_capacity_are_refused() -> None:
    with pytest.raises(ValueError, match="more than the capacity"):
        MemoryBackend(10 * KIB, {"a": 8 * KIB, "b": 8 * KIB})


def test_mooncake_backend_refuses_quotas_at_start() -> None:
    """Mooncake evicts by its own policy: a quota would promise what it cannot keep."""
    refused = subprocess.run(
        [store_bin(), "serve", "--backend", "mooncake", "--tenant-quota=a=1MiB", "--listen", "127.0.0.1:0",
         "--metrics-listen", ""],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "applies to the memory backend only" in refused.stderr, refused.stderr[-2000:]


def test_quotas_hold_under_a_multi_process_load_with_every_byte_checked(tmp_path: Path) -> None:
    quota = 1 << 20  # 64 values of 16 KiB
    args = ("--capacity", "4MiB", "--tenant-quota", "a=1MiB", "--tenant-quota", "b=1MiB")
    plan = {"a": 160, "b": 48, "c": 96, "d": 96}  # a: 2.5x its quota; b: under it; c+d: 1.5x the 2 MiB pool
    with StoreProcess(tmp_path / "store.log", *args) as store:
        context = multiprocessing.get_context("spawn")
        with context.Pool(len(plan)) as pool:
            runs = pool.starmap(run_engine, [(store.endpoint, t, n) for t, n in plan.items()], chunksize=1)
        with grpc.insecure_channel(store.endpoint) as channel:
            tenants = _tenants(Caller(channel, None))
    outcome: dict[str, dict[str, Any]] = {str(run["tenant"]): run for run in runs}
    for tenant, run in outcome.items():
        assert run["corrupt"] == [], f"tenant {tenant} read bytes that are not its own"
        assert set(run["statuses"]) == {pb.STORED}, tenant
    per_value = VALUE_BYTES
    # a stayed within its quota and kept exactly its most recent values; b lost nothing.
    assert outcome["a"]["present"] == list(range(plan["a"] - quota // per_value, plan["a"]))
    assert tenants["a"].used_bytes == quota and tenants["a"].evictions == plan["a"] - quota // per_value
    assert outcome["b"]["present"] == list(range(plan["b"])) and tenants["b"].evictions == 0
    # c and d shared what the quotas left (2 MiB) and evicted only each other.
    assert tenants["c"].used_bytes + tenants["d"].used_bytes <= 2 * quota
    assert tenants["c"].evictions + tenants["d"].evictions >= (plan["c"] + plan["d"]) - 2 * quota // per_value
