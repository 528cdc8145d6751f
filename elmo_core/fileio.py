"""How every output file appears: whole or not at all, with a checksum where one is needed.

``atomic_path`` yields a hidden temporary name beside the target (``.NAME.<pid>-<random>.tmp``: dataset readers
such as pyarrow, pandas, Spark and DuckDB globs on ``*.parquet`` skip it; unique per writer, so two writers of
one file never share one), and on success flushes it to disk and renames it into place. A crash leaves the old
file or nothing, never half a file.

``FolderLock`` is how an output folder has one writer at a time: an OS lock (``fcntl.flock``) on a file in the
job's bookkeeping, taken before anything is checked or written and held for the job's life. The kernel drops it
when the process ends, ``kill -9`` included, so a lock is never stale; a second job is refused at once, naming the
holder, or waits for it.

Space: ``require_space`` refuses an output that will not fit before its first byte; ``disk_full_error`` is the one
line of a write that failed for lack of space anyway (``errors.disk_full`` recognises it); ``atomic_folder`` makes a
folder of files appear whole or not at all; ``remove_stale_temps`` removes what a writer that died left behind.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from elmo_core.errors import DiskFullError, NoSpaceError, OutputError, disk_full

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


def files_digest(paths: Sequence[Path]) -> str:
    """A dataset's digest: the SHA-256 of its files' names and bytes, in the order given (32 hex digits). The same
    files have the same digest wherever their folder is; any change to a byte or a name changes it."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).name.encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()[:32]


class FolderLock:
    """The one-writer lock of an output folder: ``with FolderLock(lock_file, folder): ...``; ``beside(folder)`` is
    where a stage's claim keeps it (``.<name>.lock`` next to the folder, so deleting the folder keeps the lock).

    ``wait``: block until the holder is done instead of failing. The holder's pid, host and start time are
    written into the lock file for the refusal's message.
    """

    # lock files this process holds, and how many holders in it share each: a stage's claim and the main job's
    # run-once check around it take the same lock, and a lock is one job's, not one call's
    _held: dict[Path, list[int]] = {}

    def __init__(self, lock_file: str | Path, folder: str | Path, wait: bool = False) -> None:
        self.lock_file, self.folder, self.wait = Path(lock_file), Path(folder), wait
        self._fd: int | None = None

    def acquire(self) -> FolderLock:
        import fcntl

        key = self.lock_file.resolve()
        if key in FolderLock._held:  # this process holds it already: a nested claim of the same job
            FolderLock._held[key][1] += 1
            self._fd = FolderLock._held[key][0]
            return self
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
        FolderLock._held[key] = [fd, 1]
        return self

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            info = json.loads(os.pread(fd, 4096, 0) or b"{}")
            return f"pid {info['pid']} on {info['host']}, started {info['started']}"
        except (ValueError, KeyError, OSError):
            return "a process that has not written its name yet"

    def release(self) -> None:
        if self._fd is None:
            return
        key = self.lock_file.resolve()
        held = FolderLock._held.get(key)
        if held is not None and held[0] == self._fd:
            held[1] -= 1
            if held[1] == 0:
                del FolderLock._held[key]
                os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def beside(folder: str | Path) -> Path:
    """The lock file of ``folder`` that a stage's claim takes: next to it, not inside it."""
    folder = Path(folder).absolute()
    return folder.parent / f".{folder.name}.lock"


# ----- space: look before writing, and one line when it fills anyway -----------------------------------------


def format_bytes(n: float) -> str:
    """``41.2 GB``, ``980 kB``: decimal units, as ``df -H`` and disk makers count."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _existing(folder: str | Path) -> Path:
    """``folder``, or its nearest ancestor that exists (where it will be made)."""
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(folder: str | Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem that holds (or will hold) ``folder``."""
    return shutil.disk_usage(_existing(folder)).free


def space_line(folder: str | Path, needed_bytes: int) -> str:
    """What a plan prints of an output's size beside the room for it: ``about 1.2 GB to write, 40.0 GB free``."""
    return f"about {format_bytes(needed_bytes)} to write, {format_bytes(free_bytes(folder))} free"


def require_space(
    folder: str | Path, needed_bytes: int, what: str = "", advice: str = "free some space, or write elsewhere"
) -> None:
    """Refuse, before anything is written, an output of about ``needed_bytes`` that the filesystem holding
    ``folder`` has no room for: one ``NoSpaceError`` line, ``what`` saying what the bytes are (``the weights``) and
    ``advice`` what to do."""
    free = free_bytes(folder)
    if needed_bytes > free:
        raise NoSpaceError(
            f"{folder} needs about {format_bytes(needed_bytes)}{f' for {what}' if what else ''}; the filesystem "
            f"holding it has {format_bytes(free)} free; {advice}"
        )


def _is_temp(name: str) -> bool:
    return _TEMP.fullmatch(name) is not None


