"""The word vocabulary: bilm-tf ``vocab.txt`` files, the DuckDB vocab/char-id tables, and token ids per split."""

from __future__ import annotations

import hashlib
import shutil
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from elmo_core.errors import InputError
from elmo_core.fileio import atomic_path, write_text_atomic
from elmo_core.ingest import shard_paths
from elmo_core.options import SPLITS, VocabConfig
from elmo_core.progress import track
from elmo_core.stage import WholeStage
from elmo_core.text.chars import (
    BOS_ID,
    BOS_TOKEN,
    EOS_ID,
    EOS_TOKEN,
    SPECIAL_TOKENS,
    UNK_ID,
    UNK_TOKEN,
    tokens_to_char_array,
)
from elmo_core.text.vocab_file import MAX_TERM_ID, check_training_vocab, read_vocab_file, write_vocab_file

__all__ = [
    "MAX_TERM_ID",
    "VOCAB_NAME_IN_DATA",
    "build_vocab",
    "check_training_vocab",
    "read_vocab_file",
    "write_token_ids",
    "write_vocab_file",
]

VOCAB_NAME_IN_DATA = "vocab.txt"  # written beside the DuckDB file, with token_ids/ next to it


# ----- the vocabulary in DuckDB -------------------------------------------------------------------------
#
# Tables in FILE.duckdb, built by SQL over the ingested Parquet (never a Python loop over the corpus):
#   token_counts(token, count)         every train-split token
#   vocab(id, token, count)            <S>=0, </S>=1, <UNK>=2, then by count desc, token asc (deterministic)
#   char_ids(id, token, chars INTEGER[50])   bilm-tf raw char ids (0..260) of every vocab entry
#   corpus_stats(...)                  one row: sentences, tokens, types, heldout tokens and OOV rate

COUNT_TOKENS = """
CREATE OR REPLACE TABLE token_counts AS
SELECT token, count(*)::BIGINT AS count
FROM (SELECT unnest(tokens) AS token FROM read_parquet($shards) WHERE split = 'train')
GROUP BY token
"""
BUILD_VOCAB = """
CREATE OR REPLACE TABLE vocab AS
WITH specials(id, token) AS (VALUES ($bos_id, $bos), ($eos_id, $eos), ($unk_id, $unk)),
ranked AS (
    SELECT token, count FROM token_counts
    WHERE count >= $min_count AND token NOT IN ($bos, $eos, $unk)
    ORDER BY count DESC, token ASC
    LIMIT $max_words
)
SELECT s.id, s.token,
       CASE s.id WHEN $unk_id THEN 0
                 ELSE (SELECT count(*) FROM read_parquet($shards) WHERE split = 'train') END::BIGINT AS count
FROM specials s
UNION ALL
SELECT (row_number() OVER (ORDER BY count DESC, token ASC) + 2)::INTEGER AS id, token, count FROM ranked
ORDER BY id
"""
SET_UNK_COUNT = """
UPDATE vocab SET count = (SELECT coalesce(sum(c.count), 0) FROM token_counts c ANTI JOIN vocab v USING (token))
WHERE id = $unk_id
"""
IMPORT_VOCAB = """
CREATE OR REPLACE TABLE vocab AS
SELECT i.id::INTEGER AS id, i.token, coalesce(c.count, 0)::BIGINT AS count
FROM imported i LEFT JOIN token_counts c USING (token) ORDER BY i.id
"""
CORPUS_STATS = """
CREATE OR REPLACE TABLE corpus_stats AS
WITH heldout AS (SELECT unnest(tokens) AS token FROM read_parquet($shards) WHERE split = 'heldout'),
test AS (SELECT unnest(tokens) AS token FROM read_parquet($shards) WHERE split = 'test'),
counts AS (
    SELECT
        (SELECT count(*) FROM read_parquet($shards) WHERE split = 'train')::BIGINT AS train_sentences,
        (SELECT coalesce(sum(count), 0) FROM token_counts)::BIGINT AS train_tokens,
        (SELECT count(*) FROM token_counts)::BIGINT AS train_types,
        (SELECT count(*) FROM vocab)::BIGINT AS vocab_size,
        (SELECT count(*) FROM read_parquet($shards) WHERE split = 'heldout')::BIGINT AS heldout_sentences,
        (SELECT count(*) FROM heldout)::BIGINT AS heldout_tokens,
        (SELECT count(*) FROM heldout h ANTI JOIN vocab v USING (token))::BIGINT AS heldout_oov_tokens,
        (SELECT count(*) FROM read_parquet($shards) WHERE split = 'test')::BIGINT AS test_sentences,
        (SELECT count(*) FROM test)::BIGINT AS test_tokens,
        (SELECT count(*) FROM test t ANTI JOIN vocab v USING (token))::BIGINT AS test_oov_tokens
)
SELECT *,
    coalesce(heldout_oov_tokens / nullif(heldout_tokens, 0), 0.0)::DOUBLE AS heldout_oov_rate,
    coalesce(test_oov_tokens / nullif(test_tokens, 0), 0.0)::DOUBLE AS test_oov_rate
FROM counts
"""
CREATE_CHAR_IDS = "CREATE OR REPLACE TABLE char_ids (id INTEGER, token VARCHAR, chars INTEGER[50])"
INSERT_CHAR_IDS = "INSERT INTO char_ids SELECT id, token, chars::INTEGER[50] FROM char_rows"
SELECT_VOCAB = "SELECT token FROM vocab ORDER BY id"


