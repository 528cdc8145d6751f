"""Ingest: formats, tokenizers, dedup, the manifest, and every kind of bad input (real files, real DuckDB)."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import elmo_core.ingest.readers as readers_module
from elmo_core.ingest import SHARD_SCHEMA, IngestConfig, _HashSet, ingest, sentence_hashes, shard_paths
from elmo_core.text.tokenize import _only_ascii_separators, split_sentences, split_whitespace, unicode_tokens

ROOT = Path(__file__).resolve().parent.parent


def _rows(out: Path) -> list[dict]:
    return [row for shard in shard_paths(out) for row in pq.read_table(shard).to_pylist()]


def _manifest(out: Path) -> list[dict]:
    con = duckdb.connect(str(out / "_manifest.duckdb"), read_only=True)
    try:
        cur = con.execute("SELECT * FROM files ORDER BY path")
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]
    finally:
        con.close()


def test_text_gz_bz2_jsonl_parquet_and_folders(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("the cat sat .\nthe dog ran .\n")
    with gzip.open(src / "b.txt.gz", "wt") as f:
        f.write("a gzipped line .\n")
    with bz2.open(src / "sub" / "c.txt.bz2", "wt") as f:
        f.write("a bzipped line .")  # no trailing newline
    (src / "d.jsonl").write_text(json.dumps({"body": "json text here ."}) + "\n")
    pq.write_table(pa.table({"content": ["parquet row one .", "parquet row two ."]}), src / "e.parquet")
    summary = ingest(
        IngestConfig(
            sources=[str(src)],
            out=str(tmp_path / "out"),
            text_field="body",
            text_column="content",
            heldout_fraction=0.0,
        )
    )
    assert (summary.files_ingested, summary.files_failed, summary.sentences) == (5, 0, 7)
    rows = _rows(tmp_path / "out")
    assert {r["text"] for r in rows} >= {"the cat sat .", "a bzipped line .", "json text here .", "parquet row two ."}
    assert all(r["split"] == "train" and r["n_tokens"] == len(r["tokens"]) for r in rows)
    assert pq.read_schema(shard_paths(tmp_path / "out")[0]).names == SHARD_SCHEMA.names
    ids = [r["sentence_id"] for r in rows]
    assert len(set(ids)) == len(ids)


def test_glob_sources_and_missing_source(tmp_path):
    (tmp_path / "x1.txt").write_text("one .\n")
    (tmp_path / "x2.txt").write_text("two .\n")
    summary = ingest(IngestConfig(sources=[str(tmp_path / "x*.txt")], out=str(tmp_path / "out")))
    assert summary.files_ingested == 2
    from elmo_core.errors import ElmoError

    with pytest.raises(ElmoError, match="no such file, folder or matching glob"):
        ingest(IngestConfig(sources=[str(tmp_path / "nothing*.txt")], out=str(tmp_path / "out")))


def test_rerun_adds_nothing_and_a_new_file_is_ingested_alone(tmp_path):
    (tmp_path / "a.txt").write_text("first file .\n")
    config = IngestConfig(sources=[str(tmp_path / "a.txt")], out=str(tmp_path / "out"))
    assert ingest(config).files_ingested == 1
    again = ingest(config)
    assert (again.files_ingested, again.files_skipped, again.sentences) == (0, 1, 0)
    (tmp_path / "b.txt").write_text("second file .\n")
    more = ingest(IngestConfig(sources=[str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], out=str(tmp_path / "out")))
    assert (more.files_ingested, more.files_skipped) == (1, 1)
    assert len(_rows(tmp_path / "out")) == 2
    manifest = _manifest(tmp_path / "out")
    assert [m["status"] for m in manifest] == ["done", "done"]
    assert all(len(m["sha256"]) == 64 and m["sentences"] == 1 for m in manifest)


def test_duplicates_dropped_across_files_and_runs_or_kept(tmp_path):
    (tmp_path / "a.txt").write_text("same line .\nsame line .\nother line .\n")
    (tmp_path / "b.txt").write_text("same line .\nnew line .\n")
    summary = ingest(IngestConfig(sources=[str(tmp_path / "a.txt")], out=str(tmp_path / "out")))
    assert (summary.sentences, summary.duplicates) == (2, 1)
    summary = ingest(IngestConfig(sources=[str(tmp_path / "b.txt")], out=str(tmp_path / "out")))
    assert (summary.sentences, summary.duplicates) == (1, 1)
    kept = ingest(IngestConfig(sources=[str(tmp_path / "a.txt")], out=str(tmp_path / "all"), dedup=False))
    assert (kept.sentences, kept.duplicates) == (3, 0)


def test_bad_input_is_counted_and_named_while_other_files_go_on(tmp_path):
    (tmp_path / "good.txt").write_text("fine line .\n\n\n   \nanother fine line .\n")
    (tmp_path / "bad_utf8.txt").write_bytes(b"ok line .\nbroken \xff\xfe here .\nok again .\n")
    (tmp_path / "binary.txt").write_bytes(b"text\n\x00\x01\x02 binary\n")
    (tmp_path / "utf16.txt").write_bytes("hello world\n".encode("utf-16"))
    (tmp_path / "records.jsonl").write_text('{"text": "good record ."}\n{bad json\n{"other": 3}\n["a list"]\n')
    summary = ingest(IngestConfig(sources=[str(tmp_path)], out=str(tmp_path / "out")))
    assert summary.files_failed == 2 and summary.files_ingested == 3
    assert any("binary.txt: NUL byte at byte 5 (line 2)" in e for e in summary.errors)
    assert any("utf16.txt" in e and "UTF-16" in e for e in summary.errors)
    assert summary.invalid_utf8_lines == 1
    assert any(w.startswith(f"{tmp_path}/bad_utf8.txt:2: invalid UTF-8") for w in summary.warnings)
    assert summary.rejected_lines == 3
    assert any(w.startswith(f"{tmp_path}/records.jsonl:2: invalid JSON") for w in summary.warnings)
    assert any(w.startswith(f"{tmp_path}/records.jsonl:3: field 'text' missing") for w in summary.warnings)
    texts = {r["text"] for r in _rows(tmp_path / "out")}
    assert "broken \ufffd\ufffd here ." in texts and "good record ." in texts
    manifest = {Path(m["path"]).name: m for m in _manifest(tmp_path / "out")}
    assert manifest["binary.txt"]["status"] == "failed" and "NUL byte" in manifest["binary.txt"]["error"]
    assert manifest["good.txt"]["empty_lines"] == 3 and manifest["good.txt"]["sentences"] == 2


def test_missing_parquet_column_is_named(tmp_path):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "t.parquet")
    summary = ingest(IngestConfig(sources=[str(tmp_path / "t.parquet")], out=str(tmp_path / "out")))
    assert summary.files_failed == 1 and "no column 'text' (columns: body); use --text-column" in summary.errors[0]


def test_long_sentences_are_split_and_long_tokens_kept(tmp_path):
    giant = "x" * 5000
    (tmp_path / "a.txt").write_text(" ".join(f"w{i}" for i in range(25)) + f" {giant}\n")
    ingest(IngestConfig(sources=[str(tmp_path / "a.txt")], out=str(tmp_path / "out"), max_tokens=10))
    rows = _rows(tmp_path / "out")
    assert [r["n_tokens"] for r in rows] == [10, 10, 6]
    assert rows[-1]["tokens"][-1] == giant
    assert [r["sentence_id"].rsplit(":", 1)[1] for r in rows] == ["0", "1", "2"]
    assert len({r["doc_id"] for r in rows}) == 1


def test_split_is_stable_and_near_the_fraction(tmp_path):
    (tmp_path / "a.txt").write_text("".join(f"sentence number {i} .\n" for i in range(4000)))
    ingest(IngestConfig(sources=[str(tmp_path / "a.txt")], out=str(tmp_path / "o1"), heldout_fraction=0.1))
    ingest(IngestConfig(sources=[str(tmp_path / "a.txt")], out=str(tmp_path / "o2"), heldout_fraction=0.1))
    s1 = {r["sentence_id"]: r["split"] for r in _rows(tmp_path / "o1")}
    s2 = {r["sentence_id"]: r["split"] for r in _rows(tmp_path / "o2")}
    assert s1 == s2
    share = sum(v == "heldout" for v in s1.values()) / len(s1)
    assert 0.08 < share < 0.12


def test_tokenizers_and_sentence_splitting(tmp_path):
    assert unicode_tokens("Don't pay $3.50 at https://x.org/a?b=1, e-mail a.b@c.com!") == [
        "Don't",
        "pay",
        "$",
        "3.50",
        "at",
        "https://x.org/a?b=1",
        ",",
        "e-mail",
        "a.b@c.com",
        "!",
    ]
    assert split_sentences("It rained. Then it stopped! Did it? 天晴了。我们走吧") == [
        "It rained.",
        "Then it stopped!",
        "Did it?",
        "天晴了。",
        "我们走吧",
    ]
    (tmp_path / "zh.txt").write_text("我喜欢吃苹果。\n苹果发布了新手机。\n")
    ingest(IngestConfig(sources=[str(tmp_path / "zh.txt")], out=str(tmp_path / "out"), tokenizer="chinese"))
    tokens = [r["tokens"] for r in _rows(tmp_path / "out")]
    assert all("苹果" in t for t in tokens)
    (tmp_path / "para.txt").write_text("First one. Second one.\nStill second.\n\nThird paragraph here.\n")
    ingest(
        IngestConfig(
            sources=[str(tmp_path / "para.txt")], out=str(tmp_path / "p"), tokenizer="unicode", split_sentences=True
        )
    )
    rows = _rows(tmp_path / "p")
    assert [r["text"] for r in rows] == ["First one.", "Second one.", "Still second.", "Third paragraph here."]
    assert rows[0]["doc_id"] == rows[2]["doc_id"] != rows[3]["doc_id"]


@pytest.mark.slow
def test_kill_9_mid_ingest_leaves_no_partial_shard_and_the_rerun_finishes(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for k in range(3):
        with gzip.open(src / f"big{k}.txt.gz", "wt", compresslevel=1) as f:
            for i in range(250_000):
                f.write(f"file {k} line {i} with some words in it .\n")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "elmo_core.cli", "ingest", str(src), "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not list(out.glob("part-*.parquet")):
        time.sleep(0.05)
    assert list(out.glob("part-*.parquet")), "the first shard never appeared"
    time.sleep(0.3)  # now in the middle of a later file
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for shard in out.glob("part-*.parquet"):
        assert pq.ParquetFile(shard).metadata.num_rows == 250_000  # visible shards are complete
    done_before = sum(m["status"] == "done" for m in _manifest(out))
    assert done_before < 3
    rerun = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{3 - done_before} files ingested, {done_before} unchanged" in rerun.stdout
    assert len(shard_paths(out)) == 3 and not list(out.glob("*.tmp"))
    ids = [r for shard in shard_paths(out) for r in pq.read_table(shard, columns=["sentence_id"]).column(0).to_pylist()]
    assert len(ids) == len(set(ids)) == 750_000


def test_crlf_and_whitespace_only_lines_give_no_empty_tokens(tmp_path):
    (tmp_path / "w.txt").write_bytes(b"one two\r\n   \r\n\t\r\n  three   four  \r\n")
    (tmp_path / "e.jsonl").write_text('{"text": ""}\n{"text": "  five  "}\n')
    summary = ingest(IngestConfig(sources=[str(tmp_path)], out=str(tmp_path / "out")))
    rows = _rows(tmp_path / "out")
    assert sorted(r["text"] for r in rows) == ["five", "one two", "three   four"]
    assert all("" not in r["tokens"] for r in rows)
    assert summary.sentences == 3


def test_whitespace_split_matches_str_split_for_every_separator():
    """The ASCII fast path is taken only where it splits exactly like str.split (all separators are in the BMP)."""
    texts = [f"a{chr(c)}b c" for c in range(1, 0x10000) if not 0xD800 <= c < 0xE000]
    fast = [t for t in texts if _only_ascii_separators(t.encode())]
    slow = set(texts) - set(fast)
    assert all(len(t.split()) == 3 for t in slow) and len(slow) == 23  # only the rare separators go the slow way
    assert len(fast) > 60_000 and "a\u2014b c" in fast and "a\u00a0b c" not in fast and "a\u3000b c" not in fast
    assert pc.ascii_split_whitespace(pa.array(fast)).to_pylist() == [t.split() for t in fast]
    mixed = pa.array(["x\u00a0y z", "in\u2003 between", "plain  words", "—dash— ’quote’"])
    assert split_whitespace(mixed).to_pylist() == [t.split() for t in mixed.to_pylist()]
    assert split_whitespace(pa.array(["a b", "c\td"])).to_pylist() == [["a", "b"], ["c", "d"]]


def test_sentence_hashes_are_md5_numbers():
    """The dedup keys (stored in the manifest) and the split draw stay MD5-defined: equal to DuckDB's
    md5_number_lower and to hashlib's digest, whichever way they are computed."""
    texts = ["", "a", "naïve 苹果 text", "x" * 10_000]
    con = duckdb.connect()
    ours = sentence_hashes(con, pa.array(texts)).tolist()
    expected = [int.from_bytes(hashlib.md5(t.encode()).digest()[8:], "little", signed=True) for t in texts]
    duck = [int(np.uint64(con.execute("SELECT md5_number_lower(?)", [t]).fetchone()[0]).view(np.int64)) for t in texts]
    assert ours == expected == duck


