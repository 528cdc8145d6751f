"""Which files a source names: a file, a folder of corpus files, or a glob; and each file's format.

A folder must hold corpus files only: a README, a licence or a script beside the text is refused by name (the
deny-lists below), so that a dataset never ingests a file nobody meant as text."""

from __future__ import annotations

import glob
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


# ----- sources with their splits, and the published layouts ------------------------------------------------

ONE_B_TRAIN, ONE_B_HELDOUT = "training-monolingual.tokenized.shuffled", "heldout-monolingual.tokenized.shuffled"
ONE_B_TEST = "news.en.heldout-00000-of-00050"  # the benchmark's test shard (Chelba et al. 2013); the other 49: heldout
FLAIR_TRAIN, FLAIR_VALID, FLAIR_TEST = "train", "valid.txt", "test.txt"


@dataclass(frozen=True)
class Input:
    """One input file and the split its sentences go to ("auto": the hash split, or the records' split field)."""

    path: Path
    split: str


def detect_layout(folder: Path) -> str | None:
    """ "1b-word" or "flair" where ``folder`` is laid out as that corpus, else None."""
    if (folder / ONE_B_TRAIN).is_dir() and (folder / ONE_B_HELDOUT).is_dir():
        return "1b-word"
    if (folder / FLAIR_TRAIN).is_dir() and (folder / FLAIR_VALID).is_file() and (folder / FLAIR_TEST).is_file():
        return "flair"
    return None


def _layout_inputs(folder: Path, layout: str) -> list[Input]:
    """The files of a published layout with their splits (other files in the folder, a README, are left out)."""
    if layout == "1b-word":
        train = [Input(p, "train") for p in find_inputs([str(folder / ONE_B_TRAIN)])]
        held = find_inputs([str(folder / ONE_B_HELDOUT)])
        return train + [Input(p, "test" if p.name == ONE_B_TEST else "heldout") for p in held]
    train = [Input(p, "train") for p in find_inputs([str(folder / FLAIR_TRAIN)])]
    return train + [Input(folder / FLAIR_VALID, "heldout"), Input(folder / FLAIR_TEST, "test")]


def find_sources(sources: list[str | Any], split: str = "auto", layout: str = "auto") -> list[Input]:
    """Every input file of ``sources`` (strings, or ``options.Source`` with their own split) with its split.

    A folder laid out as the 1B Word Benchmark or as Flair's corpora takes that layout's splits (``layout`` auto:
    detected and announced in one line; 1b-word or flair: required; none: a plain folder). The same file named
    twice with two splits is refused. Heldout and test inputs come first, so that ``drop_overlap`` sees them
    before the training text.
    """
    found: dict[Path, Input] = {}
    for source in sources:
        path, wanted = (source, split) if isinstance(source, str) else (source.path, source.split)
        folder = Path(path)
        kind = detect_layout(folder) if folder.is_dir() and layout != "none" else None
        if layout in ("1b-word", "flair") and kind != layout:
            raise InputError(f"{folder}: not laid out as --layout {layout} ({_LAYOUT_HINT[layout]})")
        if kind is not None:
            log.info("%s: laid out as %s; %s", folder, kind, _LAYOUT_HINT[kind])
            inputs = _layout_inputs(folder, kind)
        else:
            inputs = [Input(p, wanted) for p in find_inputs([path])]
        for item in inputs:
            item = Input(item.path.resolve(), item.split)
            earlier = found.setdefault(item.path, item)
            if earlier.split != item.split:
                raise InputError(f"{item.path}: named as {earlier.split} and as {item.split}; give it one split")
    fixed_first = sorted(found.values(), key=lambda i: i.split not in ("heldout", "test"))  # stable: order kept
    return fixed_first


_LAYOUT_HINT = {
    "1b-word": f"{ONE_B_TRAIN}/ → train, {ONE_B_HELDOUT}/ → heldout, its {ONE_B_TEST} → test",
    "flair": f"{FLAIR_TRAIN}/ → train, {FLAIR_VALID} → heldout, {FLAIR_TEST} → test",
}
