"""An arena's memory: a file under the shared-memory directory that clients may map, locked for the
service's life, or anonymous shared memory; and the directory's housekeeping (leftover files, room).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import mmap
import os
import secrets
from pathlib import Path

log = logging.getLogger("kvtag_store.backends.shm")


def on_memory_file_system(fd: int) -> bool:
    """Whether the open file lives in a tmpfs (or hugetlbfs): there reserving its pages allocates
    them in memory, zeroed; on a disk file system it only reserves blocks."""
    device = os.fstat(fd).st_dev
    wanted = f"{os.major(device)}:{os.minor(device)}"
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and fields[2] == wanted and " - " in line:
                return line.split(" - ", 1)[1].split()[0] in ("tmpfs", "hugetlbfs")
    return False


def shared_memory_room(directory: str) -> int:
    """Bytes still free on the file system of `directory` (a container's /dev/shm is often 64 MiB)."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def remove_orphans(directory: str) -> int:
    """Delete arena files left by services that died without cleaning up (SIGKILL, OOM): their flock
    is gone. A live service, even in another container sharing the directory, holds its lock. Returns
    how many were removed."""
    removed = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if not entry.name.startswith("kvtag-") or not entry.is_file(follow_symlinks=False):
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held: a live service's arena
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    removed += 1
            finally:
                os.close(fd)
    if removed:
        log.warning("removed %d orphaned shared-memory arena file(s) from %s", removed, directory)
    return removed


class ArenaMemory:
    """The mapping behind one arena and, when shared, its file (`path`, `fd`)."""

    def __init__(self, tenant: str, size: int, directory: str | None, group: int | None) -> None:
        """A file in `directory` (mode 0600, or 0660 for `group`) or anonymous memory when None."""
        self.path: str | None = None
        self.segment = "anon-" + secrets.token_hex(6)
        self.fd = -1
        self.in_memory_file = False
        if directory is None:
            self.mmap = mmap.mmap(-1, size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
            return
        digest = hashlib.sha256(tenant.encode()).hexdigest()[:12]
        name = f"kvtag-{os.getpid()}-{secrets.token_hex(4)}-{digest}"
        path = str(Path(directory) / name)
        # Created under a name remove_orphans skips, locked, then renamed: no window in which
        # another starting service could take it for an orphan.
        hidden = str(Path(directory) / f".{name}")
        self.fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            # Held for the service's lifetime: a file nobody holds is an orphan (remove_orphans).
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if group is not None:
                os.fchown(self.fd, -1, group)
            os.fchmod(self.fd, 0o600 if group is None else 0o660)  # whatever the umask
            os.ftruncate(self.fd, size)
            self.mmap = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
            os.rename(hidden, path)
        except BaseException:
            os.close(self.fd)
            os.unlink(hidden)
            raise
        self.path = path
        self.segment = name
        self.in_memory_file = on_memory_file_system(self.fd)

    def close(self, view: memoryview) -> None:
        """Unmap (once `view`, the arena's view of it, is released), close and remove the file."""
        with contextlib.suppress(BufferError, ValueError):
            view.release()
            self.mmap.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