def test_hash_set_matches_a_python_set():
    rng = np.random.default_rng(0)
    seen, reference = _HashSet(), set()
    for _ in range(40):
        batch = np.unique(rng.integers(-(2**40), 2**40, size=int(rng.integers(0, 3000))))
        fresh = batch[~seen.contains(batch)]
        assert set(fresh.tolist()) == set(batch.tolist()) - reference
        seen.add(fresh)
        reference |= set(fresh.tolist())
    assert sorted(seen.values().tolist()) == sorted(reference)
    assert len(seen._runs) <= 12  # runs are merged: lookups stay a handful of binary searches


def test_block_boundaries_change_nothing(tmp_path, monkeypatch):
    """Text is read in blocks cut at line ends; tiny blocks give the same rows as one block, and the rows
    agree with str.split whatever the line endings, separators or invalid bytes."""
    lines = [
        b"one two\r",
        b"",
        b"  three\xc2\xa0four  ",
        b"five\xe2\x80\x94six",
        b"bro\xffken line",
        b"\t",
        b"ideo\xe3\x80\x80graphic",
        " ".join(f"w{i}" for i in range(250)).encode(),
        b"last line, no newline",
    ]
    (tmp_path / "a.txt").write_bytes(b"\n".join(lines))
    whole = ingest(IngestConfig(sources=[str(tmp_path / "a.txt")], out=str(tmp_path / "one"), max_tokens=100))
    monkeypatch.setattr(readers_module, "READ_BLOCK_BYTES", 7)
    pieces = ingest(IngestConfig(sources=[str(tmp_path / "a.txt")], out=str(tmp_path / "many"), max_tokens=100))
    rows = _rows(tmp_path / "one")
    assert rows == _rows(tmp_path / "many")
    assert (
        (whole.sentences, whole.invalid_utf8_lines, whole.tokens)
        == (pieces.sentences, pieces.invalid_utf8_lines, pieces.tokens)
        == (9, 1, 263)
    )
    assert all(r["tokens"] == r["text"].split() for r in rows)
    by_id = {r["sentence_id"].split(":", 1)[1]: r["text"] for r in rows}
    assert by_id["l1:0"] == "one two" and by_id["l3:0"] == "three\xa0four" and by_id["l5:0"] == "bro\ufffdken line"
    assert by_id["l8:2"] == " ".join(f"w{i}" for i in range(200, 250)) and by_id["l9:0"] == "last line, no newline"


