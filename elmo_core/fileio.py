"""How every output file appears: whole or not at all, with a checksum where one is needed.

``atomic_path`` yields a hidden temporary name beside the target (``.NAME.tmp``: dataset readers such as
pyarrow, pandas, Spark and DuckDB globs on ``*.parquet`` skip it), and on success flushes it to disk and renames
it into place. A crash leaves the old file or nothing, never half a file.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


def temp_path(path: str | Path) -> Path:
    """The hidden temporary name a write of ``path`` uses (reruns reuse it, so a killed write is overwritten)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp")


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
