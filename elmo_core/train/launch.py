"""Training on several processes without typing torchrun: PyTorch's own launcher (``torch.distributed.run``) as a
child process group that the train stage owns.

``launch(config)`` trains in this process when the launch options ask for one process; otherwise it starts
torchrun with ``nproc_per_node`` ranks (``auto``: the visible GPUs, else 1) on ``nnodes`` machines, streams rank 0's
lines to ``on_line`` (the terminal, or Prefect's logger; its progress lines move this process's own progress),
and returns rank 0's result from the file it writes. A rank that dies ends the launch in one line naming it and its
last error; a stop (SIGTERM or SIGINT to this process, a Prefect cancel) reaches every rank, which stop at the same
step after a checkpoint, and no process is left behind. Several machines meet at node 0 (``rdzv_endpoint``, the
static rendezvous): machine N runs ranks N * nproc_per_node onwards, so rank 0 and its result are on node 0, and
the launch on another machine ends with one line saying so.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elmo_core import cpu
from elmo_core.errors import ElmoError
from elmo_core.options import TrainConfig
from elmo_core.progress import Progress
from elmo_core.ranks import this_process
from elmo_core.runtime.placement import place, visible_gpus
from elmo_core.runtime.reference import pin_reference
from elmo_core.stage import Whole, WholePlan, WholeStage
from elmo_core.tracking import check_reachable
from elmo_core.train.loop import train
from elmo_core.train.plan import TrainingPlan, plan_training
from elmo_core.train.promote import promote
from elmo_core.train.run import TrainResult

log = logging.getLogger(__name__)

LAUNCH_DIR = ".launch"  # in the run folder: the ranks' config, logs and rank 0's result
RESULT_FILE = "result.json"
PLAN_FILE, PLAN_ENV = "plan.pickle", "ELMO_TRAINING_PLAN"  # the launcher's plan, which every rank runs


def _given_plan() -> TrainingPlan | None:
    """In a rank of a launch: the plan its launcher made (pickled by this project's launcher into the run folder it
    holds), or None where it made none (a rank then plans, as a run started by hand does)."""
    path = os.environ.get(PLAN_ENV)
    return pickle.loads(Path(path).read_bytes()) if path and Path(path).exists() else None


GRACE_S = 25.0  # a stop waits this long for the ranks' checkpoint (Prefect's grace period is 30 s)


class LaunchError(ElmoError):
    """A rank of a launched training failed."""


def world_of(config: TrainConfig) -> tuple[int, int]:
    """(processes per node, nodes) the launch options ask for; ``auto``: the visible GPUs, else 1."""
    per_node = config.nproc_per_node
    if per_node == "auto":
        per_node = visible_gpus() or 1
    return int(per_node), config.nnodes


def launch(
    config: TrainConfig, on_line: Callable[[str], None] = print, plan: TrainingPlan | None = None
) -> TrainResult | None:
    """Train (or resume) with the launch options of ``config``, as ``plan`` decided (``TrainStage.plan``; every rank
    gets it, through ``PLAN_FILE``); see the module docstring. Rank 0's result, or None on a machine other than
    node 0 (whose launcher has it)."""
    per_node, nodes = world_of(config)
    if this_process().launched:  # a rank of a launch: rank 0 tells the launcher, which reports
        write_result(train(config, plan=_given_plan()))
        return None
    if per_node * nodes == 1:
        return train(config, plan=plan)
    folder = Path(config.out) / LAUNCH_DIR
    if nodes > 1:  # machines sharing a file system each keep their own launch folder
        folder = folder / f"node{config.node_rank}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RESULT_FILE).unlink(missing_ok=True)
    config_file = folder / "config.json"
    config_file.write_text(config.model_dump_json(indent=2))
    plan_file = folder / PLAN_FILE
    if plan is not None:  # the ranks run what was planned, not a plan of their own
        plan_file.write_bytes(pickle.dumps(plan))
    else:
        plan_file.unlink(missing_ok=True)
    log.info("launching %d processes per node on %d node(s) with torch.distributed.run", per_node, nodes)
    child = subprocess.Popen(
        _command(config, per_node, config_file, folder / "logs"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, which the stage ends as a whole
        preexec_fn=_die_with_parent,
        env={
            **os.environ,
            **_cpu_share(config, per_node),
            "ELMO_RESULT_FILE": str(folder / RESULT_FILE),
            PLAN_ENV: str(plan_file),
        },
    )
    lines: list[str] = []
    relay = ProgressRelay()
    with _stopping(child):
        for line in child.stdout:  # type: ignore[union-attr]
            lines.append(line.rstrip("\n"))
            del lines[:-200]
            text = _strip_rank_prefix(line.rstrip("\n"))
            if not relay.feed(text):
                on_line(text)
        code = child.wait()
    relay.close()
    _end_group(child)
    if code != 0:
        raise LaunchError(_failure(lines, folder / "logs", code))
    if config.node_rank > 0:
        on_line(f"node {config.node_rank} of {nodes}: its ranks finished; node 0 reports the result")
        return None
    return TrainResult(**_read_result(folder / RESULT_FILE))


class ProgressRelay:
    """Rank 0's progress lines (``train: 120/600 steps (20%), ETA …``) replayed as this process's own progress, so
    the stage's progress bar, or its progress artifact in the Prefect UI, moves as the ranks train."""

    LINE = re.compile(
        r"^\s*(?:\S+ \S+ \S+ INFO )?(\w+): ([\d,.]+)/([\d,.]+) (\w+) \(\d+%\)(?:, ETA [\d:?]+)?(?:, (.*))?$"
    )

    def __init__(self) -> None:
        self.running: dict[str, Progress] = {}

    def feed(self, line: str) -> bool:
        """Replay ``line`` if it is a progress line (True: the replay reports it, do not log it twice)."""
        match = self.LINE.match(line)
        if match is None:
            return False
        name, done, total, unit, info = match.groups()
        done_n, total_n = float(done.replace(",", "")), float(total.replace(",", ""))
        progress = self.running.get(name)
        if progress is None or progress.total != total_n:
            if progress is not None:
                progress.close()
            progress = self.running[name] = Progress(name, total_n, unit, done=0.0)
        progress.update(done_n, info)
        if done_n >= total_n:
            self.running.pop(name).close()
        return True

    def close(self) -> None:
        for progress in self.running.values():
            progress.close()
        self.running.clear()


