"""The word vocabulary: bilm-tf ``vocab.txt`` files, the DuckDB vocab/char-id tables, and token ids per split."""

from __future__ import annotations

import hashlib
import math
import shutil
import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from elmo_core.errors import ElmoError, InputError, disk_full
from elmo_core.fileio import (
    atomic_path,
    disk_full_error,
    format_bytes,
    free_bytes,
    publish,
    require_space,
    temp_path,
    write_text_atomic,
)
from elmo_core.ingest import shard_paths
from elmo_core.options import SPLITS, VocabConfig
from elmo_core.progress import Progress, track
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


def _connect(db: str | Path, memory_limit: str, spill: Path) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(str(db))
    con.execute("SET memory_limit = ?", [memory_limit])
    con.execute("SET temp_directory = ?", [str(spill)])
    con.execute(f"SET enable_progress_bar = {str(sys.stderr.isatty()).lower()}")  # a bar only on a terminal
    return con


def build_vocab(config: VocabConfig) -> dict[str, float]:
    """Count, rank and store the vocabulary and char ids; export vocab.txt beside the DB. Returns corpus_stats.

    The database is built in a temporary folder beside it (``fileio.temp_path``: its WAL and DuckDB's spill files
    with it) and renamed into place once checkpointed and closed, so ``vocab.duckdb`` is the old one or the complete
    new one, never half of one; the folder of a writer that died is removed by the next claim
    (``fileio.remove_stale_temps``). A write that fails for lack of space is one ``DiskFullError`` saying so."""
    shards = [str(p) for p in shard_paths(config.corpus)]
    if not shards:
        raise InputError(f"{config.corpus}: no part-*.parquet shards; run `elmo ingest` first")
    db = Path(config.db)
    db.parent.mkdir(parents=True, exist_ok=True)
    # steps: count, rank, char ids + stats, then one per shard converted to token ids
    with track("vocab", 3 + (len(shards) if config.token_ids else 0), "steps") as progress:
        try:
            vocab, stats = _build_database(config, shards, progress)
            write_vocab_file(vocab, db.with_name(VOCAB_NAME_IN_DATA))
            progress.advance(1, f"{len(vocab):,} entries")
            if config.token_ids:
                ids = db.parent / "token_ids"
                write_token_ids(shards, vocab, ids, on_shard=lambda: progress.advance(1, "token ids"))
        except Exception as exc:
            if isinstance(exc, ElmoError) or not disk_full(exc):
                raise
            raise disk_full_error(db.parent, _kept(db), exc) from exc
    return stats


def _kept(db: Path) -> str:
    """What a vocab run stopped by a full disk leaves: the database whole (old or new) or none, never half of one."""
    whole = f"{db} is whole (no half-made database is left)" if db.exists() else f"no half of {db} was left"
    return f"{whole}; its inputs are untouched"


def _build_database(config: VocabConfig, shards: list[str], progress: Progress) -> tuple[list[str], dict[str, float]]:
    """The database built under a temporary name and renamed into place (``build_vocab``); (vocab, corpus_stats)."""
    db = Path(config.db)
    work = temp_path(db)  # .vocab.duckdb.<pid>-<hex>.tmp/: the database, its WAL, DuckDB's spill files
    work.mkdir()
    try:
        built = work / db.name
        con = _connect(built, config.memory_limit, work / "spill")
        try:
            vocab, stats = _fill(con, config, shards, progress)
            con.execute("CHECKPOINT")  # the WAL folded into the file before it moves: nothing left to replay
        finally:
            con.close()
        if Path(f"{built}.wal").exists():
            raise RuntimeError(f"{built}: DuckDB left a WAL after its checkpoint and close; not renamed into place")
        Path(f"{db}.wal").unlink(missing_ok=True)  # an old database's log would be replayed into the new one
        publish(built, db)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return vocab, stats


def _fill(
    con: duckdb.DuckDBPyConnection, config: VocabConfig, shards: list[str], progress: Progress
) -> tuple[list[str], dict[str, float]]:
    """The tables of the module's header, by SQL over the shards; (vocab in id order, corpus_stats)."""
    specials = {
        "bos_id": BOS_ID,
        "bos": BOS_TOKEN,
        "eos_id": EOS_ID,
        "eos": EOS_TOKEN,
        "unk_id": UNK_ID,
        "unk": UNK_TOKEN,
    }
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
        con.execute(BUILD_VOCAB, {"shards": shards, "min_count": config.min_count, "max_words": max_words, **specials})
    con.execute(SET_UNK_COUNT, {"unk_id": UNK_ID})
    progress.advance(1, "ranked")
    _store_char_ids(con)
    con.execute(CORPUS_STATS, {"shards": shards})
    vocab = [row[0] for row in con.execute(SELECT_VOCAB).fetchall()]
    stats_row = con.execute("SELECT * FROM corpus_stats").fetchone()
    names = [d[0] for d in con.description]  # type: ignore[union-attr]
    return vocab, dict(zip(names, stats_row))  # type: ignore[arg-type]


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


