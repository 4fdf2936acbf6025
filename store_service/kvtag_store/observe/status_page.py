"""The status page: the status document (status.py) rendered as one self-contained HTML page.

Server-side with the standard library only: no JavaScript, no external assets (the page must work
offline), a meta refresh to stay current, inline CSS and inline SVG sparklines. Every value from the
census goes through html.escape, since engine ids, labels and reasons come from clients.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from html import escape
from typing import Any

from kvtag_store.observe.report import human_bytes

REFRESH_S = 10

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1d2330;background:#f7f8fa}
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.15em;margin:1.6em 0 .3em}
h3{font-size:1em;margin:1.1em 0 .3em;color:#444}
section.ns{background:#fff;border:1px solid #d8dce3;border-radius:6px;padding:.6em 1.2em 1em;margin:1em 0}
table{border-collapse:collapse;margin:.2em 0}
th,td{padding:.25em .7em;border-bottom:1px solid #e4e7ec;text-align:left;vertical-align:top}
th{font-weight:600;background:#f0f2f5}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.diff{background:#ffe08a;font-weight:600}
.badge{display:inline-block;padding:0 .5em;border-radius:3px;font-size:.85em;background:#e4e7ec}
.strict{background:#f6c7c7}.isolate{background:#cfe3f7}
.live{color:#17803d;font-weight:600}.gone{color:#888}
.warn{color:#b3261e;font-weight:600}
.muted{color:#666}.mono{font-family:ui-monospace,monospace;font-size:.92em;white-space:nowrap}
.bar{display:inline-block;width:12em;height:.8em;background:#e4e7ec;border-radius:2px;vertical-align:middle}
.bar span{display:block;height:100%;background:#4a7bd0;border-radius:2px}
svg.spark{vertical-align:middle}
"""


def render(
    doc: dict[str, Any],
    refresh_s: int = REFRESH_S,
    next_href: str | None = None,
    total_namespaces: int | None = None,
) -> str:
    """The whole page for one status document: one page of namespaces, with a link to the next."""
    generated = _utc(doc["generated_at_unix_ms"])
    namespaces = doc["namespaces"]
    body = [
        "<h1>kvtag store status</h1>",
        f'<p class="muted">generated {generated}; refreshes every {refresh_s}s; '
        f"history: one point per {doc['history_interval_s']:g}s; "
        'JSON: <a href="api/v1/status">/api/v1/status</a>, metrics: <a href="metrics">/metrics</a></p>',
        _store(doc["store"]),
        _tenants(doc["tenants"]),
    ]
    if not namespaces:
        body.append("<p>No namespaces yet: no engine has opened a session.</p>")
    elif total_namespaces is not None and (next_href or total_namespaces > len(namespaces)):
        body.append(
            f'<p class="muted">{len(namespaces)} of {total_namespaces} namespaces on this page: splits '
            "first, then refusals, then the most recently active</p>"
        )
    body += [_namespace(ns, doc["history_interval_s"], doc["history_points"]) for ns in namespaces]
    if next_href:
        body.append(f'<p><a id="next-page" href="{escape(next_href)}">next page of namespaces</a></p>')
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{int(refresh_s)}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>kvtag status</title><style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _store(store: dict[str, Any]) -> str:
    if not store["backend_up"]:
        return '<p class="warn" id="store">backend unreachable: store figures unavailable</p>'
    rows = [
        ("backend", escape(store["backend"])),
        ("capacity", _bytes(store["capacity_bytes"])),
    ]
    wide = store["store_wide"]
    if wide is not None:
        capacity = store["capacity_bytes"]
        share = wide["used_bytes"] / capacity if capacity else 0.0
        rows += [
            ("used", f"{_bytes(wide['used_bytes'])} ({share:.1%}) {_bar(share)}"),
            ("blocks", f"{wide['keys']} ({wide['leased_keys']} leased)"),
            ("evictions", str(wide["evictions"])),
            ("corrupted values dropped", str(wide["corrupted_dropped"])),
            (
                "backend errors",
                ", ".join(f"{escape(k)} {v}" for k, v in wide["backend_errors"].items()) or "none",
            ),
        ]
        done, total = wide["prefault"]["done_bytes"], wide["prefault"]["total_bytes"]
        if total:
            share = done / total
            rows.append(("prefault", f"{_bytes(done)} of {_bytes(total)} ({share:.1%}) {_bar(share)}"))
    cells = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    degraded = "".join(
        f'<p class="warn degraded" id="degraded-{escape(d["tier"])}">{escape(d["tier"])} tier degraded: '
        f"{escape(d['reason']) or 'no reason given'} (the store serves from memory only)</p>"
        for d in store["degraded"]
    )
    tiers = _tiers(wide["tiers"]) if wide is not None else ""
    return f'<h2>Store</h2>{degraded}<table id="store">{cells}</table>{tiers}'


