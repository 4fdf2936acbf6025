"""The disk directory's layout: its lock, its format line, and a directory per tenant of segment files.

DIR/kvtag-disk.lock   flock'ed by the store that uses DIR, its pid inside (a second store refuses)
DIR/format            "kvtag-disk <version>"; an unknown version refuses rather than guess
DIR/tenants/<name>/   <seq:012d>.seg append-only segment files of one tenant; `shared` holds the
                      namespaces no session named a tenant for (no tenant name maps to it: tenant
                      names map to t-<name>, x-<hex> or, when long, h-<sha256>)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re

from kvtag_store.backends.memory.disk.errors import DiskDirError

LOCK_NAME = "kvtag-disk.lock"
FORMAT_NAME = "format"
FORMAT_LINE = "kvtag-disk 1"
SHARED_DIR = "shared"
_PLAIN_TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}")


def tenant_dir_name(tenant: str | None) -> str:
    if tenant is None:
        return SHARED_DIR
    if _PLAIN_TENANT.fullmatch(tenant):
        return "t-" + tenant
    encoded = tenant.encode().hex()
    if len(encoded) <= 128:
        return "x-" + encoded
    return "h-" + hashlib.sha256(tenant.encode()).hexdigest()  # within the file system's name limit


def segment_name(seq: int) -> str:
    return f"{seq:012d}.seg"


def segment_seq(name: str) -> int | None:
    if name.endswith(".seg") and name[:-4].isdigit():
        return int(name[:-4])
    return None


class DiskDir:
    """The directory, opened and locked for this store until release()."""

    def __init__(self, path: str) -> None:
        """Refuses (DiskDirError) a path that is not a usable directory, has an unknown format, or
        another live store holds."""
        self.path = os.path.abspath(path)
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
        except FileExistsError:
            raise DiskDirError(path, "it exists and is not a directory") from None
        except OSError as exc:
            raise DiskDirError(path, f"cannot create it ({exc.strerror})") from None
        if not os.path.isdir(self.path):
            raise DiskDirError(path, "it exists and is not a directory")
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise DiskDirError(path, "it is not writable by this process (check its owner and mode)")
        self._lock_fd = self._lock(path)
        try:
            self._check_format(path)
            self.tenants = os.path.join(self.path, "tenants")
            os.makedirs(self.tenants, mode=0o700, exist_ok=True)
        except OSError as exc:
            self.release()
            raise DiskDirError(path, f"cannot set it up ({exc.strerror})") from None
        except DiskDirError:
            self.release()
            raise

    def _lock(self, path: str) -> int:
        lock_path = os.path.join(self.path, LOCK_NAME)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise DiskDirError(path, f"cannot open its lock file ({exc.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = ""
            with contextlib.suppress(OSError, ValueError):
                holder = os.pread(fd, 32, 0).decode().strip()
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                who = f" (pid {holder})" if holder.isdigit() else ""
                raise DiskDirError(
                    path,
                    f"another kvtag store holds it{who}; stop that store or give this one another --disk-dir",
                ) from None
            raise DiskDirError(path, f"cannot lock it ({exc.strerror})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _check_format(self, path: str) -> None:
        format_path = os.path.join(self.path, FORMAT_NAME)
        try:
            with open(format_path, encoding="utf-8") as f:
                line = f.read().strip()
        except FileNotFoundError:
            with open(format_path, "w", encoding="utf-8") as f:
                f.write(FORMAT_LINE + "\n")
            return
        except UnicodeDecodeError:
            line = "<not text>"
        if line != FORMAT_LINE:
            raise DiskDirError(
                path,
                f"its format file says {line[:60]!r}, this store writes {FORMAT_LINE!r}; "
                "use an empty directory or the kvtag version that wrote it",
            )

    def tenant_dir(self, tenant: str | None, gid: int | None) -> str:
        """The tenant's directory, created 0700 (0750 owned by `gid` when set)."""
        path = os.path.join(self.tenants, tenant_dir_name(tenant))
        if not os.path.isdir(path):
            os.makedirs(path, mode=0o700, exist_ok=True)
            if gid is not None:
                os.chown(path, -1, gid)
                os.chmod(path, 0o750)
        return path

    def segments(self) -> list[tuple[int, str]]:
        """(seq, path) of every segment file, oldest first."""
        found: list[tuple[int, str]] = []
        for name in sorted(os.listdir(self.tenants)):
            directory = os.path.join(self.tenants, name)
            if not os.path.isdir(directory):
                continue
            for file in os.listdir(directory):
                seq = segment_seq(file)
                if seq is not None:
                    found.append((seq, os.path.join(directory, file)))
        found.sort()
        return found

    def release(self) -> None:
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.ftruncate(self._lock_fd, 0)
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = -1


def create_segment(directory: str, seq: int, gid: int | None) -> tuple[str, int]:
    """A new, empty segment file (0600, or 0640 owned by `gid`) and its fd, opened for reads and writes."""
    path = os.path.join(directory, segment_name(seq))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    if gid is not None:
        os.fchown(fd, -1, gid)
        os.fchmod(fd, 0o640)
    return path, fd
