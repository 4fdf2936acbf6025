"""Structured logging: one JSON object per line (--log-format json) or readable text, on stderr."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Any

# Attributes every LogRecord has; anything else came in through `extra=` and is a field.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD:
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        fields = " ".join(f"{k}={v}" for k, v in record.__dict__.items() if k not in _STANDARD)
        return f"{base} {fields}" if fields else base


def configure(log_format: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        formatter: logging.Formatter = JsonFormatter()
        formatter.converter = time.gmtime
    else:
        formatter = TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class RateLimited:
    """At most one line per `interval_s` for each key; the next line says how many were left out.
    For per-request warnings a misbehaving client can trigger at any rate."""

    def __init__(self, logger: logging.Logger, interval_s: float = 1.0) -> None:
        self._logger = logger
        self._interval = interval_s
        self._next: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, key: str, message: str, *args: object, extra: dict[str, Any] | None = None) -> None:
        now = time.monotonic()
        with self._lock:
            if now < self._next.get(key, 0.0):
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return
            self._next[key] = now + self._interval
            suppressed = self._suppressed.pop(key, 0)
        fields = dict(extra or {})
        if suppressed:
            fields["suppressed"] = suppressed
        self._logger.warning(message, *args, extra=fields)
