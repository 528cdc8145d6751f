"""Which files a source names: a file, a folder of corpus files, or a glob; and each file's format.

A folder must hold corpus files only: a README, a licence or a script beside the text is refused by name (the
deny-lists below), so that a dataset never ingests a file nobody meant as text."""

from __future__ import annotations

import glob
import logging
from pathlib import Path

from elmo_core.errors import InputError

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".text", ".tok", ".tokens")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
COMPRESSED = (".gz", ".bz2")


def file_format(path: Path) -> str:
    name = path.name.lower()
    for suffix in COMPRESSED:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return "text"


# Files a corpus folder often holds beside its text, which must not be read as sentences.
NOT_CORPUS_NAMES = (
    "readme",
    "license",
    "licence",
    "copying",
    "notice",
    "changelog",
    "authors",
    "contributing",
    "makefile",
)
NOT_CORPUS_SUFFIXES = (
    ".md",
    ".rst",
    ".html",
    ".htm",
    ".pdf",
    ".doc",
    ".docx",
    ".py",
    ".sh",
    ".yaml",
    ".yml",
    ".toml",
    ".cfg",
    ".ini",
    ".xml",
    ".png",
    ".jpg",
    ".jpeg",
    ".gif",
    ".zip",
    ".tar",
    ".tgz",
    ".duckdb",
    ".pt",
    ".hdf5",
    ".h5",
    ".pkl",
    ".npy",
    ".log",
)


def _looks_like_corpus(path: Path) -> bool:
    name = path.name.lower()
    stem = name.split(".")[0]
    return stem not in NOT_CORPUS_NAMES and not name.endswith(NOT_CORPUS_SUFFIXES)


def find_inputs(sources: list[str]) -> list[Path]:
    """Files named by ``sources`` (files, folders searched recursively, glob patterns), sorted, unique.

    A folder must hold corpus files only: documentation or other files beside the text (a README, a licence,
    a PDF) are refused by name, so they are never read as sentences; files and globs are taken as given.
    """
    found: list[Path] = []
    for source in sources:
        path = Path(source)
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            files = [
                p
                for p in sorted(path.rglob("*"))
                if p.is_file() and not any(part.startswith((".", "_")) for part in p.relative_to(path).parts)
            ]
            strangers = [p for p in files if not _looks_like_corpus(p)]
            if strangers:
                names = ", ".join(str(p.relative_to(path)) for p in strangers[:5]) + (
                    ", …" if len(strangers) > 5 else ""
                )
                raise InputError(
                    f"{path}: holds files that are not corpus text ({names}); name the corpus files or a glob "
                    f"such as '{path}/*.txt', or move those files out"
                )
            found.extend(files)
        else:
            matches = sorted(Path(m) for m in glob.glob(source, recursive=True) if Path(m).is_file())
            if not matches:
                raise InputError(f"{source}: no such file, folder or matching glob")
            found.extend(matches)
    unique: dict[Path, None] = {}
    for p in found:
        unique.setdefault(p.resolve(), None)
    return list(unique)