def finished_parts(folder: str | Path) -> list[Path]:
    """The ``part-*`` files of ``folder`` (recursively): each written whole (``atomic_path``), so each is finished."""
    root = Path(folder)
    if not root.is_dir():
        return []
    found = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not _is_temp(d)]
        found += [Path(directory) / f for f in files if f.startswith("part-") and not _is_temp(f)]
    return found


def _release(exc: BaseException | None) -> None:
    """Drop the locals of the frames a failed write raised through: a writer's open file (torch's, still holding an
    unlinked temporary) is closed, so the free space measured next is what is really free."""
    import gc
    import traceback

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
    gc.collect()


def disk_full_error(
    folder: str | Path, kept: str | None = None, exc: BaseException | None = None, rerun: str | None = None
) -> Exception:
    """The ``DiskFullError`` of a write into ``folder`` that failed (``exc``) for lack of space: ``kept`` (what is
    kept, as the writer knows it) or else the finished part files in the folder, the free space once the failed
    write's files are closed, and ``rerun`` (how to continue, where it is not the same command again)."""
    _release(exc)
    if kept is None:
        n = len(finished_parts(folder))
        kept = (
            "its inputs are untouched" if n == 0 else f"its {n:,} finished part file{'s are' if n != 1 else ' is'} kept"
        )
    free = format_bytes(free_bytes(folder))
    return DiskFullError(str(folder), free, kept, rerun) if rerun else DiskFullError(str(folder), free, kept)


# a writer's temporary name: ``.NAME.<pid>-<8 hex>.tmp`` (``temp_path``); ``.old`` is a folder ``atomic_folder``
# moved aside
_TEMP = re.compile(r"\..+\.(\d+)-[0-9a-f]{8}\.(tmp|old)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(folder: str | Path) -> list[Path]:
    """Remove the temporary files and folders in ``folder`` whose writer is no longer running (its pid is gone from
    this machine): what a writer killed or stopped by a full disk left behind. Those of a live writer are its own.
    Returns them."""
    folder = Path(folder)
    removed = []
    for path in folder.iterdir() if folder.is_dir() else ():
        match = _TEMP.fullmatch(path.name)
        if match is None or _alive(int(match.group(1))):  # this process's own: a thread of it may be writing it
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    if removed:
        log.info("%s: removed %d temporary file(s) of a writer that ended", folder, len(removed))
    return removed


@contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """Write a folder's files into the yielded temporary folder beside ``path``; when the block ends without an
    error it takes the place of ``path`` whole (what else an old ``path`` held, that the block did not write, is
    carried over), so ``path`` is the old folder, the complete new one, or briefly absent; never half of one. On an
    error the temporary folder is removed. Stale temporaries of writers that died, beside ``path`` and in it, are
    removed first. ``path`` must not be a mount point (a rename cannot move it)."""
    path = Path(path)
    if path.is_mount():
        raise OutputError(f"{path}: a mount point cannot be replaced whole; write into a folder inside it")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path.parent)
    remove_stale_temps(path)
    tmp = temp_path(path)
    tmp.mkdir()
    try:
        yield tmp
        for entry in tmp.iterdir():
            if entry.is_file():
                _fsync(entry)
        _swap_in(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap_in(new: Path, path: Path) -> None:
    """``new`` (complete) becomes ``path``; an existing ``path`` goes aside first, and what it held that ``new`` has
    not moves into ``new``."""
    if not path.exists():
        os.rename(new, path)
        return
    for entry in path.iterdir():
        if not (new / entry.name).exists() and not _is_temp(entry.name):
            os.rename(entry, new / entry.name)
    old = new.with_name(new.name.removesuffix(".tmp") + ".old")
    os.rename(path, old)
    os.rename(new, path)
    shutil.rmtree(old, ignore_errors=True)


def output_of(options: object) -> Path | None:
    """The folder a stage's options write to: its ``out``, the folder of its ``db`` (vocab), or its ``table`` (whose
    index it builds); None for a command that writes nothing."""
    for name, folder in (("out", lambda p: p), ("db", lambda p: p.parent), ("table", lambda p: p)):
        value = getattr(options, name, None)
        if isinstance(value, str | Path) and str(value):
            return folder(Path(value))
    return None


def as_disk_full(exc: BaseException, folder: str | Path | None) -> Exception | None:
    """The runners' one mapping: ``exc`` as the ``DiskFullError`` line where it (or what it was raised from) is a
    write that failed for lack of space, naming ``folder`` (the stage's output; else the file the error names);
    None for any other error."""
    if not disk_full(exc):
        return None
    if isinstance(exc, DiskFullError):
        return exc
    named = getattr(exc, "filename", None)
    return disk_full_error(folder or (Path(named).parent if isinstance(named, str) else Path.cwd()), exc=exc)


CACHE_ENV = "ELMO_CACHE_DIR"


def cache_root() -> Path:
    """This machine's cache for the project, the one folder every cache lives under: downloaded and converted models
    (``runtime.reference``), built C kernels (``bilm.kernels.fused_gates``). ``$ELMO_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/elmo``, else ``~/.cache/elmo``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "elmo"