_TIER_FIGURES = ("hits", "spills", "reads_back", "corrupted_dropped", "evictions", "failures")


def _tiers(tiers: list[dict[str, Any]]) -> str:
    """Per storage tier (memory, disk): how full, what moved between them, what went wrong."""
    if not tiers:
        return ""
    rows = []
    for t in tiers:
        capacity = t["capacity_bytes"]
        share = t["used_bytes"] / capacity if capacity else 0.0
        state = '<span class="warn">degraded</span>' if t["degraded"] else "ok"
        rows.append(
            f"<tr><td>{escape(t['tier'])}</td><td>{_bytes(capacity)}</td>"
            f"<td>{human_bytes(t['used_bytes'])} ({share:.1%}) {_bar(share)}</td>"
            f'<td class="num">{t["keys"]}</td>'
            + "".join(f'<td class="num">{t[name]}</td>' for name in _TIER_FIGURES)
            + f"<td>{state}</td></tr>"
        )
    head = (
        "<tr><th>tier</th><th>capacity</th><th>used</th><th>blocks</th><th>hits</th><th>spills</th>"
        "<th>reads back</th><th>corrupted dropped</th><th>evictions</th><th>failures</th><th>state</th></tr>"
    )
    return f'<h3>Tiers</h3><table id="tiers">{head}{"".join(rows)}</table>'


def _tenants(tenants: list[dict[str, Any]]) -> str:
    """Per tenant: its quota (or the shared pool), used bytes and evictions."""
    if not tenants:
        return ""
    rows = []
    for t in tenants:
        quota = t["quota_bytes"]
        if quota:
            share = t["used_bytes"] / quota
            used = f"{_bytes(t['used_bytes'])} ({share:.1%} of quota) {_bar(share)}"
        else:
            used = _bytes(t["used_bytes"])
        rows.append(
            f"<tr><td>{escape(t['tenant']) or '(none)'}</td>"
            f"<td>{_bytes(quota) if quota else 'shared pool'}</td><td>{used}</td>"
            f'<td class="num">{t["keys"]}</td><td class="num">{t["evictions"]}</td></tr>'
        )
    head = "<tr><th>tenant</th><th>capacity</th><th>used</th><th>blocks</th><th>evictions</th></tr>"
    return f'<h2>Tenants</h2><table id="tenants">{head}{"".join(rows)}</table>'


def _namespace(ns: dict[str, Any], interval_s: float, points: int) -> str:
    d = ns["descriptor"]
    policy = escape(ns["policy"])
    out = [
        f'<section class="ns" id="ns-{escape(ns["namespace_id"])}">',
        f'<h2>namespace <span class="mono">{escape(ns["namespace_id"])}</span> '
        f'<span class="badge {policy}">policy {policy}</span></h2>',
        f"<p>model {escape(d['model_name'])} ({escape(d['weights_fingerprint'])}) · "
        f"kv {escape(d['kv_dtype'])} {escape(d['kv_layout'])} · block {d['block_size']} · "
        f"{escape(d['parallel_sharding'])} · "
        f"tenant {escape(d['tenant']) or '(shared)'} · {ns['keys']} blocks, {_bytes(ns['used_bytes'])}"
        + (
            f' · established mode <span class="mono">{escape(ns["established_mode_id"])}</span>'
            if ns["established_mode_id"]
            else ""
        )
        + "</p>",
        _modes(ns),
        _counters(ns, interval_s, points),
        _engines(ns),
        _refused(ns["refused"]),
        _disagreements(ns["probe_disagreements"]),
        "</section>",
    ]
    return "\n".join(out)


