"""Query embedding tables: nearest tokens-in-context and similar sentences, by cosine similarity.

Two paths give the same rows and columns. With a fresh index beside the table (``elmo index``, ``vectors/ann/``) a
query looks the token up by binary search, takes the index's candidates and re-ranks them by exact cosine, and
scans exactly only the parts the index does not cover yet; without one (or with ``exact=True``) DuckDB scans the
table. Which path ran is said in one line (the ``elmo_core.vectors.query`` logger; ``last_path``).

All SQL is parameterized; the dataset is registered as the view ``embeddings`` (and the parts no index covers as
``unindexed``). Vectors are compared with ``list_cosine_similarity`` (Parquet fixed-size lists come back from
DuckDB as lists).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np

from elmo_core.errors import ConfigError, InputError
from elmo_core.vectors import ann

log = logging.getLogger(__name__)

FIND_TOKEN = """
SELECT sentence_id, token_index, text FROM embeddings
WHERE token = $token AND ($sentence_id IS NULL OR sentence_id = $sentence_id) AND ($text IS NULL OR text = $text)
ORDER BY sentence_id, token_index LIMIT 1
"""
NEAREST_TOKENS = """
WITH query AS (SELECT {col} AS v FROM embeddings WHERE sentence_id = $sentence_id AND token_index = $token_index)
SELECT e.token, e.text, e.sentence_id, e.token_index, list_cosine_similarity(e.{col}, query.v) AS similarity
FROM embeddings e, query
WHERE ($like IS NULL OR lower(e.token) LIKE $like)
  AND NOT (e.sentence_id = $sentence_id AND e.token_index = $token_index)
