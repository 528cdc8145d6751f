"""Ingest: corpus files (text, .gz/.bz2, JSONL, Parquet) ─► a tokenized, deduplicated Parquet dataset.

Output directory layout (a plain Parquet dataset: readers skip the ``_`` and ``.`` names):

    OUT/part-<key>.parquet   one shard per input file (zstd, streaming-sized row groups), columns SHARD_SCHEMA
    OUT/_manifest.duckdb     table ``files`` (one row per input file: size, mtime, sha256, counts, status),
                             table ``seen`` (64-bit hashes of every kept sentence, for deduplication) and
                             table ``options`` (the tokenizer and split settings every shard shares)

``<key>`` is the first 16 hex digits of the sha256 of the file's text (decompressed), so ids, shard names and
the heldout split follow the content, not the container. A file is tokenized and deduplicated (against
itself, and against DuckDB's ``seen`` table) into a hidden ``.part-<key>.parquet.tmp``, renamed, and only then
committed to the manifest: a crash or ``kill -9`` leaves no partial shard, and the next run redoes just the file
that was in flight. Files already in the manifest are skipped; a run with other tokenizer or split options is
refused, so a dataset never mixes two ways of reading text.
"""

from __future__ import annotations

import bz2
import glob
import gzip
import hashlib
import io
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from elmo_core.errors import ElmoError, InputError, OutputError
from elmo_core.fileio import file_sha256, publish, temp_path
from elmo_core.options import DATASET_OPTIONS, IngestConfig
from elmo_core.progress import Progress, track
from elmo_core.tokenize import get_tokenizer, split_sentences, split_whitespace

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".text", ".tok", ".tokens")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
COMPRESSED = (".gz", ".bz2")
MAX_EXAMPLES = 5  # file:line examples kept per problem kind
READ_BLOCK_BYTES = 1 << 23  # text is read, checked and tokenized this many bytes (rounded to whole lines) at a time

SHARD_SCHEMA = pa.schema(
    [
        ("doc_id", pa.string()),
        ("sentence_id", pa.string()),
        ("text", pa.string()),
        ("tokens", pa.list_(pa.string())),
        ("n_tokens", pa.int32()),
        ("source", pa.string()),
        ("split", pa.string()),
    ]
)

MANIFEST_DDL = """
CREATE TABLE IF NOT EXISTS files (
    sha256 VARCHAR PRIMARY KEY, path VARCHAR, size BIGINT, mtime DOUBLE, format VARCHAR,
    records BIGINT, sentences BIGINT, duplicates BIGINT, rejected_lines BIGINT, invalid_utf8_lines BIGINT,
    empty_lines BIGINT, split_long BIGINT, status VARCHAR, error VARCHAR, shard VARCHAR, ingested_at TIMESTAMP
);
CREATE TABLE IF NOT EXISTS seen (hash BIGINT);
CREATE TABLE IF NOT EXISTS options (settings VARCHAR);
"""
GET_OPTIONS = "SELECT settings FROM options"
SET_OPTIONS = "INSERT INTO options VALUES (?)"
MANIFEST_NAME = "_manifest.duckdb"

FIND_DONE_BY_STAT = "SELECT sha256 FROM files WHERE path = ? AND size = ? AND mtime = ? AND status = 'done'"
FIND_BY_SHA = "SELECT status FROM files WHERE sha256 = ?"
HASH_SENTENCES = "SELECT md5(s) AS h FROM normalized_sentences"
KNOWN_HASHES = "SELECT n.hash FROM new_hashes n SEMI JOIN seen s ON n.hash = s.hash"
REMEMBER_HASHES = "INSERT INTO seen SELECT hash FROM new_hashes"
UPSERT_FILE = """
INSERT OR REPLACE INTO files VALUES ($sha256, $path, $size, $mtime, $format, $records, $sentences, $duplicates,
    $rejected_lines, $invalid_utf8_lines, $empty_lines, $split_long, $status, $error, $shard, now())
"""


@dataclass
class FileStats:
    path: str
    format: str
    records: int = 0
    sentences: int = 0
    duplicates: int = 0
    rejected_lines: int = 0
    invalid_utf8_lines: int = 0
    empty_lines: int = 0
    split_long: int = 0
    examples: list[str] = field(default_factory=list)
    progress: Callable[[int], None] | None = None  # hears the bytes of the file read so far

    def example(self, where: str, what: str) -> None:
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {what}")