def _connect(db: str | Path, memory_limit: str) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(str(db))
    con.execute("SET memory_limit = ?", [memory_limit])
    con.execute("SET temp_directory = ?", [str(Path(db).with_suffix(".tmp"))])
    con.execute(f"SET enable_progress_bar = {str(sys.stderr.isatty()).lower()}")  # a bar only on a terminal
    return con


def build_vocab(config: VocabConfig) -> dict[str, float]:
    """Count, rank and store the vocabulary and char ids; export vocab.txt beside the DB. Returns corpus_stats."""
    shards = [str(p) for p in shard_paths(config.corpus)]
    if not shards:
        raise InputError(f"{config.corpus}: no part-*.parquet shards; run `elmo ingest` first")
    db = Path(config.db)
    db.parent.mkdir(parents=True, exist_ok=True)
    specials = {
        "bos_id": BOS_ID,
        "bos": BOS_TOKEN,
        "eos_id": EOS_ID,
        "eos": EOS_TOKEN,
        "unk_id": UNK_ID,
        "unk": UNK_TOKEN,
    }
    # steps: count, rank, char ids + stats, then one per shard converted to token ids
    with track("vocab", 3 + (len(shards) if config.token_ids else 0), "steps") as progress:
        con = _connect(db, config.memory_limit)
        try:
            con.execute(COUNT_TOKENS, {"shards": shards})
            progress.advance(1, "counted")
            if config.vocab_file:
                tokens = read_vocab_file(config.vocab_file)
                check_training_vocab(tokens, config.vocab_file)
                imported = pa.table({"id": pa.array(range(len(tokens)), pa.int32()), "token": tokens})
                con.register("imported", imported)
                con.execute(IMPORT_VOCAB)
                con.unregister("imported")
            else:
                max_words = (config.max_size - len(SPECIAL_TOKENS)) if config.max_size else 2**62
                con.execute(
                    BUILD_VOCAB, {"shards": shards, "min_count": config.min_count, "max_words": max_words, **specials}
                )
            con.execute(SET_UNK_COUNT, {"unk_id": UNK_ID})
            progress.advance(1, "ranked")
            _store_char_ids(con)
            con.execute(CORPUS_STATS, {"shards": shards})
            vocab = [row[0] for row in con.execute(SELECT_VOCAB).fetchall()]
            stats_row = con.execute("SELECT * FROM corpus_stats").fetchone()
            names = [d[0] for d in con.description]  # type: ignore[union-attr]
        finally:
            con.close()
        write_vocab_file(vocab, db.with_name("vocab.txt"))
        progress.advance(1, f"{len(vocab):,} entries")
        if config.token_ids:
            write_token_ids(shards, vocab, db.parent / "token_ids", on_shard=lambda: progress.advance(1, "token ids"))
    return dict(zip(names, stats_row))  # type: ignore[arg-type]


