"""The embedding folder as users read it: one job per folder, a plain Parquet dataset, token-bounded units,
nothing left by a failed start, and one clear line for every bad input (real files, real readers)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from elmo_core.errors import InputError, OutputError
from elmo_core.ingest import IngestConfig, ingest, shard_paths
from elmo_core.vectors.embed import EmbedConfig, embed, plan_units, work_dir
from tests.helpers import run_elmo

A = ["the cat sat on the mat .", "a dog ran in the park ."]
B = ["apples grow on trees .", "the phone rang twice .", "we sat by the river bank ."]


def _tokens(lines: list[str]) -> int:
    return sum(len(line.split()) for line in lines)


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _one_line_error(result: subprocess.CompletedProcess, command: str) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"elmo {command}: error: ")
    return last


def test_the_folder_reads_as_a_dataset_in_pandas_pyarrow_and_duckdb(tmp_path, allennlp_dir):
    out = tmp_path / "emb"
    embed(EmbedConfig(model=str(allennlp_dir), input=str(_write(tmp_path / "a.txt", A)), out=str(out)))
    tokens = _tokens(A)
    assert len(pd.read_parquet(out)) == tokens
    assert ds.dataset(out).count_rows() == tokens
    con = duckdb.connect()
    for pattern in (f"{out}/*.parquet", f"{out}/**/*.parquet"):  # DuckDB's recursive glob does not skip _ folders
        assert con.execute("SELECT count(*) FROM read_parquet($p)", {"p": pattern}).fetchone()[0] == tokens
    parquet_under_out = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.parquet"))
    assert parquet_under_out and all(name.startswith("part-") and "/" not in name for name in parquet_under_out)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("part-")) == ["_job.json", "_manifest.json"]
    assert (work_dir(out) / "input").is_dir()  # the tokenized copy of the text lives beside OUT, not in it


def test_another_input_is_refused_and_overwrite_replaces_the_table_whole(tmp_path, allennlp_dir):
    out = tmp_path / "emb"
    embed(EmbedConfig(model=str(allennlp_dir), input=str(_write(tmp_path / "a.txt", A)), out=str(out)))
    ingest(IngestConfig(sources=[str(_write(tmp_path / "b.txt", B))], out=str(tmp_path / "ing"), heldout_fraction=0.0))
    with pytest.raises(OutputError, match=r"holds embeddings of another job \(input .*a.txt|input .* → .*ing"):
        embed(EmbedConfig(model=str(allennlp_dir), input=str(tmp_path / "ing"), out=str(out)))
    assert len(pd.read_parquet(out)) == _tokens(A)  # untouched
    replaced = embed(EmbedConfig(model=str(allennlp_dir), input=str(tmp_path / "ing"), out=str(out), overwrite=True))
    table = pd.read_parquet(out)
    assert len(table) == replaced.rows == _tokens(B)
    assert set(table["text"]) == set(B)  # not one row of the old corpus
    assert json.loads((out / "_job.json").read_text())["input"]["path"] == str((tmp_path / "ing").resolve())
    assert not (work_dir(out) / "next").exists()
    # the same job again: nothing to do, with or without --overwrite
    again = embed(EmbedConfig(model=str(allennlp_dir), input=str(tmp_path / "ing"), out=str(out), overwrite=True))
    assert again.units_done_before == again.units and again.tokens == 0


@pytest.mark.slow
def test_another_text_file_is_refused_in_one_line_before_it_is_tokenized(tmp_path, allennlp_dir):
    """Two jobs started together where the second starts after the first is done (CI saw it: a loaded machine
    still importing torch): refused in one line, with no ingest log before it and the folder's working copy of
    its own input untouched. The two files have the same number of lines, so only their names tell them apart."""
    model, out = str(allennlp_dir), tmp_path / "emb"
    a, b = _write(tmp_path / "a.txt", A), _write(tmp_path / "b.txt", ["one two three .", "four five six ."])
    assert run_elmo("embed", "--model", model, "--input", str(a), "--out", str(out)).returncode == 0
    marker = work_dir(out) / "input" / "_sources.json"
    before = (marker.read_text(), sorted(p.name for p in marker.parent.iterdir()))
    result = run_elmo("embed", "--model", model, "--input", str(b), "--out", str(out))
    line = _one_line_error(result, "embed")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"holds embeddings of another job (input {a.resolve()} → {b.resolve()})" in line
    assert (marker.read_text(), sorted(p.name for p in marker.parent.iterdir())) == before
    assert len(pd.read_parquet(out)) == _tokens(A)


def test_other_options_are_named_in_the_refusal(tmp_path, allennlp_dir):
    out = tmp_path / "emb"
    text = _write(tmp_path / "a.txt", A)
    embed(EmbedConfig(model=str(allennlp_dir), input=str(text), out=str(out)))
    with pytest.raises(OutputError, match=r"options layers 'mix' → 'all'"):
        embed(EmbedConfig(model=str(allennlp_dir), input=str(text), out=str(out), layers="all"))


def test_options_of_how_a_job_runs_do_not_make_it_another_job(tmp_path, allennlp_dir):
    """Where and how it runs (device, batch size, waiting, an index after it) is not what the table is: a rerun with
    other such options finds the same job done, while an option of what the vectors are makes another job."""
    out = tmp_path / "emb"
    text = _write(tmp_path / "a.txt", A)
    first = embed(EmbedConfig(model=str(allennlp_dir), input=str(text), out=str(out)))
    again = embed(
        EmbedConfig(
            model=str(allennlp_dir), input=str(text), out=str(out), device="cpu", max_batch_tokens=64, wait=True
        )
    )
    assert again.units_done_before == again.units == first.units
    with pytest.raises(OutputError, match=r"options dtype 'float32' → 'float16'"):
        embed(EmbedConfig(model=str(allennlp_dir), input=str(text), out=str(out), dtype="float16"))


@pytest.mark.slow
def test_workers_spread_the_units_over_processes_and_write_the_same_table(tmp_path, allennlp_dir):
    """``elmo embed --workers 2`` on a CPU: the plan says so, two processes of one thread each (the cores shared)
    embed and write the units, and the table is the one process's, row for row; a rerun with other workers is the
    same job, done. One worker: this process alone."""
    lines = [" ".join(f"w{(i * 7 + j) % 53}" for j in range(3 + i % 9)) + " ." for i in range(300)]
    text = _write(tmp_path / "c.txt", lines)
    one, two = tmp_path / "one", tmp_path / "two"
    options = {"model": str(allennlp_dir), "input": str(text), "unit_tokens": 400, "device": "cpu"}
    embed(EmbedConfig(out=str(one), **options))
    result = run_elmo(
        "-v", "embed", *[f"--{k.replace('_', '-')}={v}" for k, v in options.items()], f"--out={two}", "--workers=2"
    )
    assert result.returncode == 0, result.stderr
    assert "2 processes, each with its share of the cores" in result.stderr
    units = json.loads((two / "_manifest.json").read_text())["units"]
    assert len(units) > 4 and len({u["pid"] for u in units}) == 2 and {u["threads"] for u in units} == {1}
    order = ["sentence_id", "token_index"]
    a, b = (pd.read_parquet(folder).sort_values(order).reset_index(drop=True) for folder in (one, two))
    assert a[order + ["token"]].equals(b[order + ["token"]])
    assert all(abs(x - y).max() < 1e-5 for x, y in zip(a["elmo"], b["elmo"]))  # whichever process ran them
    again = embed(EmbedConfig(out=str(two), workers=1, **options))
    assert again.units_done_before == again.units


def test_a_failed_start_leaves_nothing_behind(tmp_path, allennlp_dir):
    out = tmp_path / "emb"
    with pytest.raises(InputError):
        embed(EmbedConfig(model=str(allennlp_dir), input=str(tmp_path / "missing.txt"), out=str(out)))
    with pytest.raises(InputError, match="no such model directory"):
        embed(EmbedConfig(model=str(tmp_path / "no_model"), input=str(_write(tmp_path / "a.txt", A)), out=str(out)))
    (tmp_path / "no_model").mkdir()
    with pytest.raises(InputError, match="no options.json"):
        embed(EmbedConfig(model=str(tmp_path / "no_model"), input=str(_write(tmp_path / "a.txt", A)), out=str(out)))
    assert not out.exists() and not work_dir(out).exists()


def test_units_are_bounded_by_tokens_whatever_the_row_groups(tmp_path):
    lines = [" ".join(f"w{j}" for j in range(1 + i % 30)) + f" s{i}" for i in range(2000)]
    ingest(
        IngestConfig(sources=[str(_write(tmp_path / "c.txt", lines))], out=str(tmp_path / "ing"), heldout_fraction=0.0)
    )
    shards = shard_paths(tmp_path / "ing")
    assert pq.ParquetFile(shards[0]).num_row_groups == 1  # one row group of 2,000 sentences
    units = plan_units(shards, unit_tokens=1000)
    assert len(units) > 30
    assert all(u.tokens <= 1000 for u in units)
    covered = [row for u in units for row in range(u.start, u.stop)]
    assert covered == list(range(2000))  # every sentence in exactly one unit
    assert sum(u.tokens for u in units) == _tokens(lines)
    assert len({u.name for u in units}) == len(units)


@pytest.mark.slow
def test_bad_inputs_get_one_line_naming_the_path_and_the_fix(tmp_path, allennlp_dir):
    model = str(allennlp_dir)
    text = _write(tmp_path / "a.txt", A)
    a_file = _write(tmp_path / "not_a_folder", ["x"])
    line = _one_line_error(run_elmo("embed", "--model", model, "--input", str(text), "--out", str(a_file)), "embed")
    assert f"{a_file}: is a file; --out takes a folder" in line

    (tmp_path / "bin.txt").write_bytes(b"\x00\x01 binary\n")
    ingest(IngestConfig(sources=[str(tmp_path / "bin.txt")], out=str(tmp_path / "rejected")))
    assert not shard_paths(tmp_path / "rejected")
    line = _one_line_error(
        run_elmo("embed", "--model", model, "--input", str(tmp_path / "rejected"), "--out", str(tmp_path / "o1")),
        "embed",
    )
    assert (
        "an ingested dataset with no shards: every input was rejected" in line
        and "NUL byte" in line
        and "rerun `elmo ingest`" in line
    )

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _write(corpus / "part1.txt", A)
    _write(corpus / "README.md", ["# About this corpus"])
    line = _one_line_error(
        run_elmo("embed", "--model", model, "--input", str(corpus), "--out", str(tmp_path / "o2")), "embed"
    )
    assert "holds files that are not corpus text (README.md)" in line and f"'{corpus}/*.txt'" in line

    other = tmp_path / "someone_elses"
    other.mkdir()
    _write(other / "notes.txt", ["keep me"])
    line = _one_line_error(run_elmo("embed", "--model", model, "--input", str(text), "--out", str(other)), "embed")
    assert "holds files that `elmo embed` did not write (notes.txt)" in line
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


@pytest.mark.slow
def test_the_walkthrough_conflict_from_the_cli(tmp_path, allennlp_dir):
    """elmo embed a.txt into emb, then an ingested b into emb: refused in one line; --overwrite replaces it."""
    model, out = str(allennlp_dir), str(tmp_path / "emb")
    assert (
        run_elmo("embed", "--model", model, "--input", str(_write(tmp_path / "a.txt", A)), "--out", out).returncode == 0
    )
    assert run_elmo("ingest", str(_write(tmp_path / "b.txt", B)), "--out", str(tmp_path / "ing")).returncode == 0
    line = _one_line_error(run_elmo("embed", "--model", model, "--input", str(tmp_path / "ing"), "--out", out), "embed")
    assert "holds embeddings of another job" in line and "--overwrite" in line
    done = run_elmo("embed", "--model", model, "--input", str(tmp_path / "ing"), "--out", out, "--overwrite")
    assert done.returncode == 0, done.stderr
    count = duckdb.connect().execute("SELECT count(*) FROM read_parquet($p)", {"p": f"{out}/*.parquet"}).fetchone()[0]
    tokens = (
        duckdb.connect()
        .execute("SELECT sum(n_tokens) FROM read_parquet($p)", {"p": f"{tmp_path}/ing/*.parquet"})
        .fetchone()[0]
    )
    assert count == tokens
