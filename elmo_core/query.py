"""Query embedding tables with DuckDB: nearest tokens-in-context and similar sentences, by cosine similarity.

All SQL is parameterized; the dataset is registered as the view ``embeddings``. Vectors are compared with
``list_cosine_similarity`` (Parquet fixed-size lists come back from DuckDB as lists).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import duckdb

from elmo_core.errors import ConfigError, InputError

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


class EmbeddingStore:
    """An embedding dataset (``elmo embed`` output) as a DuckDB view."""

    def __init__(self, path: str | Path, con: duckdb.DuckDBPyConnection | None = None) -> None:
        files = sorted(str(p) for p in Path(path).glob("part-*.parquet"))
        if not files:
            raise InputError(f"{path}: no part-*.parquet embedding files; run `elmo embed` first")
        self.con = con or duckdb.connect()
        self.con.read_parquet(files).create_view("embeddings", replace=True)  # file names are never spliced into SQL
        columns = [row[0] for row in self.con.execute("DESCRIBE embeddings").fetchall()]
        self.columns = columns
        self.pooled = "token" not in columns

    def vector_column(self, layer: str | None) -> str:
        """``elmo`` or ``layer_N``; checked against the table (column names cannot be SQL parameters)."""
        name = layer or ("elmo" if "elmo" in self.columns else [c for c in self.columns if c.startswith("layer_")][-1])
        if name not in self.columns or not (name == "elmo" or name.startswith("layer_")):
            raise ConfigError(
                f"no vector column {name!r}; this table has "
                f"{[c for c in self.columns if c == 'elmo' or c.startswith('layer_')]}"
            )
        return name

    def locate(self, token: str, text: str | None = None, sentence_id: str | None = None) -> tuple[str, int, str]:
        row = self.con.execute(FIND_TOKEN, {"token": token, "text": text, "sentence_id": sentence_id}).fetchone()
        if row is None:
            where = f" in sentence {text!r}" if text else (f" in {sentence_id}" if sentence_id else "")
            raise ConfigError(f"token {token!r} not found{where}")
        return row[0], int(row[1]), row[2]

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
        """Tokens-in-context nearest to ``token`` as used in the given sentence (``like``: a LIKE filter on tokens)."""
        if self.pooled:
            raise ConfigError("this table is pooled per sentence; use similar_sentences")
        sid, index, _ = self.locate(token, text, sentence_id)
        col = self.vector_column(layer)
        rows = self.con.execute(
            NEAREST_TOKENS.format(col=col), {"sentence_id": sid, "token_index": index, "like": like, "k": k}
        ).fetchall()
        return [Neighbour(r[0], r[1], r[2], int(r[3]), float(r[4])) for r in rows]

    def similar_sentences(self, sentence_id: str, k: int = 10, layer: str | None = None) -> list[Neighbour]:
        if not self.pooled:
            raise ConfigError("sentence similarity needs a table embedded with --pool mean")
        col = self.vector_column(layer)
        rows = self.con.execute(SIMILAR_SENTENCES.format(col=col), {"sentence_id": sentence_id, "k": k}).fetchall()
        return [Neighbour(None, r[0], r[1], None, float(r[2])) for r in rows]