def _store_char_ids(con: duckdb.DuckDBPyConnection) -> None:
    """char_ids from elmo_core.text.chars (the one place the scheme lives), stored as INTEGER[50] rows."""
    rows = con.execute("SELECT id, token FROM vocab ORDER BY id").fetchall()
    ids = [r[0] for r in rows]
    tokens = [r[1] for r in rows]
    chars = tokens_to_char_array(tokens, raw=True)
    flat = pa.array(chars.reshape(-1), pa.int32())
    table = pa.table(
        {
            "id": pa.array(ids, pa.int32()),
            "token": tokens,
            "chars": pa.FixedSizeListArray.from_arrays(flat, chars.shape[1]),
        }
    )
    con.execute(CREATE_CHAR_IDS)
    con.register("char_rows", table)
    con.execute(INSERT_CHAR_IDS)
    con.unregister("char_rows")


# ----- token ids per split ---------------------------------------------------------------------------------

TOKEN_IDS_SCHEMA = pa.schema(
    [("sentence_id", pa.string()), ("tokens", pa.list_(pa.string())), ("ids", pa.list_(pa.int32()))]
)


def write_token_ids(shards: list[str], vocab: list[str], out: Path, on_shard: Callable[[], None] | None = None) -> None:
    """``out/{train,heldout,test}/part-*.parquet``: each sentence's vocab ids (``<UNK>`` for OOV) beside its tokens.

    The tokens stay because the model always reads characters, OOV words included; the ids are the softmax
    targets. Lookups are Arrow's hash ``index_in``, streamed one row group at a time. ``out/_VOCAB_SHA256``
    names the vocabulary the ids belong to; ids of another vocabulary are deleted first.
    """
    value_set = pa.array(vocab, pa.string())
    fingerprint = hashlib.sha256("\n".join(vocab).encode()).hexdigest()
    marker = out / "_VOCAB_SHA256"
    if out.exists() and (not marker.exists() or marker.read_text().strip() != fingerprint):
        shutil.rmtree(out)  # ids of another vocabulary
    for split in SPLITS:
        (out / split).mkdir(parents=True, exist_ok=True)
    write_text_atomic(marker, fingerprint + "\n")
    for shard in shards:
        name = Path(shard).name
        targets = {split: out / split / name for split in SPLITS}
        if not all(t.exists() for t in targets.values()):  # else already converted (shards never change once written)
            _write_shard_ids(shard, value_set, targets)
        if on_shard is not None:
            on_shard()


def _write_shard_ids(shard: str, value_set: pa.Array, targets: dict[str, Path]) -> None:
    with ExitStack() as stack:
        writers = {
            split: pq.ParquetWriter(stack.enter_context(atomic_path(t)), TOKEN_IDS_SCHEMA, compression="zstd")
            for split, t in targets.items()
        }
        pf = pq.ParquetFile(shard)
        for i in range(pf.num_row_groups):
            group = pf.read_row_group(i, columns=["sentence_id", "tokens", "split"])
            tokens = group.column("tokens").combine_chunks()
            ids = pc.fill_null(pc.index_in(tokens.flatten(), value_set=value_set), UNK_ID).cast(pa.int32())
            id_lists = pa.ListArray.from_arrays(tokens.offsets, ids)
            table = pa.table(
                {"sentence_id": group.column("sentence_id"), "tokens": tokens, "ids": id_lists}, schema=TOKEN_IDS_SCHEMA
            )
            for split, writer in writers.items():
                part = table.filter(pc.equal(group.column("split"), split))
                if part.num_rows:
                    writer.write_table(part)
        for writer in writers.values():
            writer.close()  # before atomic_path renames the files


class VocabStage(WholeStage):
    """The vocabulary as a stage, one unit (one DuckDB file); its result is ``corpus_stats``."""

    name = "vocab"

    def writes(self, config: VocabConfig) -> list[Path]:
        return [Path(config.db).parent]  # the database, vocab.txt and token_ids/ beside it

    def decide(self, config: VocabConfig) -> list[str]:
        shards = shard_paths(config.corpus)
        source = f"import {config.vocab_file}" if config.vocab_file else f"count words seen {config.min_count}+ times"
        cap = f", at most {config.max_size:,} entries" if config.max_size else ""
        ids = "; token ids per split" if config.token_ids else ""
        return [f"{len(shards)} shards of {config.corpus}: {source}{cap}{ids} -> {config.db}"]

    def work(self, config: VocabConfig) -> dict[str, float]:
        return build_vocab(config)
