"""Vocab, char ids, corpus stats and token ids, built by DuckDB over real ingested Parquet."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

from elmo_core.data.vocab import VocabConfig, build_vocab, read_vocab_file
from elmo_core.errors import ConfigError, InputError
from elmo_core.ingest import IngestConfig, ingest
from elmo_core.text.chars import raw_char_ids
from tests.helpers import ingested

CORPUS = [
    "b a c a .",
    "a b 苹果 .",
    "c a " + "z" * 60 + " .",
    "a <S> b .",
]


@pytest.fixture()
def corpus(tmp_path) -> Path:
    return ingested(tmp_path, CORPUS, "c.txt")


def _query(db: Path, sql: str) -> list[tuple]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_vocab_order_counts_and_export(corpus, tmp_path):
    db = tmp_path / "v" / "vocab.duckdb"
    stats = build_vocab(VocabConfig(corpus=str(corpus), db=str(db)))
    rows = _query(db, "SELECT id, token, count FROM vocab ORDER BY id")
    # a: 5, .: 4, b: 3, c: 2, then count 1 ties broken by token (byte order)
    assert rows == [
        (0, "<S>", 4),
        (1, "</S>", 4),
        (2, "<UNK>", 0),
        (3, "a", 5),
        (4, ".", 4),
        (5, "b", 3),
        (6, "c", 2),
        (7, "z" * 60, 1),
        (8, "苹果", 1),
    ]
    assert read_vocab_file(db.with_name("vocab.txt")) == [r[1] for r in rows]
    assert stats["train_tokens"] == 17 and stats["train_types"] == 7  # the literal <S> counts as a type


def test_min_count_and_max_size(corpus, tmp_path):
    db = tmp_path / "v.duckdb"
    build_vocab(VocabConfig(corpus=str(corpus), db=str(db), min_count=3, token_ids=False))
    assert [r[0] for r in _query(db, "SELECT token FROM vocab ORDER BY id")] == ["<S>", "</S>", "<UNK>", "a", ".", "b"]
    # c×2, z…, 苹果; a literal <S> in the text is the <S> entry (bilm-tf looks specials up by name)
    assert _query(db, "SELECT count FROM vocab WHERE id = 2") == [(4,)]
    build_vocab(VocabConfig(corpus=str(corpus), db=str(db), max_size=5, token_ids=False))
    assert [r[0] for r in _query(db, "SELECT token FROM vocab ORDER BY id")] == ["<S>", "</S>", "<UNK>", "a", "."]


def test_char_ids_table_equals_elmo_core(corpus, tmp_path):
    db = tmp_path / "v.duckdb"
    build_vocab(VocabConfig(corpus=str(corpus), db=str(db), token_ids=False))
    assert _query(db, "SELECT typeof(chars) FROM char_ids LIMIT 1") == [("INTEGER[50]",)]
    rows = _query(db, "SELECT token, chars FROM char_ids ORDER BY id")
    assert len(rows) == 9
    for token, chars in rows:
        assert list(chars) == list(raw_char_ids(token)), token


def _independent_oov_rate(vocab_txt: Path, corpus: Path) -> float:
    con = duckdb.connect()
    vocab = set(read_vocab_file(vocab_txt))
    tokens = [
        t
        for row in con.execute(
            "SELECT tokens FROM read_parquet($p) WHERE split = 'heldout'", {"p": str(corpus / "*.parquet")}
        ).fetchall()
        for t in row[0]
    ]
    return sum(t not in vocab for t in tokens) / len(tokens)


def test_heldout_oov_rate(tmp_path):
    # 350 distinct sentences; the split is drawn per distinct sentence, so duplicates share it
    (tmp_path / "c.txt").write_text("".join(f"w{i % 50} common x{i % 7} .\n" for i in range(3000)), encoding="utf-8")
    ingest(
        IngestConfig(sources=[str(tmp_path / "c.txt")], out=str(tmp_path / "ing"), heldout_fraction=0.2, dedup=False)
    )
    stats = build_vocab(VocabConfig(corpus=str(tmp_path / "ing"), db=str(tmp_path / "v.duckdb"), token_ids=False))
    assert stats["heldout_sentences"] > 300
    assert stats["heldout_oov_rate"] == pytest.approx(_independent_oov_rate(tmp_path / "vocab.txt", tmp_path / "ing"))
    stats = build_vocab(
        VocabConfig(corpus=str(tmp_path / "ing"), db=str(tmp_path / "v.duckdb"), max_size=20, token_ids=False)
    )
    assert 0.1 < stats["heldout_oov_rate"] < 0.3  # most w* are cut
    assert stats["heldout_oov_rate"] == pytest.approx(_independent_oov_rate(tmp_path / "vocab.txt", tmp_path / "ing"))


def test_import_existing_vocab_keeps_its_order(corpus, tmp_path, bilm_tf_dir):
    vocab_txt = bilm_tf_dir / "train" / "vocab.txt"
    db = tmp_path / "v.duckdb"
    build_vocab(VocabConfig(corpus=str(corpus), db=str(db), vocab_file=str(vocab_txt), token_ids=False))
    assert [r[0] for r in _query(db, "SELECT token FROM vocab ORDER BY id")] == read_vocab_file(vocab_txt)
    bad = tmp_path / "bad.txt"
    bad.write_text("the\n<S>\n</S>\n<UNK>\n")
    with pytest.raises(ConfigError, match="must start with <S>, </S>, <UNK>"):
        build_vocab(VocabConfig(corpus=str(corpus), db=str(db), vocab_file=str(bad)))


def test_token_ids_per_split(corpus, tmp_path):
    db = tmp_path / "v" / "vocab.duckdb"
    build_vocab(VocabConfig(corpus=str(corpus), db=str(db), min_count=2))
    vocab = read_vocab_file(db.with_name("vocab.txt"))
    table = pq.read_table(db.parent / "token_ids" / "train").to_pylist()
    assert len(table) == 4
    for row in table:
        assert row["ids"] == [vocab.index(t) if t in vocab else 2 for t in row["tokens"]]
    assert pq.read_table(db.parent / "token_ids" / "heldout").num_rows == 0
    # a different vocabulary replaces the ids
    build_vocab(VocabConfig(corpus=str(corpus), db=str(db), min_count=1))
    table = pq.read_table(db.parent / "token_ids" / "train").to_pylist()
    assert all(2 not in row["ids"] for row in table)


def test_no_shards_is_a_clear_error(tmp_path):
    with pytest.raises(InputError, match="no part-\\*.parquet shards; run `elmo ingest` first"):
        build_vocab(VocabConfig(corpus=str(tmp_path), db=str(tmp_path / "v.duckdb")))
