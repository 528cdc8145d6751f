"""``ingest``: every input of a config into the dataset, one file at a time: skipped when the manifest has it,
else sharded (``shards``) and committed (``manifest``); a file that fails is counted and the others go on."""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import pyarrow.compute as pc
import pyarrow.parquet as pq

from elmo_core.errors import ConfigError, ElmoError, InputError, OutputError
from elmo_core.fileio import FolderLock, temp_path
from elmo_core.ingest.inputs import Input, file_format, find_sources
from elmo_core.ingest.manifest import (
    FIND_BY_SHA,
    FIND_DONE_BY_STAT,
    FileEntry,
    check_options,
    commit_file,
    dataset_options,
    open_manifest,
    option_changes,
    record_failure,
)
from elmo_core.ingest.readers import Counts, FileStats, content_sha256
from elmo_core.ingest.shards import write_shard
from elmo_core.options import IngestConfig
from elmo_core.progress import Progress, track
from elmo_core.stage import WholeStage
from elmo_core.text.tokenize import get_tokenizer

log = logging.getLogger(__name__)

LOCK_NAME = ".ingest.lock"  # hidden: the dataset's readers skip it


@dataclass
class IngestSummary(Counts):
    """A run's counts: the files' ``Counts`` summed, and what only a run knows (files, bytes, tokens, time)."""

    files_ingested: int = 0
    files_skipped: int = 0
    files_failed: int = 0
    bytes_read: int = 0
    tokens: int = 0
    overlap_example: str | None = None
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def add(self, stats: FileStats, tokens: int, bytes_read: int) -> None:
        """Count one ingested file."""
        self.files_ingested += 1
        self.bytes_read += bytes_read
        self.tokens += tokens
        self.add_counts(stats)
        self.overlap_example = self.overlap_example or stats.overlap_example
        self.warnings.extend(stats.examples)

    def overlap_line(self) -> str:
        """What a reporter of heldout/test numbers needs to know: train and a fixed split share sentences."""
        if not self.overlap:
            return ""
        what = (
            f"{self.overlap_dropped:,} dropped from train"
            if self.overlap_dropped
            else "--drop-overlap drops them from train (heldout/test sources are ingested first)"
        )
        example = self.overlap_example
        return f"{self.overlap:,} sentences are both in train and in a heldout/test source ({what}); first: {example!r}"

    @property
    def nothing_ingested(self) -> bool:
        """Every input failed: no dataset to go on with (some failures beside good files are only counted)."""
        return bool(self.files_failed) and not self.files_ingested and not self.files_skipped

    def refusal(self) -> InputError | None:
        """The error that ends a run where nothing could be ingested (each runner shows the files' errors first)."""
        if not self.nothing_ingested:
            return None
        return InputError(f"no input could be ingested ({self.files_failed} failed): {'; '.join(self.errors)}")

    def line(self) -> str:
        mb = self.bytes_read / 1e6
        return (
            f"ingest: {self.files_ingested} files ingested, {self.files_skipped} unchanged, "
            f"{self.files_failed} failed; "
            f"{self.sentences:,} sentences, {self.tokens:,} tokens, {self.duplicates:,} duplicates dropped, "
            f"{self.rejected_lines:,} rejected lines, {self.invalid_utf8_lines:,} lines with invalid UTF-8, "
            f"{self.empty_lines:,} empty lines, {self.split_long:,} over-long sentences cut; "
            f"{mb:,.1f} MB in {self.seconds:.1f} s ({mb / max(self.seconds, 1e-9):,.1f} MB/s)"
            + (f"; {self.overlap_line()}" if self.overlap else "")
        )


@dataclass
class _Ingest:
    """One ``ingest`` call's open manifest, counts and progress, handed from file to file."""

    con: duckdb.DuckDBPyConnection
    config: IngestConfig
    out: Path
    summary: IngestSummary
    progress: Progress
    done_bytes: int = 0  # of the inputs before the current one


def ingest(config: IngestConfig) -> IngestSummary:
    """Ingest every input of ``config``; files already in the manifest are skipped. Returns the counts.

    A dataset read with other tokenizer or split options is refused, unless ``config.afresh`` (the main job's
    dataset, which follows its options): then it is removed and made anew, and the log says so."""
    started = time.perf_counter()
    out = Path(config.out)
    if out.is_file():
        raise OutputError(f"{out}: is a file; --out takes a dataset folder (new, or one `elmo ingest` wrote)")
    get_tokenizer(config.tokenizer)  # fail before any work if the tokenizer is unavailable
    if config.split_field and config.split != "auto":
        raise ConfigError(f"--split {config.split} and --split-field {config.split_field}: give one of them")
    inputs = find_sources(config.sources, config.split, config.layout)
    stored = dataset_options(out) if config.afresh else None
    if stored is not None and option_changes(stored, config):
        log.info(
            "%s: ingest options changed (%s); the dataset is made afresh",
            out,
            "; ".join(option_changes(stored, config)),
        )
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    with FolderLock(out / LOCK_NAME, out, wait=config.wait):  # one ingest at a time: dedup sees every file
        summary = _ingest_all(config, out, inputs)
    summary.seconds = time.perf_counter() - started
    log.info("%s", summary.line())
    return summary


