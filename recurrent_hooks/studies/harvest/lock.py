"""One writer per harvest directory and rank: an exclusive lock the operating system holds for the process.

    with DirectoryLock(out, rank=0, where="harvest"):    # refused at once if another process holds it
        ...write shards...

The lock is `out/.lock.rank<r>` held with `fcntl.flock` (`msvcrt.locking` on Windows): the kernel releases it when
the process ends, however it ends, so the lock of a killed harvest is free and the next call takes it over (no
pid files to judge as stale). The file keeps the holder's host, pid and start time, for the refusal's message, and
is removed when the lock is released (a killed harvest's stays, unlocked, until the next one takes it): a finished
harvest's directory holds only its files. A process that opened the file just before its removal finds, once it
holds the lock, that the path is another file or none, and starts again.

A rank has its own lock: the ranks of one distributed harvest write into one directory together, each its own
shards, while a second harvest into the same directory (any rank it runs as) meets the lock of that rank.

Module contents: `DirectoryLock`, `holder(out, rank)` (who holds a rank's lock, or None), `holders(out)` (who
holds any of a directory's locks).
"""

import json
import os
import pathlib
import socket
import time
from typing import Any

from ...engine.errors import Unavailable, add_note

try:
    import fcntl
except ImportError:  # pragma: no cover (Windows)
    fcntl = None
    import msvcrt

__all__ = ["DirectoryLock", "holder", "holders"]


def _path(out: pathlib.Path, rank: int) -> pathlib.Path:
    return out / f".lock.rank{rank}"


def _try_lock(fd: int) -> bool:
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:  # pragma: no cover
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    except OSError:
        return False
    return True


def _unlock(fd: int) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
    else:  # pragma: no cover
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)


def _describe(fd: int) -> dict[str, Any]:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}") if hasattr(os, "pread") else {}
    except (OSError, ValueError):
        return {}


def _same_file(fd: int, path: pathlib.Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def holders(out: pathlib.Path) -> list[dict[str, Any]]:
    """Who holds a lock of `out`, any rank's (`{"host", "pid", "since"}` each, as far as its file says)."""
    ranks = [path.name.removeprefix(".lock.rank") for path in out.glob(".lock.rank*")] if out.is_dir() else []
    found = [holder(out, int(rank)) for rank in ranks if rank.isdigit()]
    return [who for who in found if who is not None]


def holder(out: pathlib.Path, rank: int = 0) -> dict[str, Any] | None:
    """Who holds rank `rank`'s lock of `out` (`{"host", "pid", "since"}`, as far as its file says), or None."""
    try:
        fd = os.open(_path(out, rank), os.O_RDWR)
    except OSError:  # (none: no harvest holds it, or it cannot be read, which no lock in use is)
        return None
    try:
        if _try_lock(fd):
            _unlock(fd)
            return None
        return _describe(fd)
    finally:
        os.close(fd)


class DirectoryLock:
    """Rank `rank`'s exclusive lock of the directory `out` (created if missing), held inside the `with` block."""

    def __init__(self, out: pathlib.Path, rank: int = 0, where: str = "harvest") -> None:
        self.out, self.rank, self.where = pathlib.Path(out), rank, where
        self._fd: int | None = None

    def __enter__(self) -> "DirectoryLock":
        path = _path(self.out, self.rank)
        while True:
            try:
                self.out.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as error:
                add_note(error, f"{self.where}: taking the lock {path} failed")
                raise
            if not _try_lock(fd):
                other = _describe(fd)
                os.close(fd)
                who = (
                    f"process {other.get('pid', '?')} on {other.get('host', '?')}, since {other.get('since', '?')}"
                    if other
                    else "another process"
                )
                raise Unavailable(
                    f"{self.where}: {self.out} is being written by another harvest ({who} holds"
                    f" {path}): wait for it to finish (a second harvest into the same directory would"
                    " race with its files), or pass another out"
                )
            if _same_file(fd, path):
                break
            _unlock(fd)  # (its holder removed it as this process opened it: the lock is the new file's)
            os.close(fd)
        self._fd = fd
        try:  # who holds it, for a refused caller's message
            os.ftruncate(fd, 0)
            os.pwrite(
                fd,
                json.dumps(
                    {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
                ).encode(),
                0,
            )
        except (OSError, AttributeError):  # (a full disk: the lock holds all the same)
            pass
        return self

    def __exit__(self, *exc: Any) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            _path(self.out, self.rank).unlink(missing_ok=True)  # (before the unlock: see the module docstring)
        except OSError:  # pragma: no cover (Windows removes no open file: the next holder takes it as it is)
            pass
        finally:
            try:
                _unlock(fd)
            finally:
                os.close(fd)
