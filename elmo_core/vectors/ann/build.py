"""Building the index as a stage: plan (reading only), make room (under the lock), one shard per unit, summarize."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from elmo_core import cpu
from elmo_core.errors import InputError
from elmo_core.fileio import FolderLock, atomic_path, require_space, space_line, write_text_atomic
from elmo_core.options import IndexConfig
from elmo_core.stage import run_local
from elmo_core.vectors.ann.files import (
    HEADER,
    Coverage,
    Header,
    PartFile,
    ShardRecord,
    index_bytes,
    index_dir,
    read_header,
    read_shards,
)
from elmo_core.vectors.ann.table import TableFacts, normalized, vectors_of

log = logging.getLogger(__name__)

READ_ROWS = 65_536  # rows per batch read from a part while building
TRAIN_PER_LIST = 40  # training vectors per inverted list (faiss warns below 39)
MAX_TRAIN = 200_000


@dataclass
class BuildPlan:
    """What one ``elmo index`` run does (the stage's plan): start afresh or keep the index, drop stale shards, and
    build shards of about ``shard_rows`` rows for the parts no valid shard covers (its units)."""

    folder: Path
    facts: TableFacts
    fresh: bool  # everything there is dropped and the quantizer trained anew
    kept: list[ShardRecord]
    dropped: list[ShardRecord]
    todo: list[ShardRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    wait: bool = False  # a second build on the folder waits for the first instead of failing
    config: Any = None  # the options it was planned from (the claim plans again under the lock)
    meta_row: float = 0.0  # bytes of metadata a row, and of a key, in a sample of the rows to build
    key_length: float = 0.0
    freed: int = 0  # the bytes of the files ``make_room`` removes before the build writes

    @property
    def trains(self) -> bool:
        """Whether the build trains (and writes) the quantizer: ``make_room``'s rule."""
        return (self.fresh or not (self.folder / "trained.faiss").exists()) and bool(self.todo or self.kept)

    def bytes_to_write(self) -> int:
        """About the bytes the build adds to the filesystem: its shards and quantizer (``files.index_bytes``, its
        factors measured on real builds) less what it removes first."""
        header = self.facts.header
        shards = index_bytes(
            self.rows_todo, header.dim, header.dtype, header.nlist, len(self.todo), self.meta_row, self.key_length,
            self.trains,
        )  # fmt: skip
        return max(0, shards - self.freed)

    @property
    def units(self) -> list[ShardRecord]:
        return self.todo

    @property
    def rows_todo(self) -> int:
        return sum(s.rows for s in self.todo)

    def lines(self) -> list[str]:
        start = "a new index (the quantizer trained anew)" if self.fresh else f"{len(self.kept)} shards kept"
        dropped = f", {len(self.dropped)} stale shards dropped" if self.dropped else ""
        space = space_line(self.folder, self.bytes_to_write())
        todo = f"{len(self.todo)} shards to build ({self.rows_todo:,} rows)"
        return [f"{start}{dropped}; {todo}; {space} -> {self.folder}"]


def plan_build(table: Path, layer: str | None, shard_rows: int, rebuild: bool = False, **tuning: Any) -> BuildPlan:
    """Decide what a build does, reading the table and the index and changing neither (``make_room`` acts on it).
    A shard that is stale, or lost a part, is rebuilt with its parts' successors (``Coverage``)."""
    facts = TableFacts.read(table, layer, **tuning)
    folder = index_dir(facts.table, facts.header.column)
    notes: list[str] = []
    current = read_header(folder)
    fresh = rebuild or current is None  # nothing, or a first build killed between its quantizer and its header
    if current is not None and not fresh:
        differs = current.differs(facts.header)
        if differs:
            notes.append(f"the table changed ({differs}): rebuilding the index")
            fresh = True
        else:
            facts.header.nlist, facts.header.nprobe = current.nlist, current.nprobe
    shards = read_shards(folder) if folder.is_dir() else []
    coverage = Coverage.of([] if fresh else shards, facts.parts)
    lost = [s for s in coverage.shards if any(p.name in coverage.gone for p in s.parts)]
    for shard in [*coverage.stale, *lost]:
        changed = next(p.name for p in shard.parts if facts.parts.get(p.name) != p.bytes)
        notes.append(f"{shard.name}: part {changed} changed or is gone: rebuilding its {len(shard.parts)} parts")
    kept = [s for s in coverage.shards if s not in lost]
    plan = BuildPlan(folder, facts, fresh, kept, shards if fresh else [*coverage.stale, *lost], notes=notes)
    covered = {p.name for s in kept for p in s.parts}
    new = [PartFile(name, size, facts.rows[name]) for name, size in sorted(facts.parts.items()) if name not in covered]
    number = max((s.number for s in kept), default=-1) + 1
    group: list[PartFile] = []
    for part in new:
        if group and sum(p.rows for p in group) + part.rows > shard_rows:
            plan.todo.append(ShardRecord(number, group))
            number, group = number + 1, []
        group.append(part)
    if group:
        plan.todo.append(ShardRecord(number, group))
    plan.meta_row, plan.key_length = _sampled_meta(facts, plan.todo)
    removed = [*folder.glob("shard-*"), folder / "trained.faiss", folder / HEADER] if fresh else []
    removed += [path for shard in plan.dropped for path in shard.files(folder)]
    plan.freed = sum(path.stat().st_size for path in set(removed) if path.is_file())
    return plan


SAMPLE_ROWS = 4_096


def _sampled_meta(facts: TableFacts, todo: list[ShardRecord]) -> tuple[float, float]:
    """Bytes a row of a shard's metadata takes in Arrow (as ``_write_meta`` writes it: the text dictionary-encoded),
    and a key's mean length, in the first rows of the first part to build; (0, 0) where nothing is to be built."""
    if not todo:
        return 0.0, 0.0
    pf = pq.ParquetFile(facts.table / todo[0].parts[0].name)
    columns = _meta_columns(facts.header, pf.schema_arrow)
    batch = next(pf.iter_batches(batch_size=SAMPLE_ROWS, columns=columns), None)
    if batch is None or batch.num_rows == 0:
        return 0.0, 0.0
    meta = pa.table({c: batch.column(c) for c in columns})
    if "text" in meta.column_names:
        meta = meta.set_column(meta.column_names.index("text"), "text", pc.dictionary_encode(meta.column("text")))
    key = meta.column(facts.header.key)
    length = pc.sum(pc.binary_length(key.cast(pa.string()))).as_py() or 0
    return meta.nbytes / batch.num_rows, length / batch.num_rows


def make_room(plan: BuildPlan) -> None:
    """Carry out a plan's removals and train the quantizer where it is needed; under ``build_lock`` only (it deletes
    the temporary files of killed builds, which the lock says are not running)."""
    folder = plan.folder
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(".*.tmp"):
        stale.unlink(missing_ok=True)
    if plan.fresh:
        for path in [*folder.glob("shard-*"), folder / "trained.faiss", folder / HEADER]:
            path.unlink(missing_ok=True)
    for shard in plan.dropped:
        for path in reversed(shard.files(folder)):  # the record first: the shard stops counting before its data goes
            path.unlink(missing_ok=True)
    if not (folder / "trained.faiss").exists() and (plan.todo or plan.kept):
        _train(plan)


def _train_sample(table: Path, parts: list[str], column: str, dim: int, want: int) -> np.ndarray:
    """About ``want`` vectors from row groups spread over the table (a fixed seed: the same sample every time)."""
    groups = [(name, g) for name in parts for g in range(pq.ParquetFile(table / name).metadata.num_row_groups)]
    order = np.random.default_rng(0).permutation(len(groups))
    chunks, have = [], 0
    for i in order:
        name, g = groups[i]
        chunk = normalized(vectors_of(pq.ParquetFile(table / name).read_row_group(g, columns=[column]).column(0), dim))
        chunks.append(chunk)
        have += len(chunk)
        if have >= want:
            break
    sample = np.concatenate(chunks)
    return sample[np.random.default_rng(1).permutation(len(sample))[:want]]


def _train(plan: BuildPlan) -> None:
    import faiss

    header, folder = plan.facts.header, plan.folder
    total = sum(s.rows for s in plan.todo) + sum(s.rows for s in plan.kept)
    if total == 0:
        raise InputError(f"{plan.facts.table}: the table has no rows; nothing to index")
    header.nlist = min(header.nlist, max(1, total // TRAIN_PER_LIST))
    started = time.perf_counter()
    sample = _train_sample(
        plan.facts.table,
        sorted(plan.facts.parts),
        header.column,
        header.dim,
        min(MAX_TRAIN, TRAIN_PER_LIST * header.nlist * 2),
    )
    quantizer = faiss.IndexFlatIP(header.dim)
    index = faiss.IndexIVFScalarQuantizer(
        quantizer, header.dim, header.nlist, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT
    )
    index.train(sample)
    with atomic_path(folder / "trained.faiss") as tmp:
        faiss.write_index(index, str(tmp))
    write_text_atomic(folder / HEADER, json.dumps(asdict(header), indent=2) + "\n")
    log.info(
        "index: trained %d lists on %s vectors in %.1f s",
        header.nlist,
        f"{len(sample):,}",
        time.perf_counter() - started,
    )


def _meta_columns(header: Header, schema: pa.Schema) -> list[str]:
    wanted = [header.key, "sentence_id", "token_index", "text"]
    return [c for c in dict.fromkeys(wanted) if c in schema.names]


def build_shard(
    folder: Path, table: Path, shard: ShardRecord, on_rows: Callable[[int], None] | None = None
) -> ShardRecord:
    """Read the shard's parts as a stream and write its files; the ``.json`` record last, once all are in place."""
    import faiss

    header = read_header(folder)
    assert header is not None, f"{folder}: no {HEADER}; plan_build writes it first"
    index = faiss.read_index(str(folder / "trained.faiss"))
    dtype = np.dtype(header.dtype)
    files = shard.files(folder)
    meta: list[pa.Table] = []
    with atomic_path(files.vectors) as tmp_vectors, open(tmp_vectors, "wb") as out:
        np.lib.format.write_array_header_2_0(
            out,
            {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (shard.rows, header.dim)},
        )
        pos = 0
        for part in shard.parts:
            pf = pq.ParquetFile(table / part.name)
            columns = _meta_columns(header, pf.schema_arrow)
            for batch in pf.iter_batches(batch_size=READ_ROWS, columns=[header.column, *columns]):
                vectors = vectors_of(batch.column(header.column), header.dim)
                out.write(np.ascontiguousarray(vectors, dtype=dtype).tobytes())
                index.add_with_ids(normalized(vectors), np.arange(pos, pos + len(vectors), dtype=np.int64))
                meta.append(pa.table({c: batch.column(c) for c in columns}))
                pos += len(vectors)
                if on_rows:
                    on_rows(len(vectors))
        if pos != shard.rows:
            raise InputError(f"{table}: parts changed while being indexed ({pos:,} rows read, {shard.rows:,} expected)")
    _write_meta(files.meta, files.order, files.keys, meta, header.key)
    with atomic_path(files.lists) as tmp:
        faiss.write_index(index, str(tmp))
    write_text_atomic(files.record, json.dumps(shard.to_record()) + "\n")
    return shard


def _write_arrow(path: Path, table: pa.Table) -> None:
    with atomic_path(path) as tmp, pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def _write_meta(path: Path, order_path: Path, keys_path: Path, chunks: list[pa.Table], key: str) -> None:
    """The shard's metadata in the vectors' order; its positions sorted by (key, sentence_id, token_index); and the
    distinct keys with the range of ``order`` each has."""
    meta = pa.concat_tables(chunks) if chunks else pa.table({key: pa.array([], pa.string())})
    sort_keys = [(c, "ascending") for c in dict.fromkeys((key, "sentence_id", "token_index")) if c in meta.column_names]
    order = pc.sort_indices(meta, sort_keys=sort_keys).to_numpy().astype(np.int64)
    if "text" in meta.column_names:  # a sentence's text once, not once per token
        meta = meta.set_column(meta.column_names.index("text"), "text", pc.dictionary_encode(meta.column("text")))
    _write_arrow(path, meta.combine_chunks())
    with atomic_path(order_path) as tmp, open(tmp, "wb") as f:
        np.save(f, order)
    keys = meta.column(key).to_numpy(zero_copy_only=False)[order]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if len(keys) else np.empty(0, np.int64)
    stops = np.r_[starts[1:], len(keys)].astype(np.int64)
    _write_arrow(keys_path, pa.table({"key": pa.array(keys[starts], pa.string()), "lo": starts, "hi": stops}))


def build_lock(table: Path, column: str, wait: bool = False) -> FolderLock:
    return _folder_lock(index_dir(table, column), wait)


def _folder_lock(folder: Path, wait: bool) -> FolderLock:
    return FolderLock(folder / "lock", folder, wait=wait)


@dataclass
class IndexSummary:
    folder: Path
    shards_built: int
    rows_built: int
    shards: int
    rows: int
    bytes: int
    seconds: float
    notes: list[str]

    def line(self) -> str:
        what = (
            f"{self.shards_built} shards ({self.rows_built:,} rows) built"
            if self.shards_built
            else "up to date, nothing to build"
        )
        return (
            f"index: {what} in {self.seconds:.1f} s; {self.shards} shards cover {self.rows:,} rows, "
            f"{self.bytes / 2**20:,.1f} MiB -> {self.folder}"
        )


def summarize(folder: Path, built: list[ShardRecord], seconds: float, notes: list[str] | None = None) -> IndexSummary:
    shards = read_shards(folder)
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    built_rows = sum(s.rows for s in built)
    covered = sum(s.rows for s in shards)
    return IndexSummary(folder, len(built), built_rows, len(shards), covered, size, seconds, notes or [])


class IndexStage:
    """Indexing as a stage (``elmo_core.stage``): claim the index folder, plan the shards, build each, summarize.
    A shard builder that a runner started with a share of the cores (``cpu.worker_env``) gives faiss that share."""

    name, counts = "index", "rows"

    def identity(self, config: IndexConfig) -> dict[str, Any]:
        return config.identity()

    def plan(self, config: IndexConfig) -> BuildPlan:
        """What the build does, reading the table and the index only (``make_room`` acts on it, in the claim);
        refused in one line where the filesystem has no room for the shards it writes."""
        plan = self._planned(config)
        require_space(plan.folder, plan.bytes_to_write(), "the index", "free some space, or index a smaller table")
        return plan

    @staticmethod
    def _planned(config: IndexConfig) -> BuildPlan:
        tuning = {"nlist": config.nlist, "nprobe": config.nprobe}
        plan = plan_build(Path(config.table), config.layer, config.shard_rows, config.rebuild, **tuning)
        plan.wait, plan.config = config.wait, config
        return plan

    @contextlib.contextmanager
    def claim(self, plan: BuildPlan) -> Iterator[None]:
        """The index folder's lock, then the room made: stale shards dropped, the quantizer trained where new."""
        with _folder_lock(plan.folder, plan.wait):
            vars(plan).update(vars(self._planned(plan.config)))  # again under the lock: another build may have run
            for note in plan.notes:
                log.info("index: %s", note)
            make_room(plan)
            yield

    def run_unit(self, plan: BuildPlan, shard: ShardRecord, report: Callable[[int], None] | None = None) -> ShardRecord:
        import faiss

        share = cpu.thread_share()
        if share:
            faiss.omp_set_num_threads(share)
        return build_shard(plan.folder, plan.facts.table, shard, report)

    def finish(self, plan: BuildPlan, results: list[ShardRecord], seconds: float) -> IndexSummary:
        return summarize(plan.folder, results, seconds, plan.notes)


def build_index(table: str | Path, layer: str | None = None, **options: Any) -> IndexSummary:
    """Index ``layer``'s column of the table, or add shards for the parts the index does not cover yet (``options``
    as ``IndexConfig``'s: ``workers`` > 1 builds shards in that many processes, each with its share of the cores).
    A killed build leaves no half shard in use, and a rerun builds only what is missing."""
    config = IndexConfig(table=str(table), layer=layer, **options)
    return run_local(IndexStage(), config, workers=config.workers)
