"""From a better model to the table, with nobody's hand on it: a real Prefect server and process worker, `prefect
deploy --all` (the refresh deployment with its trigger and concurrency limit from prefect.yaml, pointed at the
corpus with the README's command), real trainings on a real MLflow store (`elmo train --promote-to champion`, as a
user runs them by hand; the train deployment sends the same event, tests/test_orchestration.py).

- the first training is promoted, and a refresh run appears that nobody started: the table's first version;
- a better second one moves the alias, a second version is written and switched to, while a reader process queries
  the table over and over: every answer is one version's, whole;
- a worse third is registered and not promoted: no event, no refresh;
- two forced promotions at once: their refresh runs never run together (one waited for the limit's slot), and the
  table ends on the version the alias names.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from tests.helpers import ROOT, stop_group
from tests.test_orchestration import BIN, _api, _prefect, _readme_champion_params, _wait, prefect_server  # noqa: F401
from tests.test_train import FIXTURE_OPTIONS, _ingested_fixture_data

pytestmark = [pytest.mark.slow, pytest.mark.prefect]

NAME = "news"  # the registered model: its events' resource is elmo.model.news

# queries current.duckdb until told to stop: one JSON line per answer (rows, distinct model ids, the id)
READER = """
import json, sys, time, pathlib
import duckdb
table, stop = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
while not stop.exists():
    try:
        con = duckdb.connect(str(table / "current.duckdb"), read_only=True)
        query = "SELECT count(*), count(DISTINCT model_id), any_value(model_id) FROM vectors"
        rows, ids, model = con.execute(query).fetchone()
        con.close()
        print(json.dumps([rows, ids, model]), flush=True)
    except duckdb.IOException as exc:  # not written yet
        print(json.dumps(["none", str(exc)[:80]]), flush=True)
    time.sleep(0.02)
