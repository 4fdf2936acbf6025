"""`kvtag-store diagnose --watch`: the diagnose report redrawn in the terminal, changes highlighted.

Each frame clears the screen and prints the report; the lines that changed since the previous frame
carry a `>` in the left margin and, on a terminal, reverse video. "12s ago" ticking on its own is
not a change: ages are masked before frames are compared.
"""

from __future__ import annotations

import difflib
import re
import threading
import time
from collections.abc import Callable
from typing import TextIO

CLEAR = "\x1b[H\x1b[2J"
_MARK_ON, _MARK_OFF = "\x1b[7m", "\x1b[0m"
_AGE = re.compile(r"\b\d+[sm] ago\b")


class Watcher:
    """Turns successive reports into frames whose changed lines are marked."""

    def __init__(self, fetch: Callable[[], str], *, color: bool) -> None:
        self._fetch = fetch
        self._color = color
        self._previous: list[str] | None = None

    def frame(self) -> str:
        """The next frame's text (without the screen clear)."""
        lines = self._fetch().splitlines()
        changed = self._changed(lines)
        self._previous = lines
        return "\n".join(self._mark(line) if i in changed else "  " + line for i, line in enumerate(lines))

    def _changed(self, lines: list[str]) -> set[int]:
        if self._previous is None:
            return set()
        before = [_AGE.sub("", line) for line in self._previous]
        after = [_AGE.sub("", line) for line in lines]
        changed: set[int] = set()
        for tag, _i1, _i2, j1, j2 in difflib.SequenceMatcher(
            None, before, after, autojunk=False
        ).get_opcodes():
            if tag in ("replace", "insert"):
                changed.update(range(j1, j2))
        return changed

    def _mark(self, line: str) -> str:
        return f"{_MARK_ON}> {line}{_MARK_OFF}" if self._color else "> " + line


def run(
    fetch: Callable[[], str],
    out: TextIO,
    *,
    title: str,
    interval_s: float,
    stop: threading.Event | None = None,
) -> int:
    """Redraw every `interval_s` until Ctrl-C (or `stop`); exit status 0."""
    watcher = Watcher(fetch, color=out.isatty())
    stop = stop or threading.Event()
    try:
        while True:
            body = watcher.frame()
            stamp = time.strftime("%H:%M:%S UTC", time.gmtime())
            out.write(
                f"{CLEAR}{title}  every {interval_s:g}s  {stamp}  (Ctrl-C to stop; > changed)\n\n{body}\n"
            )
            out.flush()
            if stop.wait(interval_s):
                return 0
    except KeyboardInterrupt:
        out.write("\n")
        return 0
