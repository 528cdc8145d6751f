"""Train / heldout / test as the user has them: a split per source, the 1B Word and Flair layouts, a split field,
the refusal of a second split for one file, the overlap report, vocab from train only, OOV and perplexity per split,
and no abbreviated flags."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

from elmo_core.data.vocab import build_vocab
from elmo_core.errors import OutputError
from elmo_core.ingest import IngestConfig, ingest, shard_paths
from elmo_core.options import Source, VocabConfig
from tests.helpers import run_elmo, run_module

TRAIN = [f"the cat number {i} sat on the mat ." for i in range(40)] + ["a dog ran ."] * 3
VALID = [f"the dog number {i} ran off ." for i in range(7)]
TEST = [f"a bird number {i} flew by ." for i in range(5)] + ["a dog ran ."]  # one sentence train also holds


def _write(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def _split_counts(dataset: Path) -> dict[str, int]:
    rows = duckdb.sql(
        f"SELECT split, count(*) FROM read_parquet('{dataset}/part-*.parquet') GROUP BY split ORDER BY split"
    ).fetchall()
    return dict(rows)


def _texts(dataset: Path, split: str) -> list[str]:
    return sorted(
        r[0]
        for r in duckdb.sql(
            f"SELECT text FROM read_parquet('{dataset}/part-*.parquet') WHERE split = '{split}'"
        ).fetchall()
    )


def test_a_split_per_source_keeps_each_file_whole(tmp_path):
    train, valid, test = (
        _write(tmp_path / n, lines) for n, lines in (("train.txt", TRAIN), ("valid.txt", VALID), ("test.txt", TEST))
    )
    out = tmp_path / "ds"
    ingest(IngestConfig(sources=[str(train)], out=str(out), heldout_fraction=0.0))
    # another file with its own split is not an option change
    ingest(IngestConfig(sources=[str(valid)], out=str(out), split="heldout", heldout_fraction=0.0))
    summary = ingest(IngestConfig(sources=[Source(path=str(test), split="test")], out=str(out), heldout_fraction=0.0))
    # counts equal the files' lines after dedup (within each file: train's three "a dog ran ." count once)
    assert _split_counts(out) == {"heldout": len(VALID), "test": len(TEST), "train": len(set(TRAIN))}
    assert _texts(out, "test") == sorted(TEST)  # the test file stays whole, its sentence that train holds too
    assert summary.overlap == 1 and summary.overlap_example == "a dog ran ."
    assert "1 sentences are both in train and in a heldout/test source" in summary.line()


def test_the_same_file_under_another_split_is_refused_in_one_line(tmp_path):
    train = _write(tmp_path / "train.txt", TRAIN)
    out = tmp_path / "ds"
    ingest(IngestConfig(sources=[str(train)], out=str(out)))
    with pytest.raises(OutputError, match=r"train.txt: already in .* as split auto; ingest it with --split auto"):
        ingest(IngestConfig(sources=[str(train)], out=str(out), split="test"))
    copy = _write(tmp_path / "copy.txt", TRAIN)  # the same text under another name is the same file
    with pytest.raises(OutputError, match=r"copy.txt: already in .* as split auto \(as .*train.txt, the same text\)"):
        ingest(IngestConfig(sources=[str(copy)], out=str(out), split="heldout"))


def test_drop_overlap_removes_the_shared_sentences_from_train(tmp_path):
    train, test = _write(tmp_path / "train.txt", TRAIN), _write(tmp_path / "test.txt", TEST)
    out = tmp_path / "ds"
    summary = ingest(
        IngestConfig(
            sources=[str(train), Source(path=str(test), split="test")],  # test is ingested first whatever the order
            out=str(out),
            heldout_fraction=0.0,
            drop_overlap=True,
        )
    )
    assert summary.overlap_dropped == 1 and "1 dropped from train" in summary.line()
    assert "a dog ran ." not in _texts(out, "train") and "a dog ran ." in _texts(out, "test")
    assert _split_counts(out) == {"test": len(TEST), "train": len(set(TRAIN)) - 1}


def test_flair_layout_is_detected_and_announced(tmp_path, caplog):
    corpus = tmp_path / "corpus"
    _write(corpus / "train" / "train_split_1", TRAIN[:20])
    _write(corpus / "train" / "train_split_2", TRAIN[20:])
    _write(corpus / "valid.txt", VALID)
    _write(corpus / "test.txt", TEST)
    with caplog.at_level(logging.INFO, logger="elmo_core.ingest.inputs"):
        ingest(IngestConfig(sources=[str(corpus)], out=str(tmp_path / "ds"), heldout_fraction=0.5))
    assert "laid out as flair" in caplog.text
    assert _split_counts(tmp_path / "ds") == {"heldout": len(VALID), "test": len(TEST), "train": len(set(TRAIN))}


def test_1b_word_layout_with_its_test_shard(tmp_path):
    corpus = tmp_path / "1-billion-word-language-modeling-benchmark-r13output"
    _write(corpus / "training-monolingual.tokenized.shuffled" / "news.en-00001-of-00100", TRAIN)
    _write(corpus / "heldout-monolingual.tokenized.shuffled" / "news.en.heldout-00000-of-00050", TEST)
    _write(corpus / "heldout-monolingual.tokenized.shuffled" / "news.en.heldout-00001-of-00050", VALID)
    _write(corpus / "README", ["not a corpus file: left out"])
    result = run_elmo("ingest", str(corpus), "--out", str(tmp_path / "ds"), "--layout", "1b-word")
    assert result.returncode == 0, result.stderr
    assert "laid out as 1b-word" in result.stderr
    assert _split_counts(tmp_path / "ds") == {"heldout": len(VALID), "test": len(TEST), "train": len(set(TRAIN))}
    wrong = run_elmo("ingest", str(tmp_path / "ds"), "--out", str(tmp_path / "x"), "--layout", "flair")
    assert wrong.returncode == 2 and "not laid out as --layout flair" in wrong.stderr


def test_a_split_field_of_jsonl_records(tmp_path):
    rows = [{"text": t, "part": "train"} for t in TRAIN] + [{"text": t, "part": "valid"} for t in VALID]
    rows += [{"text": t, "part": "test"} for t in TEST] + [{"text": "stray line .", "part": "later"}]
    source = tmp_path / "all.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    summary = ingest(IngestConfig(sources=[str(source)], out=str(tmp_path / "ds"), split_field="part"))
    assert _split_counts(tmp_path / "ds") == {"heldout": len(VALID), "test": len(TEST), "train": len(set(TRAIN))}
    assert summary.rejected_lines == 1 and "all.jsonl:57: split field 'part' is 'later'" in summary.warnings[0]


def test_vocab_from_train_only_and_oov_and_token_ids_per_split(tmp_path):
    train, valid, test = (
        _write(tmp_path / n, lines) for n, lines in (("train.txt", TRAIN), ("valid.txt", VALID), ("test.txt", TEST))
    )
    out = tmp_path / "ds"
    ingest(
        IngestConfig(
            sources=[str(train), Source(path=str(valid), split="heldout"), Source(path=str(test), split="test")],
            out=str(out),
            heldout_fraction=0.0,
        )
    )
    stats = build_vocab(VocabConfig(corpus=str(out), db=str(tmp_path / "vocab" / "vocab.duckdb")))
    vocab = (tmp_path / "vocab" / "vocab.txt").read_text().split("\n")
    assert "bird" not in vocab and "flew" not in vocab  # test words never enter the vocabulary
    # test: "a bird number i flew by ." -> bird, flew, by are OOV (3 of 7 tokens, 5 times); "a dog ran ." none
    assert stats["test_tokens"] == 5 * 7 + 4 and stats["test_oov_tokens"] == 5 * 3
    assert stats["heldout_tokens"] == 7 * 7 and stats["heldout_oov_tokens"] == 7  # "off"
    counts = {
        s: sum(pq.ParquetFile(p).metadata.num_rows for p in (tmp_path / "vocab" / "token_ids" / s).glob("*.parquet"))
        for s in ("train", "heldout", "test")
    }
    assert counts == {"train": len(set(TRAIN)), "heldout": len(VALID), "test": len(TEST)}
    assert len(shard_paths(out)) == 3


def test_abbreviated_flags_are_refused():
    result = run_elmo("ingest", "--split-sent", "x.txt", "--out", "/tmp/never")
    assert result.returncode == 2 and "unrecognized arguments: --split-sent" in result.stderr
    result = run_elmo("embed", "--mod", "m", "--input", "x", "--out", "y")
    assert result.returncode == 2 and "unrecognized arguments: --mod m" in result.stderr  # not taken for --model


def _softmax_model(folder: Path) -> Path:
    """A tiny random biLM with a softmax over TRAIN's words and its vocab.txt (what ``elmo perplexity`` needs)."""
    import torch

    from elmo_core import BiLM
    from elmo_core.bilm.initialization import init_bilm_tf
    from elmo_core.config import preset

    words = sorted({w for line in TRAIN for w in line.split()})
    vocab = ["<S>", "</S>", "<UNK>", *words]
    torch.manual_seed(0)
    bilm = BiLM(preset("tiny").model_copy(update={"n_tokens_vocab": len(vocab)}), vocab=vocab)
    init_bilm_tf(bilm)
    bilm.save_pretrained(str(folder))
    return folder