"""


def _train(env: dict, data: Path, out: Path, steps: int, seed: int = 0) -> subprocess.CompletedProcess:
    options = {**FIXTURE_OPTIONS, "tracking": "mlflow", "register_as": NAME, "promote_to": "champion"}
    config = {**options, "data": str(data), "out": str(out), "max_steps": steps, "seed": seed, "checkpoint_every": 10}
    (out.parent / f"{out.name}.json").write_text(json.dumps(config))
    return _elmo(env, "train", "--config", str(out.parent / f"{out.name}.json"))


def _elmo(env: dict, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "elmo_core.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _refresh_runs(env: dict) -> list[dict]:
    with_id = _api(env, "/deployments/filter", {"deployments": {"name": {"any_": ["champion"]}}})
    (deployment,) = with_id
    runs = _api(env, "/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [deployment["id"]]}}})
    return sorted(runs, key=lambda r: r["created"])


def _promotions(env: dict) -> list[dict]:
    found = _api(env, "/events/filter", {"filter": {"event": {"name": ["elmo.model.promoted"]}}, "limit": 50})
    return found["events"]  # type: ignore[call-overload]


def _states(env: dict, run_id: str) -> list[str]:
    request = f"/flow_run_states/?flow_run_id={run_id}"
    import urllib.request

    with urllib.request.urlopen(env["PREFECT_API_URL"] + request, timeout=30) as response:
        return [s["name"] for s in json.loads(response.read())]


def _all_done(env: dict, count: int) -> bool:
    runs = _refresh_runs(env)
    if any(r["state"]["type"] in ("FAILED", "CRASHED", "CANCELLED") for r in runs):
        raise AssertionError(f"a refresh run failed: {[(r['name'], r['state']['message']) for r in runs]}")
    return len(runs) >= count and all(r["state"]["type"] == "COMPLETED" for r in runs)


def _model_id(version: Path) -> str:
    return json.loads((version / "_job.json").read_text())["model_id"]


def test_promotions_refresh_the_table_by_trigger_alone(prefect_server, tmp_path, bilm_tf_dir):  # noqa: F811
    env = {**prefect_server, "ELMO_CACHE_DIR": str(tmp_path / "cache")}
    data = _ingested_fixture_data(tmp_path / "data", bilm_tf_dir, heldout_fraction=0.5)
    corpus, table = tmp_path / "data" / "ingest", tmp_path / "tables" / "news"

    _prefect(env, "work-pool", "create", "local", "--type", "process", "--overwrite")
    _prefect(env, "--no-prompt", "deploy", "--all")
    # the README's command that points the refresh deployment at a corpus and a table
    params = _readme_champion_params().replace("/runs/news/ingest", str(corpus)).replace("/runs/news", str(tmp_path))
    _prefect(env, "--no-prompt", "deploy", "--name", "champion", "--params", params)
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
        # 1. the first version: promoted (no champion yet), and the table's first version by the trigger alone
        first = _train(env, data, tmp_path / "first", 3)
        assert "promoted to @champion" in first.stdout, first.stdout
        _wait(lambda: _all_done(env, 1), 300, "the first refresh")
        (run,) = _refresh_runs(env)
        assert run["created_by"] and run["created_by"]["type"] == "AUTOMATION", run["created_by"]
        assert run["parameters"]["model"] == f"models:/{NAME}/1"
        pointer = json.loads((table / "current.json").read_text())
        assert pointer["name"] == f"{NAME}-v1" and pointer["model_version"] == f"models:/{NAME}/1"
        v1 = table / "versions" / f"{NAME}-v1"
        header = json.loads((v1 / "_index" / "elmo" / "index.json").read_text())
        assert header["model_version"] == f"models:/{NAME}/1" and header["input_digest"] == pointer["input_digest"]
        query = f"SELECT sum(n_tokens) FROM read_parquet('{corpus}/part-*.parquet')"
        tokens = duckdb.connect().execute(query).fetchall()[0][0]  # a connection of its own, read to its end

        # 2. a better version: a second table version, switched to under a reader that never sees a mix
        stop = tmp_path / "stop-reading"
        reader = subprocess.Popen(
            [sys.executable, "-c", READER, str(table), str(stop)], stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        try:
            better = _train(env, data, tmp_path / "better", 30)
            assert "promoted to @champion" in better.stdout, better.stdout
            _wait(lambda: _all_done(env, 2), 300, "the second refresh")
            time.sleep(0.5)  # a few more reads of the new version
        finally:
            stop.touch()
            answers = [json.loads(line) for line in reader.communicate(timeout=60)[0].splitlines()]
        v2 = table / "versions" / f"{NAME}-v2"
        assert json.loads((table / "current.json").read_text())["name"] == f"{NAME}-v2"
        seen = [a for a in answers if a[0] != "none"]
        assert all(rows == tokens and ids == 1 for rows, ids, _ in seen), [a for a in seen if a[1] != 1][:5]
        assert {m for _, _, m in seen} == {_model_id(v1), _model_id(v2)}  # read before and after the switch
        assert v1.is_dir()  # kept until the next switch

        # 3. a worse version: registered, not promoted, no event, nothing re-embedded
        worse = _train(env, data, tmp_path / "worse", 1, seed=3)
        assert "not promoted to @champion" in worse.stdout, worse.stdout
        assert len(_promotions(env)) == 2 and len(_refresh_runs(env)) == 2

        # 4. two promotions at once: serialized by the deployment's limit; the table ends on the alias's version
        both = [
            subprocess.Popen(
                [sys.executable, "-m", "elmo_core.cli", "promote", f"models:/{NAME}/{n}", "--force"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            for n in (3, 1)
        ]
        assert all(p.wait(timeout=300) == 0 for p in both)
        _wait(lambda: len(_promotions(env)) == 4, 60, "the two promotions' events")
        _wait(lambda: _all_done(env, 4), 400, "the two refreshes")
        last_two = _refresh_runs(env)[2:]
        spans = sorted((r["start_time"], r["end_time"]) for r in last_two)
        assert spans[0][1] <= spans[1][0], spans  # one ended before the other began
        assert any("AwaitingConcurrencySlot" in _states(env, r["id"]) for r in last_two), "the limit never acted"
        from mlflow import MlflowClient

        champion = MlflowClient(env["MLFLOW_TRACKING_URI"]).get_model_version_by_alias(NAME, "champion").version
        assert json.loads((table / "current.json").read_text())["name"] == f"{NAME}-v{champion}"
    finally:
        stop_group(worker)
        worker_log.close()
