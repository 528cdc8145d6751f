"""An approximate-nearest-neighbour index beside an embedding table, so a query does not scan every row.

The table (``elmo embed`` output, or any Parquet folder with the same columns) stays the source of truth; the
index of one vector column lives in ``TABLE/_index/<column>/`` (readers of the table skip ``_`` folders):

    index.json                 what it indexes: column, key column, model id, width, dtype, nlist, nprobe
    trained.faiss              the coarse quantizer and 8-bit scalar quantizer, trained once on a sample
    shard-NNNNN.faiss          IVF lists of 8-bit codes of the normalized vectors of a group of parts (faiss-cpu)
    shard-NNNNN.vectors.npy    the same rows' vectors as the table holds them: candidates are re-ranked by exact cosine
    shard-NNNNN.meta.arrow     key (token, or sentence_id in pooled tables), sentence_id, token_index and text of
                               each row, in the vectors' order (Arrow IPC, memory-mapped: a row is read by position)
    shard-NNNNN.order.npy      the positions sorted by (key, sentence_id, token_index)
    shard-NNNNN.keys.arrow     each distinct key once, sorted, with its range in ``order``: a lookup by token is a
                               binary search, not a scan, and ``--like`` matches these keys only
    shard-NNNNN.json           the parts the shard covers (name, bytes, rows); written last: a shard without it is
                               not part of the index (a build killed midway), and a rerun builds it again

A shard covers whole part files. When the table changes, a query uses the shards whose parts are all unchanged
minus parts that are gone, and scans the parts no shard covers exactly (``query.py``); ``elmo index`` again builds
shards for just those parts (and rebuilds shards that lost a part). Shards share the trained quantizer, so N shards
built on N machines answer as one index over the same parts would: the query merges their top-k.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from elmo_core import cpu
from elmo_core.errors import ConfigError, InputError
from elmo_core.fileio import FolderLock, atomic_path, write_text_atomic
from elmo_core.options import IndexConfig
from elmo_core.stage import run_local

log = logging.getLogger(__name__)

INDEX_DIR, HEADER = "_index", "index.json"
FORMAT = 1
READ_ROWS = 65_536  # rows per batch read from a part while building
TRAIN_PER_LIST = 40  # training vectors per inverted list (faiss warns below 39)
MAX_TRAIN = 200_000


@dataclass(frozen=True)
class PartFile:
    """A part of the table as the index knows it: name and size say whether it is still the same file."""

    name: str
    bytes: int
    rows: int = 0


def table_parts(table: Path) -> dict[str, int]:
    """``part-*.parquet`` file name → size in bytes (a stat, no footer read: a query calls this every time)."""
    return {
        e.name: e.stat().st_size
        for e in os.scandir(table)
        if e.name.startswith("part-") and e.name.endswith(".parquet")
    }


def pick_column(names: Sequence[str], layer: str | None, where: Path) -> str:
    """``elmo`` or ``layer_N`` (default: elmo, else the top layer) among a table's column names, checked against
    them: they are spliced into SQL, where column names cannot be parameters."""
    columns = [n for n in names if n == "elmo" or n.startswith("layer_")]
    if not columns:
        raise InputError(f"{where}: no vector column (elmo or layer_N) in this table")
    name = layer or ("elmo" if "elmo" in columns else columns[-1])
    if name not in columns:
        raise ConfigError(f"{where}: no vector column {name!r}; this table has {columns}")
    return name


def first_schema(table: Path) -> pa.Schema:
    """The table's schema (its first part's); one line if there is no table or no part."""
    if not Path(table).is_dir():
        raise InputError(f"{table}: no such table folder")
    parts = table_parts(Path(table))
    if not parts:
        raise InputError(f"{table}: no part-*.parquet files; nothing to index (run `elmo embed` first)")
    return pq.ParquetFile(Path(table) / min(parts)).schema_arrow


def index_dir(table: Path, column: str) -> Path:
    return Path(table) / INDEX_DIR / column


def table_model_id(table: Path, first_part: Path) -> str | None:
    """The model the table was embedded with: ``_job.json`` of ``elmo embed``, else the first row's model_id."""
    job = table / "_job.json"
    if job.exists():
        return json.loads(job.read_text()).get("model_id")
    pf = pq.ParquetFile(first_part)
    if "model_id" not in pf.schema_arrow.names or pf.metadata.num_rows == 0:
        return None
    for batch in pf.iter_batches(batch_size=1, columns=["model_id"]):
        return batch.column(0)[0].as_py()
    return None


