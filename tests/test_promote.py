"""Promotion by evidence, with real trainings in a real MLflow store: each training logs its train and heldout data
as MLflow datasets; the first version is promoted (no champion yet); a better one moves ``@champion``; a worse one
is registered and not promoted, its tags saying why; trainings on other heldout data are not compared; ``--force``
moves the alias without a comparison and says so; ``elmo promote`` does the same from the command line."""

from __future__ import annotations

import os
from pathlib import Path

import mlflow
import pytest

from elmo_core.options import TrainConfig
from elmo_core.train.loop import train
from elmo_core.train.promote import promote
from tests.helpers import run_elmo
from tests.test_train import FIXTURE_OPTIONS, _ingested_fixture_data

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"


@pytest.fixture(scope="module")
def data(tmp_path_factory, bilm_tf_dir) -> Path:
    return _ingested_fixture_data(tmp_path_factory.mktemp("heldout_data"), bilm_tf_dir, heldout_fraction=0.5)


def _train(data: Path, out: Path, store: str, steps: int, seed: int = 0) -> str:
    options = {**FIXTURE_OPTIONS, "tracking": "mlflow", "tracking_uri": store, "register_as": "promoted"}
    config = TrainConfig(data=str(data), out=str(out), max_steps=steps, seed=seed, checkpoint_every=10, **options)
    return train(config).model_uri  # type: ignore[return-value]


def test_a_better_version_becomes_the_champion_a_worse_one_does_not(tmp_path, data, store, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    first = _train(data, tmp_path / "first", store, 3)
    client = mlflow.MlflowClient(store)
    run = client.get_run(client.get_model_version("promoted", "1").run_id)
    logged = {
        next(t.value for t in d.tags if t.key == "mlflow.data.context"): d.dataset for d in run.inputs.dataset_inputs
    }
    assert set(logged) == {"train", "heldout"} and logged["heldout"].digest and '"tokens"' in logged["heldout"].profile

    # the version's MLflow model carries its ONNX file beside the bilm-tf folder (docs/onnx.md)
    import onnxruntime

    carried = mlflow.artifacts.download_artifacts(f"{first}/artifacts/model.onnx", dst_path=str(tmp_path / "onnx"))
    session = onnxruntime.InferenceSession(carried, providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["layers", "mask"]

    decision = promote(first)
    assert decision.promoted and "the first version" in decision.why and decision.perplexity is not None
    assert str(client.get_model_version_by_alias("promoted", "champion").version) == "1"

    better = _train(data, tmp_path / "better", store, 30)
    # its checkpoints are MLflow 3 LoggedModels of its run, each with its step and heldout perplexity at it
    better_run = client.get_model_version("promoted", "2").run_id
    checkpoints = {
        m.name: {x.key: x.value for x in m.metrics or []}
        for m in mlflow.search_logged_models(output_format="list", filter_string="name LIKE 'checkpoint-%'")
        if m.source_run_id == better_run
    }
    assert {"checkpoint-10", "checkpoint-20"} <= set(checkpoints) and "checkpoint_heldout_perplexity" in checkpoints[
        "checkpoint-20"
    ]
    decision = promote(better)
    assert decision.promoted, decision.line()
    assert decision.perplexity < decision.champion_perplexity and decision.champion == "models:/promoted/1"
    assert str(client.get_model_version_by_alias("promoted", "champion").version) == "2"
    tags = client.get_model_version("promoted", "2").tags
    assert tags["elmo.promotion.decision"] == "promoted" and tags["elmo.promotion.heldout_digest"] == decision.digest

    worse = _train(data, tmp_path / "worse", store, 1, seed=3)
    decision = promote(worse)
    assert not decision.promoted and "not below models:/promoted/2's" in decision.why
    assert str(client.get_model_version_by_alias("promoted", "champion").version) == "2"
    assert client.get_model_version("promoted", "3").tags["elmo.promotion.decision"] == "not promoted"

    env = {**os.environ, "MLFLOW_TRACKING_URI": store}
    forced = run_elmo("promote", "models:/promoted/3", "--force", env=env)
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.strip().endswith("--force: moved without a comparison (@champion named models:/promoted/2)")
    assert str(client.get_model_version_by_alias("promoted", "champion").version) == "3"


def test_versions_trained_on_other_heldout_data_are_not_compared(tmp_path, data, store, monkeypatch, bilm_tf_dir):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    options = {**FIXTURE_OPTIONS, "tracking": "mlflow", "tracking_uri": store, "register_as": "apart"}
    first = train(TrainConfig(data=str(data), out=str(tmp_path / "a"), max_steps=5, **options)).model_uri
    assert promote(first).promoted  # type: ignore[arg-type]
    other = _ingested_fixture_data(tmp_path / "other", bilm_tf_dir, heldout_fraction=0.6)
    second = train(TrainConfig(data=str(other), out=str(tmp_path / "b"), max_steps=5, **options)).model_uri
    decision = promote(second)  # type: ignore[arg-type]
    assert not decision.promoted and "their heldout data differ" in decision.why
    assert str(mlflow.MlflowClient(store).get_model_version_by_alias("apart", "champion").version) == "1"