@dataclass
class IngestSummary:
    files_ingested: int = 0
    files_skipped: int = 0
    files_failed: int = 0
    bytes_read: int = 0
    sentences: int = 0
    tokens: int = 0
    duplicates: int = 0
    rejected_lines: int = 0
    invalid_utf8_lines: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def nothing_ingested(self) -> bool:
        """Every input failed: no dataset to go on with (some failures beside good files are only counted)."""
        return bool(self.files_failed) and not self.files_ingested and not self.files_skipped

    def line(self) -> str:
        mb = self.bytes_read / 1e6
        return (
            f"ingest: {self.files_ingested} files ingested, {self.files_skipped} unchanged, "
            f"{self.files_failed} failed; "
            f"{self.sentences:,} sentences, {self.tokens:,} tokens, {self.duplicates:,} duplicates dropped, "
            f"{self.rejected_lines:,} rejected lines, {self.invalid_utf8_lines:,} lines with invalid UTF-8; "
            f"{mb:,.1f} MB in {self.seconds:.1f} s ({mb / max(self.seconds, 1e-9):,.1f} MB/s)"
        )


class BinaryFileError(InputError):
    """A file that holds NUL bytes is not a text corpus."""


# ----- finding and reading inputs -------------------------------------------------------------------


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


def _line_blocks(path: Path, stats: FileStats | None = None) -> Iterator[tuple[int, memoryview, np.ndarray]]:
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


def _line_array(data: memoryview, ends: np.ndarray, path: Path, first_line: int, stats: FileStats) -> pa.StringArray:
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
    for before, data, _ in _line_blocks(path, stats):
        yield from enumerate(_decode_lines(bytes(data), path, before + 1, stats), before + 1)


def _records(path: Path, fmt: str, config: IngestConfig, stats: FileStats) -> Iterator[tuple[str, str]]:
    """(record position, text) of one input file: a JSON line, a Parquet row, or (--split-sentences) a paragraph."""
    if fmt == "parquet":
        try:
            pf = pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise InputError(f"{path}: not a readable Parquet file ({exc})") from None
        if config.text_column not in pf.schema_arrow.names:
            raise InputError(
                f"{path}: no column {config.text_column!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                "use --text-column"
            )
        row = 0
        for batch in pf.iter_batches(columns=[config.text_column], batch_size=65_536):
            for value in batch.column(0).to_pylist():
                row += 1
                if not isinstance(value, str):
                    stats.rejected_lines += 1
                    stats.example(
                        f"{path}:row {row}", f"column {config.text_column!r} is {type(value).__name__}, not text"
                    )
                    continue
                yield f"r{row}", value
        return
    if fmt == "jsonl":
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
                stats.example(
                    f"{path}:{line_no}", f"field {config.text_field!r} missing or not a string; use --text-field"
                )
                continue
            yield f"l{line_no}", value
        return
    # plain text: one sentence per line goes through _line_array in _write_shard; here, paragraphs
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
                yield f"l{start}", " ".join(paragraph)
                paragraph = []
    if paragraph:
        yield f"l{start}", " ".join(paragraph)


_HEX_VALUE = np.zeros(256, np.uint8)
_HEX_VALUE[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16, dtype=np.uint8)


def sentence_hashes(con: duckdb.DuckDBPyConnection, normalized: pa.Array) -> np.ndarray:
    """Signed 64-bit keys: the last 8 bytes of each string's MD5 read little-endian, i.e. DuckDB's
    ``md5_number_lower`` (MD5 is a standard, so the keys are stable across versions and runs).

    The dedup key, and (other bits) the train/heldout draw. DuckDB computes the hex digests over the Arrow
    array (twice as fast as its ``md5_number_lower``); numpy turns them into integers.
    """
    con.register("normalized_sentences", pa.table({"s": normalized}))
    try:
        digests = con.sql(HASH_SENTENCES).to_arrow_table().column(0).combine_chunks()
    finally:
        con.unregister("normalized_sentences")
    hex_digits = np.frombuffer(digests.buffers()[2], np.uint8)[: 32 * len(digests)].reshape(-1, 32)
    nibbles = _HEX_VALUE[hex_digits[:, 16:]]
    return np.ascontiguousarray((nibbles[:, 0::2] << 4) | nibbles[:, 1::2]).view("<i8").ravel()


_SPLIT_NAMES = pa.array(["train", "heldout"], pa.string())


def _splits(hashes: np.ndarray, heldout_fraction: float) -> pa.Array:
    draw = (hashes.view(np.uint64) >> np.uint64(20)) & np.uint64(0xFFFFF)
    return _SPLIT_NAMES.take(pa.array((draw < heldout_fraction * 0x100000).astype(np.int8)))


