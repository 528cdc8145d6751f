"""End to end with real servers: a Prefect server, a process worker, `prefect deploy --all`,
`prefect deployment run elmo/train` and `embed/embed`, checked through MLflow's client and DuckDB; the train
deployment on two processes (completed, a rank killed, cancelled and resumed).
Plus the embed flow on a 2-worker Dask LocalCluster. Everything runs on 127.0.0.1 and is torn down."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import duckdb
import pytest

from tests.helpers import free_port, run_module, start_server, stop_group

pytestmark = [pytest.mark.slow, pytest.mark.prefect]

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CORPUS = (
    "\n".join(
        f"the {a} {b} sat on the {c} near the {d} ."
        for a, b, c, d in [
            ("old", "cat", "mat", "door"),
            ("young", "dog", "rug", "fire"),
            ("small", "bird", "branch", "nest"),
            ("big", "horse", "hill", "barn"),
            ("red", "fox", "log", "river"),
            ("grey", "mouse", "floor", "wall"),
        ]
        * 5
    )
    + "\nI like to eat apples .\nMany people find the Apple phone easy to use .\n"
)


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory, prefect_home):
    home = prefect_home(tmp_path_factory.mktemp("prefect_home"))
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "DO_NOT_TRACK": "true",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_TRACKING_URI": f"sqlite:///{home}/mlflow.db",
        "PYTHONUNBUFFERED": "1",
    }
    server = start_server(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        f"http://127.0.0.1:{port}/api/health",
        home / "server.log",
        env,
    )
    try:
        yield env
    finally:
        stop_group(server)


def _prefect(env: dict, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(BIN / "prefect"), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"prefect {' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def _check_mlflow_ui(env: dict, run_id: str, tmp_path: Path) -> None:
    """The README's `mlflow ui --backend-store-uri ...` serves the run."""
    port = free_port()
    command = [str(BIN / "mlflow"), "ui", "--backend-store-uri", env["MLFLOW_TRACKING_URI"]]
    command += ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    ui_env = {**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    ui = start_server(command, f"http://127.0.0.1:{port}/health", tmp_path / "mlflow.log", ui_env)
    try:
        url = f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/get?run_id={run_id}"
        with urllib.request.urlopen(url, timeout=30) as r:
            assert json.loads(r.read())["run"]["info"]["run_id"] == run_id
    finally:
        stop_group(ui)


def _api(env: dict, path: str, body: dict) -> list[dict]:
    request = urllib.request.Request(
        env["PREFECT_API_URL"] + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _check_progress_in_the_ui(env: dict) -> None:
    """Each long stage left a progress artifact at 100% and progress lines (with an ETA) in its run's logs."""
    artifacts = _api(env, "/artifacts/filter", {"artifacts": {"type": {"any_": ["progress"]}}})
    done = {a["key"]: a["data"] for a in artifacts}
    for stage in ("ingest", "vocab", "train", "evaluate", "embed"):
        assert done.get(f"{stage}-progress") == 100.0, (stage, done)
    messages: list[str] = []
    while True:
        page = _api(env, "/logs/filter", {"limit": 200, "offset": len(messages), "sort": "TIMESTAMP_ASC"})
        messages += [log["message"] for log in page]
        if len(page) < 200:
            break
    assert any(m.startswith("train: started (") for m in messages), messages[:50]
    assert any(m.startswith("train: ") and "ETA" in m for m in messages)
    assert any(m.startswith("train: ") and " steps in " in m for m in messages)


def _readme_params(deployment: str) -> str:
    """The JSON after `prefect deployment run DEPLOYMENT --watch --params` in the README's walkthrough."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(rf"prefect deployment run {re.escape(deployment)} --watch --params '(.*?)'", readme, re.S)
    assert match, f"no `prefect deployment run {deployment}` in the README"
    return match.group(1)


def _readme_champion_params() -> str:
    """The JSON after `prefect --no-prompt deploy --name champion --params` in the README's walkthrough."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"prefect --no-prompt deploy --name champion --params '(.*?)'", readme, re.S)
    assert match, "no `prefect --no-prompt deploy --name champion --params` in the README"
    return match.group(1)


def test_the_readme_walkthrough_through_a_worker(prefect_server, tmp_path):
    """The README's commands as written (its paths mapped into tmp_path): deploy, train, embed; tables hold exactly
    one row per corpus token."""
    env = prefect_server
    corpus, runs = tmp_path / "corpora" / "news", tmp_path / "runs" / "news"
    corpus.mkdir(parents=True)
    lines = CORPUS.splitlines()
    for i in range(2):  # the README trains on *.txt.gz
        with gzip.open(corpus / f"part{i}.txt.gz", "wt", encoding="utf-8") as f:
            f.write("\n".join(lines[i::2]) + "\n")

    def params_of(text: str) -> str:
        text = text.replace("/corpora/news", str(corpus)).replace("/runs/news", str(runs))
        json.loads(text)  # valid JSON, as the README shows it
        return text

    def params(deployment: str) -> str:
        return params_of(_readme_params(deployment))

    _prefect(env, "work-pool", "create", "local", "--type", "process", "--overwrite")
    deployed = _prefect(env, "--no-prompt", "deploy", "--all")
    assert "elmo/train" in deployed.stdout and "embed/embed" in deployed.stdout and "probe/probe" in deployed.stdout
    assert "elmo/train-gpu" in deployed.stdout and "refresh/champion" in deployed.stdout
    _prefect(env, "--no-prompt", "deploy", "--name", "champion", "--params", params_of(_readme_champion_params()))
    worker_log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen(
        [str(BIN / "prefect"), "worker", "start", "--pool", "local"],
        cwd=ROOT,
        env=env,
        stdout=worker_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        run = _prefect(
            env,
            "deployment",
            "run",
            "elmo/train",
            "--params",
            params("elmo/train"),
            "--watch",
            "--watch-timeout",
            "900",
            timeout=1000,
        )
        assert "Completed" in run.stdout, run.stdout[-3000:]

        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
        experiment = client.get_experiment_by_name("elmo")
        (mlrun,) = client.search_runs([experiment.experiment_id])
        assert mlrun.info.status == "FINISHED"
        assert {"loss", "perplexity_forward", "perplexity_backward", "tokens_per_s", "heldout_perplexity"} <= set(
            mlrun.data.metrics
        )
        assert mlrun.data.params["config.preset"] == "small" and mlrun.data.params["config.batch_size"] == "128"
        assert {"export", "checkpoint", "config.json"} <= {a.path for a in client.list_artifacts(mlrun.info.run_id)}
        assert [int(v.version) for v in client.search_model_versions("name = 'elmo'")] == [1]
        _check_mlflow_ui(env, mlrun.info.run_id, tmp_path)
        # lineage and promotion: the run's datasets, the first version @champion, and the event Prefect received
        contexts = {t.value for d in mlrun.inputs.dataset_inputs for t in d.tags if t.key == "mlflow.data.context"}
        assert contexts == {"train", "heldout"}
        assert str(client.get_model_version_by_alias("elmo", "champion").version) == "1"
        events = _api(env, "/events/filter", {"filter": {"event": {"name": ["elmo.model.promoted"]}}, "limit": 5})
        (promoted,) = events["events"]  # type: ignore[call-overload]
        assert promoted["resource"]["prefect.resource.id"] == "elmo.model.elmo"
        assert promoted["payload"]["model"] == "models:/elmo/1" and promoted["payload"]["alias"] == "champion"

        # ... which the refresh deployment's trigger followed: the corpus's table, version 1, in use
        def refreshes() -> list[dict]:
            return _api(env, "/flow_runs/filter", {"flows": {"name": {"any_": ["refresh"]}}})

        def refreshed() -> bool:
            states = [r["state"]["type"] for r in refreshes()]
            assert not {"FAILED", "CRASHED"} & set(states), (tmp_path / "worker.log").read_text()[-3000:]
            return states == ["COMPLETED"]

        _wait(refreshed, 300, "the refresh the promotion triggered")
        (refresh,) = refreshes()
        assert refresh["created_by"]["type"] == "AUTOMATION"  # nobody started it
        pointer = json.loads((runs / "tables" / "news" / "current.json").read_text())
        assert pointer["name"] == "elmo-v1" and pointer["model_version"] == "models:/elmo/1"

        run = _prefect(
            env,
            "deployment",
            "run",
            "embed/embed",
            "--params",
            params("embed/embed"),
            "--watch",
            "--watch-timeout",
            "600",
            timeout=700,
        )
        assert "Completed" in run.stdout, run.stdout[-3000:]
        _check_progress_in_the_ui(env)

        # judge the registered model with the tagging probe, through the probe deployment
        tagging = ROOT / "data" / "probes" / "tagging"
        probe = {
            "kind": "tag",
            "tag": {
                "model": "models:/elmo/latest",
                "train": str(tagging / "train.tsv"),
                "dev": str(tagging / "dev.tsv"),
                "out": str(runs / "probe_tag"),
                "min_steps": 50,
            },
        }
        run = _prefect(
            env,
            "deployment",
            "run",
            "probe/probe",
            "--params",
            json.dumps(probe),
            "--watch",
            "--watch-timeout",
            "600",
            timeout=700,
        )
        assert "Completed" in run.stdout, run.stdout[-3000:]
        results = json.loads((runs / "probe_tag" / "results.json").read_text())
        assert set(results["dev"]["accuracy"]) == {"layer_0", "layer_1", "layer_2", "mix"}
        probe_run = client.get_run(results["mlflow_run_id"])
        assert "tag/acc/mix" in probe_run.data.metrics and probe_run.data.tags["elmo.probe"] == "tag"
        markdown = _api(env, "/artifacts/filter", {"artifacts": {"key": {"any_": ["probe-tag"]}}})
        assert markdown and "| layer_1 |" in markdown[0]["data"]
    finally:
        stop_group(worker)
        worker_log.close()

    con = duckdb.connect()
    tokens = con.execute(
        "SELECT sum(n_tokens) FROM read_parquet($p)", {"p": str(runs / "ingest" / "part-*.parquet")}
    ).fetchone()[0]
    rows, sentences = con.execute(
        "SELECT count(*), count(DISTINCT sentence_id) FROM read_parquet($p)",
        {"p": str(runs / "embed" / "**" / "*.parquet")},
    ).fetchone()
    assert rows == tokens and sentences == 8  # 6 distinct template sentences + the two apple sentences
    probe_tokens = sum(
        len(line.split()) for line in (ROOT / "data" / "probes" / "apple.txt").read_text(encoding="utf-8").splitlines()
    )
    probe_rows = con.execute(
        "SELECT count(*) FROM read_parquet($p)", {"p": str(runs / "probe_vectors" / "*.parquet")}
    ).fetchone()[0]
    assert probe_rows == probe_tokens  # the pipeline's probe vectors have their own table
    top = con.execute(
        "SELECT token, list_cosine_similarity(elmo, (SELECT elmo FROM read_parquet($p) WHERE token = 'apples')) AS s "
        "FROM read_parquet($p) WHERE token <> 'apples' ORDER BY s DESC LIMIT 1",
        {"p": str(runs / "embed" / "*.parquet")},
    ).fetchone()
    assert -1.0 <= top[1] <= 1.0


def test_embed_flow_on_a_two_worker_dask_cluster_then_its_index(prefect_server, tmp_path, allennlp_dir, monkeypatch):
    for key, value in prefect_server.items():
        monkeypatch.setenv(key, value)
    from elmo_core.ingest import IngestConfig, ingest
    from elmo_core.vectors.embed import EmbedConfig

    lines = [f"sentence number {i} about the {w} ." for i, w in enumerate(["apple", "phone", "river", "bank"] * 50)]
    (tmp_path / "c.txt").write_text("\n".join(lines) + "\n")
    ingest(
        IngestConfig(sources=[str(tmp_path / "c.txt")], out=str(tmp_path / "ing"))
    )  # one row group, cut into units by tokens
    script = (
        "import json, sys; from flows.embed import run_on_dask; from elmo_core.vectors.embed import EmbedConfig; "
        "print(json.dumps(run_on_dask(EmbedConfig.model_validate_json(sys.argv[1]), n_workers=2)))"
    )
    config = EmbedConfig(
        model=str(allennlp_dir), input=str(tmp_path / "ing"), out=str(tmp_path / "emb"), unit_tokens=280, index=True
    )  # 40 sentences a unit: 5 units; then the index, its shard built on a worker
    result = subprocess.run(
        [sys.executable, "-c", script, config.model_dump_json()],
        cwd=ROOT,
        env={**os.environ},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["files"] == 5
    assert summary["worker_processes"] == 2  # the units ran in both Dask worker processes
    con = duckdb.connect()
    rel = con.read_parquet(sorted(str(p) for p in (tmp_path / "emb").glob("part-*.parquet")))  # noqa: F841  (used by name)
    assert con.execute("SELECT count(*) FROM rel").fetchone()[0] == sum(len(line.split()) for line in lines)

    from elmo_core.vectors.query import EmbeddingStore

    assert summary["index_shards"] == 1 and summary["index_line"].startswith("index: 1 shards (1,400 rows) built")
    indexed, exact = EmbeddingStore(tmp_path / "emb"), EmbeddingStore(tmp_path / "emb", exact=True)
    got = indexed.nearest_tokens("bank", k=5)
    assert indexed.last_path.startswith(f"query: index {tmp_path / 'emb' / '_index' / 'elmo'}")
    # the template sentences make near-ties: the same similarities, whichever of a tie comes first
    assert [h.similarity for h in got] == pytest.approx([h.similarity for h in exact.nearest_tokens("bank", k=5)])
    markdown = _api(prefect_server, "/artifacts/filter", {"artifacts": {"key": {"any_": ["embedding-index"]}}})
    assert markdown and f"elmo query {tmp_path / 'emb'} --token" in markdown[0]["data"]


def test_a_failing_flow_reports_its_reason_once_without_tracebacks_or_retries(prefect_server, tmp_path, allennlp_dir):
    (tmp_path / "a_file").write_text("not a folder\n")
    config = {
        "model": str(allennlp_dir),
        "input": str(ROOT / "data" / "probes" / "apple.txt"),
        "out": str(tmp_path / "a_file"),
    }
    result = run_module("flows.embed", json.dumps(config), env=prefect_server)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in output
    reason = f"{tmp_path / 'a_file'}: is a file; --out takes a folder"
    assert (
        result.stderr.strip().splitlines()[-1].startswith("embed: failed: ")
        and reason in result.stderr.strip().splitlines()[-1]
    )
    assert "Retry" not in output  # a user error is not retried
    messages = [
        log["message"] for log in _api(prefect_server, "/logs/filter", {"limit": 200, "sort": "TIMESTAMP_DESC"})
    ]
    runs_reporting = [m for m in messages if reason in m]
    assert 1 <= len(runs_reporting) <= 2  # the failed task's state line and the flow's, each once


def _flow_run_state(env: dict, flow_run_id: str) -> str:
    try:
        (run,) = _api(env, "/flow_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
    except urllib.error.HTTPError as exc:
        return f"unknown ({exc})"  # asked again by _wait
    return run["state"]["type"]


def _wait(condition, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _ranks_of(workdir: Path) -> list:
    """The processes of a launched training under ``workdir`` (torchrun and its ranks name its config file)."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if str(workdir) in " ".join(process.info["cmdline"] or []) and "elmo_core.cli" in " ".join(
                process.info["cmdline"]
            ):
                found.append(process)
        except psutil.Error:
            pass
    return found


def _gone(processes: list) -> bool:
    import psutil

    def alive(p) -> bool:  # noqa: ANN001
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    return not any(alive(p) for p in processes)


def test_the_train_deployment_on_two_processes_completes_fails_cleanly_cancels_and_resumes(prefect_server, tmp_path):
    """`prefect deployment run elmo/train` with nproc_per_node 2 through a real worker: a rank killed with -9 fails
    the flow run naming the rank; a cancel stops every rank; each leaves no process; the rerun of the cancelled one
    resumes from its checkpoint and completes, with one MLflow run of world size 2 and identical replicas."""
    env = prefect_server
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((CORPUS + "\n") * 3)
    _prefect(env, "work-pool", "create", "local", "--type", "process", "--overwrite")
    _prefect(env, "--no-prompt", "deploy", "--all")
    train = {
        "preset": "tiny",
        "nproc_per_node": 2,
        "batch_size": 2,
        "unroll_steps": 10,
        "n_negative_samples_batch": 8,
        "register_as": None,
        "checkpoint_every": 20,
        "log_every": 10,
        "n_train_tokens": 1_000_000,
    }  # fmt: skip  (long epochs: no heldout evaluation every few steps)

    def params(name: str, **options) -> str:  # noqa: ANN003
        return json.dumps(
            {
                "params": {
                    "sources": [str(corpus)],
                    "workdir": str(tmp_path / name),
                    "probes": None,
                    "ingest": {"tokenizer": "whitespace", "split_sentences": False, "heldout_fraction": 0.2},
                    "vocab": {"min_count": 1},
                    "train": {**train, **options},
                }
            }  # fmt: skip
        )

    def start(name: str, **options) -> str:  # noqa: ANN003
        out = _prefect(env, "deployment", "run", "elmo/train", "--params", params(name, **options)).stdout
        return re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)

    worker_log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen(
        [str(BIN / "prefect"), "worker", "start", "--pool", "local"],
        cwd=ROOT, env=env, stdout=worker_log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        # a rank killed with -9: the flow run fails, naming the rank; nothing is left running
        killed = start("killed", max_steps=100_000)
        _wait(lambda: list((tmp_path / "killed" / "train" / "checkpoints").glob("step-*.pt")), 600, "a checkpoint")
        family = _ranks_of(tmp_path / "killed")
        (rank1,) = [p for p in family if p.environ().get("RANK") == "1"]
        rank1.kill()
        _wait(lambda: _flow_run_state(env, killed) in ("FAILED", "CRASHED"), 120, "the failed state")
        failed = "rank 1 of the launched training failed (killed by SIGKILL)"

        def errors() -> list[str]:  # the run's error lines (its logs reach the server in batches, a little later)
            query = {"logs": {"flow_run_id": {"any_": [killed]}, "level": {"ge_": 40}}, "limit": 200}
            return [log["message"] for log in _api(env, "/logs/filter", query)]

        _wait(lambda: any(failed in message for message in errors()), 60, f"{failed!r} in the run's logs")
        _wait(lambda: _gone(family), 60, "no process left after the kill")

        # cancelled: every rank stops within Prefect's grace period; the rerun resumes from the checkpoint
        cancelled = start("cancel", max_steps=240)
        _wait(lambda: list((tmp_path / "cancel" / "train" / "checkpoints").glob("step-*.pt")), 600, "a checkpoint")
        family = _ranks_of(tmp_path / "cancel")
        assert len([p for p in family if p.environ().get("RANK") in ("0", "1")]) == 2
        _prefect(env, "flow-run", "cancel", cancelled)
        _wait(lambda: _flow_run_state(env, cancelled) == "CANCELLED", 120, "the cancelled state")
        _wait(lambda: _gone(family), 60, "no process left after the cancel")
        stopped_at = max(
            int(p.stem.split("-")[1]) for p in (tmp_path / "cancel" / "train" / "checkpoints").glob("*.pt")
        )
        assert stopped_at < 240
        again = _prefect(env, "deployment", "run", "elmo/train", "--params", params("cancel", max_steps=240),
                         "--watch", "--watch-timeout", "900", timeout=1000)  # fmt: skip
        assert "Completed" in again.stdout, again.stdout[-3000:]
        rerun = re.search(r"UUID: ([0-9a-f-]{36})", again.stdout).group(1)
        logs = _api(env, "/logs/filter", {"logs": {"flow_run_id": {"any_": [rerun]}}, "limit": 200})
        assert any("resumed from" in log["message"] for log in logs)
        steps = [json.loads(line)["step"] for line in (tmp_path / "cancel" / "train" / "metrics.jsonl").open()]
        assert max(steps) == 240
        # completed: the resumed MLflow run, of world size 2, and the two replicas' weights identical
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
        (mlrun,) = [
            r
            for r in client.search_runs([client.get_experiment_by_name("elmo").experiment_id])
            if r.data.params.get("config.out") == str(tmp_path / "cancel" / "train")
        ]
        assert mlrun.data.params["data.world_size"] == "2" and mlrun.info.status == "FINISHED"
        digests = json.loads((tmp_path / "cancel" / "train" / "ddp_weights.json").read_text())
        assert len(digests) == 2 and len(set(digests)) == 1
    finally:
        stop_group(worker)
        worker_log.close()
