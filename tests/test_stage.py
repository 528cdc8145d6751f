"""The stage protocol (``elmo_core/stage.py``) and its runners: every unit runs once, under the stage's claim, in
this process or in workers with the same results; the main job's bookkeeping skips what did not change; the CLI and
a Prefect flow of a stage write the same table."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from elmo_core.stage import WholeStage, fingerprint_files, run_local, run_once
from tests.helpers import ROOT, run_elmo, run_module


@dataclass(frozen=True)
class Piece:
    name: str
    size: int


@dataclass
class Pieces:
    folder: Path
    units: list[Piece]

    def lines(self) -> list[str]:
        return [f"{len(self.units)} pieces into {self.folder}"]


class FilesStage:
    """A stage whose units each write one file (with the pid that wrote it), for the runner's contract: the plan
    reads, the claim holds the folder (and makes it) from before the first unit to after the finish."""

    name, counts = "files", "rows"

    def __init__(self) -> None:
        self.claimed: list[str] = []

    def plan(self, folder: Path) -> Pieces:
        self.claimed.append("planned")
        return Pieces(folder, [Piece(f"part-{i}", 10 + i) for i in range(5)])

    @contextlib.contextmanager
    def claim(self, plan: Pieces):
        self.claimed.append("held")
        plan.folder.mkdir(exist_ok=True)
        yield
        self.claimed.append("released")

    def run_unit(self, plan: Pieces, unit: Piece, report=None) -> dict:
        (plan.folder / unit.name).write_text(str(unit.size))
        if report:
            report(unit.size // 2)
        return {"name": unit.name, "pid": os.getpid()}

    def finish(self, plan: Pieces, results: list[dict], seconds: float) -> list[dict]:
        return results


def test_run_local_runs_every_unit_once_under_the_claim_in_unit_order(tmp_path):
    stage = FilesStage()
    results = run_local(stage, tmp_path / "out")
    assert [r["name"] for r in results] == [f"part-{i}" for i in range(5)]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"part-{i}" for i in range(5)]
    assert stage.claimed == ["planned", "held", "released"] and {r["pid"] for r in results} == {os.getpid()}


def test_run_local_with_workers_gives_the_same_results_from_other_processes(tmp_path):
    results = run_local(FilesStage(), tmp_path / "out", workers=2)
    assert [r["name"] for r in results] == [f"part-{i}" for i in range(5)]  # in unit order, whoever finished first
    assert os.getpid() not in {r["pid"] for r in results}
    assert [(tmp_path / "out" / f"part-{i}").read_text() for i in range(5)] == [str(10 + i) for i in range(5)]


@dataclass
class SlotPieces(Pieces):
    processes: list[dict[str, str]]


class SlotsStage(FilesStage):
    """Units that need the process they run in to show one GPU each (``plan.processes``): each says the slot its
    process was given, and waits (for the other process's first file, at most 60 s) so that both processes work."""

    def plan(self, folder: Path) -> SlotPieces:
        slots = [{"ELMO_TEST_SLOT": "gpu-a"}, {"ELMO_TEST_SLOT": "gpu-b"}]
        return SlotPieces(folder, [Piece(f"part-{i}", 1) for i in range(6)], slots)

    def run_unit(self, plan: Pieces, unit: Piece, report=None) -> dict:
        import time

        (plan.folder / f"{unit.name}.{os.getpid()}").write_text(os.environ.get("ELMO_TEST_SLOT", "none"))
        deadline = time.monotonic() + 60
        while len({p.suffix for p in plan.folder.iterdir()}) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"name": unit.name, "pid": os.getpid(), "slot": os.environ.get("ELMO_TEST_SLOT")}


def test_a_plan_that_names_its_processes_runs_its_units_in_one_process_each(tmp_path):
    """What one GPU per process rests on: two processes, each with one of the plan's environments for all the
    units it runs (the GPUs themselves are in tests/test_gpu.py)."""
    results = run_local(SlotsStage(), tmp_path / "out")
    slot_of = {}
    for r in results:
        assert slot_of.setdefault(r["pid"], r["slot"]) == r["slot"]  # a process keeps the slot it took
    assert sorted(slot_of.values()) == ["gpu-a", "gpu-b"] and os.getpid() not in slot_of


