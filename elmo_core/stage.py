"""A stage of the pipeline as one protocol: plan it, claim what it writes, run its units, finish it.

Every stage is a ``Stage``: embed and index in many units; ingest, vocab, train, export, perplexity and the probes in
one (``WholeStage``). A stage's options are read and decided once, in ``plan`` (device, precision, the job's
identity, what is already done, what it will write); ``plan`` writes, deletes and trains nothing, so a retried or
repeated plan is harmless and ``elmo <stage> --plan`` prints it and changes nothing on disk. Everything after reads
the plan:

    plan = stage.plan(options)                  options → a Plan: what to do, as units (picklable), and its lines
    with stage.claim(plan):                     every folder the plan writes locked, before a byte of it changes
        results = [stage.run_unit(plan, u) for u in plan.units]     anywhere: this process, workers, a cluster
        summary = stage.finish(plan, results, seconds)              the table made whole, a summary with .line()

``stage.identity(options)`` is what a rerun compares (the main job skips a stage whose identity and inputs did not
change). Two runners drive it and decide nothing of their own: ``run_local`` below (the ``elmo`` command: a
progress bar, and ``workers`` processes each with its share of the cores) and ``flows.common.run_stage`` (a unit
= a Prefect task, on Dask under ``run_on_dask``; artifacts built from the summary). Both run the same units, so the
CLI and a deployment of a stage write the same table.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing
import multiprocessing.queues
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from elmo_core import cpu
from elmo_core.fileio import FolderLock, beside, remove_stale_temps, write_text_atomic
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
    """What a stage's plan offers every runner: its units, and what it decided as lines (``--plan`` prints them,
    a run logs them before it acts). A plan may also say which processes its units need (``processes``: one
    environment each, such as one GPU each for embedding); ``run_local`` then runs the units in those."""

    @property
    def units(self) -> Sequence[Unit]: ...

    def lines(self) -> list[str]: ...


class Stage(Protocol[OptionsT, PlanT, ResultT, SummaryT]):
    """One stage: ``name`` is its verb (the command, the flow, the progress bar), ``counts`` what a unit's size
    measures ("tokens", "rows")."""

    name: str
    counts: str

    def identity(self, options: OptionsT) -> dict[str, Any]: ...

    def plan(self, options: OptionsT) -> PlanT: ...

    def claim(self, plan: PlanT) -> contextlib.AbstractContextManager[Any]: ...

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
    """A one-unit stage's plan: its options, the folders it writes (the claim locks them), what it decided."""

    options: Any
    units: list[Whole]
    writes: list[Path] = field(default_factory=list)
    decided: list[str] = field(default_factory=list)
    wait: bool = False

    def lines(self) -> list[str]:
        return [*self.decided, *(f"writes {folder}" for folder in self.writes)]


@contextlib.contextmanager
def claim_folders(folders: Sequence[Path], wait: bool = False) -> Iterator[None]:
    """Lock every folder a stage writes (``fileio.beside``: the lock lives next to the folder), in a fixed order, so
    that a second job on any of them is refused in one line (or waits, with ``wait``) before anything changes; then
    the temporary files of writers that died are removed from it."""
    with contextlib.ExitStack() as stack:
        for folder in sorted({Path(f).absolute() for f in folders}):
            stack.enter_context(FolderLock(beside(folder), folder, wait=wait))
            remove_stale_temps(folder)  # left by a writer that died (killed, or stopped by a full disk)
        yield