def test_the_same_text_compressed_twice_gets_the_same_ids_and_split(tmp_path):
    text = "".join(f"sentence number {i} of the corpus .\n" for i in range(400))
    (tmp_path / "plain.txt").write_text(text)
    for name, stamp in (("a.txt.gz", 1_000_000), ("b.txt.gz", 2_000_000)):  # different gzip header times
        with gzip.GzipFile(tmp_path / name, "wb", mtime=stamp, compresslevel=1 if name == "a.txt.gz" else 9) as f:
            f.write(text.encode())
    assert (tmp_path / "a.txt.gz").read_bytes() != (tmp_path / "b.txt.gz").read_bytes()
    tables = []
    for name in ("plain.txt", "a.txt.gz", "b.txt.gz"):
        ingest(IngestConfig(sources=[str(tmp_path / name)], out=str(tmp_path / f"out-{name}"), heldout_fraction=0.2))
        rows = sorted(_rows(tmp_path / f"out-{name}"), key=lambda r: r["sentence_id"])
        tables.append([(r["doc_id"], r["sentence_id"], r["split"], r["text"]) for r in rows])
    assert tables[0] == tables[1] == tables[2]
    assert {split for *_, split, _ in tables[0]} == {"train", "heldout"}
    # into one dataset, the second copy of the same text is recognised as already ingested
    both = ingest(
        IngestConfig(sources=[str(tmp_path / "a.txt.gz"), str(tmp_path / "b.txt.gz")], out=str(tmp_path / "one"))
    )
    assert (both.files_ingested, both.files_skipped) == (1, 1)


