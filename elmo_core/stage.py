"""A stage of the pipeline as one protocol: claim its output, plan it, run its units, finish it.

Every stage is a ``Stage``: embed and index in many units; ingest, vocab, train, export, perplexity and the probes in
one (``WholeStage``). Its options are resolved once, in ``plan`` (device, precision, the job's identity, what is already
done), and everything after reads the plan:

    with stage.claim(options):                  the output folder's one-writer lock, held by the runner's process
        plan = stage.plan(options)              options → a Plan: what to do, as units (picklable)
        results = [stage.run_unit(plan, u) for u in plan.units]     anywhere: this process, workers, a cluster
        summary = stage.finish(plan, results, seconds)              the table made whole, a summary with .line()

Two runners drive it and decide nothing of their own: ``run_local`` below (the ``elmo`` command: a progress bar,
and ``workers`` processes each with its share of the cores) and ``flows.common.run_stage`` (a unit = a Prefect
task, on Dask under ``run_on_dask``; artifacts built from the summary). Both run the same units, so the CLI and a
deployment of a stage write the same table.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from elmo_core import cpu
from elmo_core.fileio import write_text_atomic
from elmo_core.progress import track

log = logging.getLogger(__name__)

OptionsT = TypeVar("OptionsT", contravariant=True)
PlanT = TypeVar("PlanT", bound="Plan")
ResultT = TypeVar("ResultT")
SummaryT = TypeVar("SummaryT", covariant=True)


class Unit(Protocol):
    """A piece of a stage's work: named (its output file, its log line) and sized (what progress counts)."""

    @property
    def name(self) -> str: ...

    @property
    def size(self) -> int: ...


class Plan(Protocol):
    """What a stage's plan offers every runner: its units (the rest is the stage's own)."""

    @property
    def units(self) -> Sequence[Unit]: ...


class Stage(Protocol[OptionsT, PlanT, ResultT, SummaryT]):
    """One stage: ``name`` is its verb (the command, the flow, the progress bar), ``counts`` what a unit's size
    measures ("tokens", "rows")."""

    name: str
    counts: str

    def claim(self, options: OptionsT) -> contextlib.AbstractContextManager[Any]: ...

    def plan(self, options: OptionsT) -> PlanT: ...

    def run_unit(self, plan: PlanT, unit: Any, report: Callable[[int], None] | None = None) -> ResultT:
        """Do one unit; ``report(amount)`` as parts of it are done, where the runner shows finer progress."""
        ...

    def finish(self, plan: PlanT, results: list[ResultT], seconds: float) -> SummaryT: ...


@dataclass(frozen=True)
class Whole:
    """The one unit of a stage done in one piece."""

    name: str
    size: int = 1


@dataclass
class WholePlan:
    options: Any
    units: list[Whole]


