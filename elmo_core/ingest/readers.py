"""Reading corpus files as (record id, text) or as blocks of lines: text (plain, .gz, .bz2), JSONL and Parquet.

Bad input is counted in ``FileStats`` with file:line examples; a file that cannot be read as text fails alone."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from elmo_core.errors import InputError
from elmo_core.fileio import file_sha256
from elmo_core.ingest.inputs import COMPRESSED
from elmo_core.options import IngestConfig

log = logging.getLogger(__name__)

MAX_EXAMPLES = 5  # file:line examples kept per problem kind
READ_BLOCK_BYTES = 1 << 23  # text is read, checked and tokenized this many bytes (rounded to whole lines) at a time


@dataclass
class Counts:
    """What ingest counts, per file (``FileStats``) and summed over a run (``run.IngestSummary``): one set of
    counters, kept once."""

    sentences: int = 0
    duplicates: int = 0
    rejected_lines: int = 0
    invalid_utf8_lines: int = 0
    empty_lines: int = 0  # blank lines, or text without a token
    split_long: int = 0  # sentences longer than max_tokens, cut into pieces
    overlap: int = 0  # sentences both in train and in a heldout/test source (see shards.py)
    overlap_dropped: int = 0  # of those, dropped from train (--drop-overlap)

    def add_counts(self, other: Counts) -> None:
        for f in fields(Counts):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class FileStats(Counts):
    path: str = ""
    format: str = ""
    records: int = 0
    overlap_example: str | None = None
    examples: list[str] = field(default_factory=list)
    progress: Callable[[int], None] | None = None  # hears the bytes of the file read so far

    def example(self, where: str, what: str) -> None:
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {what}")


class BinaryFileError(InputError):
    """A file that holds NUL bytes is not a text corpus."""


def _open_binary(path: Path) -> tuple[io.BufferedIOBase, io.BufferedReader]:
    """(the decompressed stream, the file underneath it: its position is how far the read has got on disk)."""
    raw = open(path, "rb")
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw  # type: ignore[return-value]
    if name.endswith(".bz2"):
        return bz2.BZ2File(raw, "rb"), raw  # type: ignore[return-value]
    return raw, raw


def content_sha256(path: Path) -> str:
    """SHA-256 of a file's text: of the decompressed bytes for .gz/.bz2, so that the same text compressed twice
    (different gzip header times, levels) gets the same key, shard name, sentence ids and split."""
    if not path.name.lower().endswith(COMPRESSED):
        return file_sha256(path)
    stream, raw = _open_binary(path)
    with raw, stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()  # type: ignore[arg-type]


def line_blocks(path: Path, stats: FileStats | None = None) -> Iterator[tuple[int, memoryview, np.ndarray]]:
    """(number of lines before, whole lines, where each line ends) of a file, ``READ_BLOCK_BYTES`` at a time.

    NUL bytes reject the file as binary. Line ends are offsets just past each line's newline (or the
    block's end, for a last line without one). ``stats.progress`` hears how far into the file (on disk) the read is.
    """
    line_no = offset = 0
    carry = b""
    f, raw = _open_binary(path)
    with raw, f:
        while True:
            block = f.read(READ_BLOCK_BYTES)
            if stats is not None and stats.progress is not None:
                stats.progress(raw.tell())
            if not block and not carry:
                return
            data = carry + block if carry else block
            cut = data.rfind(b"\n") + 1 if block else len(data)
            if cut == 0:  # no line ends in this block yet
                carry = data
                continue
            carry = data[cut:]
            nul = data.find(b"\x00", 0, cut)
            if nul >= 0:
                at_line = line_no + data.count(b"\n", 0, nul) + 1
                raise BinaryFileError(
                    f"{path}: NUL byte at byte {offset + nul} (line {at_line}): "
                    "a binary file, not UTF-8 text (convert UTF-16 text to UTF-8 first)"
                )
            offset += cut
            ends = np.flatnonzero(np.frombuffer(data, np.uint8, count=cut) == 0x0A) + 1
            if data[cut - 1] != 0x0A:
                ends = np.append(ends, cut)
            yield line_no, memoryview(data)[:cut], ends  # a view: no copy of the block
            line_no += len(ends)


def _decode_lines(data: bytes, path: Path, first_line: int, stats: FileStats) -> list[str]:
    """The lines of a block as str; invalid UTF-8 is replaced, counted and reported with file:line."""
    try:
        lines = data.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        lines = []
        for i, raw in enumerate(data.split(b"\n")):
            try:
                lines.append(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                stats.invalid_utf8_lines += 1
                stats.example(f"{path}:{first_line + i}", f"invalid UTF-8 at byte {exc.start} of the line, replaced")
                lines.append(raw.decode("utf-8", "replace"))
    if data.endswith(b"\n"):
        lines.pop()  # the empty string after the last newline
    return lines


def line_array(data: memoryview, ends: np.ndarray, path: Path, first_line: int, stats: FileStats) -> pa.StringArray:
    """The lines of a block as one Arrow array laid over the block's bytes (no copy, no Python per line).

    Each line keeps its newline (the trim in ``_ShardWriter`` drops it). Arrow validates the UTF-8; a block
    with invalid bytes takes the line-by-line path of ``_decode_lines``.
    """
    if len(data) < 1 << 31:  # else beyond 32-bit offsets (a single huge line): pa.array chunks it
        offsets = np.zeros(len(ends) + 1, np.int32)
        offsets[1:] = ends
        lines = pa.StringArray.from_buffers(len(ends), pa.py_buffer(offsets), pa.py_buffer(data))
        try:
            lines.validate(full=True)  # UTF-8 included
            return lines
        except pa.ArrowInvalid:
            pass
    return pa.array(_decode_lines(bytes(data), path, first_line, stats), pa.string())


def _text_lines(path: Path, stats: FileStats) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) of a text file, decoded to str."""
    for before, data, _ in line_blocks(path, stats):
        yield from enumerate(_decode_lines(bytes(data), path, before + 1, stats), before + 1)


