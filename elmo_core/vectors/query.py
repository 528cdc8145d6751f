"""Query embedding tables: nearest tokens-in-context and similar sentences, by cosine similarity.

One path answers every query: the rows an index finds (``elmo index``, ``vectors/ann/``: the token looked up by
binary search, the index's candidates re-ranked by exact cosine) merged with an exact DuckDB scan of the parts no
index shard covers. Without an index (or with ``exact=True``) the index is one of zero shards, so the scan covers
every part. Which it was is said in one line (the ``elmo_core.vectors.query`` logger; ``last_path``).

All SQL is parameterized; the parts a query scans are registered as the view ``unindexed``, the whole table as
``embeddings`` (for a user's own SQL on ``store.con``). Vectors are compared
with ``list_cosine_similarity`` (Parquet fixed-size lists come back from DuckDB as lists); rows are read by column
name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np

from elmo_core.errors import ConfigError, InputError
from elmo_core.vectors import ann

log = logging.getLogger(__name__)

# {col} is a vector column checked against the table (``ann.pick_column``): names cannot be SQL parameters
FIND_TOKEN = """
SELECT sentence_id, token_index, text, {col} AS vector FROM unindexed
WHERE token = $token AND ($sentence_id IS NULL OR sentence_id = $sentence_id) AND ($text IS NULL OR text = $text)
ORDER BY sentence_id, token_index LIMIT 1
"""
NEAREST_TOKENS = """
SELECT token AS key, sentence_id, token_index, text, list_cosine_similarity({col}, $v::FLOAT[]) AS similarity
FROM unindexed
WHERE ($like IS NULL OR lower(token) LIKE $like) AND NOT (sentence_id = $sentence_id AND token_index = $token_index)
ORDER BY similarity DESC, sentence_id, token_index LIMIT $k
"""
FIND_SENTENCE = "SELECT {col} AS vector FROM unindexed WHERE sentence_id = $sentence_id LIMIT 1"
SIMILAR_SENTENCES = """
SELECT sentence_id AS key, sentence_id, NULL AS token_index, text,
       list_cosine_similarity({col}, $v::FLOAT[]) AS similarity
