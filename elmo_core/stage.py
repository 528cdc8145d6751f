"""A stage of the pipeline as one protocol: claim its output, plan it, run its units, finish it.

Every stage that does work in pieces (embed, index; ingest, vocab, train, export and evaluate as one unit each)
is a ``Stage``. Its options are resolved once, in ``plan`` (device, precision, the job's identity, what is already
done), and everything after reads the plan:

    with stage.claim(options):                  the output folder's one-writer lock, held by the runner's process
        plan = stage.plan(options)              options → a Plan: what to do, as units (JSON-able, picklable)
        results = [stage.run_unit(plan, u) for u in plan.units]     anywhere: this process, workers, a cluster
        summary = stage.finish(plan, results, seconds)              the table made whole, a summary with .line()

Two runners drive it and decide nothing of their own: ``run_local`` below (the ``elmo`` command: a progress bar,
and ``workers`` processes each with its share of the cores) and ``flows.common.run_stage`` (a unit = a Prefect
task, on Dask under ``run_on_dask``; artifacts built from the summary). Both run the same units, so the CLI and a
deployment of a stage write the same table.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, Protocol, TypeVar

from elmo_core import cpu
from elmo_core.progress import track

OptionsT = TypeVar("OptionsT", contravariant=True)
PlanT = TypeVar("PlanT")
ResultT = TypeVar("ResultT")
SummaryT = TypeVar("SummaryT", covariant=True)


class Unit(Protocol):
    """A piece of a stage's work: named (its output file, its log line) and sized (what progress counts)."""

    @property
    def name(self) -> str: ...

    @property
    def size(self) -> int: ...


class Plan(Protocol):
    @property
    def units(self) -> Sequence[Any]: ...


class Summary(Protocol):
    def line(self) -> str: ...


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


def _run_in_worker(stage: Stage, plan: Any, unit: Any) -> Any:
    cpu.apply_thread_share()  # the environment cpu.worker_env gave this process: its share of the cores
    return stage.run_unit(plan, unit)


def run_local(stage: Stage[OptionsT, PlanT, ResultT, SummaryT], options: OptionsT, workers: int = 1) -> SummaryT:
    """Run a stage in this process (``workers`` > 1: its units in that many spawned processes, each with its share of
    the cores), with a progress bar and ETA; the claim is held from the plan to the finish."""
    started = time.perf_counter()
    with stage.claim(options):
        plan = stage.plan(options)
        units = list(plan.units)  # type: ignore[attr-defined]
        results: dict[str, ResultT] = {}
        with track(stage.name, sum(u.size for u in units), stage.counts) as progress:
            if workers <= 1 or len(units) <= 1:
                for unit in units:
                    tally = _Tally(progress)
                    results[unit.name] = stage.run_unit(plan, unit, tally.report)
                    progress.advance(max(0, unit.size - tally.reported), f"{len(results)}/{len(units)} units")
            else:
                for unit, result in _in_processes(stage, plan, units, workers):
                    results[unit.name] = result
                    progress.advance(unit.size, unit.name)
        return stage.finish(plan, [results[u.name] for u in units], time.perf_counter() - started)


class _Tally:
    """What a unit reported of its progress as it ran; the runner adds the rest when it is done."""

    def __init__(self, progress: Any) -> None:
        self.progress, self.reported = progress, 0

    def report(self, amount: int) -> None:
        self.reported += amount
        self.progress.advance(amount)


def _in_processes(stage: Stage, plan: Any, units: list[Any], workers: int) -> Any:
    """(unit, result) as each finishes in one of ``workers`` spawned processes."""
    spawn = multiprocessing.get_context("spawn")
    with cpu.environment(cpu.worker_env(workers)), ProcessPoolExecutor(workers, mp_context=spawn) as pool:
        futures = {pool.submit(_run_in_worker, stage, plan, unit): unit for unit in units}
        for future in as_completed(futures):
            yield futures[future], future.result()