# what a split field may say, and the split it means
SPLIT_NAMES = {
    "train": "train",
    "training": "train",
    "heldout": "heldout",
    "valid": "heldout",
    "validation": "heldout",
    "dev": "heldout",
    "test": "test",
}


def record_split(value: object, where: str, field_name: str, stats: FileStats) -> str | None:
    """The split a record's field names, or None (the record is rejected, with an example) for anything else."""
    split = SPLIT_NAMES.get(value.lower()) if isinstance(value, str) else None
    if split is None:
        stats.rejected_lines += 1
        stats.example(where, f"split field {field_name!r} is {value!r}; expected train, heldout (valid, dev) or test")
    return split


Record = tuple[str, str, str | None]  # (record position, text, split named by split_field or None)


def read_records(path: Path, fmt: str, config: IngestConfig, stats: FileStats) -> Iterator[Record]:
    """(record position, text, split named by ``split_field`` or None) of one input file: a Parquet row, a JSON
    line, or (--split-sentences) a paragraph."""
    if config.split_field and fmt == "text":
        raise InputError(f"{path}: --split-field names a JSONL field or Parquet column; a text file has none")
    readers = {"parquet": _parquet_records, "jsonl": _jsonl_records}
    return readers.get(fmt, _paragraphs)(path, config, stats)


def _parquet_records(path: Path, config: IngestConfig, stats: FileStats) -> Iterator[Record]:
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputError(f"{path}: not a readable Parquet file ({exc})") from None
    columns = [config.text_column, *([config.split_field] if config.split_field else [])]
    for column, flag in zip(columns, ("--text-column", "--split-field")):
        if column not in pf.schema_arrow.names:
            raise InputError(f"{path}: no column {column!r} (columns: {', '.join(pf.schema_arrow.names)}); use {flag}")
    row = 0
    for batch in pf.iter_batches(columns=columns, batch_size=65_536):
        splits = batch.column(1).to_pylist() if config.split_field else [None] * batch.num_rows
        for value, named in zip(batch.column(0).to_pylist(), splits):
            row += 1
            if not isinstance(value, str):
                stats.rejected_lines += 1
                stats.example(f"{path}:row {row}", f"column {config.text_column!r} is {type(value).__name__}, not text")
                continue
            split = record_split(named, f"{path}:row {row}", config.split_field, stats) if config.split_field else None
            if config.split_field and split is None:
                continue
            yield f"r{row}", value, split


def _jsonl_records(path: Path, config: IngestConfig, stats: FileStats) -> Iterator[Record]:
    for line_no, line in _text_lines(path, stats):
        if not line.strip():
            stats.empty_lines += 1
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            stats.rejected_lines += 1
            stats.example(f"{path}:{line_no}", f"invalid JSON ({exc.msg} at column {exc.colno})")
            continue
        value = obj.get(config.text_field) if isinstance(obj, dict) else None
        if not isinstance(value, str):
            stats.rejected_lines += 1
            stats.example(f"{path}:{line_no}", f"field {config.text_field!r} missing or not a string; use --text-field")
            continue
        split = None
        if config.split_field:
            split = record_split(obj.get(config.split_field), f"{path}:{line_no}", config.split_field, stats)
            if split is None:
                continue
        yield f"l{line_no}", value, split


def _paragraphs(path: Path, config: IngestConfig, stats: FileStats) -> Iterator[Record]:
    """Plain text split into sentences: paragraphs (one sentence per line goes through ``line_array`` instead)."""
    paragraph: list[str] = []
    start = 0
    for line_no, line in _text_lines(path, stats):
        if line.strip():
            if not paragraph:
                start = line_no
            paragraph.append(line.strip())
        else:
            stats.empty_lines += 1
            if paragraph:
                yield f"l{start}", " ".join(paragraph), None
                paragraph = []
    if paragraph:
        yield f"l{start}", " ".join(paragraph), None
