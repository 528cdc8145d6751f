"""Checkpoints carry their SHA-256; a damaged one (truncated, zeroed, another file) is skipped with one warning."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from elmo_core.errors import CheckpointError
from elmo_core.train.checkpoint import (
    digest_path,
    list_checkpoints,
    load_checkpoint,
    load_newest_valid,
    write_checkpoint,
)
from tests.helpers import run_elmo


def _run(tmp_path: Path, steps=(10, 20, 30)) -> Path:
    for step in steps:
        write_checkpoint(tmp_path, step, {"step": step, "weights": torch.full((64,), float(step))}, keep=3)
    return tmp_path


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _zero(path: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


def _replace_with_another_file(path: Path) -> None:
    other = path.with_name("other.pt")
    torch.save({"step": 99, "weights": torch.zeros(64)}, other)  # a loadable checkpoint, but not these bytes
    shutil.move(other, path)


def test_digests_are_written_beside_and_rotated_with_the_checkpoints(tmp_path):
    run = _run(tmp_path, steps=(10, 20, 30, 40))
    names = [p.name for p in list_checkpoints(run)]
    assert names == ["step-000000020.pt", "step-000000030.pt", "step-000000040.pt"]
    digests = sorted(p.name for p in (run / "checkpoints").glob("*.sha256"))
    assert digests == [n + ".sha256" for n in names]
    line = digest_path(list_checkpoints(run)[-1]).read_text()
    assert line.endswith("  step-000000040.pt\n") and len(line.split()[0]) == 64  # sha256sum -c reads it


@pytest.mark.parametrize("damage", [_truncate, _zero, _replace_with_another_file])
def test_the_newest_valid_checkpoint_is_used_and_the_damaged_one_named(tmp_path, caplog, damage):
    run = _run(tmp_path)
    newest = list_checkpoints(run)[-1]
    damage(newest)
    with caplog.at_level("WARNING"):
        path, payload = load_newest_valid(run)
    assert path.name == "step-000000020.pt" and payload["step"] == 20
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and str(newest) in warnings[0] and "SHA-256 differs" in warnings[0]
    with pytest.raises(CheckpointError, match="SHA-256 differs"):
        load_checkpoint(newest)


def test_no_valid_checkpoint_is_one_error_naming_each(tmp_path):
    run = _run(tmp_path)
    for path in list_checkpoints(run):
        _zero(path)
    with pytest.raises(
        CheckpointError,
        match=r"no valid checkpoint in .*checkpoints: .*step-000000030.pt .*step-000000020.pt .*step-000000010.pt",
    ):
        load_newest_valid(run)
    assert load_newest_valid(tmp_path / "fresh") is None


def test_a_checkpoint_without_a_digest_must_still_load(tmp_path):
    run = _run(tmp_path)
    newest = list_checkpoints(run)[-1]
    digest_path(newest).unlink()
    assert load_newest_valid(run)[0] == newest  # an older version's checkpoint: accepted when it loads
    _truncate(newest)
    assert load_newest_valid(run)[0].name == "step-000000020.pt"


@pytest.mark.slow
def test_train_resume_and_export_survive_a_damaged_newest_checkpoint(tmp_path, bilm_tf_dir):
    """Through the CLI as a user runs it: the resumed run logs exactly the losses of an uninterrupted run."""
    from elmo_core.data.vocab import VocabConfig, build_vocab
    from elmo_core.ingest import IngestConfig, ingest
    from tests.test_train import FIXTURE_OPTIONS

    ingest(
        IngestConfig(
            sources=[str(bilm_tf_dir / "train" / "data.txt")], out=str(tmp_path / "ingest"), heldout_fraction=0.0
        )
    )
    build_vocab(
        VocabConfig(
            corpus=str(tmp_path / "ingest"),
            db=str(tmp_path / "vocab" / "vocab.duckdb"),
            vocab_file=str(bilm_tf_dir / "train" / "vocab.txt"),
        )
    )
    options = {
        **FIXTURE_OPTIONS,
        "data": str(tmp_path / "vocab"),
        "checkpoint_every": 10,
        "keep_checkpoints": 3,
        "seed": 3,
    }

    def train(name: str, *flags: str) -> subprocess.CompletedProcess:
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump({**options, "out": str(tmp_path / name)}))
        return run_elmo("train", "--config", str(config), *flags, timeout=600)

    def losses(name: str) -> dict[int, float]:
        return {
            r["step"]: r["loss"] for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
        }

    assert train("ref", "--max-steps", "50").returncode == 0
    assert train("run", "--max-steps", "40").returncode == 0
    newest = list_checkpoints(tmp_path / "run")[-1]
    assert newest.name == "step-000000040.pt"
    _truncate(newest)

    exported = run_elmo("export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "exp"))
    assert exported.returncode == 0, exported.stderr
    assert (
        exported.stdout.startswith("export: step 30 of ")
        and "step-000000040.pt" in exported.stderr
        and "Traceback" not in exported.stderr
    )

    resumed = train("run", "--max-steps", "50", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "skipped damaged checkpoint" in resumed.stderr and "step-000000040.pt" in resumed.stderr
    assert losses("run") == losses("ref") and len(losses("ref")) == 50

    for path in list_checkpoints(tmp_path / "run"):
        _zero(path)
    failed = train("run", "--max-steps", "60", "--resume")
    assert failed.returncode == 2 and "Traceback" not in failed.stderr
    assert failed.stderr.strip().splitlines()[-1].startswith("elmo train: error: no valid checkpoint in ")
