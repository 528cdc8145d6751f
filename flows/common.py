"""Shared bits of the flows: environment defaults (set before Prefect is imported), progress in the Prefect UI,
one-line failures (a full disk included, as the ``elmo`` command says it), the retry policy, and ``run_stage``: the
Prefect runner of a stage (``elmo_core.stage``)."""

import functools
import inspect
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

# Telemetry off; elmo_core's log lines go to the Prefect run logs.
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "elmo_core")
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")  # elmo_core also logs outside runs
# a busy 2-core machine can need more than the default 20 s to start the ephemeral API server
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

from prefect import get_run_logger, task, unmapped  # noqa: E402  (after the environment defaults)
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact  # noqa: E402
from prefect.futures import as_completed  # noqa: E402
from prefect.tasks import exponential_backoff  # noqa: E402

from elmo_core import events  # noqa: E402
from elmo_core.errors import ElmoError, StoreUnreachable, disk_full  # noqa: E402
from elmo_core.fileio import as_disk_full, output_of  # noqa: E402
from elmo_core.progress import Progress, add_sink, format_amount, track  # noqa: E402
from elmo_core.stage import Stage  # noqa: E402

PROJECT_ROOT = Path(__file__).resolve().parent.parent
logging.getLogger("elmo_core").setLevel(logging.INFO)  # its INFO lines (not only warnings) reach the run logs

F = TypeVar("F", bound=Callable[..., Any])


class PrefectProgress:
    """A stage's progress in the Prefect UI: a progress artifact per stage, updated every 2% or 10 s, and the
    stage's progress lines (about every 10% or 60 s, with the ETA) in the run's logs."""

    def __init__(self) -> None:
        self.logger = get_run_logger()
        self.artifacts: dict[str, Any] = {}
        self.shown: dict[str, tuple[float, float]] = {}  # name → (time, percent) of the artifact's last update

    def begin(self, progress: Progress) -> None:
        name = progress.name
        self.artifacts[name] = create_progress_artifact(
            0.0, key=f"{name}-progress", description=f"{name}: {progress.unit} done of the stage"
        )
        self.shown[name] = (time.monotonic(), 0.0)
        total = format_amount(progress.total) if progress.total else "?"
        self.logger.info("%s: started (%s %s)", name, total, progress.unit)

    def update(self, progress: Progress, line: str | None) -> None:
        then, shown = self.shown.get(progress.name, (0.0, 0.0))
        now = time.monotonic()
        if progress.name in self.artifacts and (progress.percent - shown >= 2.0 or now - then >= 10.0):
            update_progress_artifact(self.artifacts[progress.name], progress.percent)
            self.shown[progress.name] = (now, progress.percent)
        if line is not None:
            self.logger.info("%s", line)

    def end(self, progress: Progress, seconds: float) -> None:
        if progress.name in self.artifacts:
            update_progress_artifact(self.artifacts.pop(progress.name), 100.0)
        self.logger.info("%s: %s %s in %.0f s", progress.name, format_amount(progress.done), progress.unit, seconds)


@contextmanager
def reporting() -> Iterator[None]:
    """Inside a task or flow: elmo_core's progress also goes to the Prefect UI."""
    with add_sink(PrefectProgress()):
        yield


@contextmanager
def disk_full_as_one_line(folder: Any) -> Iterator[None]:
    """The flows' side of the CLI's mapping: a write that failed for lack of space, in whichever library, becomes the
    one ``DiskFullError`` line naming ``folder`` (the stage's output) and its free space; the traceback stays in the
    run's debug log."""
    try:
        yield
    except Exception as exc:
        full = as_disk_full(exc, folder)
        if full is None or full is exc:
            raise
        logging.getLogger(__name__).debug("the write that failed for lack of space", exc_info=exc)
        raise full from exc


def stage(fn: F) -> F:
    """Run a task body (one of the main job's stages, with an ``out`` folder) with its progress in the Prefect UI and
    a full disk as one line."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = signature.bind_partial(*args, **kwargs).arguments.get("out")
        with reporting(), disk_full_as_one_line(out):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


class _UserErrorsOnce(logging.Filter):
    """Prefect logs a failing run's exception with its traceback, and then the run's final state with the message.
    For an ``ElmoError`` (a user error whose message says what to fix) and a full disk (the flow's one line says
    which folder) only the state line is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, ElmoError) or disk_full(error))


for _logger in ("prefect.task_runs", "prefect.flow_runs"):
    logging.getLogger(_logger).addFilter(_UserErrorsOnce())