FROM unindexed WHERE sentence_id <> $sentence_id ORDER BY similarity DESC, sentence_id LIMIT $k
"""


@dataclass
class Neighbour:
    token: str | None
    text: str | None
    sentence_id: str
    token_index: int | None
    similarity: float


@dataclass
class Found:
    """A use of a token (or a sentence) that a query starts from: where it is, and its vector."""

    sentence_id: str
    token_index: int
    text: str
    vector: np.ndarray


class EmbeddingStore:
    """An embedding dataset (``elmo embed`` output, or any Parquet folder with its columns) to query.

    ``exact``: scan the table even where an index is (today's answer, for comparison); ``nprobe``: inverted lists an
    indexed query visits per shard (more: better recall, slower).
    """

    def __init__(
        self,
        path: str | Path,
        con: duckdb.DuckDBPyConnection | None = None,
        *,
        exact: bool = False,
        nprobe: int | None = None,
    ) -> None:
        self.path = ann.in_use(path)  # a versioned table (``elmo refresh``): the version it uses now
        self.parts = ann.table_parts(self.path) if self.path.is_dir() else {}
        if not self.parts:
            raise InputError(f"{path}: no part-*.parquet embedding files; run `elmo embed` first")
        self.con = con or duckdb.connect()
        files = [str(self.path / name) for name in sorted(self.parts)]
        self.con.read_parquet(files).create_view("embeddings", replace=True)  # the whole table, for a user's own SQL
        self._db = self.con.cursor()  # the store's own queries: a user's unfinished result on ``con`` is no matter
        self.columns = ann.first_schema(self.path).names
        self.pooled = "token" not in self.columns
        self.exact, self.nprobe = exact, nprobe
        self.last_path: str | None = None
        self._indexes: dict[str, tuple[ann.AnnIndex, str]] = {}
        self._scanned: list[str] | None = None  # the parts the view ``unindexed`` reads now

    def vector_column(self, layer: str | None) -> str:
        """``elmo`` or ``layer_N``; checked against the table (column names cannot be SQL parameters)."""
        return ann.pick_column(self.columns, layer, self.path)

    def index(self, column: str) -> ann.AnnIndex:
        """The column's index (opened once; one of zero shards where none is usable, or under ``exact``), with the
        view ``unindexed`` over the parts it leaves to a scan; says which path a query takes."""
        if column not in self._indexes:
            if self.exact:
                folder = ann.index_dir(self.path, column)
                line = f"exact scan of {len(self.parts)} parts (exact=True / --exact)"
                self._indexes[column] = (ann.AnnIndex.none(folder, self.parts), line)
            else:
                model_id = ann.table_model_id(self.path, self.path / min(self.parts))
                self._indexes[column] = ann.AnnIndex.open(self.path, column, self.parts, model_id, self.nprobe)
        index, line = self._indexes[column]
        self._say(f"query: {line}")
        if index.shards:
            log.debug("query: %s", index.describe())
        if index.coverage.unindexed and self._scanned != index.coverage.unindexed:
            files = [str(self.path / name) for name in index.coverage.unindexed]
            self._db.read_parquet(files).create_view("unindexed", replace=True)
            self._scanned = index.coverage.unindexed
        return index

    def _say(self, line: str) -> None:
        if line != self.last_path:  # once per store, not once per call
            log.info("%s", line)
        self.last_path = line

    def _rows(self, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        cursor = self._db.execute(sql, params)
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row)) for row in cursor.fetchall()]

    def locate(self, token: str, text: str | None = None, sentence_id: str | None = None) -> tuple[str, int, str]:
        """The first use of ``token`` (by sentence_id, token_index), in the given sentence if one is given."""
        column = self._token_column()
        found = self._find(self.index(column), column, token, text, sentence_id)
        return found.sentence_id, found.token_index, found.text

    def _token_column(self, layer: str | None = None) -> str:
        """The vector column of a token table (a pooled one has no tokens to start from)."""
        if self.pooled:
            raise ConfigError(f"{self.path}: this table is pooled per sentence; use similar_sentences (--similar-to)")
        return self.vector_column(layer)

    def _find(self, index: ann.AnnIndex, column: str, token: str, text: str | None, sentence_id: str | None) -> Found:
        """The first use of ``token``: from the index's shards and the scanned parts, whichever comes first."""
        found = []
        hit = index.locate(token, sentence_id, text)
        if hit is not None:
            row = index.row(*hit)
            found.append(Found(row.sentence_id, int(row.token_index or 0), row.text or "", index.vector(*hit)))
        if index.coverage.unindexed:
            params = {"token": token, "text": text, "sentence_id": sentence_id}
            for row in self._rows(FIND_TOKEN.format(col=column), params):
                vector = np.asarray(row["vector"], dtype=np.float32)
                found.append(Found(row["sentence_id"], int(row["token_index"]), row["text"], vector))
        if not found:
            where = f" in sentence {text!r}" if text else (f" in {sentence_id}" if sentence_id else "")
            raise ConfigError(f"token {token!r} not found{where}")
        return min(found, key=lambda f: (f.sentence_id, f.token_index))

    def _scanned_rows(self, sql: str, params: dict[str, Any]) -> list[ann.Row]:
        return [
            ann.Row(r["key"], r["sentence_id"], r["token_index"], r["text"], float(r["similarity"]))
            for r in self._rows(sql, params)
        ]

    def nearest_tokens(
        self,
        token: str,
        *,
        text: str | None = None,
        sentence_id: str | None = None,
        k: int = 10,
        layer: str | None = None,
        like: str | None = None,
    ) -> list[Neighbour]:
        """Tokens-in-context nearest to ``token`` as used in the given sentence (``like``: a LIKE filter on tokens,
        answered exactly over the matching tokens' rows)."""
        column = self._token_column(layer)
        index = self.index(column)
        query = self._find(index, column, token, text, sentence_id)

        def itself(row: ann.Row) -> bool:
            return row.sentence_id == query.sentence_id and row.token_index == query.token_index

        if like is None:
            found = index.search(query.vector, k, itself)
        else:
            found = index.exact_over_keys(index.keys_like(like), query.vector, k, itself)
        if index.coverage.unindexed:
            params = {"v": query.vector.tolist(), "like": like, "k": k}
            params |= {"sentence_id": query.sentence_id, "token_index": query.token_index}
            found += self._scanned_rows(NEAREST_TOKENS.format(col=column), params)
        return [Neighbour(r.key, r.text, r.sentence_id, r.token_index, r.similarity) for r in _merged(found, k)]

    def similar_sentences(self, sentence_id: str, k: int = 10, layer: str | None = None) -> list[Neighbour]:
        if not self.pooled:
            raise ConfigError(f"{self.path}: sentence similarity needs a table embedded with --pool mean")
        column = self.vector_column(layer)
        index = self.index(column)
        vector = None
        hit = index.locate(sentence_id)
        if hit is not None:
            vector = index.vector(*hit)
        elif index.coverage.unindexed:
            rows = self._rows(FIND_SENTENCE.format(col=column), {"sentence_id": sentence_id})
            vector = np.asarray(rows[0]["vector"], dtype=np.float32) if rows else None
        if vector is None:
            return []  # no such sentence, no neighbours
        found = index.search(vector, k, lambda row: row.sentence_id == sentence_id)
        if index.coverage.unindexed:
            params = {"v": vector.tolist(), "sentence_id": sentence_id, "k": k}
            found += self._scanned_rows(SIMILAR_SENTENCES.format(col=column), params)
        return [Neighbour(None, r.text, r.sentence_id, None, r.similarity) for r in _merged(found, k)]


def _merged(found: list[ann.Row], k: int) -> list[ann.Row]:
    """The index's rows and the scan's, in today's order (similarity descending, then sentence_id, token_index)."""
    return sorted(found, key=ann.order_key)[:k]