def _ordinals_within_runs(keys: pa.StringArray) -> np.ndarray:
    """0, 1, 2, … along each run of equal consecutive ``keys`` (a record's sentences arrive together)."""
    n = len(keys)
    same = np.zeros(n, dtype=bool)
    if n > 1:
        same[1:] = pc.equal(keys.slice(1), keys.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    position = np.arange(n)
    return position - np.maximum.accumulate(np.where(same, 0, position))


class _HashSet:
    """A set of int64 hashes as sorted numpy runs, merged like a binary counter (each run at least twice
    the next one's size): lookups are a few vectorized binary searches, memory is 8 bytes per hash, and an
    insert costs O(log n) amortized, so a file of 100M sentences is deduplicated without a Python object per
    sentence."""

    def __init__(self) -> None:
        self._runs: list[np.ndarray] = []

    def contains(self, values: np.ndarray) -> np.ndarray:
        found = np.zeros(len(values), dtype=bool)
        for run in self._runs:
            at = np.minimum(np.searchsorted(run, values), len(run) - 1)
            found |= run[at] == values
        return found

    def add(self, values: np.ndarray) -> None:
        """Add hashes that are not in the set yet."""
        run = np.sort(values)
        while self._runs and len(self._runs[-1]) <= 2 * len(run):
            run = np.sort(np.concatenate([self._runs.pop(), run]), kind="stable")  # timsort: a linear merge
        if len(run):
            self._runs.append(run)

    def values(self) -> np.ndarray:
        return np.concatenate(self._runs) if self._runs else np.zeros(0, np.int64)


class _ShardWriter:
    """Collects (record, text) pairs; writes them tokenized and deduplicated to the shard's ``.tmp`` file.

    Dedup is inline: a batch's sentence hashes are checked against this file's earlier hashes and,
    with one DuckDB semi-join, against the ``seen`` table of files already committed.

    A record's sentences are numbered k = 0, 1, … (sentence splitting and over-long pieces both count), so
    ``sentence_id`` = ``<key>:<record>:<k>`` and ``doc_id`` = ``<key>:<record>``.
    """

    BATCH = 20_000

    def __init__(
        self, path: Path, key: str, config: IngestConfig, tmp: Path, con: duckdb.DuckDBPyConnection, stats: FileStats
    ) -> None:
        self.key, self.config, self.stats, self.source, self.con = key, config, stats, str(path), con
        self.tokenize = get_tokenizer(config.tokenizer)
        # zstd level 1 and no dictionary for the mostly-unique columns: writing is most of the cost of ingest
        # and min/max statistics only where a filter can use them (not on unique ids and texts)
        self.writer = pq.ParquetWriter(
            tmp,
            SHARD_SCHEMA,
            compression="zstd",
            compression_level=1,
            use_dictionary=["tokens.list.element", "source", "split"],
            write_statistics=["n_tokens", "source", "split"],
        )
        self.records: list[str] = []  # a label per text: "l<line>" or "r<row>" (JSONL lines, Parquet rows)
        self.texts: list[str] = []
        self._in_file = _HashSet()  # hashes of the sentences kept from this file
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parquet-writer")
        self._pending: Future | None = None

    def _wait_for_write(self) -> None:
        if self._pending is not None:
            self._pending.result()  # re-raises a write error here
            self._pending = None

    def add(self, record: str, text: str) -> None:
        pieces = split_sentences(text) if self.config.split_sentences else [text]
        self.records.extend([record] * len(pieces))
        self.texts.extend(pieces)
        if len(self.texts) >= self.BATCH:  # only between records: a record never spans two batches
            self.flush()

    def add_lines(self, before: int, lines: pa.StringArray, block: bytes) -> None:
        """A block of one-sentence-per-line text (``block``: the bytes it was cut from), labelled without a
        Python loop per line."""
        self.flush()
        self.stats.records += len(lines)
        line_numbers = pc.cast(pa.array(np.arange(before + 1, before + len(lines) + 1)), pa.string())
        self._write(lines, pc.binary_join_element_wise("l", line_numbers, ""), one_per_record=True, source=block)

    def flush(self) -> None:
        if self.texts:
            texts, records = pa.array(self.texts, pa.string()), pa.array(self.records, pa.string())
            self.texts, self.records = [], []
            self._write(texts, records, one_per_record=not self.config.split_sentences)

    def _write(
        self, texts: pa.StringArray, records: pa.StringArray, one_per_record: bool, source: bytes | None = None
    ) -> None:
        if not len(texts):
            return
        texts = pc.utf8_trim_whitespace(texts)  # also drops the newline, and the \r of CRLF files
        if self.config.tokenizer == "whitespace":
            tokens = split_whitespace(texts, source)
        else:
            tokens = pa.array([self.tokenize(t) for t in texts.to_pylist()], pa.list_(pa.string()))
        counts = pc.list_value_length(tokens).to_numpy(zero_copy_only=False)
        # Arrow splits "" into [""]: a trimmed empty text has no tokens whatever the count says
        offsets = np.frombuffer(texts.buffers()[1], np.int32)[texts.offset : texts.offset + len(texts) + 1]
        empty = (counts == 0) | (offsets[1:] == offsets[:-1])
        if empty.any():  # blank lines, or text without a single token
            self.stats.empty_lines += int(empty.sum())
            nonempty = np.flatnonzero(~empty)
            texts, tokens, counts, records = (
                texts.take(nonempty),
                tokens.take(nonempty),
                counts[nonempty],
                records.take(nonempty),
            )
        if (counts > self.config.max_tokens).any():
            texts, tokens, records = self._split_long(texts, tokens, records, counts)
            counts = pc.list_value_length(tokens).to_numpy(zero_copy_only=False)
            one_per_record = False
        n = len(records)
        if not n:
            return
        doc_ids = pc.binary_join_element_wise(f"{self.key}:", records, "")
        ordinals = "0" if one_per_record else pc.cast(pa.array(_ordinals_within_runs(doc_ids)), pa.string())
        sentence_ids = pc.binary_join_element_wise(doc_ids, ordinals, ":")
        hashes = sentence_hashes(self.con, texts)
        keep = self._first_seen(hashes) if self.config.dedup else np.ones(n, dtype=bool)
        self.stats.duplicates += int(n - keep.sum())
        table = pa.table(
            {
                "doc_id": doc_ids,
                "sentence_id": sentence_ids,
                "text": texts,
                "tokens": tokens,
                "n_tokens": pa.array(counts.astype(np.int32)),
                "source": pa.repeat(pa.scalar(self.source, pa.string()), n),
                "split": _splits(hashes, self.config.heldout_fraction),
            },
            schema=SHARD_SCHEMA,
        )
        if not keep.all():
            table = table.filter(pa.array(keep))
        if table.num_rows:
            # Parquet encoding (Arrow, GIL released) overlaps with tokenizing the next block; one block in flight
            self._wait_for_write()
            self._pending = self._io.submit(self.writer.write_table, table, row_group_size=self.config.row_group_size)
        self.stats.sentences += table.num_rows

    def _first_seen(self, hashes: np.ndarray) -> np.ndarray:
        """True for the first copy of each hash in this file that no committed file holds."""
        candidates, first = np.unique(hashes, return_index=True)  # sorted, which makes the lookups cache-friendly
        self.con.register("new_hashes", pa.table({"hash": candidates}))
        try:
            known = self.con.execute(KNOWN_HASHES).fetchnumpy()["hash"]
        finally:
            self.con.unregister("new_hashes")
        fresh = ~self._in_file.contains(candidates)
        if len(known):
            fresh &= ~np.isin(candidates, known)
        self._in_file.add(candidates[fresh])
        keep = np.zeros(len(hashes), dtype=bool)
        keep[first[fresh]] = True
        return keep

    def _split_long(
        self, texts: pa.Array, tokens: pa.Array, records: pa.StringArray, counts: np.ndarray
    ) -> tuple[pa.Array, pa.Array, pa.StringArray]:
        """Split rows longer than ``max_tokens`` into pieces, each a sentence of its own (rare: plain Python)."""
        limit = self.config.max_tokens
        out_texts: list[str] = []
        out_tokens: list[list[str]] = []
        out_records: list[str] = []
        for text, toks, record, count in zip(texts.to_pylist(), tokens.to_pylist(), records.to_pylist(), counts):
            if count <= limit:
                out_texts.append(text)
                out_tokens.append(toks)
                out_records.append(record)
                continue
            self.stats.split_long += 1
            for start in range(0, count, limit):
                piece = toks[start : start + limit]
                out_texts.append(" ".join(piece))
                out_tokens.append(piece)
                out_records.append(record)
        return (
            pa.array(out_texts, pa.string()),
            pa.array(out_tokens, pa.list_(pa.string())),
            pa.array(out_records, pa.string()),
        )

    def close(self) -> np.ndarray:
        """Finish the ``.tmp`` file; returns the hashes of the kept sentences."""
        try:
            self.flush()
            self._wait_for_write()
        finally:
            self._io.shutdown(wait=True)
            self.writer.close()
        return self._in_file.values()


def _write_shard(
    path: Path, key: str, fmt: str, config: IngestConfig, tmp: Path, con: duckdb.DuckDBPyConnection, stats: FileStats
) -> np.ndarray:
    """Tokenize and dedup one file into ``tmp``; returns the kept sentences' hashes."""
    writer = _ShardWriter(path, key, config, tmp, con, stats)
    try:
        if fmt == "text" and not config.split_sentences:
            for before, data, ends in _line_blocks(path, stats):
                writer.add_lines(before, _line_array(data, ends, path, before + 1, stats), data.obj)
        else:
            for record, text in _records(path, fmt, config, stats):
                stats.records += 1
                writer.add(record, text)
    finally:
        hashes = writer.close()
    return hashes


def shard_paths(out: str | Path) -> list[Path]:
    """The committed-or-complete shards of a dataset (never temporary files)."""
    return sorted(Path(out).glob("part-*.parquet"))


def manifest_path(out: str | Path) -> Path:
    """``OUT/_manifest.duckdb`` (a leading ``_``: dataset readers skip it); datasets of earlier versions are renamed."""
    out = Path(out)
    legacy = out / "manifest.duckdb"
    if legacy.exists() and not (out / MANIFEST_NAME).exists():
        legacy.rename(out / MANIFEST_NAME)
    return out / MANIFEST_NAME


def open_manifest(out: Path, memory_limit: str = "2GB") -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(str(manifest_path(out)))
    con.execute("SET memory_limit = ?", [memory_limit])
    # its queries here are small (hash a block, probe the seen table): a second thread only burns CPU
    # (15% of ingest's CPU time measured on 2 cores) that the Parquet writer thread could use
    con.execute("SET threads = 1")
    con.execute("SET temp_directory = ?", [str(out / "_duckdb_tmp")])
    con.execute(MANIFEST_DDL)
    return con


def dataset_options(out: str | Path) -> dict | None:
    """The tokenizer and split options an ingested dataset was made with (None for a new folder)."""
    path = Path(out) / MANIFEST_NAME
    if not path.exists():
        return None
    con = duckdb.connect(str(path), read_only=True)
    try:
        rows = (
            con.execute(GET_OPTIONS).fetchall()
            if con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = 'options'").fetchone()[0]
            else []
        )
    finally:
        con.close()
    return json.loads(rows[0][0]) if rows else None


def option_changes(stored: dict, config: IngestConfig) -> list[str]:
    """How ``config`` reads text differently from a dataset's stored options ("tokenizer: 'a' → 'b'", …)."""
    wanted = config.model_dump(include=set(DATASET_OPTIONS))
    return [f"{k}: {stored.get(k)!r} → {v!r}" for k, v in wanted.items() if stored.get(k) != v]


def _check_options(con: duckdb.DuckDBPyConnection, out: Path, config: IngestConfig) -> None:
    """A dataset grows by new files over many runs, all tokenized and split the same way: refuse other options."""
    row = con.execute(GET_OPTIONS).fetchall()
    if not row:
        con.execute(SET_OPTIONS, [json.dumps(config.model_dump(include=set(DATASET_OPTIONS)), sort_keys=True)])
        return
    changed = option_changes(json.loads(row[0][0]), config)
    if changed:
        raise OutputError(
            f"{out}: this dataset was ingested with other options ({'; '.join(changed)}); "
            "ingest into a new --out folder, or use the dataset's options"
        )


def ingest(config: IngestConfig) -> IngestSummary:
    """Ingest every input of ``config``; files already in the manifest are skipped. Returns the counts."""
    started = time.perf_counter()
    out = Path(config.out)
    if out.is_file():
        raise OutputError(f"{out}: is a file; --out takes a dataset folder (new, or one `elmo ingest` wrote)")
    get_tokenizer(config.tokenizer)  # fail before any work if the tokenizer is unavailable
    inputs = find_inputs(config.sources)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob(".part-*.tmp"), *out.glob("part-*.tmp")]:
        stale.unlink()  # left by an interrupted run
    summary = IngestSummary()
    con = open_manifest(out, config.memory_limit)
    done_bytes = 0
    try:
        _check_options(con, out, config)
        with track("ingest", sum(p.stat().st_size for p in inputs) / 1e6, "MB") as progress:
            for n, path in enumerate(inputs, 1):
                stat = path.stat()
                _ingest_file(con, config, out, path, stat, f"[{n}/{len(inputs)}]", summary, progress, done_bytes)
                done_bytes += stat.st_size
                progress.update(done_bytes / 1e6, f"{summary.files_ingested} files, {summary.sentences:,} sentences")
    finally:
        con.close()
    summary.seconds = time.perf_counter() - started
    log.info("%s", summary.line())
    return summary


