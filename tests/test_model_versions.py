"""A job resolves its model once, when it plans, to the exact version it then names: an embedding table resumed after
``latest`` moved is refused in one line that says how to finish it; a probe and a fine-tuning run are pinned to the
version their plan saw. A real MLflow store (SQLite) and the ``elmo`` command as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import h5py
import pytest

from elmo_core.options import TrainConfig, WsdConfig
from tests.helpers import ROOT, run_elmo

MODEL = ROOT / "tests" / "fixtures" / "allennlp_elmo"

pytestmark = pytest.mark.slow


def register(folder: Path, name: str) -> str:
    from elmo_core.tracking import MLflowTracker

    tracker = MLflowTracker(experiment="versions-test")
    registered = tracker.log_model_dir(folder, name)
    tracker.close()
    return registered  # type: ignore[return-value]


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """An MLflow store of its own and a download cache of its own, for this process and the commands it runs."""
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "ELMO_CACHE_DIR": str(tmp_path / "cache")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return {**os.environ, **env}


def scaled(folder: Path, factor: float) -> Path:
    shutil.copytree(MODEL, folder)
    with h5py.File(folder / "lm_weights.hdf5", "r+") as f:
        f.visititems(lambda _, node: node.write_direct(node[()] * factor) if isinstance(node, h5py.Dataset) else None)
    return folder


def test_a_table_resumed_after_latest_moved_is_refused_then_finished(tmp_path: Path, store: dict[str, str]) -> None:
    assert register(MODEL, "pinned") == "models:/pinned/1"
    text = tmp_path / "text.txt"
    text.write_text("".join(f"Sentence number {i} is about apples and pears .\n" for i in range(40)))
    out = tmp_path / "table"
    args = ["--input", str(text), "--out", str(out), "--unit-tokens", "100"]
    first = run_elmo("embed", "--model", "models:/pinned/latest", *args, env=store)
    assert first.returncode == 0, first.stderr
    job = json.loads((out / "_job.json").read_text())
    assert job["model"] == "models:/pinned/latest" and job["model_version"] == "models:/pinned/1"
    assert job["model_identity"]["version"] == "1" and job["model_identity"]["run_id"]
    parts = sorted(out.glob("part-*.parquet"))
    assert len(parts) > 2
    parts[-1].unlink()  # the job was killed before its last unit
    (out / "_manifest.json").unlink()

    assert register(scaled(tmp_path / "second", 1.1), "pinned") == "models:/pinned/2"
    moved = run_elmo("embed", "--model", "models:/pinned/latest", *args, env=store)
    assert moved.returncode == 2
    line = moved.stderr.strip().splitlines()[-1]
    assert "models:/pinned/1" in line and "models:/pinned/2" in line, line
    assert "--model models:/pinned/1 finishes it" in line, line
    assert not parts[-1].exists()  # nothing written

    finished = run_elmo("embed", "--model", "models:/pinned/1", *args, env=store)
    assert finished.returncode == 0, finished.stderr
    assert parts[-1].exists() and json.loads((out / "_job.json").read_text())["model_version"] == "models:/pinned/1"


def test_a_probe_and_a_fine_tuning_are_pinned_to_the_version_their_plan_saw(
    tmp_path: Path, store: dict[str, str]
) -> None:
    from elmo_core.train.launch import TrainStage
    from elmo_core.vectors.probe import ProbeStage

    register(MODEL, "pinned")
    register(scaled(tmp_path / "second", 1.1), "pinned")
    probe = ProbeStage().plan(WsdConfig(model="models:/pinned/latest", out=str(tmp_path / "probe"), tracking="none"))
    assert probe.options.model == "models:/pinned/2"
    assert any("models:/pinned/2" in line for line in probe.lines())
    alias = TrainStage().settle(
        TrainConfig(data=str(tmp_path), out=str(tmp_path / "run"), init_from="models:/pinned/2")
    )
    assert alias.init_from == "models:/pinned/2"  # an exact version stays as it is
    import mlflow

    mlflow.MlflowClient().set_registered_model_alias("pinned", "champion", "1")
    config = TrainConfig(data=str(tmp_path), out=str(tmp_path / "run"), init_from="models:/pinned@champion")
    assert TrainStage().settle(config).init_from == "models:/pinned/1"
    assert TrainStage().settle(config.model_copy(update={"init_from": str(MODEL)})).init_from == str(MODEL)
