"""What an index is on disk: its header, its shards and their files, and how it stands against the table now."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

INDEX_DIR, HEADER = "_index", "index.json"
FORMAT = 1


@dataclass(frozen=True)
class PartFile:
    """A part of the table as the index knows it: name and size say whether it is still the same file."""

    name: str
    bytes: int
    rows: int = 0


def index_dir(table: Path, column: str) -> Path:
    return Path(table) / INDEX_DIR / column


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
    model_version: str | None = None  # the exact model of the table it indexes (models:/elmo/3), and its input's
    input_digest: str | None = None  # digest (``fileio.files_digest``): what the table's job record says

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


# ----- what an embedding table will take on disk (its plan compares it with the free space) -------------------

# Measured on real output: ``elmo embed`` of 9,059 tokens (497 sentences) of the pydoc prose with the AllenNLP test
# model (width 32, 3 layers), every layers × dtype × pool × compression, read back per column from the Parquet footers.
# Written plain (the default), a vector takes its raw bytes and one bit a value more: the list's repetition levels,
# bit-packed (4 bytes a row of width 32, float32 1.031 and float16 1.063 of raw; 128 bytes, 3%, at width 1,024). With
# ``compression: zstd`` the contextual vectors (the mix, layers 1-2) take 0.89-0.93 of their raw bytes, levels included,
# as 20,000 random float32 rows of width 1024 do (0.932). lz4 and snappy take 0.99 and 1.00 of raw (float32, levels
# included), under the plain count, and are counted as plain. The other columns take 6.6 bytes a token row and 59.4 a
# sentence row (its text, zstd); each part file's footer 3.9-5.2 kB. Layer 0 (one vector per word type) compresses far
# better under zstd (0.17-0.48 of raw there), but how much depends on the text, so it is counted as a contextual layer:
# the estimate errs high for ``layers: all`` with zstd.
ZSTD_FACTOR = 0.93  # of a vector's raw bytes, written with zstd
LEVEL_BYTES = 1 / 8  # a value's repetition level, written plain
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2}  # a stored value's bytes, by the dtype's name
ROW_BYTES = {"none": 8, "mean": 64}  # the other columns of a token row, of a sentence row (pool: mean)
PART_FOOTER_BYTES = 6_000


def table_bytes(
    rows: int, n_layers: int, width: int, dtype: str, layers: str, pool: str, compression: str, parts: int = 1
) -> int:
    """About the bytes of an embedding table of ``rows`` rows (tokens; sentences with ``pool: mean``) of vectors of
    ``width`` in ``dtype`` (float32, float16) written with ``compression``: one column with ``layers: mix``,
    ``n_layers`` with ``layers: all``, in ``parts`` part files. Pure arithmetic on the measured factors above."""
    itemsize = DTYPE_BYTES[dtype]
    value = itemsize * ZSTD_FACTOR if compression == "zstd" else itemsize + LEVEL_BYTES
    columns = n_layers if layers == "all" else 1
    per_row = columns * width * value + ROW_BYTES[pool]
    return int(rows * per_row + parts * PART_FOOTER_BYTES)


# ----- what an index will take on disk (its plan compares it with the free space) -----------------------------

# Measured on real builds (``elmo index`` of the tiny AllenNLP test model's tables, width 32: 9,059 and 40,291 token
# rows in float32 and float16, and sentences pooled): a shard's vectors.npy is its rows × width × the dtype's bytes
# (+ a 128-byte header); its .faiss the 8-bit codes (a byte a dimension) and an 8-byte id a row, with the coarse
# quantizer (nlist × width float32) and 8 bytes a list in every shard (1,635,016 bytes for 39,997 rows, nlist 256);
# order.npy 8 bytes a row; meta.arrow what a sample of the rows' key, ids and text take in Arrow (51.4 bytes a row
# written, 52.4 sampled); keys.arrow a key's text, 16 bytes of range and a 4-byte offset per distinct key, counted as
# if every row had its own (4.4 bytes a row written for 6,220 words in 39,997 rows, 25.6 counted); trained.faiss the
# quantizer once more (33,208 bytes).
CODE_BYTES = 1  # a dimension's code (QT_8bit)
ROW_ID_BYTES = 8  # a row's id in the inverted lists
ORDER_BYTES = 8  # a row's place in order.npy
KEY_RANGE_BYTES = 20  # a key's lo and hi (int64) and its offset
LIST_BYTES = 8  # a list's length, per shard
FILE_SLACK = 6 * 4_096 + 2_048  # per shard: its six files' last blocks, headers, its record


def index_bytes(
    rows: int, dim: int, dtype: str, nlist: int, shards: int, meta_row: float, key_length: float, train: bool
) -> int:
    """About the bytes of ``shards`` shards of ``rows`` rows in all, of vectors of ``dim`` in ``dtype``, with
    ``meta_row`` bytes of metadata a row (sampled) and keys of ``key_length`` bytes; ``train``: the quantizer's
    file too. Pure arithmetic on the measurements above."""
    itemsize = DTYPE_BYTES[dtype]
    per_row = dim * (itemsize + CODE_BYTES) + ROW_ID_BYTES + ORDER_BYTES + meta_row + key_length + KEY_RANGE_BYTES
    quantizer = nlist * dim * 4
    per_shard = quantizer + nlist * LIST_BYTES + FILE_SLACK
    trained = quantizer + 2 * dim * 4 + FILE_SLACK if train else 0
    return int(rows * per_row + shards * per_shard + trained)