ORDER BY similarity DESC, e.sentence_id, e.token_index
LIMIT $k
"""
# the same, for the parts an index does not cover, against a query vector found elsewhere
FIND_TOKEN_VECTOR = """
SELECT sentence_id, token_index, text, {col} FROM unindexed
WHERE token = $token AND ($sentence_id IS NULL OR sentence_id = $sentence_id) AND ($text IS NULL OR text = $text)
ORDER BY sentence_id, token_index LIMIT 1
"""
NEAREST_UNINDEXED = """
SELECT token, text, sentence_id, token_index, list_cosine_similarity({col}, $v::FLOAT[]) AS similarity
FROM unindexed
WHERE ($like IS NULL OR lower(token) LIKE $like) AND NOT (sentence_id = $sentence_id AND token_index = $token_index)
ORDER BY similarity DESC, sentence_id, token_index LIMIT $k
"""
FIND_SENTENCE_VECTOR = "SELECT {col} FROM unindexed WHERE sentence_id = $sentence_id LIMIT 1"
SIMILAR_UNINDEXED = """
SELECT NULL, text, sentence_id, NULL, list_cosine_similarity({col}, $v::FLOAT[]) AS similarity FROM unindexed
WHERE sentence_id <> $sentence_id ORDER BY similarity DESC, sentence_id LIMIT $k
"""
SIMILAR_SENTENCES = """
WITH query AS (SELECT {col} AS v FROM embeddings WHERE sentence_id = $sentence_id)
SELECT e.text, e.sentence_id, list_cosine_similarity(e.{col}, query.v) AS similarity
FROM embeddings e, query WHERE e.sentence_id <> $sentence_id
ORDER BY similarity DESC, e.sentence_id LIMIT $k
"""


@dataclass
class Neighbour:
    token: str | None
    text: str | None
    sentence_id: str
    token_index: int | None
    similarity: float


def _neighbour(row: ann.Row, pooled: bool) -> Neighbour:
    if pooled:
        return Neighbour(None, row.text, row.sentence_id, None, row.similarity)
    return Neighbour(row.key, row.text, row.sentence_id, row.token_index, row.similarity)


def _merged(found: list[ann.Row], k: int) -> list[ann.Row]:
    return sorted(found, key=ann.order_key)[:k]


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
        self.path = Path(path)
        self.parts = ann.table_parts(self.path) if self.path.is_dir() else {}
        if not self.parts:
            raise InputError(f"{path}: no part-*.parquet embedding files; run `elmo embed` first")
        self.files = [str(self.path / name) for name in sorted(self.parts)]
        self.con = con or duckdb.connect()
        self.con.read_parquet(self.files).create_view("embeddings", replace=True)  # names are never spliced into SQL
        columns = [row[0] for row in self.con.execute("DESCRIBE embeddings").fetchall()]
        self.columns = columns
        self.pooled = "token" not in columns
        self.exact, self.nprobe = exact, nprobe
        self.last_path: str | None = None
        self._indexes: dict[str, tuple[ann.AnnIndex | None, str]] = {}

    def vector_column(self, layer: str | None) -> str:
        """``elmo`` or ``layer_N``; checked against the table (column names cannot be SQL parameters)."""
        return ann.pick_column(self.columns, layer, self.path)

    def index(self, column: str) -> ann.AnnIndex | None:
        """The column's index if a usable one is beside the table (opened once), and says which path a query takes."""
        if self.exact:
            self._say(f"query: exact scan of {len(self.files)} parts (exact=True / --exact)")
            return None
        if column not in self._indexes:
            model_id = ann.table_model_id(self.path, Path(self.files[0]))
            index, line = ann.AnnIndex.open(self.path, column, self.parts, model_id, self.nprobe)
            if index is not None and index.coverage.unindexed:
                files = [str(self.path / name) for name in index.coverage.unindexed]
                self.con.read_parquet(files).create_view("unindexed", replace=True)
            self._indexes[column] = (index, line)
        index, line = self._indexes[column]
        if index is None:
            self._say(f"query: exact scan of {len(self.files)} parts; {line}")
        else:
            self._say(f"query: {line}")
            log.debug("query: %s", index.describe())
        return index

    def _say(self, line: str) -> None:
        if line != self.last_path:  # once per store, not once per call
            log.info("%s", line)
        self.last_path = line

    def locate(self, token: str, text: str | None = None, sentence_id: str | None = None) -> tuple[str, int, str]:
        """The first use of ``token`` (by sentence_id, token_index), in the given sentence if one is given."""
        index = None if self.pooled else self.index(self.vector_column(None))
        found = self._locate(index, token, text, sentence_id, None)
        return found[0], found[1], found[2]

    def _locate(
        self, index: ann.AnnIndex | None, token: str, text: str | None, sentence_id: str | None, column: str | None
    ) -> tuple[str, int, str, np.ndarray | None]:
        """(sentence_id, token_index, text, the vector of ``column`` or None): through the index, else DuckDB."""
        params = {"token": token, "text": text, "sentence_id": sentence_id}
        if index is None:
            row = self.con.execute(FIND_TOKEN, params).fetchone()
            if row is None:
                raise ConfigError(self._not_found(token, text, sentence_id))
            return row[0], int(row[1]), row[2], None
        found = []
        hit = index.locate(token, sentence_id, text)
        if hit is not None:
            shard, pos = hit
            row = index.row(shard, pos)
            found.append((row.sentence_id, int(row.token_index or 0), row.text, index.vector(shard, pos)))
        if index.coverage.unindexed:
            column = column or index.header.column
            fresh = self.con.execute(FIND_TOKEN_VECTOR.format(col=column), params).fetchone()
            if fresh is not None:
                found.append((fresh[0], int(fresh[1]), fresh[2], np.asarray(fresh[3], dtype=np.float32)))
        if not found:
            raise ConfigError(self._not_found(token, text, sentence_id))
        return min(found, key=lambda f: (f[0], f[1]))

    @staticmethod
    def _not_found(token: str, text: str | None, sentence_id: str | None) -> str:
        where = f" in sentence {text!r}" if text else (f" in {sentence_id}" if sentence_id else "")
        return f"token {token!r} not found{where}"

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
        if self.pooled:
            raise ConfigError(f"{self.path}: this table is pooled per sentence; use similar_sentences (--similar-to)")
        col = self.vector_column(layer)
        index = self.index(col)
        if index is None:
            sid, position, _, _ = self._locate(None, token, text, sentence_id, col)
            rows = self.con.execute(
                NEAREST_TOKENS.format(col=col), {"sentence_id": sid, "token_index": position, "like": like, "k": k}
            ).fetchall()
            return [Neighbour(r[0], r[1], r[2], int(r[3]), float(r[4])) for r in rows]
        sid, position, _, vector = self._locate(index, token, text, sentence_id, col)

        def itself(row: ann.Row) -> bool:
            return row.sentence_id == sid and row.token_index == position

        if like is None:
            found = index.search(vector, k, itself)
        else:
            found = index.exact_over_keys(index.keys_like(like), vector, k, itself)
        if index.coverage.unindexed:
            params = {"v": vector.tolist(), "like": like, "sentence_id": sid, "token_index": position, "k": k}
            rows = self.con.execute(NEAREST_UNINDEXED.format(col=col), params).fetchall()
            found += [ann.Row(r[0], r[2], int(r[3]), r[1], float(r[4])) for r in rows]
        return [_neighbour(r, pooled=False) for r in _merged(found, k)]

    def similar_sentences(self, sentence_id: str, k: int = 10, layer: str | None = None) -> list[Neighbour]:
        if not self.pooled:
            raise ConfigError(f"{self.path}: sentence similarity needs a table embedded with --pool mean")
        col = self.vector_column(layer)
        index = self.index(col)
        if index is None:
            rows = self.con.execute(SIMILAR_SENTENCES.format(col=col), {"sentence_id": sentence_id, "k": k}).fetchall()
            return [Neighbour(None, r[0], r[1], None, float(r[2])) for r in rows]
        vector = None
        hit = index.locate(sentence_id)
        if hit is not None:
            vector = index.vector(*hit)
        elif index.coverage.unindexed:
            row = self.con.execute(FIND_SENTENCE_VECTOR.format(col=col), {"sentence_id": sentence_id}).fetchone()
            vector = None if row is None else np.asarray(row[0], dtype=np.float32)
        if vector is None:
            return []  # as the scan: no such sentence, no neighbours
        found = index.search(vector, k, lambda row: row.sentence_id == sentence_id)
        if index.coverage.unindexed:
            params = {"v": vector.tolist(), "sentence_id": sentence_id, "k": k}
            rows = self.con.execute(SIMILAR_UNINDEXED.format(col=col), params).fetchall()
            found += [ann.Row(r[2], r[2], None, r[1], float(r[4])) for r in rows]
        return [_neighbour(r, pooled=True) for r in _merged(found, k)]