def _ingest_file(
    con: duckdb.DuckDBPyConnection,
    config: IngestConfig,
    out: Path,
    path: Path,
    stat: os.stat_result,
    label: str,
    summary: IngestSummary,
    progress: Progress,
    done_bytes: int,
) -> None:
    """One input file into its shard and the manifest (or skipped: already done; or failed, counted)."""
    if con.execute(FIND_DONE_BY_STAT, [str(path), stat.st_size, stat.st_mtime]).fetchall():
        summary.files_skipped += 1
        return
    sha = content_sha256(path)
    row = con.execute(FIND_BY_SHA, [sha]).fetchall()
    if row and row[0][0] == "done":
        summary.files_skipped += 1
        return
    key = sha[:16]
    fmt = file_format(path)
    stats = FileStats(str(path), fmt, progress=lambda at: progress.update((done_bytes + at) / 1e6, path.name))
    shard = out / f"part-{key}.parquet"
    shard.unlink(missing_ok=True)  # a shard renamed just before a crash is redone
    log.info("%s %s (%s, %.1f MB)", label, path, fmt, stat.st_size / 1e6)
    tmp = temp_path(shard)
    try:
        hashes = _write_shard(path, key, fmt, config, tmp, con, stats)
    except (ElmoError, OSError, EOFError) as exc:  # this file fails; the others go on
        tmp.unlink(missing_ok=True)
        summary.files_failed += 1
        summary.errors.append(str(exc))
        log.error("%s", exc)
        con.execute(UPSERT_FILE, _file_row(sha, path, stat, stats, "failed", str(exc), None))
        return
    _commit_file(con, config, tmp, shard, sha, path, stat, stats, hashes)
    summary.files_ingested += 1
    summary.bytes_read += stat.st_size
    summary.sentences += stats.sentences
    summary.tokens += _token_count(shard) if stats.sentences else 0
    summary.duplicates += stats.duplicates
    summary.rejected_lines += stats.rejected_lines
    summary.invalid_utf8_lines += stats.invalid_utf8_lines
    for example in stats.examples:
        summary.warnings.append(example)
        log.warning("%s", example)