def _ingest_all(config: IngestConfig, out: Path, inputs: list[Input]) -> IngestSummary:
    for stale in [*out.glob(".part-*.tmp"), *out.glob("part-*.tmp")]:
        stale.unlink()  # left by an interrupted run (no other ingest can be writing: the lock is held)
    summary = IngestSummary()
    con = open_manifest(out, config.memory_limit)
    try:
        check_options(con, out, config)
        with track("ingest", sum(i.path.stat().st_size for i in inputs) / 1e6, "MB") as progress:
            run = _Ingest(con=con, config=config, out=out, summary=summary, progress=progress)
            for n, item in enumerate(inputs, 1):
                size = item.path.stat().st_size
                _ingest_file(run, item, f"[{n}/{len(inputs)}]")
                run.done_bytes += size
                progress.update(
                    run.done_bytes / 1e6, f"{summary.files_ingested} files, {summary.sentences:,} sentences"
                )
    finally:
        con.close()
    return summary


def _ingest_file(run: _Ingest, item: Input, label: str) -> None:
    """One input file into its shard and the manifest (or skipped: already done; or failed, counted)."""
    con, summary, path, stat = run.con, run.summary, item.path, item.path.stat()
    done = con.execute(FIND_DONE_BY_STAT, [str(path), stat.st_size, stat.st_mtime]).fetchall()
    if done:
        _same_split(path, done[0][0], item.split, run.out)
        summary.files_skipped += 1
        return
    sha = content_sha256(path)
    row = con.execute(FIND_BY_SHA, [sha]).fetchall()
    if row and row[0][0] == "done":
        _same_split(path, row[0][1], item.split, run.out, row[0][2])
        summary.files_skipped += 1
        return
    fmt = file_format(path)
    at_start = run.done_bytes
    progress = lambda at: run.progress.update((at_start + at) / 1e6, path.name)  # noqa: E731
    stats = FileStats(path=str(path), format=fmt, progress=progress)
    entry = FileEntry(path=path, stat=stat, sha256=sha, stats=stats, split=item.split)
    shard = run.out / f"part-{entry.key}.parquet"
    shard.unlink(missing_ok=True)  # a shard renamed just before a crash is redone
    log.info("%s %s (%s, %.1f MB)", label, path, fmt, stat.st_size / 1e6)
    tmp = temp_path(shard)
    try:
        hashes = write_shard(
            path, entry.key, fmt=fmt, config=run.config, tmp=tmp, con=con, stats=stats, split=item.split
        )
    except (ElmoError, OSError, EOFError) as exc:  # this file fails; the others go on
        tmp.unlink(missing_ok=True)
        summary.files_failed += 1
        summary.errors.append(str(exc))
        log.error("%s", exc)
        record_failure(con, entry, str(exc))
        return
    commit_file(con, entry, tmp=tmp, shard=shard, hashes=hashes, dedup=run.config.dedup)
    summary.add(stats, tokens=_token_count(shard) if stats.sentences else 0, bytes_read=stat.st_size)
    for example in stats.examples:
        log.warning("%s", example)


def _same_split(path: Path, ingested: str, wanted: str, out: Path, as_path: str | None = None) -> None:
    """A file already in the dataset keeps the split it was ingested with: another one is refused in one line."""
    if ingested != wanted:
        same = f" (as {as_path}, the same text)" if as_path and as_path != str(path) else ""
        raise OutputError(
            f"{path}: already in {out} as split {ingested}{same}; ingest it with --split {ingested}, or into a new "
            "--out folder to change its split"
        )


def _token_count(shard: Path) -> int:
    table = pq.read_table(shard, columns=["n_tokens"])
    return int(pc.sum(table.column(0)).as_py() or 0)


class IngestStage(WholeStage):
    """Ingest as a stage, one unit (deduplication against one manifest is sequential); ``afresh`` (an option, the
    main job's) makes a dataset of other options anew."""

    name = "ingest"

    def decide(self, config: IngestConfig) -> list[str]:
        inputs = find_sources(config.sources, config.split, config.layout)
        size = sum(i.path.stat().st_size for i in inputs)
        lines = [
            f"{len(inputs)} input files ({size:,} bytes), tokenizer {config.tokenizer}, dedup "
            f"{'on' if config.dedup else 'off'}, heldout fraction {config.heldout_fraction:g}"
        ]
        try:
            stored = dataset_options(config.out)
        except duckdb.IOException:  # another ingest writes it now: the work checks the options under the lock
            return [*lines, f"{config.out} is being written by another job: checked once it is this job's turn"]
        changes = option_changes(stored, config) if stored is not None else []
        if changes:
            verb = "made afresh" if config.afresh else "refused (another dataset's options)"
            lines.append(f"{config.out} was read with other options ({'; '.join(changes)}): {verb}")
        elif stored is not None:
            lines.append(f"{config.out} exists: files already in its manifest are skipped")
        return lines

    def work(self, config: IngestConfig) -> IngestSummary:
        return ingest(config)