def retry_unless_user_error(task: Any, task_run: Any, state: Any) -> bool:
    """Retries are for passing trouble (a busy disk, an MLflow server away for a while, a lost worker), not for
    input that is wrong, nor for a full disk: space is seldom freed within a retry's seconds, the units already
    written are kept and the rerun continues from there, so its one line comes at once (three retries of a unit on a
    full disk held it back 34 s)."""
    error = state.result(raise_on_failure=False)
    if disk_full(error):
        return False
    return not isinstance(error, ElmoError) or isinstance(error, StoreUnreachable)


# the project's one retry policy (``@task(**RETRIED)``): passing trouble is retried three times, 5, 10 and 20 s
# later (give or take a fifth, so that many tasks failed by one outage do not come back at once); a user's error is not
RETRIED: dict[str, Any] = {
    "retries": 3,
    "retry_delay_seconds": exponential_backoff(backoff_factor=5),
    "retry_jitter_factor": 0.2,
    "retry_condition_fn": retry_unless_user_error,
}


def run_main(flow_fn: Callable[..., Any], *args: Any) -> None:
    """Run a flow as a script: its summary on success; on failure its reason in one line and exit status 1."""
    import sys

    state = flow_fn(*args, return_state=True)
    if state.is_failed() or state.is_crashed():
        print(f"{flow_fn.name}: failed: {state.message}", file=sys.stderr)
        sys.exit(1)


@contextmanager
def progress_over(name: str, total: float, unit: str) -> Iterator[Any]:
    """``track`` with the Prefect sink, for progress a flow measures itself (units finished by workers)."""
    with reporting(), track(name, total, unit) as progress:
        yield progress


# ----- the stage protocol (elmo_core.stage), run by Prefect ------------------------------------------------


@task(**RETRIED)
@stage
def plan_stage(runner: Stage, options: Any) -> Any:
    """A stage's plan (options resolved once, the folder's state read), with its progress in the Prefect UI."""
    return runner.plan(options)


@task(**RETRIED)
def run_unit(runner: Stage, plan: Any, unit: Any) -> Any:
    """One unit of a stage, on whichever worker the flow's task runner picks (a Dask worker under ``run_on_dask``)."""
    return runner.run_unit(plan, unit)


@task(**RETRIED)
@stage
def finish_stage(runner: Stage, plan: Any, results: list[Any], seconds: float) -> Any:
    return runner.finish(plan, results, seconds)


def run_stage(runner: Stage, options: Any) -> Any:
    """A stage as Prefect tasks: its plan, one task per unit (named and tagged ``elmo-<stage>-unit``, so a work pool
    can limit them), then its finish; the claim on what the plan writes is held by the flow's process from the plan
    to the finish, and the
    units' progress shows in the Prefect UI. The summary it returns is the stage's own, as ``run_local``'s is."""
    started = time.perf_counter()
    plan = plan_stage.with_options(name=f"plan-{runner.name}")(runner, options)  # reads only: a retry is harmless
    with disk_full_as_one_line(output_of(options)), runner.claim(plan):
        for line in plan.lines():
            get_run_logger().info("%s plan: %s", runner.name, line)
        units = list(plan.units)
        unit_task = run_unit.with_options(name=f"{runner.name}-unit", tags=[f"elmo-{runner.name}-unit"])
        futures = unit_task.map(unmapped(runner), unmapped(plan), units)
        get_run_logger().info("%s: %d units", runner.name, len(units))
        by_future = dict(zip(futures, units))
        with progress_over(runner.name, sum(u.size for u in units), runner.counts) as progress:
            for future in as_completed(futures):
                future.result()
                progress.advance(by_future[future].size, by_future[future].name)
        results = [f.result() for f in futures]
        return finish_stage.with_options(name=f"finish-{runner.name}")(
            runner, plan, results, time.perf_counter() - started
        )


def mlflow_run_link(tracking_uri: str | None, run_id: str | None) -> str | None:
    """Where the run shows in `mlflow ui` (served on 127.0.0.1:5000 by the README's command)."""
    if not run_id:
        return None
    import mlflow

    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    experiment = mlflow.get_run(run_id).info.experiment_id
    return f"http://127.0.0.1:5000/#/experiments/{experiment}/runs/{run_id}"


def announce_promotion(promotion: dict[str, Any] | None, tracking_uri: str | None) -> None:
    """A training's promotion in the Prefect UI (an artifact with the decision and its evidence) and, where the
    version became the alias's, the event ``elmo.model.promoted`` (``elmo_core.events``) that the refresh
    deployment's trigger follows."""
    if not promotion:
        return
    rows = [{"field": key, "value": str(value)} for key, value in promotion.items() if key != "line"]
    create_table_artifact(key="promotion", table=rows, description=promotion["line"])
    events.announce_promotion(promotion, tracking_uri)