def _token_count(shard: Path) -> int:
    table = pq.read_table(shard, columns=["n_tokens"])
    return int(pc.sum(table.column(0)).as_py() or 0)


def _file_row(
    sha: str, path: Path, stat: os.stat_result, stats: FileStats, status: str, error: str | None, shard: str | None
) -> dict:
    return {
        "sha256": sha,
        "path": str(path),
        "size": stat.st_size,
        "mtime": stat.st_mtime,
        "format": stats.format,
        "records": stats.records,
        "sentences": stats.sentences,
        "duplicates": stats.duplicates,
        "rejected_lines": stats.rejected_lines,
        "invalid_utf8_lines": stats.invalid_utf8_lines,
        "empty_lines": stats.empty_lines,
        "split_long": stats.split_long,
        "status": status,
        "error": error,
        "shard": shard,
    }


def _commit_file(
    con: duckdb.DuckDBPyConnection,
    config: IngestConfig,
    tmp: Path,
    shard: Path,
    sha: str,
    path: Path,
    stat: os.stat_result,
    stats: FileStats,
    hashes: np.ndarray,
) -> None:
    """Rename the finished shard into place, then record its hashes and the file in one DuckDB transaction.

    A crash between the two leaves a complete shard that the manifest does not list: the next run redoes it.
    """
    con.execute("BEGIN TRANSACTION")
    try:
        if config.dedup and len(hashes):
            con.register("new_hashes", pa.table({"hash": hashes}))
            con.execute(REMEMBER_HASHES)
            con.unregister("new_hashes")
        if stats.sentences:
            publish(tmp, shard)
        else:
            tmp.unlink(missing_ok=True)
        con.execute(
            UPSERT_FILE, _file_row(sha, path, stat, stats, "done", None, shard.name if stats.sentences else None)
        )
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
