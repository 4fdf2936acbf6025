"""Readable renderings of Diagnose and GetStats for `kvtag-store diagnose` / `stats`."""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvtag.v1 import store_pb2 as pb

from kvtag_store.config import policy_name
from kvtag_store.policy.mode_diff import MODE_FIELDS, field_text


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = [indent + "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append(indent + "  ".join("-" * w for w in widths))
    lines += [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _ago(unix_ms: int) -> str:
    if not unix_ms:
        return "-"
    seconds = max(0.0, time.time() - unix_ms / 1000)
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def diagnose_table(answer: pb.DiagnoseResponse) -> str:
    if not answer.namespaces:
        return "no namespaces yet: no engine has opened a session"
    out: list[str] = []
    for ns in answer.namespaces:
        d = ns.namespace
        out.append(
            f"namespace {ns.namespace_id}  policy {policy_name(ns.policy)}"
            + (f"  established mode {ns.established_mode_id}" if ns.established_mode_id else "")
        )
        out.append(
            f"  model {d.model_name} ({d.weights_fingerprint})  kv {d.kv_dtype} {d.kv_layout}  "
            f"block {d.block_size}  sharding {d.parallel_sharding}  tenant {d.tenant or '(shared)'}"
        )
        out.append("")
        out.append("  modes")
        out.append(
            table(
                ["mode_id", *MODE_FIELDS],
                [[m.mode_id, *(field_text(m.mode, f) for f in MODE_FIELDS)] for m in ns.modes],
                indent="    ",
            )
        )
        out.append("")
        out.append("  engines")
        engine_rows = [
            [
                e.engine_id,
                m.mode_id,
                "live" if e.live else "gone",
                _ago(e.last_seen_unix_ms),
                ",".join(f"{k}={v}" for k, v in sorted(e.labels.items())) or "-",
            ]
            for m in ns.modes
            for e in m.engines
        ]
        out.append(table(["engine", "mode_id", "state", "last seen", "labels"], engine_rows, indent="    "))
        out.append("")
        out.append("  counters")
        counter_rows = []
        for m in ns.modes:
            c = m.counters
            held = ", ".join(f"mode {x.held_by_mode_id} held {x.count}" for x in m.cross_mode_misses) or "-"
            counter_rows.append(
                [
                    m.mode_id,
                    str(c.hits),
                    str(c.misses),
                    str(c.mode_mismatches),
                    str(c.cross_mode_misses),
                    str(c.conflicts),
                    str(c.stored),
                    held,
                ]
            )
        out.append(
            table(
                [
                    "mode_id",
                    "hits",
                    "misses",
                    "mode mismatches",
                    "cross-mode misses",
                    "conflicts",
                    "stored",
                    "cross-mode: mode M' held it",
                ],
                counter_rows,
                indent="    ",
            )
        )
        if ns.refused:
            out.append("")
            out.append("  refused sessions")
            for r in ns.refused:
                out.append(f"    {_ago(r.at_unix_ms)}  engine {r.engine_id}: {r.reason}")
                if r.HasField("refusal") and r.refusal.diffs:
                    out.append(
                        table(
                            ["field", "established", "requested"],
                            [[f.field, f.established, f.requested] for f in r.refusal.diffs],
                            indent="      ",
                        )
                    )
        if ns.probe_disagreements:
            out.append("")
            out.append("  probe disagreements")
            for p in ns.probe_disagreements:
                out.append(
                    f"    {_ago(p.at_unix_ms)}  mode {p.mode_id}: engine {p.engine_id} vs reference "
                    f"{p.reference_engine_id}; {p.likely_cause}"
                )
        out.append("")
    return "\n".join(out).rstrip()


def stats_table(answer: pb.GetStatsResponse) -> str:
    used_pct = 100.0 * answer.used_bytes / answer.capacity_bytes if answer.capacity_bytes else 0.0
    rows = [
        ["backend", answer.backend],
        ["capacity", f"{human_bytes(answer.capacity_bytes)} ({answer.capacity_bytes} bytes)"],
        ["used", f"{human_bytes(answer.used_bytes)} ({answer.used_bytes} bytes, {used_pct:.1f}%)"],
        ["keys", str(answer.keys)],
        ["leased keys", str(answer.leased_keys)],
        ["evictions", str(answer.evictions)],
        ["corrupted dropped", str(answer.corrupted_dropped)],
    ]
    out = [table(["figure", "value"], rows, indent="")]
    if answer.namespaces:
        out.append("")
        out.append(
            table(
                ["namespace_id", "keys", "used"],
                [[n.namespace_id, str(n.keys), human_bytes(n.used_bytes)] for n in answer.namespaces],
                indent="",
            )
        )
    if answer.tiers:
        out.append("")
        out.append(tiers_table(answer))
    if answer.prefault_total_bytes:
        done, total = answer.prefault_done_bytes, answer.prefault_total_bytes
        out.append("")
        out.append(
            f"prefault: {human_bytes(done)} of {human_bytes(total)} touched ({100.0 * done / total:.1f}%)"
        )
    degraded = degraded_lines(answer)
    if degraded:
        out.append("")
        out.extend(degraded)
    if answer.tenants:
        out.append("")
        out.append(
            table(
                ["tenant", "quota", "keys", "used", "evictions"],
                [
                    [
                        t.tenant or "(shared)",
                        human_bytes(t.quota_bytes) if t.quota_bytes else "shared pool",
                        str(t.keys),
                        human_bytes(t.used_bytes),
                        str(t.evictions),
                    ]
                    for t in answer.tenants
                ],
                indent="",
            )
        )
    return "\n".join(out)


def tiers_table(answer: pb.GetStatsResponse) -> str:
    return table(
        [
            "tier",
            "capacity",
            "used",
            "keys",
            "hits",
            "spills",
            "reads back",
            "corrupted",
            "evictions",
            "failures",
            "state",
        ],
        [
            [
                t.tier,
                human_bytes(t.capacity_bytes),
                human_bytes(t.used_bytes),
                str(t.keys),
                str(t.hits),
                str(t.spills),
                str(t.reads_back),
                str(t.corrupted_dropped),
                str(t.evictions),
                str(t.failures),
                "DEGRADED" if t.degraded else "ok",
            ]
            for t in answer.tiers
        ],
        indent="",
    )


def degraded_lines(answer: pb.GetStatsResponse) -> list[str]:
    """One line per tier out of use, worded as on the status page."""
    return [
        f"{t.tier} tier degraded: {t.degraded_reason or 'no reason given'} "
        "(the store serves from memory only)"
        for t in answer.tiers
        if t.degraded
    ]