def _modes(ns: dict[str, Any]) -> str:
    modes = ns["modes"]
    if not modes:
        return "<h3>Modes</h3><p>none admitted</p>"
    fields = list(modes[0]["fields"])
    differing = set(ns["differing_fields"])
    head = "<tr><th>mode_id</th>" + "".join(
        f'<th class="diff">{escape(f)}</th>' if f in differing else f"<th>{escape(f)}</th>" for f in fields
    )
    rows = [
        f'<tr><td class="mono">{escape(m["mode_id"])}</td>'
        + "".join(
            f'<td class="{"diff" if f in differing else ""}">{escape(m["fields"][f])}</td>' for f in fields
        )
        + "</tr>"
        for m in modes
    ]
    note = (
        f'<p class="warn">{len(modes)} modes split this namespace; they differ in '
        f"{escape(', '.join(ns['differing_fields']))} (highlighted) and never share blocks</p>"
        if differing
        else ""
    )
    return f'<h3>Modes</h3>{note}<table class="modes">{head}</tr>{"".join(rows)}</table>'


def _counters(ns: dict[str, Any], interval_s: float, points: int) -> str:
    head = (
        "<tr><th>mode_id</th><th>hits</th><th>misses</th><th>mode mismatches</th>"
        "<th>cross-mode misses</th><th>hit rate</th><th>if aligned</th><th>conflicts</th>"
        f"<th>stored</th><th>history (hit rate; cross-mode share dashed; {interval_s:g}s a point)</th></tr>"
    )
    rows = []
    for m in ns["modes"]:
        c = m["counters"]
        history = m["history"]
        figures = [
            *(str(c[k]) for k in ("hits", "misses", "mode_mismatches", "cross_mode_misses")),
            _pct(m["hit_rate"]),
            _pct(m["hit_rate_if_aligned"]),
            str(c["conflicts"]),
            str(c["stored"]),
        ]
        spark = sparkline(
            [p["hit_rate"] for p in history], [p["cross_mode_share"] for p in history], slots=points
        )
        rows.append(
            f'<tr><td class="mono">{escape(m["mode_id"])}</td>'
            + "".join(f'<td class="num">{f}</td>' for f in figures)
            + f"<td>{spark}</td></tr>"
        )
    held = [
        f'<li class="crossmode">mode <span class="mono">{escape(s["held_by_mode_id"])}</span> held '
        f'<b>{s["misses"]}</b> of mode <span class="mono">{escape(s["mode_id"])}</span>\'s misses: '
        f"this split costs that mode {_points(s['hit_rate_cost'])} of hit rate</li>"
        for s in ns["splits"]
    ]
    splits = (
        f'<ul class="splits">{"".join(held)}</ul>' if held else '<p class="muted">no cross-mode misses</p>'
    )
    return f'<h3>Hits and misses per mode</h3><table class="counters">{head}{"".join(rows)}</table>{splits}'


def _engines(ns: dict[str, Any]) -> str:
    rows = [
        f'<tr><td class="mono">{escape(e["engine_id"])}</td><td class="mono">{escape(m["mode_id"])}</td>'
        f'<td class="{"live" if e["live"] else "gone"}">{"live" if e["live"] else "gone"}</td>'
        f"<td>{_utc(e['last_seen_unix_ms'])} ({_ago(e['last_seen_unix_ms'])})</td>"
        f"<td>{_labels(e['labels'])}</td></tr>"
        for m in ns["modes"]
        for e in m["engines"]
    ]
    if not rows:
        return "<h3>Engines</h3><p>none</p>"
    head = "<tr><th>engine</th><th>mode_id</th><th>state</th><th>last heartbeat</th><th>labels</th></tr>"
    return f'<h3>Engines</h3><table class="engines">{head}{"".join(rows)}</table>'


