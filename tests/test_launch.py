"""``elmo train --nproc-per-node 2``: torchrun started for the user (gloo on the CPU), with real processes: both ranks
train on disjoint sentences to identical weights and rank 0's result comes back; a rank killed with -9 ends the
launch in one line naming it, with no process left; SIGTERM stops every rank after a checkpoint, and the rerun
continues with exactly the losses of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from elmo_core.data.batches import SentenceStream
from elmo_core.options import TrainConfig
from elmo_core.train.export import latest_checkpoint
from tests.helpers import ROOT
from tests.test_train import FIXTURE_OPTIONS, fixture_data  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _config(tmp_path: Path, data: Path, name: str, **options) -> Path:
    path = tmp_path / f"{name}.json"
    base = {
        **FIXTURE_OPTIONS,
        "data": str(data),
        "out": str(tmp_path / name),
        "device": "cpu",
        "checkpoint_every": 10_000,
    }
    path.write_text(json.dumps({**base, **options}))
    return path


def _start(config: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "elmo_core.cli", "train", "--config", str(config), "--nproc-per-node", "2"],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _family_while(job: subprocess.Popen, until) -> set[psutil.Process]:
    seen: dict[int, psutil.Process] = {}
    for _ in range(1200):
        for child in psutil.Process(job.pid).children(recursive=True):
            seen.setdefault(child.pid, child)
        if until():
            break
        time.sleep(0.1)
    return set(seen.values())


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # gone between the two questions
        return False


def _none_alive(processes: set[psutil.Process]) -> bool:
    time.sleep(1)
    return not [p for p in processes if _alive(p)]


def _rank(processes: set[psutil.Process], rank: int) -> psutil.Process:
    """The process of a launched rank, among those seen (some may have ended since: torchrun's helpers)."""
    for process in processes:
        try:
            if "elmo_core.cli" in " ".join(process.cmdline()) and process.environ().get("RANK") == str(rank):
                return process
        except psutil.Error:
            continue
    raise AssertionError(f"no rank {rank} among {len(processes)} processes")


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _steps(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def test_two_ranks_launched_for_the_user_train_disjoint_sentences_to_one_model(tmp_path, fixture_data):  # noqa: F811
    job = _start(_config(tmp_path, fixture_data, "run", max_steps=6))
    out, err = job.communicate(timeout=600)
    assert job.returncode == 0, err[-3000:]
    assert out.count("train: 6 steps") == 1  # rank 0's result, reported once by the launcher
    digests = json.loads((tmp_path / "run" / "ddp_weights.json").read_text())
    assert len(digests) == 2 and digests[0] == digests[1]
    payload = torch.load(latest_checkpoint(tmp_path / "run"), weights_only=True)
    states = [json.loads(r["batcher"])["forward"] for r in payload["ranks"]]
    assert len(states) == 2
    read = [_sentences_read(fixture_data, rank, state) for rank, state in enumerate(states)]
    assert read[0] and read[1] and not set(read[0]) & set(read[1])  # each rank read its own sentences, none twice
    for rank, state in enumerate(states):  # the sentences a rank's rows were cut off in are among its own
        for row in filter(None, state["rows"]):
            assert any(tokens[len(tokens) - len(row[1]) :] == row[1] for tokens in read[rank].values())


def _sentences_read(data: Path, rank: int, state: dict) -> dict[tuple[int, int, int], list[str]]:
    """The sentences a rank of two had taken when its checkpoint was written, replayed from the same seeded order:
    (epoch, row group position, row) → tokens."""
    stream = SentenceStream(
        sorted((data / "token_ids" / "train").glob("part-*.parquet")),
        TrainConfig.model_fields["seed"].default,
        rank=rank,
        world=2,
    )
    target, read = (state["stream"]["epoch"], state["stream"]["unit"], state["stream"]["offset"]), {}
    for group, row in stream:
        taken = (stream.epoch, stream.unit, stream.offset)  # the position once this sentence is taken
        if taken > target:
            break
        read[(stream.epoch, stream.unit, row)] = group.unread(row, 0)[1]
    return read


def test_a_rank_killed_ends_the_launch_in_one_line_naming_it_and_leaves_no_process(tmp_path, fixture_data):  # noqa: F811
    run = tmp_path / "run"
    job = _start(_config(tmp_path, fixture_data, "run", max_steps=5000))
    family = _family_while(job, lambda: _steps(run) > 20)
    _rank(family, 1).send_signal(signal.SIGKILL)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("elmo train: error: rank 1 of the launched training failed (killed by SIGKILL)"), last
    assert _none_alive(family)


def test_sigterm_stops_every_rank_after_a_checkpoint_and_the_rerun_resumes_exactly(tmp_path, fixture_data):  # noqa: F811
    total = 60
    whole = _start(_config(tmp_path, fixture_data, "whole", max_steps=total))
    assert whole.wait(timeout=600) == 0, whole.communicate()[1][-2000:]
    run = tmp_path / "stopped"
    config = _config(tmp_path, fixture_data, "stopped", max_steps=total, resume=True)
    job = _start(config)
    family = _family_while(job, lambda: _steps(run) > 10)
    started = time.perf_counter()
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 2 and time.perf_counter() - started < 30
    assert "training stopped by signal SIGTERM; rerun it to resume" in err
    assert _none_alive(family)
    checkpoint = latest_checkpoint(run)
    assert checkpoint is not None
    stopped_at = int(checkpoint.stem.split("-")[1])
    assert 10 <= stopped_at < total
    rerun = _start(config)
    out, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, err[-2000:]
    assert f"resumed from {checkpoint}" in out + err
    assert _losses(run) == _losses(tmp_path / "whole")  # every step's loss, before and after the stop


def test_two_machines_meet_and_log_one_run_with_each_machines_system_metrics(tmp_path, fixture_data):  # noqa: F811
    """Two `elmo train` commands, as on two machines (node_rank 0 and 1, one rank each, meeting at node 0 on this
    host): they train together, node 1 says node 0 reports, and the one MLflow run holds both machines' metrics."""
    import socket

    from mlflow.tracking import MlflowClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    config = _config(tmp_path, fixture_data, "two", max_steps=40, tracking="mlflow", tracking_uri=uri, register_as=None)
    env = {**ENV, "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "0.5", "MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING": "1"}
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "elmo_core.cli",
                "train",
                "--config",
                str(config),
                "--nproc-per-node",
                "1",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:]
    assert "node 1 of 2: its ranks finished; node 0 reports the result" in outputs[1]
    assert "train: 40 steps" in outputs[0]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("elmo").experiment_id])
    assert run.data.params["data.world_size"] == "2"
    metrics = set(run.data.metrics)
    assert any(k.startswith("system/node0/") for k in metrics) and any(k.startswith("system/node1/") for k in metrics)


def test_the_ranks_run_the_plan_their_launcher_made(tmp_path, fixture_data, monkeypatch):  # noqa: F811
    """The stage plans once, in the launcher, and every rank trains as that plan says: given a plan of 2 steps for a
    config that asks for 6, the ranks stop at 2 (a rank that planned again would run 6)."""
    import dataclasses

    from elmo_core.train.launch import PLAN_FILE, TrainStage, launch

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = TrainConfig.model_validate_json(
        _config(tmp_path, fixture_data, "planned", max_steps=6, nproc_per_node=2).read_text()
    )
    plan = TrainStage().plan(config)
    assert plan.training is not None and plan.training.total_steps == 6 and any("2 ranks" in x for x in plan.lines())
    result = launch(plan.options, lambda line: None, dataclasses.replace(plan.training, total_steps=2))
    assert result is not None and result.steps == 2
    assert (tmp_path / "planned" / ".launch" / PLAN_FILE).exists()