def _vectors(column: pa.Array | pa.ChunkedArray, dim: int) -> np.ndarray:
    """A FixedSizeList column as an (n, dim) array (``flatten`` honours slices' offsets)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return column.flatten().to_numpy(zero_copy_only=False).reshape(-1, dim)


def _normalized(vectors: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms == 0, 1, norms)


# ----- what an index is ------------------------------------------------------------------------------------


@dataclass
class Header:
    """What ``index.json`` says: a new build replaces an index whose header differs from the table's."""

    column: str
    key: str  # "token", or "sentence_id" for tables pooled per sentence
    model_id: str | None
    dim: int
    dtype: str
    nlist: int
    nprobe: int
    library: str
    format: int = FORMAT

    def differs(self, other: Header) -> str:
        fields = ("column", "key", "model_id", "dim", "dtype", "format")
        return ", ".join(
            f"{f} {getattr(self, f)} → {getattr(other, f)}" for f in fields if getattr(self, f) != getattr(other, f)
        )


def read_header(folder: Path) -> Header | None:
    path = folder / HEADER
    return Header(**json.loads(path.read_text())) if path.exists() else None


@dataclass
class ShardRecord:
    number: int
    parts: list[PartFile]

    @property
    def name(self) -> str:
        return f"shard-{self.number:05d}"

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    def to_record(self) -> dict[str, Any]:
        return {"number": self.number, "parts": [asdict(p) for p in self.parts], "rows": self.rows}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> ShardRecord:
        return cls(record["number"], [PartFile(**p) for p in record["parts"]])

    @property
    def size(self) -> int:  # what a build's progress counts
        return self.rows

    def files(self, folder: Path) -> ShardFiles:
        return ShardFiles(*(folder / f"{self.name}{suffix}" for suffix in ShardFiles.SUFFIXES))


class ShardFiles(NamedTuple):
    """A shard's files, in the order a build writes them (the record last: the shard counts once it is there)."""

    vectors: Path  # the rows' vectors as the table holds them (.npy, memory-mapped for re-ranking)
    meta: Path  # key, sentence_id, token_index, text per row (Arrow IPC)
    order: Path  # positions sorted by (key, sentence_id, token_index)
    keys: Path  # distinct keys with their range in ``order``
    lists: Path  # the faiss IVF lists of 8-bit codes
    record: Path  # the parts it covers (JSON)

    SUFFIXES = (".vectors.npy", ".meta.arrow", ".order.npy", ".keys.arrow", ".faiss", ".json")


def read_shards(folder: Path) -> list[ShardRecord]:
    shards = []
    for path in sorted(folder.glob("shard-*.json")):
        shards.append(ShardRecord.from_record(json.loads(path.read_text())))
    return shards


