"""One writer per output folder, with real processes: a second job is refused in one line naming the holder, or
waits with --wait; kill -9 never leaves a stale lock; two jobs started together end in one correct table; two
ingests into one dataset deduplicate against each other."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from elmo_core import cpu
from elmo_core.fileio import FolderLock
from elmo_core.vectors.sources import LOCK_NAME, work_dir
from tests.helpers import ROOT, free_port, run_elmo, start_server
from tests.test_train import FIXTURE_OPTIONS, fixture_data  # noqa: F401  (the fixture: bilm-tf's data, its vocab)

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


@pytest.mark.slow
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
        # it says that it waits, and for whom, then blocks: nothing is written while the holder holds the folder
        lines = iter(waiting.stderr.readline, "")
        said = next((line for line in lines if "waiting for it to end" in line), "")
        assert f"in use by another job (pid {__import__('os').getpid()} on " in said, said
        assert waiting.poll() is None and not out.exists()
    finally:
        holder.release()
    _, stderr = waiting.communicate(timeout=300)
    assert waiting.returncode == 0, stderr
    assert _rows(out) == (_tokens(source), _tokens(source))


@pytest.mark.slow
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


@pytest.mark.timing
@pytest.mark.slow
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
    # the same for an embedding job whose model is a registered one
    started = time.perf_counter()
    embedded = run_elmo(
        "embed", "--model", "models:/elmo/latest", "--input", "x.txt", "--out", str(tmp_path / "e"), env=env
    )
    assert embedded.returncode == 2 and time.perf_counter() - started < 15
    assert "no MLflow server answers at http://127.0.0.1:9" in embedded.stderr and not (tmp_path / "e").exists()
    # and for a probe, which logs its results as an MLflow run
    tagging = ROOT / "data" / "probes" / "tagging"
    started = time.perf_counter()
    probe = run_elmo(
        "probe",
        "tag",
        "--model",
        "m",
        "--train",
        str(tagging / "train.tsv"),
        "--dev",
        str(tagging / "dev.tsv"),
        "--out",
        str(tmp_path / "p"),
        env=env,
    )
    assert probe.returncode == 2 and time.perf_counter() - started < 15
    assert "no MLflow server answers at http://127.0.0.1:9" in probe.stderr and not (tmp_path / "p").exists()


@pytest.mark.slow
def test_a_tracking_server_that_goes_away_mid_run_neither_kills_nor_stalls_the_training(tmp_path, fixture_data):  # noqa: F811
    import json
    import os
    import signal

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server_env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    command = [str(mlflow_bin), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    command += [
        "--backend-store-uri",
        f"sqlite:///{tmp_path / 'mlflow.db'}",
        "--default-artifact-root",
        str(tmp_path / "art"),
    ]
    server = start_server(command, f"{uri}/health", tmp_path / "mlflow.log", server_env)
    try:
        config = {
            **FIXTURE_OPTIONS,
            "data": str(fixture_data),
            "out": str(tmp_path / "run"),
            "max_steps": 400,
            "log_every": 1,
            "checkpoint_every": 100,
            "tracking": "mlflow",
            "tracking_uri": uri,
        }
        (tmp_path / "train.json").write_text(json.dumps(config))
        training = subprocess.Popen(
            [sys.executable, "-m", "elmo_core.cli", "train", "--config", str(tmp_path / "train.json")],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        metrics = tmp_path / "run" / "metrics.jsonl"
        for _ in range(600):
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 30:
                break
            time.sleep(0.1)
        os.killpg(server.pid, signal.SIGKILL)  # the store goes away mid-run
        server.wait(timeout=30)
        gone = time.perf_counter()
        _, stderr = training.communicate(timeout=240)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    assert training.returncode == 0, stderr[-2000:]
    assert time.perf_counter() - gone < 180  # not MLflow's minutes of retries per call
    assert len(metrics.read_text().splitlines()) == 400 and (tmp_path / "run" / "model" / "weights.hdf5").exists()
    assert "was unreachable for part of the run; not logged:" in stderr and "metric points" in stderr


def _cmdline(process) -> str:
    import psutil

    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # ended since it was seen
        return ""


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


DASK_SCRIPT = """
import json, sys
from elmo_core.vectors.embed import EmbedConfig
from flows.embed import run_on_dask

if __name__ == "__main__":
    print(json.dumps(run_on_dask(EmbedConfig.model_validate_json(sys.argv[1]), n_workers=2)))