# ----- what a build writes, estimated before it starts (the plan compares it with the free space) ---------------
#
# Measured by running ``build_vocab`` while a thread summed the folder's file sizes every 0.5 ms, on the bilm-tf
# fixture (134 tokens, 77 types), the repo's default corpus (``write_default_corpus``: 40,291 tokens, 6,258 types),
# vim's help files (1.2M tokens, 128k types), Zipf-drawn random words (160k-2.2M tokens, 26k-524k types) and words
# seen once each (118k-130k):
#   vocab.duckdb   1.06 MB at least (its header and the tables' first 256 kB blocks), then 70-85 bytes a type (each
#                  of token_counts, vocab and char_ids holds it; tokens of 9-10 bytes);
#   its WAL        while building, a table of fewer rows than DuckDB's row group (122,880; 122,000 are logged, 123,500
#                  are not) is logged row by row, uncompressed: 262-272 bytes a type (31 MB beside an 8.4 MB database
#                  at 118k types) until the checkpoint; larger tables are written to the database file directly;
#   vocab.txt      a line an entry;
#   token_ids/     the shards' tokens column again (1.0x its compressed bytes), sentence_id (dictionary-encoded there:
#                  up to 3.7x the shards' plain column, 2.4 bytes a sentence) and the ids: 2.1-3.0 bytes a token, and
#                  4.6 where every token is a new word (the ids' dictionary holds each once, as int32).
# Types are not known before counting: the tokens of up to ``SAMPLE_GROUPS`` row groups spread over the shards are
# counted (all of a small corpus: exact) and scaled by Heaps' law with an exponent of 0.85, never above the tokens
# (vim's help, ingested in 35 row groups, fits 0.75-0.83 from 1 to 8 of them; English prose is nearer 0.5-0.7 at
# scale, so a large corpus is estimated high). Where the types are extrapolated, the WAL is counted up to 1.5x its
# threshold: vim's help in 5 row groups, 128k types estimated at 143k, is estimated 3.6x what its build held (no
# WAL); the others, 1.2-1.5x. Not counted: DuckDB's spill files, written only past ``memory_limit``.
DB_BYTES = 1_500_000  # an empty database, with room for the blocks its tables round up to
TYPE_BYTES = 64  # a type in the database, + 3 bytes a byte of its text
# a row of each table in the WAL, + a byte a byte of its text: 262 bytes in all for tokens of 9 bytes
WAL_ROW_BYTES = {"token_counts": 30, "vocab": 30, "char_ids": 220}
WAL_ROWS = 122_880  # a table of this many rows or more goes to the database file, not the WAL
ID_BYTES, ID_TYPE_BYTES, SENTENCE_BYTES = 3, 4, 4  # token_ids/: a token's id, a type's in the dictionary, a sentence
FILE_BYTES = 8_192  # a token_ids part's footer and its last block, per split and shard
SAMPLE_GROUPS = 4
HEAPS_EXPONENT = 0.85


@dataclass(frozen=True)
class VocabEstimate:
    """About what a vocab run writes, from the shards' footers and a sample of their tokens (the notes above)."""

    tokens: int  # in every split (the footers count them)
    types: int  # estimated, or counted where the sample is the corpus
    entries: int  # of the vocabulary (vocab.txt)
    db: int  # vocab.duckdb and, at its largest, its WAL
    vocab_txt: int
    token_ids: int  # less what token_ids/ holds already (kept, or removed before it is written again)

    @property
    def total(self) -> int:
        return self.db + self.vocab_txt + self.token_ids

    def line(self, free: int) -> str:
        parts = f"vocab.duckdb and its WAL {format_bytes(self.db)}, vocab.txt {format_bytes(self.vocab_txt)}"
        ids = f", token_ids {format_bytes(self.token_ids)}" if self.token_ids else ""
        return (
            f"{self.tokens:,} tokens, about {self.types:,} types: about {format_bytes(self.total)} to write "
            f"({parts}{ids}), {format_bytes(free)} free"
        )


@dataclass
class _Footers:
    """What the shards' footers say: tokens, sentences, the compressed bytes of the columns token_ids/ copies."""

    groups: list[tuple[Path, int]]
    tokens: int = 0
    sentences: int = 0
    copied: int = 0

    @classmethod
    def read(cls, shards: list[Path]) -> _Footers:
        found = cls([])
        for shard in shards:
            meta = pq.ParquetFile(shard).metadata
            found.sentences += meta.num_rows
            for g in range(meta.num_row_groups):
                found.groups.append((shard, g))
                for c in range(meta.row_group(g).num_columns):
                    column = meta.row_group(g).column(c)
                    if column.path_in_schema.split(".")[0] in ("tokens", "sentence_id"):
                        found.copied += column.total_compressed_size
                    if column.path_in_schema.startswith("tokens"):
                        found.tokens += column.num_values  # a value per token (and per empty list)
        return found