class WholeStage:
    """A stage done as one unit, whatever runs it: ingest (deduplication against one manifest is sequential), vocab
    (one DuckDB), train (its launcher owns the ranks), export, perplexity, a probe. Its own work shows its own
    progress; a runner drives it as any other stage (in a Prefect flow, the task that calls it is the unit).
    Subclasses name it, say what it writes (``writes``), what it decided (``decide``, reading only) and what
    ``work`` does."""

    name = "stage"
    counts = ""  # no runner's bar: the work shows its own progress

    def identity(self, options: Any) -> dict[str, Any]:
        return options.identity()

    def writes(self, options: Any) -> list[Path]:
        out = getattr(options, "out", None)
        return [Path(out)] if out else []

    def decide(self, options: Any) -> list[str]:
        """What this run will do, read and decided without writing (the plan's lines)."""
        return []

    def settle(self, options: Any) -> Any:
        """The options as the run will use them, decided once in the plan: a model reference that moves
        (``models:/NAME/latest``, an alias) pinned to the exact version it names now, so that the work, and every
        process it starts, reads that version (``runtime.reference.pin_reference``). By default: as given."""
        return options

    def plan(self, options: Any) -> WholePlan:
        options = self.settle(options)
        wait = bool(getattr(options, "wait", False))
        return WholePlan(options, [Whole(self.name)], self.writes(options), self.decide(options), wait)

    def claim(self, plan: WholePlan) -> contextlib.AbstractContextManager[None]:
        return claim_folders(plan.writes, plan.wait)

    def run_unit(self, plan: WholePlan, unit: Whole, report: Callable[[int], None] | None = None) -> Any:
        return self.work(plan.options)

    def finish(self, plan: WholePlan, results: list[Any], seconds: float) -> Any:
        return results[0]

    def work(self, options: Any) -> Any:
        raise NotImplementedError


def show_plan(stage: Stage, options: Any) -> list[str]:
    """``elmo <stage> --plan``: the plan's lines, nothing written (the plan only reads)."""
    plan = stage.plan(options)
    units = list(plan.units)
    head = f"{stage.name}: {len(units)} unit{'s' if len(units) != 1 else ''}"
    if stage.counts:
        head += f", {sum(u.size for u in units):,} {stage.counts}"
    return [head, *plan.lines()]


def _run_in_worker(stage: Stage, plan: Plan, unit: Unit) -> Any:
    # the environment cpu.worker_env gave this process holds its share of the cores: the runtime takes it as the
    # model's threads (runtime.placement.take_threads), an index shard as faiss's
    return stage.run_unit(plan, unit)


def run_local(stage: Stage[OptionsT, PlanT, ResultT, SummaryT], options: OptionsT, workers: int = 1) -> SummaryT:
    """Run a stage in this process (``workers`` > 1: its units in that many spawned processes, each with its share of
    the cores; a plan that names its ``processes``, one GPU each: in those), with a progress bar and ETA: the plan,
    then the claim (held to the finish) and the plan's lines."""
    started = time.perf_counter()
    plan = stage.plan(options)
    with stage.claim(plan):
        for line in plan.lines():  # what it decided, before it acts (a refused claim prints only its refusal)
            log.info("%s plan: %s", stage.name, line)
        units = list(plan.units)
        results: dict[str, ResultT] = {}
        processes = _processes(plan, workers)
        with _bar(stage, units) as progress:
            if len(processes) <= 1 or len(units) <= 1:
                for unit in units:
                    tally = _Tally(progress)
                    results[unit.name] = stage.run_unit(plan, unit, tally.report)
                    tally.done(unit, f"{len(results)}/{len(units)} units")
            else:
                for unit, result in _in_processes(stage, plan, units, processes):
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


def _processes(plan: Plan, workers: int) -> list[dict[str, str]]:
    """The processes a local run spreads the units over, as what each one's environment adds: the plan's own
    (``plan.processes``, one GPU each) where it names several, else ``workers`` alike; [] for this process alone."""
    own = list(getattr(plan, "processes", None) or [])
    if len(own) > 1:
        return own
    return [{} for _ in range(workers)] if workers > 1 else []


def _take_environment(environments: multiprocessing.queues.Queue) -> None:
    """A spawned worker's first act: take one of the environments left (one GPU: before CUDA starts in it)."""
    os.environ.update(environments.get(timeout=60))


def _in_processes(
    stage: Stage, plan: Plan, units: list[Unit], processes: list[dict[str, str]]
) -> Iterator[tuple[Unit, Any]]:
    """(unit, result) as each finishes in one of ``len(processes)`` spawned processes, each with its share of the
    cores and one of ``processes``' environments."""
    spawn = multiprocessing.get_context("spawn")
    environments = spawn.Queue()
    for environment in processes:
        environments.put(environment)
    with (
        cpu.environment(cpu.worker_env(len(processes))),
        ProcessPoolExecutor(
            len(processes), mp_context=spawn, initializer=_take_environment, initargs=(environments,)
        ) as pool,
    ):
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
    with FolderLock(beside(directory), directory):  # the stage's claim (in ``work``) is the same lock: one job
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