def _refused(refused: Sequence[dict[str, Any]]) -> str:
    if not refused:
        return ""
    out = ["<h3>Refused sessions</h3>"]
    for r in refused:
        out.append(
            f'<div class="refused"><p><span class="warn">{escape(r["kind"])}</span> engine '
            f'<span class="mono">{escape(r["engine_id"])}</span>, {_utc(r["at_unix_ms"])}: '
            f"{escape(r['reason'])}</p>"
        )
        if r["diffs"]:
            rows = "".join(
                f'<tr><td class="diff">{escape(d["field"])}</td><td>{escape(d["established"])}</td>'
                f'<td class="diff">{escape(d["requested"])}</td></tr>'
                for d in r["diffs"]
            )
            out.append(
                '<table class="refusal-diff"><tr><th>field</th>'
                f"<th>established ({escape(r['established_mode_id'] or '')})</th>"
                f"<th>requested ({escape(r['requested_mode_id'] or '')})</th></tr>{rows}</table>"
            )
        out.append("</div>")
    return "\n".join(out)


def _disagreements(items: Sequence[dict[str, Any]]) -> str:
    if not items:
        return ""
    rows = "".join(
        f'<tr><td class="mono">{escape(p["mode_id"])}</td><td class="mono">{escape(p["engine_id"])}</td>'
        f'<td class="mono">{escape(p["reference_engine_id"])}</td><td>{escape(p["likely_cause"])}</td>'
        f"<td>{_utc(p['at_unix_ms'])}</td></tr>"
        for p in items
    )
    head = "<tr><th>mode_id</th><th>engine</th><th>reference engine</th><th>likely cause</th><th>at</th></tr>"
    return f'<h3>Probe disagreements</h3><table class="probes">{head}{rows}</table>'


def sparkline(
    rates: Sequence[float | None],
    shares: Sequence[float | None] = (),
    slots: int = 60,
    width: int = 160,
    height: int = 28,
) -> str:
    """Inline SVG over `slots` intervals, newest at the right edge: `rates` solid and `shares`
    dashed, both on a 0..1 scale; None (an interval without lookups) is a gap."""
    if not rates:
        return '<span class="muted">no points yet</span>'
    step = width / max(1, slots - 1)
    first = max(0, slots - len(rates))

    def lines(values: Sequence[float | None], color: str, dash: str) -> Iterable[str]:
        run: list[tuple[float, float]] = []
        for i, v in enumerate([*values, None]):
            if v is not None:
                run.append(((first + i) * step, (1 - v) * (height - 2) + 1))
                continue
            if len(run) == 1:  # a lone point is a dot
                yield f'<circle cx="{run[0][0]:.1f}" cy="{run[0][1]:.1f}" r="1.5" fill="{color}"/>'
            elif run:
                points = " ".join(f"{x:.1f},{y:.1f}" for x, y in run)
                yield (
                    f'<polyline fill="none" stroke="{color}" stroke-width="1.5" '
                    f'stroke-dasharray="{dash}" points="{points}"/>'
                )
            run = []

    last = next((v for v in reversed(rates) if v is not None), None)
    title = f"last hit rate {_pct(last)}" if last is not None else "no lookups in the last interval"
    parts = [
        f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="{title}"><title>{title}</title>',
        f'<rect width="{width}" height="{height}" fill="#f0f2f5"/>',
        *lines(shares, "#b3261e", "3,2"),
        *lines(rates, "#17803d", "none"),
        "</svg>",
    ]
    return "".join(parts)


def _labels(labels: dict[str, str]) -> str:
    return ", ".join(f"{escape(k)}={escape(v)}" for k, v in labels.items()) or '<span class="muted">-</span>'


def _bar(share: float) -> str:
    return f'<span class="bar"><span style="width:{min(100.0, share * 100):.1f}%"></span></span>'


def _bytes(n: int | None) -> str:
    return "-" if n is None else f"{human_bytes(n)} ({n} bytes)"


def _points(rate: float | None) -> str:
    return "-" if rate is None else f"{rate * 100:.1f} percentage points"


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.1%}"


def _utc(unix_ms: int) -> str:
    if not unix_ms:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix_ms / 1000))


def _ago(unix_ms: int) -> str:
    if not unix_ms:
        return "-"
    seconds = max(0.0, time.time() - unix_ms / 1000)
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"
