"""How every output file appears: whole or not at all, with a checksum where one is needed.

``atomic_path`` yields a hidden temporary name beside the target (``.NAME.<pid>-<random>.tmp``: dataset readers
such as pyarrow, pandas, Spark and DuckDB globs on ``*.parquet`` skip it; unique per writer, so two writers of
one file never share one), and on success flushes it to disk and renames it into place. A crash leaves the old
file or nothing, never half a file.

``FolderLock`` is how an output folder has one writer at a time: an OS lock (``fcntl.flock``) on a file in the
job's bookkeeping, taken before anything is checked or written and held for the job's life. The kernel drops it
when the process ends, ``kill -9`` included, so a lock is never stale; a second job is refused at once, naming the
holder, or waits for it.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import secrets
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)


def temp_path(path: str | Path) -> Path:
    """A hidden temporary name for a write of ``path``, unique to this writer (pid and a random part): two
    processes writing the same file (a retried task beside the first attempt) never touch each other's."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, path: Path) -> None:
    """Flush a finished temporary file to disk and rename it into place."""
    _fsync(tmp)
    os.replace(tmp, path)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Write to the yielded temporary path; it replaces ``path`` when the block ends without an error."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        yield tmp
        publish(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def atomic_write(path: str | Path, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """``open(path, mode)`` whose content replaces ``path`` only once complete (text by default)."""
    with atomic_path(path) as tmp:
        with open(tmp, mode, encoding=None if "b" in mode else encoding) as f:
            yield f


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_write(path) as f:
        f.write(text)


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class FolderLock:
    """The one-writer lock of an output folder: ``with FolderLock(lock_file, folder): ...``.

    ``wait``: block until the holder is done instead of failing. The holder's pid, host and start time are
    written into the lock file for the refusal's message.
    """

    def __init__(self, lock_file: str | Path, folder: str | Path, wait: bool = False) -> None:
        self.lock_file, self.folder, self.wait = Path(lock_file), Path(folder), wait
        self._fd: int | None = None

    def acquire(self) -> FolderLock:
        import fcntl

        from elmo_core.errors import OutputError

        self.lock_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder(fd)
            if not self.wait:
                os.close(fd)
                raise OutputError(
                    f"{self.folder}: in use by another job ({holder}); wait for it to end, or give --wait to queue "
                    "behind it"
                ) from None
            log.info("%s: in use by another job (%s); waiting for it to end (--wait)", self.folder, holder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}).encode())
        self._fd = fd
        return self

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            info = json.loads(os.pread(fd, 4096, 0) or b"{}")
            return f"pid {info['pid']} on {info['host']}, started {info['started']}"
        except (ValueError, KeyError, OSError):
            return "a process that has not written its name yet"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
