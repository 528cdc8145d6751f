"""One writer per output folder, with real processes: a second job is refused in one line naming the holder, or
waits with --wait; kill -9 never leaves a stale lock; two jobs started together end in one correct table; two
ingests into one dataset deduplicate against each other."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from elmo_core.embed import LOCK_NAME, work_dir
from elmo_core.fileio import FolderLock
from tests.helpers import ROOT, run_elmo

WORDS = ["apple", "river", "bank", "stone", "light", "music", "paper", "green", "seven", "quiet"]


def _text(path: Path, n: int, seed: int) -> Path:
    lines = [" ".join(WORDS[(seed + i * k) % len(WORDS)] for k in range(1, 9)) + f" {seed}-{i}" for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _embed_args(model: Path, source: Path, out: Path, *extra: str) -> list[str]:
    return ["embed", "--model", str(model), "--input", str(source), "--out", str(out), *extra]


def _rows(out: Path) -> tuple[int, int]:
    """(rows, distinct (sentence_id, token_index)) of an embedding table."""
    return duckdb.sql(
        f"SELECT count(*), count(DISTINCT (sentence_id, token_index)) FROM read_parquet('{out}/*.parquet')"
    ).fetchall()[0]


def _tokens(source: Path) -> int:
    return sum(len(line.split()) for line in source.read_text().splitlines())


def test_a_second_job_is_refused_naming_the_holder_and_waits_with_wait(tmp_path, allennlp_dir):
    source, out = _text(tmp_path / "a.txt", 30, 1), tmp_path / "emb"
    holder = FolderLock(work_dir(out) / LOCK_NAME, out).acquire()  # this test's process is the other job
    try:
        refused = run_elmo(*_embed_args(allennlp_dir, source, out))
        assert refused.returncode == 2
        assert f"in use by another job (pid {__import__('os').getpid()} on " in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1 and not out.exists()
        waiting = subprocess.Popen(
            [sys.executable, "-m", "elmo_core.cli", *_embed_args(allennlp_dir, source, out, "--wait")],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(3)
        assert waiting.poll() is None  # queued behind the holder
    finally:
        holder.release()
    _, stderr = waiting.communicate(timeout=300)
    assert waiting.returncode == 0, stderr
    assert _rows(out) == (_tokens(source), _tokens(source))


def test_kill_9_of_the_holder_leaves_no_stale_lock(tmp_path, allennlp_dir):
    source, out = _text(tmp_path / "a.txt", 20, 2), tmp_path / "emb"
    code = (
        "import sys, time; from elmo_core.fileio import FolderLock\n"
        f"FolderLock({str(work_dir(out) / LOCK_NAME)!r}, {str(out)!r}).acquire(); print('locked', flush=True)\n"
        "time.sleep(120)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    assert run_elmo(*_embed_args(allennlp_dir, source, out)).returncode == 2
    holder.kill()
    holder.wait(timeout=30)
    result = run_elmo(*_embed_args(allennlp_dir, source, out))
    assert result.returncode == 0, result.stderr
    assert _rows(out) == (_tokens(source), _tokens(source))


@pytest.mark.slow
def test_two_jobs_started_together_end_in_one_table_and_one_clear_line(tmp_path, allennlp_dir):
    a, b = _text(tmp_path / "a.txt", 1500, 3), _text(tmp_path / "b.txt", 1500, 4)
    out = tmp_path / "emb"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "elmo_core.cli", *_embed_args(allennlp_dir, source, out)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for source in (a, b)
    ]
    results = [(p.wait(timeout=600), p.communicate()[1]) for p in procs]
    winners = [i for i, (code, _) in enumerate(results) if code == 0]
    assert len(winners) == 1, results
    loser_code, loser_err = results[1 - winners[0]]
    assert loser_code == 2 and len(loser_err.strip().splitlines()) == 1
    assert "in use by another job" in loser_err or "holds embeddings of another job" in loser_err
    assert ".tmp" not in loser_err
    winner = (a, b)[winners[0]]
    assert _rows(out) == (_tokens(winner), _tokens(winner))


def test_two_ingests_into_one_dataset_deduplicate_against_each_other(tmp_path):
    shared = [f"the same sentence number {i} ." for i in range(200)]
    (tmp_path / "x.txt").write_text("\n".join(shared + [f"only in x {i} ." for i in range(50)]) + "\n")
    (tmp_path / "y.txt").write_text("\n".join(shared + [f"only in y {i} ." for i in range(50)]) + "\n")
    out = tmp_path / "ds"
    holder = FolderLock(out / ".ingest.lock", out).acquire()
    try:
        refused = run_elmo("ingest", str(tmp_path / "x.txt"), "--out", str(out))
        assert refused.returncode == 2 and "in use by another job" in refused.stderr
    finally:
        holder.release()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "elmo_core.cli", "ingest", str(tmp_path / name), "--out", str(out), "--wait"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("x.txt", "y.txt")
    ]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.communicate()[1]
    (rows, distinct) = duckdb.sql(
        f"SELECT count(*), count(DISTINCT text) FROM read_parquet('{out}/part-*.parquet')"
    ).fetchall()[0]
    assert rows == distinct == 300  # 200 shared (once) + 50 + 50


def test_an_unreachable_tracking_server_fails_a_training_in_seconds_before_any_work(tmp_path):
    """MLflow's own client retries for minutes; the run is refused in one line naming the URI and the way out."""
    import os

    out = tmp_path / "run"
    env = {**os.environ, "MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}  # nothing listens on the discard port
    started = time.perf_counter()
    result = run_elmo("train", "--data", str(tmp_path / "nowhere"), "--out", str(out), env=env)
    seconds = time.perf_counter() - started
    assert result.returncode == 2 and seconds < 15, (seconds, result.stderr)
    assert "no MLflow server answers at http://127.0.0.1:9" in result.stderr and "tracking: none" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not out.exists()
