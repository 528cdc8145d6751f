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
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from elmo_core.errors import ConfigError, InputError
from elmo_core.fileio import FolderLock, atomic_path, write_text_atomic
from elmo_core.progress import Progress, track

log = logging.getLogger(__name__)

INDEX_DIR, HEADER = "_index", "index.json"
FORMAT = 1
DEFAULT_SHARD_ROWS = 2_000_000  # a shard's codes, metadata and sort fit in about 1.5 GiB at width 1024
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

    def files(self, folder: Path) -> list[Path]:
        suffixes = (".faiss", ".vectors.npy", ".meta.arrow", ".order.npy", ".keys.arrow", ".json")
        return [folder / f"{self.name}{suffix}" for suffix in suffixes]


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
    """The shards one ``elmo index`` run builds: parts no valid shard covers, in groups of about ``shard_rows``."""

    folder: Path
    facts: TableFacts
    kept: list[ShardRecord]
    todo: list[ShardRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def rows_todo(self) -> int:
        return sum(s.rows for s in self.todo)


def _remove_shard(folder: Path, shard: ShardRecord) -> None:
    for path in reversed(shard.files(folder)):  # the record first: the shard stops counting before its data goes
        path.unlink(missing_ok=True)


def plan_build(
    table: Path, layer: str | None = None, shard_rows: int = DEFAULT_SHARD_ROWS, rebuild: bool = False, **tuning: Any
) -> BuildPlan:
    """Check the table and its index, drop what is stale, train the quantizer if needed, and group new parts.

    Call it under ``build_lock``: it deletes stale shards and the temporary files of killed builds.
    """
    facts = TableFacts.read(table, layer, **tuning)
    folder = index_dir(facts.table, facts.header.column)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(".*.tmp"):  # a build killed midway; the lock says none is running now
        stale.unlink(missing_ok=True)
    notes: list[str] = []
    current = read_header(folder)
    if current is None:  # nothing, or a first build killed between its quantizer and its header: start afresh
        rebuild = True
    elif not rebuild:
        differs = current.differs(facts.header)
        if differs:
            notes.append(f"the table changed ({differs}): rebuilding the index")
            rebuild = True
        else:
            facts.header.nlist, facts.header.nprobe = current.nlist, current.nprobe
    if rebuild:
        for path in folder.glob("shard-*"):
            path.unlink()
        (folder / "trained.faiss").unlink(missing_ok=True)
        (folder / HEADER).unlink(missing_ok=True)
    kept = []
    for shard in read_shards(folder):
        gone = [p.name for p in shard.parts if facts.parts.get(p.name) != p.bytes]
        if gone:
            notes.append(f"{shard.name}: part {gone[0]} changed or is gone: rebuilding its {len(shard.parts)} parts")
            _remove_shard(folder, shard)
        else:
            kept.append(shard)
    plan = BuildPlan(folder, facts, kept, notes=notes)
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
    if not (folder / "trained.faiss").exists() and (plan.todo or kept):
        _train(plan)
    return plan


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
    with atomic_path(files[1]) as tmp_vectors, open(tmp_vectors, "wb") as out:
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
    _write_meta(files[2], files[3], files[4], meta, header.key)
    with atomic_path(files[0]) as tmp:
        faiss.write_index(index, str(tmp))
    write_text_atomic(files[5], json.dumps(shard.to_record()) + "\n")
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


def _build_in_child(folder: str, table: str, shard: dict[str, Any], threads: int) -> int:
    import faiss

    faiss.omp_set_num_threads(threads)
    return build_shard(Path(folder), Path(table), ShardRecord.from_record(shard)).rows


def _build_in_processes(plan: BuildPlan, workers: int, progress: Progress) -> list[ShardRecord]:
    """Shards built by ``workers`` spawned processes, each with its share of the cores as faiss threads."""
    import multiprocessing

    from elmo_core.cpu import threads_for

    built = []
    args = (str(plan.folder), str(plan.facts.table))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_build_in_child, *args, s.to_record(), threads_for(workers)): s for s in plan.todo}
        for future in as_completed(futures):
            progress.advance(future.result(), futures[future].name)
            built.append(futures[future])
    return built


def build_index(
    table: str | Path,
    layer: str | None = None,
    *,
    shard_rows: int = DEFAULT_SHARD_ROWS,
    workers: int = 1,
    rebuild: bool = False,
    wait: bool = False,
    nlist: int | None = None,
    nprobe: int | None = None,
) -> IndexSummary:
    """Index ``layer``'s column of the table, or add shards for the parts the index does not cover yet.

    ``workers`` > 1 builds shards in that many processes (each with its share of the cores); a killed build
    leaves no half shard in use, and a rerun builds only what is missing.
    """
    started = time.perf_counter()
    table = Path(table)
    column = pick_column(first_schema(table).names, layer, table)  # checked before the lock makes _index/<column>
    with build_lock(table, column, wait):
        plan = plan_build(table, column, shard_rows, rebuild, nlist=nlist, nprobe=nprobe)
        for note in plan.notes:
            log.info("index: %s", note)
        with track("index", plan.rows_todo, "rows") as progress:
            if workers <= 1 or len(plan.todo) <= 1:
                built = [build_shard(plan.folder, table, shard, progress.advance) for shard in plan.todo]
            else:
                built = _build_in_processes(plan, workers, progress)
        return summarize(plan.folder, built, time.perf_counter() - started, plan.notes)


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
        self.index = faiss.read_index(str(files[0]), faiss.IO_FLAG_MMAP)
        self.index.parallel_mode = 1  # one query at a time: its inverted lists split over the threads, not queries
        self.vectors = np.load(files[1], mmap_mode="r")
        self.meta = pa.ipc.open_file(pa.memory_map(str(files[2]))).read_all()
        self.order = np.load(files[3], mmap_mode="r")
        self.keys = pa.ipc.open_file(pa.memory_map(str(files[4]))).read_all()
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
    """How the index stands against the table now: what it answers for, what a query must scan exactly."""

    shards: list[ShardRecord]
    gone: set[str]  # parts an index shard covers that are no longer in the table (their rows are left out)
    unindexed: list[str]  # table parts no shard covers (scanned exactly)

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
        shards, gone = [], set()
        for shard in read_shards(folder):
            changed = [p.name for p in shard.parts if p.name in parts and parts[p.name] != p.bytes]
            if changed:
                continue  # rewritten in place: its rows are scanned exactly instead
            shards.append(shard)
            gone |= {p.name for p in shard.parts if p.name not in parts}
        if not shards:
            return None, f"{folder}: no finished shard covers this table's parts; rerun `elmo index`"
        covered = {p.name for s in shards for p in s.parts}
        coverage = Coverage(shards, gone, sorted(set(parts) - covered))
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
