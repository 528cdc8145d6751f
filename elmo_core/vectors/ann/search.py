"""Searching the index: shards opened memory-mapped, candidates by their codes merged over shards, re-ranked by
exact cosine; lookups by key through the sorted key map."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from elmo_core.vectors.ann.files import Coverage, Header, ShardRecord, index_dir, read_header, read_shards
from elmo_core.vectors.ann.table import normalized

log = logging.getLogger(__name__)


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


class AnnIndex:
    """The shards of one column's index that still match the table, opened for queries."""

    def __init__(self, folder: Path, header: Header | None, coverage: Coverage, nprobe: int | None = None) -> None:
        self.folder, self.header, self.coverage = folder, header, coverage
        self.nprobe = nprobe or (header.nprobe if header else 1)
        self.shards = [Shard(folder, s, header, coverage.gone) for s in coverage.shards]
        self._keys_db: Any = None  # a DuckDB connection over the distinct keys, made by the first --like

    @classmethod
    def none(cls, folder: Path, parts: dict[str, int]) -> AnnIndex:
        """No index: zero shards, every part of the table left to an exact scan (what ``exact`` asks for too)."""
        return cls(folder, None, Coverage([], [], set(), sorted(parts)))

    @classmethod
    def open(
        cls, table: Path, column: str, parts: dict[str, int], model_id: str | None, nprobe: int | None = None
    ) -> tuple[AnnIndex, str]:
        """The index if one is there and is of this table's model and column, else ``none``; and why, in one line."""
        folder = index_dir(table, column)
        header = read_header(folder)
        why = ""
        if header is None:
            why = f"no index of {column} (`elmo index {table}` makes one)"
        elif header.model_id != model_id:
            why = (
                f"{folder}: an index of another model ({header.model_id}; the table's is {model_id}): "
                "rerun `elmo index`"
            )
        else:
            coverage = Coverage.of(read_shards(folder), parts)
            if coverage.shards:
                return cls(folder, header, coverage, nprobe), coverage.line(folder)
            why = f"{folder}: no finished shard covers this table's parts; rerun `elmo index`"
        return cls.none(folder, parts), f"exact scan of {len(parts)} parts; {why}"

    def describe(self) -> str:
        h = self.header
        if h is None:
            return "index parameters: none (an exact scan)"
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

        if not self.shards:
            return []
        want = candidates or max(4 * k, 50)
        q = normalized(np.asarray(query)[None, :])
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
        if not self.shards:
            return []
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
