"""End to end with real servers: a Prefect server, a process worker, `prefect deploy --all`,
`prefect deployment run elmo/train` and `embed/embed`, checked through MLflow's client and DuckDB.
Plus the embed flow on a 2-worker Dask LocalCluster. Everything runs on 127.0.0.1 and is torn down."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import duckdb
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.prefect]

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CORPUS = "\n".join(
    f"the {a} {b} sat on the {c} near the {d} ." for a, b, c, d in
    [("old", "cat", "mat", "door"), ("young", "dog", "rug", "fire"), ("small", "bird", "branch", "nest"),
     ("big", "horse", "hill", "barn"), ("red", "fox", "log", "river"), ("grey", "mouse", "floor", "wall")] * 5
) + "\nI like to eat apples .\nMany people find the Apple phone easy to use .\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect_home")
    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "DO_NOT_TRACK": "true",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_WORKER_QUERY_SECONDS": "2", "MLFLOW_DISABLE_TELEMETRY": "true",
           "MLFLOW_TRACKING_URI": f"sqlite:///{home}/mlflow.db", "PYTHONUNBUFFERED": "1"}
    log = open(home / "server.log", "w")
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2)
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    raise RuntimeError(f"Prefect server did not start: {(home / 'server.log').read_text()[-2000:]}")
                time.sleep(0.5)
        yield env
    finally:
        _kill_group(server)
        log.close()


def _prefect(env: dict, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    result = subprocess.run([str(BIN / "prefect"), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"prefect {' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def _check_mlflow_ui(env: dict, run_id: str, tmp_path: Path) -> None:
    """The README's `mlflow ui --backend-store-uri ...` serves the run."""
    port = _free_port()
    log = open(tmp_path / "mlflow.log", "w")
    ui = subprocess.Popen([str(BIN / "mlflow"), "ui", "--backend-store-uri", env["MLFLOW_TRACKING_URI"], "--host", "127.0.0.1",
                           "--port", str(port), "--workers", "1"], env={**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/get?run_id={run_id}", timeout=5) as r:
                    assert json.loads(r.read())["run"]["info"]["run_id"] == run_id
                break
            except OSError:
                if time.time() > deadline or ui.poll() is not None:
                    raise RuntimeError(f"mlflow ui did not serve the run: {(tmp_path / 'mlflow.log').read_text()[-2000:]}")
                time.sleep(0.5)
    finally:
        _kill_group(ui)
        log.close()


def test_deploy_train_and_embed_through_a_worker(prefect_server, tmp_path):
    env = prefect_server
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS + "\n")
    _prefect(env, "work-pool", "create", "local", "--type", "process", "--overwrite")
    deployed = _prefect(env, "--no-prompt", "deploy", "--all")
    assert "elmo/train" in deployed.stdout and "embed/embed" in deployed.stdout
    worker_log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", "local"], cwd=ROOT, env=env,
                              stdout=worker_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        params = {"params": {"sources": [str(corpus)], "workdir": str(tmp_path / "work"), "tokenizer": "whitespace", "split_sentences": False,
                             "heldout_fraction": 0.2, "min_count": 1,
                             "train": {"preset": "tiny", "max_steps": 20, "batch_size": 4, "unroll_steps": 10,
                                       "n_negative_samples_batch": 16, "register_as": "elmo-e2e"}}}
        run = _prefect(env, "deployment", "run", "elmo/train", "--params", json.dumps(params), "--watch", "--watch-timeout", "600", timeout=700)
        assert "Completed" in run.stdout, run.stdout[-3000:]

        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
        experiment = client.get_experiment_by_name("elmo")
        (mlrun,) = client.search_runs([experiment.experiment_id])
        assert mlrun.info.status == "FINISHED"
        assert {"loss", "perplexity_forward", "perplexity_backward", "tokens_per_s", "heldout_perplexity"} <= set(mlrun.data.metrics)
        assert mlrun.data.params["config.preset"] == "tiny"
        assert {"export", "checkpoint", "config.json"} <= {a.path for a in client.list_artifacts(mlrun.info.run_id)}
        version = max(int(v.version) for v in client.search_model_versions("name = 'elmo-e2e'"))
        _check_mlflow_ui(env, mlrun.info.run_id, tmp_path)

        embed_params = {"config": {"model": f"models:/elmo-e2e/{version}", "input": str(tmp_path / "work" / "ingest"), "out": str(tmp_path / "emb")}}
        run = _prefect(env, "deployment", "run", "embed/embed", "--params", json.dumps(embed_params), "--watch", "--watch-timeout", "600", timeout=700)
        assert "Completed" in run.stdout, run.stdout[-3000:]
    finally:
        _kill_group(worker)
        worker_log.close()

    con = duckdb.connect()
    rel = con.read_parquet(sorted(str(p) for p in (tmp_path / "emb").glob("part-*.parquet")))
    rows, sentences = con.execute("SELECT count(*), count(DISTINCT sentence_id) FROM rel").fetchone()
    tokens = con.execute("SELECT sum(n_tokens) FROM read_parquet($p)", {"p": str(tmp_path / "work" / "ingest" / "part-*.parquet")}).fetchone()[0]
    assert rows == tokens and sentences == 8  # 6 distinct template sentences + the two apple sentences
    top = con.execute("SELECT token, list_cosine_similarity(elmo, (SELECT elmo FROM rel WHERE token = 'apples')) AS s "
                      "FROM rel WHERE token <> 'apples' ORDER BY s DESC LIMIT 1").fetchone()
    assert -1.0 <= top[1] <= 1.0


def test_embed_flow_on_a_two_worker_dask_cluster(prefect_server, tmp_path, allennlp_dir, monkeypatch):
    for key, value in prefect_server.items():
        monkeypatch.setenv(key, value)
    from elmo_core.embed import EmbedConfig
    from elmo_core.ingest import IngestConfig, ingest

    lines = [f"sentence number {i} about the {w} ." for i, w in enumerate(["apple", "phone", "river", "bank"] * 50)]
    (tmp_path / "c.txt").write_text("\n".join(lines) + "\n")
    ingest(IngestConfig(sources=[str(tmp_path / "c.txt")], out=str(tmp_path / "ing"), row_group_size=40))
    script = ("import json, sys; from flows.embed import run_on_dask; from elmo_core.embed import EmbedConfig; "
              "print(json.dumps(run_on_dask(EmbedConfig.model_validate_json(sys.argv[1]), n_workers=2)))")
    config = EmbedConfig(model=str(allennlp_dir), input=str(tmp_path / "ing"), out=str(tmp_path / "emb"))
    result = subprocess.run([sys.executable, "-c", script, config.model_dump_json()], cwd=ROOT, env={**os.environ},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["files"] == 5
    assert summary["worker_processes"] == 2  # the units ran in both Dask worker processes
    con = duckdb.connect()
    rel = con.read_parquet(sorted(str(p) for p in (tmp_path / "emb").glob("part-*.parquet")))
    assert con.execute("SELECT count(*) FROM rel").fetchone()[0] == sum(len(line.split()) for line in lines)