@dataclass
class TableFacts:
    """What a build needs to know of the table before reading a vector."""

    table: Path
    parts: dict[str, int]  # name → bytes
    rows: dict[str, int]  # name → rows (each footer read once)
    header: Header

    @classmethod
    def read(cls, table: Path, layer: str | None, nlist: int | None = None, nprobe: int | None = None) -> TableFacts:
        import faiss

        table = Path(table)
        schema = first_schema(table)
        parts = table_parts(table)
        first = table / min(parts)
        column = pick_column(schema.names, layer, table)
        key = "token" if "token" in schema.names else "sentence_id"
        kind = schema.field(column).type
        dim = kind.list_size
        if dim <= 0:
            raise InputError(f"{table}: column {column} is not a fixed-size list of floats ({kind})")
        rows = {name: pq.ParquetFile(table / name).metadata.num_rows for name in parts}
        chosen = nlist or default_nlist(sum(rows.values()))
        header = Header(
            column=column,
            key=key,
            model_id=table_model_id(table, first),
            dim=dim,
            dtype=str(kind.value_type.to_pandas_dtype().__name__),
            nlist=chosen,
            nprobe=nprobe or max(16, chosen // 32),
            library=f"faiss-cpu {faiss.__version__}",
        )
        return cls(table, parts, rows, header)


def default_nlist(rows: int) -> int:
    """About sqrt(rows) inverted lists, a power of two, at least 16 and at most 16384."""
    return int(min(16384, max(16, 2 ** round(np.log2(max(rows, 1) ** 0.5)))))


# ----- building ----------------------------------------------------------------------------------------------


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

    @property
    def units(self) -> list[ShardRecord]:
        return self.todo

    @property
    def rows_todo(self) -> int:
        return sum(s.rows for s in self.todo)


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
    return plan


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
        chunk = _normalized(_vectors(pq.ParquetFile(table / name).read_row_group(g, columns=[column]).column(0), dim))
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
                vectors = _vectors(batch.column(header.column), header.dim)
                out.write(np.ascontiguousarray(vectors, dtype=dtype).tobytes())
                index.add_with_ids(_normalized(vectors), np.arange(pos, pos + len(vectors), dtype=np.int64))
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
    folder = index_dir(table, column)
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

    def claim(self, config: IndexConfig) -> FolderLock:
        table = Path(config.table)
        column = pick_column(first_schema(table).names, config.layer, table)  # checked before _index/<column> is made
        return build_lock(table, column, config.wait)

    def plan(self, config: IndexConfig) -> BuildPlan:
        tuning = {"nlist": config.nlist, "nprobe": config.nprobe}
        plan = plan_build(Path(config.table), config.layer, config.shard_rows, config.rebuild, **tuning)
        for note in plan.notes:
            log.info("index: %s", note)
        make_room(plan)
        return plan

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


# ----- searching ---------------------------------------------------------------------------------------------


@dataclass
class Row:
    """A row found through the index: the columns a query returns, with its exact cosine to the query."""

    key: str
    sentence_id: str
    token_index: int | None
    text: str | None
    similarity: float


class Shard:
    """One shard opened for queries: its faiss lists, vectors and metadata memory-mapped, not read."""

    def __init__(self, folder: Path, record: ShardRecord, header: Header, gone: set[str]) -> None:
        import faiss

        self.record, self.header = record, header
        files = record.files(folder)
        self.index = faiss.read_index(str(files.lists), faiss.IO_FLAG_MMAP)
        self.index.parallel_mode = 1  # one query at a time: its inverted lists split over the threads, not queries
        self.vectors = np.load(files.vectors, mmap_mode="r")
        self.meta = pa.ipc.open_file(pa.memory_map(str(files.meta))).read_all()
        self.order = np.load(files.order, mmap_mode="r")
        self.keys = pa.ipc.open_file(pa.memory_map(str(files.keys))).read_all()
        self._distinct = self.keys.column("key").combine_chunks()
        starts = np.cumsum([0] + [p.rows for p in record.parts])
        self.dead = [(starts[i], starts[i + 1]) for i, p in enumerate(record.parts) if p.name in gone]

    def alive(self, positions: np.ndarray) -> np.ndarray:
        keep = positions >= 0
        for start, stop in self.dead:
            keep &= (positions < start) | (positions >= stop)
        return keep

    def positions_of(self, key: str, sentence_id: str | None = None) -> np.ndarray:
        """The positions of the rows whose key is ``key`` (and in ``sentence_id``), by (sentence_id, token_index),
        parts gone left out: binary searches, however frequent the key."""
        lo, hi = self.key_range(key)
        if sentence_id is not None and hi > lo:
            ids = _Keys(self.meta.column("sentence_id"), self.order[lo:hi])
            lo, hi = lo + bisect.bisect_left(ids, sentence_id), lo + bisect.bisect_right(ids, sentence_id)
        positions = np.asarray(self.order[lo:hi])
        return positions[self.alive(positions)]

    def has_text(self, positions: np.ndarray, text: str) -> np.ndarray:
        """Which of the rows are of the sentence ``text``: its index in the text dictionary, compared as integers."""
        column = self.meta.column("text").chunk(0)
        code = pc.index(column.dictionary, text).as_py()
        if code < 0:
            return np.zeros(len(positions), dtype=bool)
        return column.indices.to_numpy()[positions] == code

    def key_range(self, key: str) -> tuple[int, int]:
        """The range of ``order`` whose key is ``key``: a binary search over the sorted distinct keys."""
        i = bisect.bisect_left(_Keys(self._distinct), key)
        if i == len(self._distinct) or self._distinct[i].as_py() != key:
            return 0, 0
        return self.keys.column("lo")[i].as_py(), self.keys.column("hi")[i].as_py()

    def rows(self, positions: np.ndarray, similarities: np.ndarray) -> list[Row]:
        taken = self.meta.take(pa.array(positions, pa.int64())).to_pydict()
        n = len(positions)
        key = taken[self.header.key]
        index = taken.get("token_index", [None] * n)
        text = taken.get("text", [None] * n)
        return [Row(key[i], taken["sentence_id"][i], index[i], text[i], float(similarities[i])) for i in range(n)]

    def cosine(self, positions: np.ndarray, query: np.ndarray) -> np.ndarray:
        """Exact cosine of the table's own vectors at ``positions`` (read from the memory map, sorted for locality)."""
        order = np.argsort(positions)
        vectors = np.asarray(self.vectors[positions[order]], dtype=np.float64)
        sims = np.empty(len(positions))
        sims[order] = cosine(vectors, query)
        return sims


def cosine(vectors: np.ndarray, query: np.ndarray) -> np.ndarray:
    q = np.asarray(query, dtype=np.float64)
    norms = np.linalg.norm(vectors, axis=1) * np.linalg.norm(q)
    return (vectors @ q) / np.where(norms == 0, np.nan, norms)


class _Keys:
    """A sorted Arrow string column (or its rows in a sorted order) as a sequence ``bisect`` can search: only the
    log n values the search looks at are decoded."""

    def __init__(self, array: pa.Array | pa.ChunkedArray, order: np.ndarray | None = None) -> None:
        self.array, self.order = array, order

    def __len__(self) -> int:
        return len(self.array) if self.order is None else len(self.order)

    def __getitem__(self, i: int) -> str:
        return self.array[i if self.order is None else int(self.order[i])].as_py()


@dataclass
class Coverage:
    """How an index stands against the table now, the one rule a build and a query both follow: a shard whose parts
    are all unchanged or gone is valid (the rows of gone parts are left out); a shard with a part rewritten in place
    is stale (its rows are scanned exactly, and a build replaces it); table parts no valid shard covers are
    unindexed (scanned exactly, and a build indexes them)."""

    shards: list[ShardRecord]  # valid
    stale: list[ShardRecord]
    gone: set[str]  # parts a valid shard covers that are no longer in the table
    unindexed: list[str]

    @classmethod
    def of(cls, shards: list[ShardRecord], parts: dict[str, int]) -> Coverage:
        valid, stale, gone = [], [], set()
        for shard in shards:
            if any(p.name in parts and parts[p.name] != p.bytes for p in shard.parts):
                stale.append(shard)
            else:
                valid.append(shard)
                gone |= {p.name for p in shard.parts if p.name not in parts}
        covered = {p.name for s in valid for p in s.parts}
        return cls(valid, stale, gone, sorted(set(parts) - covered))

    def line(self, folder: Path) -> str:
        parts = sum(len(s.parts) for s in self.shards) - len(self.gone)
        line = f"index {folder} ({len(self.shards)} shards, {parts} parts)"
        if self.unindexed:
            line += f" + exact scan of {len(self.unindexed)} parts it does not cover yet"
        if self.gone:
            line += f"; {len(self.gone)} indexed parts are gone from the table and left out"
        if self.unindexed or self.gone:
            line += " (`elmo index` brings it up to date)"
        return line


class AnnIndex:
    """The shards of one column's index that still match the table, opened for queries."""

    def __init__(self, folder: Path, header: Header, coverage: Coverage, nprobe: int | None = None) -> None:
        self.folder, self.header, self.coverage = folder, header, coverage
        self.nprobe = nprobe or header.nprobe
        self.shards = [Shard(folder, s, header, coverage.gone) for s in coverage.shards]
        self._keys_db: Any = None  # a DuckDB connection over the distinct keys, made by the first --like

    @classmethod
    def open(
        cls, table: Path, column: str, parts: dict[str, int], model_id: str | None, nprobe: int | None = None
    ) -> tuple[AnnIndex | None, str]:
        """The index if one is there and is of this table's model and column, else None; and why, in one line."""
        folder = index_dir(table, column)
        header = read_header(folder)
        if header is None:
            return None, f"no index of {column} (`elmo index {table}` makes one)"
        if header.model_id != model_id:
            return (
                None,
                f"{folder}: an index of another model ({header.model_id}; the table's is {model_id}): "
                "rerun `elmo index`",
            )
        coverage = Coverage.of(read_shards(folder), parts)
        if not coverage.shards:
            return None, f"{folder}: no finished shard covers this table's parts; rerun `elmo index`"
        return cls(folder, header, coverage, nprobe), coverage.line(folder)

    def describe(self) -> str:
        h = self.header
        rows = sum(s.record.rows for s in self.shards)
        return (
            f"index parameters: faiss IVF{h.nlist},SQ8, inner product of normalized {h.column} "
            f"({h.dim} wide, {h.dtype}), "
            f"nprobe {self.nprobe}, {len(self.shards)} shards, {rows:,} rows, candidates re-ranked by exact cosine "
            f"({h.library})"
        )

    def locate(self, key: str, sentence_id: str | None = None, text: str | None = None) -> tuple[Shard, int] | None:
        """The first row (by sentence_id, token_index) with this key, optionally in this sentence: (shard, pos)."""
        best: tuple[tuple[str, int], Shard, int] | None = None
        for shard in self.shards:
            positions = shard.positions_of(key, sentence_id)
            if text is not None and len(positions):
                positions = positions[shard.has_text(positions, text)]
            if not len(positions):
                continue
            first = int(positions[0])  # in (sentence_id, token_index) order already
            row = shard.rows(np.array([first]), np.array([1.0]))[0]
            order = (row.sentence_id, row.token_index or 0)
            if best is None or order < best[0]:
                best = (order, shard, first)
        return None if best is None else (best[1], best[2])

    def search(
        self, query: np.ndarray, k: int, skip: Callable[[Row], bool], candidates: int | None = None
    ) -> list[Row]:
        """The ``k`` rows nearest ``query``: the ``candidates`` best by their 8-bit codes over all shards (each
        shard's own best, merged: what one index over the same parts would propose), re-ranked by exact cosine.

        ``candidates`` (default ``max(4k, 50)``) grows while rows the query leaves out (parts gone from the table)
        leave fewer than ``k``; only the candidates' vectors are read.
        """
        import faiss

        want = candidates or max(4 * k, 50)
        q = _normalized(np.asarray(query)[None, :])
        params = faiss.SearchParametersIVF(nprobe=self.nprobe)
        while True:
            scores, shard_of, positions, short = [], [], [], False
            for i, shard in enumerate(self.shards):
                n = min(want, shard.index.ntotal)
                score, ids = shard.index.search(q, n, params=params)
                keep = shard.alive(ids[0])
                short |= n < shard.index.ntotal and int(keep.sum()) < n
                scores.append(score[0][keep])
                positions.append(ids[0][keep])
                shard_of.append(np.full(int(keep.sum()), i))
            score, shard_ix, pos = (np.concatenate(x) for x in (scores, shard_of, positions))
            best = np.argsort(-score, kind="stable")[:want]
            found: list[Row] = []
            for i in np.unique(shard_ix[best]):
                mine = pos[best][shard_ix[best] == i]
                sims = self.shards[i].cosine(mine, query)
                top = _top(sims, k + 1)  # the query's own row may be among them
                found.extend(r for r in self.shards[i].rows(mine[top], sims[top]) if not skip(r))
            if len(found) >= k or not short:
                return sorted(found, key=order_key)[:k]
            want *= 4

    def exact_over_keys(self, keys: list[str], query: np.ndarray, k: int, skip: Callable[[Row], bool]) -> list[Row]:
        """Exact top-k over the rows of the given keys (a ``--like`` filter): only those rows' vectors are read."""
        found: list[Row] = []
        for shard in self.shards:
            positions = np.concatenate([shard.positions_of(key) for key in keys] or [np.empty(0, np.int64)])
            if not len(positions):
                continue
            sims = shard.cosine(positions, query)
            top = _top(sims, k + 1)  # the query's own row may be among them
            found.extend(r for r in shard.rows(positions[top], sims[top]) if not skip(r))
        return sorted(found, key=order_key)[:k]

    def keys_like(self, pattern: str) -> list[str]:
        """Distinct keys whose lower case matches a SQL LIKE pattern (DuckDB over the shards' distinct keys, which
        it is given once)."""
        if self._keys_db is None:
            import duckdb

            self._keys_db = duckdb.connect()
            self._keys_db.register("shard_keys", pa.concat_tables([s.keys.select(["key"]) for s in self.shards]))
        rows = self._keys_db.execute(
            "SELECT DISTINCT key FROM shard_keys WHERE lower(key) LIKE $p ORDER BY key", {"p": pattern}
        )
        return [r[0] for r in rows.fetchall()]

    def vector(self, shard: Shard, pos: int) -> np.ndarray:
        return np.asarray(shard.vectors[pos])

    def row(self, shard: Shard, pos: int) -> Row:
        return shard.rows(np.array([pos]), np.array([1.0]))[0]


def _top(similarities: np.ndarray, n: int) -> np.ndarray:
    """Indices of the ``n`` largest similarities (NaN, a zero vector's, last); ties are settled by ``order_key``."""
    values = np.nan_to_num(similarities, nan=-2.0)
    if len(values) <= n:
        return np.arange(len(values))
    cut = np.partition(values, len(values) - n)[len(values) - n]
    return np.flatnonzero(values >= cut)  # all rows tied at the cut, so the final order decides among them


def order_key(row: Row) -> tuple[float, str, int]:
    """Today's order: similarity descending, then sentence_id, token_index (NaN last)."""
    sim = row.similarity if row.similarity == row.similarity else -np.inf
    return (-sim, row.sentence_id, row.token_index or 0)
