"""The status page as a person sees it: Debian's headless chromium loads it from a real server.

The scenario (tests/service/status_scenario.py) has two modes in one isolate namespace with
cross-mode misses, and a strict namespace with a refused engine. The DOM chromium builds
(`--dump-dom`) must show the modes with the differing field marked, the refused engine's diff and
the cross-mode figure; the screenshot is kept in tests/artifacts/ for a person to look at.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.service import status_scenario as sc

pytestmark = pytest.mark.slow  # a real browser

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


def chromium(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("chromium")
    if binary is None:
        pytest.fail("chromium not found: run scripts/test_status.sh (make test-status)")
    with tempfile.TemporaryDirectory(prefix="kvtag-chromium-") as profile:
        return subprocess.run(
            [
                binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--disable-extensions", "--disable-background-networking",
                f"--user-data-dir={profile}", "--window-size=1400,2200", *args,
            ],
            capture_output=True,
            text=True,
            timeout=90,
            check=True,
        )  # fmt: skip


class Cells(HTMLParser):
    """Collects the text of every table row, per table class, and the classes of each cell."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[tuple[str, str]]]] = {}
        self._table: str | None = None
        self._cell: list[str] | None = None
        self._cell_class = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = dict(attrs).get("class") or ""
        if tag == "table":
            self._table = classes or dict(attrs).get("id") or ""
            self.tables.setdefault(self._table, [])
        elif tag == "tr" and self._table is not None:
            self.tables[self._table].append([])
        elif tag in ("td", "th") and self._table is not None:
            self._cell, self._cell_class = [], classes

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._table is not None:
            self.tables[self._table][-1].append(("".join(self._cell).strip(), self._cell_class))
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


@pytest.fixture(scope="module")
def scenario() -> Iterator[sc.Scenario]:
    s = sc.start(history_interval_s=0.1)
    try:
        sc.run(s)
        # A few intervals of lookups so the sparklines have points to draw.
        ahead = s.store.open("engine-lookahead-2", sc.LOOKAHEAD, sc.SPLIT_NS)
        for _ in range(5):
            s.store.lookup(ahead.session_id, b"ahead-0", b"ahead-1", b"ahead-9")
            time.sleep(0.12)
        yield s
    finally:
        s.close()


def test_page_in_headless_chromium_shows_modes_refusal_diff_and_cross_mode_misses(
    scenario: sc.Scenario,
) -> None:
    dom = chromium("--dump-dom", scenario.http + "/").stdout
    # The browser's DOM, not the served text: chromium inserts the <tbody> the server never writes.
    assert "<tbody>" in dom and "<tbody>" not in scenario.fetch("/")[2], dom[:200]
    cells = Cells()
    cells.feed(dom)

    mode_rows = [[text for text, _ in row] for row in cells.tables["modes"]]
    assert mode_rows[0][:7] == [
        "mode_id", "key_scheme", "scheme_version", "hash_algorithm", "hash_block_size",
        "lookahead_tokens", "seed_fingerprint",
    ]  # fmt: skip
    split_modes = {row[0]: row for row in mode_rows[1:]}
    assert split_modes[scenario.lookahead_mode][5] == "1"
    assert split_modes[scenario.legacy_mode][5] == "0"
    # Only the field the two modes differ in is highlighted.
    highlighted = {text for row in cells.tables["modes"] for text, cls in row if "diff" in cls}
    assert highlighted == {"lookahead_tokens", "0", "1"}

    diff_rows = [[text for text, _ in row] for row in cells.tables["refusal-diff"]]
    assert diff_rows[0] == [
        "field",
        f"established ({scenario.lookahead_mode})",
        f"requested ({scenario.refused_mode})",
    ]
    assert diff_rows[1:] == [["hash_algorithm", "sha256", "xxh3-128"], ["lookahead_tokens", "1", "0"]]
    assert "engine-strict-b" in dom

    assert f"mode {scenario.legacy_mode} held 3 of mode {scenario.lookahead_mode}'s misses" in _text(dom)
    counters: dict[str, list[str]] = {}
    for row in cells.tables["counters"][1:]:  # the split namespace comes first (splits lead the page)
        counters.setdefault(row[0][0], [t for t, _ in row])
    assert counters[scenario.lookahead_mode][4] == str(sc.CROSS_MODE_MISSES)
    engines = {row[0][0]: [t for t, _ in row] for row in cells.tables["engines"][1:]}
    assert engines["engine-drifted"][2] == "gone" and engines["engine-legacy"][2] == "live"
    assert "<polyline" in dom, "the sparkline drew the lookups of consecutive intervals"


def test_screenshot_is_kept_as_an_artifact(scenario: sc.Scenario) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "status-page.png"
    shot.unlink(missing_ok=True)
    chromium(f"--screenshot={shot}", scenario.http + "/")
    header = shot.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    assert (width, height) == (1400, 2200)


def _text(dom: str) -> str:
    """The DOM's text with tags removed and whitespace collapsed."""

    parts: list[str] = []

    class Text(HTMLParser):
        def handle_data(self, data: str) -> None:
            parts.append(data)

    Text().feed(dom)
    return " ".join("".join(parts).split())