@pytest.mark.slow
def test_elmo_perplexity_scores_the_split_it_is_told_to(tmp_path, allennlp_dir):
    """``--split test`` scores the test sentences: the same figures as those sentences ingested alone as heldout;
    the train split's differ. A model without a softmax is refused, naming what it needs."""
    train, test = _write(tmp_path / "train.txt", TRAIN), _write(tmp_path / "test.txt", TEST)
    out = tmp_path / "ds"
    ingest(IngestConfig(sources=[str(train), Source(path=str(test), split="test")], out=str(out), heldout_fraction=0.0))
    alone = tmp_path / "test-alone"
    ingest(IngestConfig(sources=[str(test)], out=str(alone), split="heldout", heldout_fraction=0.0))
    model = _softmax_model(tmp_path / "model")

    def score(corpus: Path, split: str) -> str:
        result = run_elmo("perplexity", "--model", str(model), "--corpus", str(corpus), "--split", split)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().splitlines()[-1].split(" on ")[0]

    on_test = score(out, "test")
    assert on_test.startswith("perplexity: ")
    assert on_test == score(alone, "heldout")
    assert on_test != score(out, "train")
    result = run_elmo("perplexity", "--model", str(allennlp_dir), "--corpus", str(out), "--split", "test")
    assert result.returncode == 2 and "needs a model with a softmax" in result.stderr