def test_a_folder_with_documents_beside_the_text_is_refused(tmp_path):
    from elmo_core.errors import InputError

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("one line .\n")
    (tmp_path / "src" / "LICENSE").write_text("Permission is hereby granted\n")
    (tmp_path / "src" / "news-00001-of-00100").write_text("files without a suffix are corpus files .\n")
    with pytest.raises(
        InputError, match=r"holds files that are not corpus text \(LICENSE\); name the corpus files or a glob"
    ):
        ingest(IngestConfig(sources=[str(tmp_path / "src")], out=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()
    done = ingest(
        IngestConfig(
            sources=[str(tmp_path / "src" / "a.txt"), str(tmp_path / "src" / "news-*")], out=str(tmp_path / "out")
        )
    )
    assert done.files_ingested == 2


def test_a_dataset_refuses_other_tokenizer_options_and_reads_as_a_dataset(tmp_path):
    import pandas as pd
    import pyarrow.dataset as ds

    from elmo_core.errors import OutputError

    (tmp_path / "a.txt").write_text("Hello, world.\n")
    (tmp_path / "b.txt").write_text("Goodbye, world.\n")
    ingest(IngestConfig(sources=[str(tmp_path / "a.txt")], out=str(tmp_path / "out"), tokenizer="unicode"))
    with pytest.raises(OutputError, match=r"ingested with other options \(tokenizer: 'unicode' → 'whitespace'\)"):
        ingest(IngestConfig(sources=[str(tmp_path / "b.txt")], out=str(tmp_path / "out")))
    ingest(IngestConfig(sources=[str(tmp_path / "b.txt")], out=str(tmp_path / "out"), tokenizer="unicode"))
    assert len(pd.read_parquet(tmp_path / "out")) == ds.dataset(tmp_path / "out").count_rows() == 2