def _cpu_share(config: TrainConfig, per_node: int) -> dict[str, str]:
    """CPU ranks split this machine's cores (``cpu.worker_env``): each gets cores / ranks torch threads, where
    torchrun alone would give each one thread, and torch alone each every core."""
    on_gpu = place(config.device).torch_device.type == "cuda"  # the runtime's device, as each rank's will be
    return {} if on_gpu else cpu.worker_env(per_node)


def _command(config: TrainConfig, per_node: int, config_file: Path, logs: Path) -> list[str]:
    rendezvous = ["--standalone"]
    if config.rdzv_endpoint:  # the static rendezvous: machine node_rank gets ranks node_rank * per_node onwards, so
        host, _, port = config.rdzv_endpoint.rpartition(":")  # rank 0 (and its result) is on node 0
        rendezvous = ["--master-addr", host, "--master-port", port, "--node-rank", str(config.node_rank)]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(per_node),
        "--nnodes",
        str(config.nnodes),
        *rendezvous,
        "--log-dir",
        str(logs),
        "--redirects",
        "3",
        "--tee",
        "3",
        "--local-ranks-filter",
        "0",
        "-m",
        "elmo_core.cli",
        "train",
        "--config",
        str(config_file),
    ]


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies (Linux), so a killed flow run
    never leaves a training behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class _stopping:
    """While the child runs: SIGTERM/SIGINT to this process (main thread only) become a stop of the whole group."""

    def __init__(self, child: subprocess.Popen) -> None:
        self.child = child
        self.previous: dict[int, object] = {}

    def __enter__(self) -> _stopping:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._stop)
        return self

    def _stop(self, signum: int, _frame: object) -> None:
        log.warning("stopping every rank (a checkpoint first, at most %.0f s)", GRACE_S)
        stop(self.child)
        raise LaunchError(f"training stopped by signal {signal.Signals(signum).name}; rerun it to resume")

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def stop(child: subprocess.Popen) -> None:
    """SIGTERM to every rank (they checkpoint at the same step and exit), then SIGKILL to what is left."""
    try:
        os.killpg(child.pid, signal.SIGTERM)
        child.wait(timeout=GRACE_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    _end_group(child)


def _end_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_RANK_PREFIX = re.compile(r"^\[(?:default)?\d+\]:")


def _strip_rank_prefix(line: str) -> str:
    return _RANK_PREFIX.sub("", line, count=1)


def _failure(lines: list[str], logs: Path, code: int) -> str:
    """One line: which rank failed, how, and its last error line (from torchrun's summary and the rank's log)."""
    text = "\n".join(lines)
    failed = [(int(r), int(c)) for r, c in re.findall(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", text, re.S)]
    if not failed:
        last = next((line for line in reversed(lines) if line.strip()), "")
        return f"the launched training failed (exit code {code}): {_strip_rank_prefix(last)[:300]}"
    # torchrun's root cause (listed last), unless another rank was killed by a signal torchrun does not send itself
    # (it stops the rest with SIGTERM): then that kill is the cause, and the root cause a rank broken by it
    killed = [(r, c) for r, c in failed if c < 0 and -c not in (signal.SIGTERM, signal.SIGINT)]
    rank, number = killed[0] if killed and failed[-1][1] >= 0 else failed[-1]
    how = f"killed by {signal.Signals(-number).name}" if number < 0 else f"exit code {number}"
    return f"rank {rank} of the launched training failed ({how}): {_last_error(logs, rank)}"


_ERROR_LINE = re.compile(r"^(elmo [\w ]+: error: |[\w.]*(Error|Exception): )")


def _last_error(logs: Path, rank: int) -> str:
    """The rank's own last error: its ``elmo train: error: …`` line, or the last line of a traceback."""
    for path in sorted(logs.rglob(f"{rank}/stderr.log"), key=lambda p: p.stat().st_mtime, reverse=True):
        errors = [line.strip() for line in path.read_text(errors="replace").splitlines() if _ERROR_LINE.match(line)]
        if errors:
            return errors[-1][:300]
    return "it wrote no error of its own (killed from outside, or out of memory)"


def _read_result(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        raise LaunchError(f"{path}: rank 0 wrote no result") from None
    data["model_dir"] = Path(data["model_dir"])
    return data


def write_result(result: TrainResult) -> None:
    """Rank 0 of a launch leaves its result where ``launch`` reads it (``ELMO_RESULT_FILE``)."""
    target = os.environ.get("ELMO_RESULT_FILE")
    if target and this_process().main:
        data = {**result.__dict__, "model_dir": str(result.model_dir)}
        Path(target).write_text(json.dumps(data, default=str))


class TrainStage(WholeStage):
    """Training as a stage, one unit: its launcher owns the ranks (``launch``). ``on_line``: where rank 0's lines go
    (the terminal, or a Prefect run's log). Its result is None on a rank of a launch and on a machine other than
    node 0: the launcher on node 0 reports."""

    name = "train"

    def __init__(self, on_line: Callable[[str], None] = print) -> None:
        self.on_line = on_line

    def settle(self, config: TrainConfig) -> TrainConfig:
        """``init_from`` pinned (``models:/elmo/latest`` → ``models:/elmo/3``) before the ranks start: every rank,
        and a resume, fine-tunes the version the plan named, and the MLflow run's parameters name it."""
        if config.init_from is None or this_process().launched:
            return config
        return config.model_copy(update={"init_from": pin_reference(config.init_from)})

    def plan(self, config: TrainConfig) -> TrainPlan:
        """The run's decisions (``plan_training``), made once, here: the unit hands them to the training, and a
        launch to each of its ranks (``PLAN_FILE``), which plan nothing again. A rank of a launch plans nothing."""
        config = self.settle(config)
        whole = [Whole(self.name)]
        if this_process().launched:  # the launcher planned the run; each rank takes its plan (``_given_plan``)
            return TrainPlan(config, whole, self.writes(config), [], bool(getattr(config, "wait", False)))
        if config.tracking == "mlflow":
            check_reachable(config.tracking_uri)  # a tracking server that is away: refused first, in seconds
        per_node, nodes = world_of(config)
        world = per_node * nodes
        training = plan_training(config, world=world)
        training.require_room()  # refused in one line where the run's checkpoints and export will not fit
        lines = training.lines() + (
            [f"{world} ranks ({per_node} a node on {nodes} nodes), torchrun"] if world > 1 else []
        )
        return TrainPlan(config, whole, self.writes(config), lines, bool(getattr(config, "wait", False)), training)

    def writes(self, config: TrainConfig) -> list[Path]:
        """The run folder, which node 0's launcher holds for every rank; another machine's launcher writes only its
        own launch folder inside it."""
        out = Path(config.out)
        return [out] if config.node_rank == 0 else [out / LAUNCH_DIR / f"node{config.node_rank}"]

    def claim(self, plan: Any) -> contextlib.AbstractContextManager[Any]:
        """The lock of what it writes; a rank of a launch leaves it to its launcher, which holds it for the ranks."""
        return contextlib.nullcontext() if this_process().launched else super().claim(plan)

    def run_unit(self, plan: TrainPlan, unit: Whole, report: Callable[[int], None] | None = None) -> Any:
        result = launch(plan.options, self.on_line, plan.training)
        config = plan.options
        if result is not None and config.promote_to and (result.model_uri or "").startswith("models:/"):
            # the registered version against @promote_to, on the same heldout data (train.promote)
            try:
                decision = promote(
                    result.model_uri, config.promote_to, config.promote_margin, False, config.tracking_uri
                )
                result.promotion = decision.record()
            except (ElmoError, OSError) as exc:  # the model is trained and registered; `elmo promote` decides later
                line = f"{result.model_uri}: not promoted, the comparison failed: {str(exc).splitlines()[0]}"
                result.promotion = {"model": result.model_uri, "promoted": False, "line": line}
            self.on_line(result.promotion["line"])
        return result


@dataclass
class TrainPlan(WholePlan):
    """The training stage's plan: its lines, and the decisions themselves (None on a rank of a launch)."""

    training: TrainingPlan | None = None
