"""The error a disk directory that cannot be used raises, for the CLI to turn into exit 2."""

from __future__ import annotations


class DiskDirError(ValueError):
    """The disk tier's directory cannot be used: `path` and a `reason` a person can act on."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(path, reason)
        self.path = path
        self.reason = reason

    def __str__(self) -> str:
        return f"disk dir {self.path}: {self.reason}"
