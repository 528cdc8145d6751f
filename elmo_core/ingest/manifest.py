"""The dataset's DuckDB manifest, ``OUT/_manifest.duckdb``: which files are in (size, mtime, sha256, counts,
status), the hashes of every kept sentence (for deduplication), and the options every shard shares."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from elmo_core.errors import OutputError
from elmo_core.fileio import publish
from elmo_core.ingest.readers import FileStats
from elmo_core.options import DATASET, IngestConfig, tagged

log = logging.getLogger(__name__)

MANIFEST_DDL = """
CREATE TABLE IF NOT EXISTS files (
    sha256 VARCHAR PRIMARY KEY, path VARCHAR, size BIGINT, mtime DOUBLE, format VARCHAR,
    records BIGINT, sentences BIGINT, duplicates BIGINT, rejected_lines BIGINT, invalid_utf8_lines BIGINT,
    empty_lines BIGINT, split_long BIGINT, status VARCHAR, error VARCHAR, shard VARCHAR, ingested_at TIMESTAMP
);
CREATE TABLE IF NOT EXISTS seen (hash BIGINT);
CREATE TABLE IF NOT EXISTS options (settings VARCHAR);
ALTER TABLE files ADD COLUMN IF NOT EXISTS split VARCHAR DEFAULT 'auto';
ALTER TABLE files ADD COLUMN IF NOT EXISTS overlap BIGINT DEFAULT 0;
ALTER TABLE seen ADD COLUMN IF NOT EXISTS pool VARCHAR DEFAULT 'corpus';
"""
# a file's split (auto, train, heldout, test) is part of its identity: the same file under another is refused
GET_OPTIONS = "SELECT settings FROM options"
SET_OPTIONS = "INSERT INTO options VALUES (?)"
MANIFEST_NAME = "_manifest.duckdb"

FIND_DONE_BY_STAT = "SELECT split FROM files WHERE path = ? AND size = ? AND mtime = ? AND status = 'done'"
FIND_BY_SHA = "SELECT status, split, path FROM files WHERE sha256 = ?"
REMEMBER_HASHES = "INSERT INTO seen (hash, pool) SELECT hash, pool FROM new_hashes"
OVERLAP = "SELECT coalesce(sum(overlap), 0) FROM files WHERE status = 'done'"
UPSERT_FILE = """
INSERT OR REPLACE INTO files (sha256, path, size, mtime, format, records, sentences, duplicates, rejected_lines,
    invalid_utf8_lines, empty_lines, split_long, status, error, shard, ingested_at, split, overlap)
VALUES ($sha256, $path, $size, $mtime, $format, $records, $sentences, $duplicates, $rejected_lines,
    $invalid_utf8_lines, $empty_lines, $split_long, $status, $error, $shard, now(), $split, $overlap)
"""


def manifest_path(out: str | Path) -> Path:
    """``OUT/_manifest.duckdb`` (a leading ``_``: dataset readers skip it)."""
    return Path(out) / MANIFEST_NAME


def _adopt_legacy_manifest(out: Path) -> None:
    """Datasets of earlier versions kept ``OUT/manifest.duckdb``: renamed when the dataset is next written to."""
    legacy = out / "manifest.duckdb"
    if legacy.exists() and not manifest_path(out).exists():
        legacy.rename(manifest_path(out))


def open_manifest(out: Path, memory_limit: str = "2GB") -> duckdb.DuckDBPyConnection:
    """The manifest open for writing (created, or adopted from an earlier version's name)."""
    _adopt_legacy_manifest(out)
    con = duckdb.connect(str(manifest_path(out)))
    con.execute("SET memory_limit = ?", [memory_limit])
    # its queries here are small (hash a block, probe the seen table): a second thread only burns CPU that the
    # Parquet writer thread could use
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
    wanted = config.model_dump(include=set(tagged(IngestConfig, DATASET)))
    return [f"{k}: {stored.get(k)!r} → {v!r}" for k, v in wanted.items() if stored.get(k) != v]


def check_options(con: duckdb.DuckDBPyConnection, out: Path, config: IngestConfig) -> None:
    """A dataset grows by new files over many runs, all tokenized and split the same way: refuse other options."""
    row = con.execute(GET_OPTIONS).fetchall()
    if not row:
        con.execute(
            SET_OPTIONS, [json.dumps(config.model_dump(include=set(tagged(IngestConfig, DATASET))), sort_keys=True)]
        )
        return
    changed = option_changes(json.loads(row[0][0]), config)
    if changed:
        raise OutputError(
            f"{out}: this dataset was ingested with other options ({'; '.join(changed)}); "
            "ingest into a new --out folder, or use the dataset's options"
        )


@dataclass
class FileEntry:
    """One input file as the manifest records it: where it is, its stat, its content hash and its counts."""

    path: Path
    stat: os.stat_result
    sha256: str
    stats: FileStats
    split: str = "auto"  # as asked for: auto, train, heldout or test

    @property
    def key(self) -> str:
        """The shard's name and the sentence ids follow the content: the first 16 hex digits of its hash."""
        return self.sha256[:16]

    def row(self, status: str, error: str | None = None, shard: str | None = None) -> dict:
        stats = self.stats
        return {
            "sha256": self.sha256,
            "path": str(self.path),
            "size": self.stat.st_size,
            "mtime": self.stat.st_mtime,
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
            "split": self.split,
            "overlap": stats.overlap,
        }


def record_failure(con: duckdb.DuckDBPyConnection, entry: FileEntry, error: str) -> None:
    con.execute(UPSERT_FILE, entry.row("failed", error))


def commit_file(
    con: duckdb.DuckDBPyConnection,
    entry: FileEntry,
    *,
    tmp: Path,
    shard: Path,
    hashes: dict[str, np.ndarray],
    dedup: bool,
) -> None:
    """Rename the finished shard into place, then record its hashes and the file in one DuckDB transaction.

    A crash between the two leaves a complete shard that the manifest does not list: the next run redoes it.
    """
    con.execute("BEGIN TRANSACTION")
    try:
        for pool, values in hashes.items() if dedup else ():
            if len(values):
                con.register(
                    "new_hashes",
                    pa.table({"hash": values, "pool": pa.repeat(pa.scalar(pool, pa.string()), len(values))}),
                )
                con.execute(REMEMBER_HASHES)
                con.unregister("new_hashes")
        if entry.stats.sentences:
            publish(tmp, shard)
        else:
            tmp.unlink(missing_ok=True)
        con.execute(UPSERT_FILE, entry.row("done", shard=shard.name if entry.stats.sentences else None))
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