def estimate_vocab(config: VocabConfig, shards: list[Path]) -> VocabEstimate:
    """What ``build_vocab(config)`` will write, at its largest, read from the footers and a sample of tokens."""
    footers = _Footers.read(shards)
    types, length, exact = _types(footers.groups, footers.tokens)
    entries = min(types + len(SPECIAL_TOKENS), config.max_size or types + len(SPECIAL_TOKENS))
    vocab_txt = int(entries * (length + 1))
    if config.vocab_file:  # imported: its entries, whatever the corpus holds (a missing file: refused in one line)
        imported = read_vocab_file(config.vocab_file)
        entries, vocab_txt = len(imported), sum(len(token.encode()) + 1 for token in imported)
    rows = max(types, entries)
    db = DB_BYTES + rows * (TYPE_BYTES + 3 * length)
    db += _wal_bytes({"token_counts": types, "vocab": entries, "char_ids": entries}, length, exact)
    ids = 0
    if config.token_ids:
        there = sum(f.stat().st_size for f in (Path(config.db).parent / "token_ids").rglob("*") if f.is_file())
        ids = footers.copied + ID_BYTES * footers.tokens + ID_TYPE_BYTES * types + SENTENCE_BYTES * footers.sentences
        ids = max(0, ids + FILE_BYTES * len(SPLITS) * len(shards) - there)
    return VocabEstimate(footers.tokens, types, entries, int(db), vocab_txt, ids)


def _wal_bytes(rows: dict[str, int], length: float, exact: bool) -> int:
    """The WAL at its largest: the tables DuckDB logs row by row (under ``WAL_ROWS``; from 1.5 times that where the
    rows are extrapolated, and may be low), each row uncompressed."""
    limit = WAL_ROWS if exact else 1.5 * WAL_ROWS
    return int(sum(n * (WAL_ROW_BYTES[table] + length) for table, n in rows.items() if n < limit))


def _types(groups: list[tuple[Path, int]], tokens: int) -> tuple[int, float, bool]:
    """About how many distinct tokens ``tokens`` tokens hold, their mean length in bytes, and whether that was
    counted exactly: counted in up to ``SAMPLE_GROUPS`` row groups spread over ``groups``, scaled by Heaps' law."""
    if not groups:  # no shards: the work says so, in one line
        return 0, 0.0, True
    picked = sorted({round(i * (len(groups) - 1) / max(1, SAMPLE_GROUPS - 1)) for i in range(SAMPLE_GROUPS)})
    read = [pq.ParquetFile(groups[i][0]).read_row_group(groups[i][1], columns=["tokens"]).column(0) for i in picked]
    sample = pa.chunked_array([c.combine_chunks().flatten() for c in read], pa.string())
    if len(sample) == 0:
        return 0, 0.0, True
    distinct = pc.unique(sample)
    length = pc.mean(pc.binary_length(distinct)).as_py() or 0.0
    if len(picked) == len(groups):
        return len(distinct), length, True
    scaled = len(distinct) * (max(tokens, len(sample)) / len(sample)) ** HEAPS_EXPONENT
    return min(tokens, math.ceil(scaled)), length, False


class VocabStage(WholeStage):
    """The vocabulary as a stage, one unit (one DuckDB file); its result is ``corpus_stats``."""

    name = "vocab"

    def writes(self, config: VocabConfig) -> list[Path]:
        return [Path(config.db).parent]  # the database, vocab.txt and token_ids/ beside it

    def decide(self, config: VocabConfig) -> list[str]:
        """What it will do, and about how many bytes that writes: refused in one line, before anything is written,
        where the filesystem holding the database has no room for them."""
        shards = shard_paths(config.corpus)
        source = f"import {config.vocab_file}" if config.vocab_file else f"count words seen {config.min_count}+ times"
        cap = f", at most {config.max_size:,} entries" if config.max_size else ""
        ids = "; token ids per split" if config.token_ids else ""
        folder = Path(config.db).parent
        estimate = estimate_vocab(config, shards)
        require_space(folder, estimate.total, "the vocabulary" + (" and its token ids" if config.token_ids else ""))
        return [
            f"{len(shards)} shards of {config.corpus}: {source}{cap}{ids} -> {config.db}",
            estimate.line(free_bytes(folder)),
        ]

    def work(self, config: VocabConfig) -> dict[str, float]:
        return build_vocab(config)
