"""What a build reads of the table before any vector: its parts, the column to index, its model, its width."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from elmo_core.errors import ConfigError, InputError
from elmo_core.vectors.ann.files import Header

log = logging.getLogger(__name__)

JOB_FILE = "_job.json"  # an embedding table's record of its job: the exact model, its input and the input's digest


POINTER = "current.json"  # in a versioned table's folder: the version in use (``vectors.tables``)


def in_use(table: str | Path) -> Path:
    """The folder a reader reads: the version a versioned table uses now (``vectors.tables``), else ``table``."""
    pointer = Path(table) / POINTER
    return Path(json.loads(pointer.read_text())["folder"]) if pointer.exists() else Path(table)


def table_job(table: Path) -> dict:
    """The table's job record (``elmo embed`` writes it), or {} for Parquet written some other way."""
    path = Path(table) / JOB_FILE
    return json.loads(path.read_text()) if path.exists() else {}


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


def vectors_of(column: pa.Array | pa.ChunkedArray, dim: int) -> np.ndarray:
    """A FixedSizeList column as an (n, dim) array (``flatten`` honours slices' offsets)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return column.flatten().to_numpy(zero_copy_only=False).reshape(-1, dim)


def normalized(vectors: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms == 0, 1, norms)


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
            model_version=table_job(table).get("model_version"),
            input_digest=table_job(table).get("input_digest"),
        )
        return cls(table, parts, rows, header)


def default_nlist(rows: int) -> int:
    """About sqrt(rows) inverted lists, a power of two, at least 16 and at most 16384."""
    return int(min(16384, max(16, 2 ** round(np.log2(max(rows, 1) ** 0.5)))))