"""


def _assert_exits_with_its_flow(stderr: str, ended: datetime.datetime) -> None:
    """The job's process ends when its flow does: nothing is left queued for the temporary server it stopped (Prefect
    retried such logs and events at exit for over a minute, after the job's last line)."""
    assert "Error logging to API" not in stderr, stderr[-2000:]
    (finished,) = [line for line in stderr.splitlines() if "Flow run" in line and "Finished in state Completed" in line]
    clock = datetime.datetime.combine(ended.date(), datetime.time.fromisoformat(finished.split(" | ")[0]))
    assert (ended - clock).total_seconds() < 15, f"the job ended {ended - clock} after its flow"


@pytest.mark.slow
def test_a_dask_worker_killed_mid_job_costs_only_its_unit_and_leaves_no_process(tmp_path, allennlp_dir, prefect_home):
    import os
    import signal

    import psutil

    from elmo_core.ingest import IngestConfig, ingest, shard_paths
    from elmo_core.vectors.embed import EmbedConfig, plan_units

    lines = [f"sentence number {i} about the {w} ." for i, w in enumerate(WORDS * 40)]
    (tmp_path / "c.txt").write_text("\n".join(lines) + "\n")
    ingest(IngestConfig(sources=[str(tmp_path / "c.txt")], out=str(tmp_path / "ing")))
    out = tmp_path / "emb"
    config = EmbedConfig(model=str(allennlp_dir), input=str(tmp_path / "ing"), out=str(out), unit_tokens=70)
    script = tmp_path / "embed_on_dask.py"  # the README's example as a saved script, with its main guard
    script.write_text(DASK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(prefect_home(tmp_path / "prefect"))

    def start() -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, str(script), config.model_dump_json()],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    job = start()
    seen: set[int] = set()
    for _ in range(1800):
        family = psutil.Process(job.pid).children(recursive=True)
        seen |= {p.pid for p in family}
        if len(list(out.glob("part-*.parquet"))) >= 4:
            break
        time.sleep(0.1)
    cmdlines = {p.pid: _cmdline(p) for p in family}
    assert sum("uvicorn" in c for c in cmdlines.values()) == 1  # one Prefect server for the flow and its workers
    workers = [p for p in family if "spawn_main" in cmdlines[p.pid]]
    assert len(workers) >= 2
    os.kill(workers[0].pid, signal.SIGKILL)
    # counted after the kill, so at most what was done at it: the worker died with units left to do
    assert len(list(out.glob("part-*.parquet"))) < len(plan_units(shard_paths(tmp_path / "ing"), 70))
    stdout, stderr = job.communicate(timeout=600)
    if job.returncode != 0:  # the lost unit may fail the run: a rerun does what is missing
        rerun = start()
        stdout, stderr = rerun.communicate(timeout=600)
        assert rerun.returncode == 0, stderr[-3000:]
    _assert_exits_with_its_flow(stderr, datetime.datetime.now())
    # the two local workers split the cores: each torch has cores / 2 threads, not all of them
    assert json.loads(stdout.strip().splitlines()[-1])["worker_threads"] == [cpu.threads_for(2)]
    tokens = sum(len(line.split()) for line in lines)
    assert _rows(out) == (tokens, tokens)
    time.sleep(2)
    alive = [pid for pid in seen if _running(pid)]
    assert not alive, [_cmdline(psutil.Process(p)) for p in alive if _running(p)]


@pytest.mark.slow  # 100 s here: a Prefect server starts, then Dask gives up on the workers that cannot start
def test_run_on_dask_in_a_script_without_its_main_guard_says_so(tmp_path, allennlp_dir, prefect_home):
    import os

    from elmo_core.vectors.embed import EmbedConfig

    script = tmp_path / "unguarded.py"
    script.write_text(DASK_SCRIPT.replace('if __name__ == "__main__":\n    ', ""))
    source = _text(tmp_path / "a.txt", 20, 5)  # a real input: the workers start when its units are sent
    config = EmbedConfig(model=str(allennlp_dir), input=str(source), out=str(tmp_path / "emb"))
    env = {**os.environ, "PREFECT_HOME": str(prefect_home(tmp_path / "prefect"))}
    result = subprocess.run(
        [sys.executable, str(script), config.model_dump_json()],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert 'put the call under `if __name__ == "__main__":`' in result.stderr