def test_one_gpu_each_follows_what_the_machine_shows():
    from elmo_core.runtime.placement import gpu_processes, one_gpu_each

    assert one_gpu_each(4, None) == [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(4)]
    assert one_gpu_each(2, "3, 5") == [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    assert one_gpu_each(1, None) == [] and one_gpu_each(0, "") == []
    assert gpu_processes("cuda:1") == [] and gpu_processes("cpu") == []  # a GPU named, or none: this process


def test_a_whole_stage_is_one_unit_whose_work_is_the_result(tmp_path):
    class Doubling(WholeStage):
        name = "double"

        def work(self, options: int) -> int:
            return 2 * options

    plan = Doubling().plan(21)
    assert [u.name for u in plan.units] == ["double"] and run_local(Doubling(), 21) == 42


def test_run_once_skips_a_stage_whose_inputs_did_not_change(tmp_path):
    calls = []

    def work() -> dict:
        calls.append(1)
        return {"n": len(calls)}

    folder = tmp_path / "stage"
    assert run_once(folder, "a", work) == {"n": 1}
    assert run_once(folder, "a", work) == {"n": 1} and len(calls) == 1  # skipped: same inputs
    assert run_once(folder, "b", work) == {"n": 2}  # other inputs: done again
    (folder / "checkpoint").write_text("of inputs b")
    assert run_once(folder, "c", work, fresh_start=True) == {"n": 3} and not (folder / "checkpoint").exists()
    stamp = json.loads((folder / "_stage.json").read_text())
    assert stamp == {"fingerprint": "c", "status": "done", "result": {"n": 3}}


def test_a_stage_interrupted_is_done_again_with_the_same_inputs(tmp_path):
    folder = tmp_path / "stage"

    def dies() -> dict:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_once(folder, "a", dies)
    assert json.loads((folder / "_stage.json").read_text())["status"] == "started"
    assert run_once(folder, "a", lambda: {"ok": True}) == {"ok": True}


def test_a_fingerprint_follows_the_files_and_the_options(tmp_path):
    (tmp_path / "a.txt").write_text("one")
    first = fingerprint_files([tmp_path / "a.txt"], {"min_count": 2})
    assert fingerprint_files([tmp_path / "a.txt"], {"min_count": 2}) == first
    assert fingerprint_files([tmp_path / "a.txt"], {"min_count": 3}) != first
    (tmp_path / "a.txt").write_text("one more")
    assert fingerprint_files([tmp_path / "a.txt"], {"min_count": 2}) != first


def _table(folder: Path) -> dict[str, dict[str, list]]:
    return {p.name: pq.read_table(p).to_pydict() for p in sorted(folder.glob("part-*.parquet"))}


@pytest.mark.slow
@pytest.mark.prefect
def test_the_cli_and_the_prefect_flow_of_a_stage_write_the_same_table(tmp_path, allennlp_dir, prefect_home):
    """``elmo embed`` and the embed flow run the same units: the same files, the same rows, the same vectors."""
    from elmo_core.options import EmbedConfig

    source = ROOT / "data" / "probes" / "apple.txt"
    options = ["--model", str(allennlp_dir), "--input", str(source), "--unit-tokens", "40", "--tokenizer", "unicode"]
    cli = run_elmo("embed", *options, "--out", str(tmp_path / "cli"))
    assert cli.returncode == 0, cli.stderr[-2000:]
    config = EmbedConfig(
        model=str(allennlp_dir), input=str(source), out=str(tmp_path / "flow"), unit_tokens=40, tokenizer="unicode"
    )
    # the flow's own temporary Prefect server
    env = {**os.environ, "PREFECT_HOME": str(prefect_home(tmp_path / "prefect"))}
    flow = run_module("flows.embed", config.model_dump_json(), env=env)
    assert flow.returncode == 0, flow.stderr[-2000:]
    by_cli, by_flow = _table(tmp_path / "cli"), _table(tmp_path / "flow")
    assert len(by_cli) > 1 and list(by_cli) == list(by_flow)  # several units, one file each, the same files
    for name, columns in by_cli.items():
        vectors, other = columns.pop("elmo"), by_flow[name].pop("elmo")
        assert columns == by_flow[name], name  # the same rows: tokens, sentences, positions, model
        np.testing.assert_allclose(np.array(vectors), np.array(other), atol=1e-6, rtol=0, err_msg=name)


def test_a_claim_removes_what_a_dead_writer_left_and_keeps_a_live_ones(tmp_path):
    """The next claim of a folder removes the temporary files of a writer that died (its pid is gone), before the
    stage's work; a live writer's (this process's) stay."""
    from types import SimpleNamespace

    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = out / f".part-0.parquet.{dead.stdout.strip()}-0123abcd.tmp"
    live = out / f".part-1.parquet.{os.getpid()}-4567cdef.tmp"
    stale.write_text("half")
    live.write_text("being written")
    seen = []

    class Looking(WholeStage):
        name = "looking"

        def work(self, options: SimpleNamespace) -> list[str]:
            seen.extend(sorted(p.name for p in out.iterdir()))
            return seen

    run_local(Looking(), SimpleNamespace(out=str(out)))
    assert seen == [live.name] and not stale.exists()