@pytest.mark.slow
def test_elmo_embed_embeds_the_test_split(tmp_path, allennlp_dir):
    """Every split ingest keeps can be embedded, test too: exactly its sentences, each token a row."""
    train, test = _write(tmp_path / "train.txt", TRAIN), _write(tmp_path / "test.txt", TEST)
    out = tmp_path / "ds"
    ingest(IngestConfig(sources=[str(train), Source(path=str(test), split="test")], out=str(out), heldout_fraction=0.0))
    emb = tmp_path / "emb"
    result = run_elmo("embed", "--model", str(allennlp_dir), "--input", str(out), "--out", str(emb), "--split", "test")
    assert result.returncode == 0, result.stderr
    rows = duckdb.sql(
        f"SELECT text, count(*) FROM read_parquet('{emb}/*.parquet') GROUP BY text ORDER BY text"
    ).fetchall()
    assert [text for text, _ in rows] == sorted(TEST)
    assert all(n == len(text.split()) for text, n in rows)


@pytest.mark.slow
def test_the_pipeline_trains_on_train_and_reports_heldout_and_test_perplexity(tmp_path, prefect_home):
    import os

    from mlflow.tracking import MlflowClient

    train = _write(tmp_path / "corpus" / "train.txt", TRAIN * 3)
    valid = _write(tmp_path / "corpus" / "valid.txt", VALID)
    test = _write(tmp_path / "corpus" / "test.txt", TEST)
    params = {
        "sources": [str(train), {"path": str(valid), "split": "heldout"}, {"path": str(test), "split": "test"}],
        "workdir": str(tmp_path / "work"),
        "probes": None,
        "ingest": {"tokenizer": "whitespace", "split_sentences": False, "heldout_fraction": 0.0},
        "vocab": {"min_count": 1},
        "train": {"preset": "tiny", "max_steps": 4, "batch_size": 4, "unroll_steps": 5, "n_negative_samples_batch": 16},
    }
    env = {**os.environ, "PREFECT_HOME": str(prefect_home(tmp_path / "prefect")), "MLFLOW_TRACKING_URI": ""}
    result = run_module("flows.pipeline", json.dumps(params), env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout + result.stderr  # the flow's prints go through Prefect's logger
    assert "heldout     perplexity" in printed and "test        perplexity" in printed
    counts = _split_counts(tmp_path / "work" / "ingest")
    assert counts == {"heldout": len(VALID), "test": len(TEST), "train": len(set(TRAIN))}
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'work' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("elmo").experiment_id])
    assert {"heldout/perplexity", "test/perplexity", "test/perplexity_unigram"} <= set(run.data.metrics)
    scored = run_elmo(
        "perplexity",
        "--model",
        str(tmp_path / "work" / "export"),
        "--corpus",
        str(tmp_path / "work" / "ingest"),
        "--split",
        "test",
    )
    assert scored.returncode == 0, scored.stderr
    assert float(scored.stdout.split("perplexity: ")[1].split(" ")[0]) == pytest.approx(
        run.data.metrics["test/perplexity"], rel=1e-3
    )
    # the same job again: every stage skips, export and evaluate too (nothing re-exported, re-scored or re-logged)
    weights = tmp_path / "work" / "export" / "weights.hdf5"
    exported = weights.stat().st_mtime_ns
    again = run_module("flows.pipeline", json.dumps(params), env=env, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    printed = again.stdout + again.stderr
    for folder in ("ingest", "vocab", "train", "export", "evaluate"):
        assert f"{folder}: inputs unchanged" in printed, folder
    assert "exported step" not in printed and "test        perplexity" in printed  # the result is still reported
    assert weights.stat().st_mtime_ns == exported
    assert len(client.get_metric_history(run.info.run_id, "test/perplexity")) == 1
