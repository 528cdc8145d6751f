"""What an embedding job reads: an ingested dataset as it is, or text files tokenized first into the job's work
folder (as ingest tokenizes, every line kept, no heldout split), and the units its rows are cut into.

Tokenizing text is a stage of its own (``TokenizeStage``), run before the embedding stage by ``vectors.embed.embed``
under the job's lock, so that the embedding stage's plan only reads: it finds the tokenized copy (``input_shards``)
and cuts it into units (``plan_units``). The copy is reused while the text files are unchanged (their names, sizes
and modification times, and the tokenizer, in ``_sources.json``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from elmo_core.errors import InputError
from elmo_core.fileio import FolderLock, write_text_atomic
from elmo_core.ingest import find_inputs, ingest, manifest_path, shard_paths
from elmo_core.options import EmbedConfig, IngestConfig
from elmo_core.stage import WholeStage

log = logging.getLogger(__name__)

LOCK_NAME = "lock"  # in the work folder: the one-writer lock of OUT (fileio.FolderLock)
SOURCES_FILE = "_sources.json"  # in the tokenized copy: which text files, as what, it was made from


@dataclass(frozen=True)
class Unit:
    """Rows [start, stop) of one row group of one input shard: the unit of work, of output and of resume."""

    shard: str
    row_group: int
    start: int
    stop: int
    tokens: int

    @property
    def name(self) -> str:
        return f"part-{Path(self.shard).stem.removeprefix('part-')}-{self.row_group:05d}-{self.start:07d}.parquet"

    @property
    def size(self) -> int:
        return self.tokens


def work_dir(out: Path) -> Path:
    """The job's working folder, beside OUT: ``.<name>.elmo``."""
    return out.parent / f".{out.name}.elmo"


def job_lock(config: EmbedConfig) -> FolderLock:
    """The lock a job on ``config.out`` holds while it changes anything (the tokenized copy, the table): a second job
    on the folder is refused at once, naming the holder (or waits, with ``wait``)."""
    out = Path(config.out)
    return FolderLock(work_dir(out) / LOCK_NAME, out, wait=config.wait)


def _is_dataset(config: EmbedConfig) -> bool:
    source = Path(config.input)
    return source.is_dir() and (bool(shard_paths(source)) or manifest_path(source).exists())


def _sources(config: EmbedConfig) -> str:
    inputs = find_inputs([config.input])
    return json.dumps([[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in inputs] + [config.tokenizer])


def needs_tokenizing(config: EmbedConfig) -> bool:
    """Text input whose tokenized copy is missing or was made from other files (reading only). Input that cannot
    be read counts as such: the tokenizing stage's plan then says why, in the runner's own way."""
    if _is_dataset(config):
        return False
    marker = work_dir(Path(config.out)) / "input" / SOURCES_FILE
    try:
        return not (marker.exists() and marker.read_text() == _sources(config))
    except (InputError, OSError):
        return True


def _no_shards_reason(dataset: Path) -> str:
    """Why an ingested dataset has no shards, from its manifest."""
    con = duckdb.connect(str(manifest_path(dataset)), read_only=True)
    try:
        rows = con.execute("SELECT path, status, error, sentences FROM files ORDER BY path").fetchall()
    finally:
        con.close()
    failed = [(p, e) for p, status, e, _ in rows if status == "failed"]
    if failed:
        first = failed[0][1] or "failed"
        return (
            f"every input was rejected ({len(failed)} files; first: {first})"
            if len(failed) == len(rows)
            else f"its inputs gave no sentences ({len(failed)} rejected; first: {first})"
        )
    return "its inputs held no sentences" if rows else "no input was ingested into it"


def input_shards(config: EmbedConfig, work: Path) -> tuple[Path, list[Path]]:
    """(dataset folder, its shards), reading only: an ingested dataset as it is, or text input's tokenized copy."""
    source = Path(config.input)
    if source.is_dir() and shard_paths(source):
        return source, shard_paths(source)
    if source.is_dir() and manifest_path(source).exists():
        raise InputError(
            f"{source}: an ingested dataset with no shards: {_no_shards_reason(source)}; fix its inputs and "
            "rerun `elmo ingest`"
        )
    if needs_tokenizing(config):
        raise InputError(f"{config.input}: text input not tokenized yet (`elmo embed` tokenizes it first)")
    corpus = work / "input"
    if not shard_paths(corpus):
        raise InputError(f"{config.input}: no sentences to embed (every line is empty)")
    return corpus, shard_paths(corpus)


class TokenizeStage(WholeStage):
    """Text input tokenized into the job's work folder, one unit, under the job's lock. ``check``: what the job
    refuses before any text is tokenized (another job's folder, a model that is not there), run in its plan."""

    name = "tokenize"

    def __init__(self, check: Callable[[EmbedConfig], Any] | None = None) -> None:
        self.check = check

    def identity(self, config: EmbedConfig) -> dict[str, Any]:
        return {"sources": json.loads(_sources(config))}

    def writes(self, config: EmbedConfig) -> list[Path]:
        return [work_dir(Path(config.out)) / "input"]

    def decide(self, config: EmbedConfig) -> list[str]:
        if self.check is not None:
            self.check(config)
        inputs = find_inputs([config.input])
        size = sum(p.stat().st_size for p in inputs)
        return [f"tokenize {len(inputs)} text files ({size:,} bytes) with the {config.tokenizer} tokenizer"]

    def claim(self, plan: Any) -> contextlib.AbstractContextManager[Any]:
        return job_lock(plan.options)

    def work(self, config: EmbedConfig) -> Path:
        corpus = work_dir(Path(config.out)) / "input"
        shutil.rmtree(corpus, ignore_errors=True)  # made from other files, or cut short
        summary = ingest(
            IngestConfig(
                sources=[str(p) for p in find_inputs([config.input])],
                out=str(corpus),
                tokenizer=config.tokenizer,
                dedup=False,
                heldout_fraction=0.0,
            )
        )
        if summary.errors:
            more = f" (and {len(summary.errors) - 1} more)" if len(summary.errors) > 1 else ""
            raise InputError(f"{summary.errors[0]}{more}; fix or remove the file and run again")
        for warning in summary.warnings:
            log.warning("%s", warning)
        write_text_atomic(corpus / SOURCES_FILE, _sources(config))
        return corpus


def plan_units(shards: list[Path], unit_tokens: int, split: str = "all") -> list[Unit]:
    """Cut every row group into units of at most ``unit_tokens`` tokens (a longer sentence is a unit alone),
    whatever the row-group size the input was written with. Rows of another split count no tokens."""
    units: list[Unit] = []
    for shard in shards:
        pf = pq.ParquetFile(shard)
        for group in range(pf.num_row_groups):
            table = pf.read_row_group(group, columns=["n_tokens", "split"])
            tokens = table.column("n_tokens").to_numpy(zero_copy_only=False).astype(np.int64)
            if split != "all":
                tokens = np.where(pc.equal(table.column("split"), split).to_numpy(zero_copy_only=False), tokens, 0)
            start, taken = 0, 0
            for row, n in enumerate(tokens.tolist()):
                if row > start and taken + n > unit_tokens:
                    units.append(Unit(str(shard), group, start, row, taken))
                    start, taken = row, 0
                taken += n
            if len(tokens) > start:
                units.append(Unit(str(shard), group, start, len(tokens), taken))
    return [u for u in units if u.tokens] if split != "all" else units