class WholeStage:
    """A stage done as one unit, whatever runs it: ingest (deduplication against one manifest is sequential), vocab
    (one DuckDB), train (its launcher owns the ranks), export, perplexity, a probe. Its own work keeps its own lock
    and progress bar; a runner drives it as any other stage (in a Prefect flow, the task that calls it is the unit).
    Subclasses name it and say what ``work`` does."""

    name = "stage"
    counts = ""  # no runner's bar: the work shows its own progress

    def claim(self, options: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def plan(self, options: Any) -> WholePlan:
        return WholePlan(options, [Whole(self.name)])

    def run_unit(self, plan: WholePlan, unit: Whole, report: Callable[[int], None] | None = None) -> Any:
        return self.work(plan.options)

    def finish(self, plan: WholePlan, results: list[Any], seconds: float) -> Any:
        return results[0]

    def work(self, options: Any) -> Any:
        raise NotImplementedError


def _run_in_worker(stage: Stage, plan: Plan, unit: Unit) -> Any:
    # the environment cpu.worker_env gave this process holds its share of the cores: the runtime takes it as the
    # model's threads (runtime.placement.take_threads), an index shard as faiss's
    return stage.run_unit(plan, unit)


def run_local(stage: Stage[OptionsT, PlanT, ResultT, SummaryT], options: OptionsT, workers: int = 1) -> SummaryT:
    """Run a stage in this process (``workers`` > 1: its units in that many spawned processes, each with its share of
    the cores), with a progress bar and ETA; the claim is held from the plan to the finish."""
    started = time.perf_counter()
    with stage.claim(options):
        plan = stage.plan(options)
        units = list(plan.units)
        results: dict[str, ResultT] = {}
        with _bar(stage, units) as progress:
            if workers <= 1 or len(units) <= 1:
                for unit in units:
                    tally = _Tally(progress)
                    results[unit.name] = stage.run_unit(plan, unit, tally.report)
                    tally.done(unit, f"{len(results)}/{len(units)} units")
            else:
                for unit, result in _in_processes(stage, plan, units, workers):
                    results[unit.name] = result
                    _Tally(progress).done(unit, unit.name)
        return stage.finish(plan, [results[u.name] for u in units], time.perf_counter() - started)


def _bar(stage: Stage, units: list[Unit]) -> contextlib.AbstractContextManager[Any]:
    """The stage's progress bar, counted in its units' sizes; none where the stage's work shows its own."""
    return track(stage.name, sum(u.size for u in units), stage.counts) if stage.counts else contextlib.nullcontext()


class _Tally:
    """What a unit reported of its progress as it ran; the runner adds the rest when it is done."""

    def __init__(self, progress: Any) -> None:
        self.progress, self.reported = progress, 0

    def report(self, amount: int) -> None:
        self.reported += amount
        if self.progress is not None:
            self.progress.advance(amount)

    def done(self, unit: Unit, info: str) -> None:
        if self.progress is not None:
            self.progress.advance(max(0, unit.size - self.reported), info)


def _in_processes(stage: Stage, plan: Plan, units: list[Unit], workers: int) -> Iterator[tuple[Unit, Any]]:
    """(unit, result) as each finishes in one of ``workers`` spawned processes."""
    spawn = multiprocessing.get_context("spawn")
    with cpu.environment(cpu.worker_env(workers)), ProcessPoolExecutor(workers, mp_context=spawn) as pool:
        futures = {pool.submit(_run_in_worker, stage, plan, unit): unit for unit in units}
        for future in as_completed(futures):
            yield futures[future], future.result()


# ----- a stage's folder, made once per input: the main job's reruns skip what did not change -----------------

STAMP_NAME = "_stage.json"  # in a stage's folder: the input fingerprint it was made from, and its result


def run_once(
    directory: Path, fingerprint: str, work: Callable[[], dict[str, Any]], fresh_start: bool = False
) -> dict[str, Any]:
    """The one way a stage of the main job skips work: its folder's ``_stage.json`` names the input fingerprint it
    was made from. Done with the same fingerprint: skipped, its result returned. Otherwise the stamp says "started"
    while the work runs (an interrupted stage with the same inputs continues: training resumes from its checkpoints)
    and "done" with the result after. ``fresh_start``: work of other inputs in the folder is removed first
    (checkpoints of another training configuration)."""
    path = directory / STAMP_NAME
    stamp = json.loads(path.read_text()) if path.exists() else None
    if stamp and stamp["fingerprint"] == fingerprint and stamp.get("status", "done") == "done":
        log.info("%s: inputs unchanged (fingerprint %s…), skipped", directory.name, fingerprint[:12])
        return stamp["result"]
    if fresh_start and stamp and stamp["fingerprint"] != fingerprint and directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"fingerprint": fingerprint, "status": "started"}, indent=2) + "\n")
    result = work()
    done = {"fingerprint": fingerprint, "status": "done", "result": result}
    write_text_atomic(path, json.dumps(done, indent=2, default=str) + "\n")
    return result


def fingerprint_files(paths: Iterable[Path], extra: Any = None) -> str:
    """An input fingerprint from files' names, sizes and modification times (cheap, no reading) plus parameters."""
    digest = hashlib.sha256(json.dumps(extra, sort_keys=True, default=str).encode())
    for path in sorted(Path(p) for p in paths):
        if path.is_dir():
            for child in sorted(path.rglob("*")):
                if child.is_file() and not child.name.endswith(".tmp"):
                    stat = child.stat()
                    digest.update(f"{child}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        elif path.exists():
            stat = path.stat()
            digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()
