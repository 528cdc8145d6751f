"""The model processes: each loads the biLM once (``compute.BatchEmbedder``) with its share of the cores and runs
the batches it is sent, one at a time. Every process of a pool loads the one model the server resolved
(``WorkerPlan.model``, a ``ModelRef`` pinned with its content hash), and so does every restart: a restart after
``latest`` moved still loads the version the pool was planned with, and one whose files changed under the same
folder refuses to load. A reload is another pool (its ``generation``), started beside this one.

The HTTP process watches each through its pipe: a process that dies fails only the batch it held (those requests
get 503) and is started again: at once the first time, then after a pause that doubles (a process that dies as it
starts would otherwise be respawned as fast as the machine can). One busy past the batch timeout is killed
(``kill``), and that is a death like any other.

A model process ignores SIGINT and SIGTERM: the HTTP process decides when serving ends (after draining) and then
closes the pipe, which ends the process; a pipe that closes because the HTTP process died ends it too.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from elmo_core import cpu
from elmo_core.runtime.reference import ModelRef
from elmo_core.serve.api import Answer, Batch
from elmo_core.serve.encode import Computed

log = logging.getLogger(__name__)

RESTARTS_BEFORE_GIVING_UP = 5  # deaths in a row with no batch answered in between: the model cannot run here
# Below the HTTP process in the CPU's queue: when a burst and the model want the same cores, the HTTP process
# still reads requests and answers 429s at once, and the model takes the rest.
WORKER_NICENESS = 5
RESTART_PAUSE_S = (0.0, 1.0, 2.0, 4.0, 8.0)  # before the n-th restart in a row; the last repeats


@dataclass(frozen=True)
class WorkerPlan:
    """What every model process is told: the exact model, where and how it runs, its token budget (the batcher's,
    so that the runtime's line names the budget it is given), and how many share the machine."""

    model: ModelRef  # resolved once by the HTTP process; its files, pinned with their content hash
    device: str  # the runtime's placement, decided once before the port was bound (``run.place_model``)
    precision: str
    precision_why: str
    processes: int
    max_batch_tokens: int


def _embedder(plan: WorkerPlan) -> Any:
    """The model's runner in this process: ONNX Runtime for an ``elmo onnx`` file (torch never imported), else the
    runtime."""
    if plan.model.onnx:
        from elmo_core.serve.onnx_compute import OnnxEmbedder

        return OnnxEmbedder(plan.model, plan.max_batch_tokens)
    from elmo_core.serve.compute import BatchEmbedder

    return BatchEmbedder(plan.model, plan.device, plan.precision, plan.precision_why, plan.max_batch_tokens)


def worker_main(conn: Connection, plan: WorkerPlan) -> None:
    """A model process: load, warm up, say ready (or why not), then answer batches until the pipe closes.

    A batch's vectors go to the answer thread, which encodes and sends them, while this thread says ``computed``
    and takes the next batch: the HTTP process sends one as soon as it hears that. Why: encoding a batch of 33
    sentences' layers as JSON floats takes about 12 ms on a 2-vCPU Xeon beside some 50 ms of model, and the next
    batch waited for it. Where a core is free it now runs beside the next batch (+2% measured, the model on one of
    two cores); where the model's threads take every core it gains nothing (docs/benchmarks.md). At most one batch
    waits for the answer thread (``answers``), so a slow encoder holds the model back rather than piling answers
    up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.nice(WORKER_NICENESS)
    sending = threading.Lock()  # both threads send on the one pipe

    def send(message: tuple) -> None:
        with sending:
            conn.send(message)

    try:
        plan.model.check_unchanged()  # a restart must load the model the pool was planned with, or none
        embedder = _embedder(plan)
        seconds = embedder.warm_up()
        send(("ready", {**embedder.info(), "warm_up_seconds": round(seconds, 3)}))
    except Exception as exc:  # the model cannot load or run here: one line for the user, the server stops
        send(("fatal", f"{type(exc).__name__}: {exc}".splitlines()[0]))
        return
    answers: queue.Queue[tuple[Batch, Computed] | None] = queue.Queue(maxsize=1)
    answering = threading.Thread(target=_answer, args=(answers, send), name="answers", daemon=True)
    answering.start()
    while True:
        try:
            batch: Batch | None = conn.recv()
        except (EOFError, OSError):  # the HTTP process is gone
            break
        if batch is None:  # serving ends
            break
        try:
            computed = embedder.run(batch)
        except Exception as exc:  # a batch the model cannot run: its requests get the line, the process goes on
            log.error("batch %d failed: %s", batch.id, traceback.format_exc())
            send(("failed", batch.id, f"{type(exc).__name__}: {exc}".splitlines()[0]))
            continue
        send(("computed", batch.id))
        answers.put((batch, computed))
    answers.put(None)
    answering.join()


def _answer(answers: queue.Queue, send: Callable[[tuple], None]) -> None:
    """The answer thread: each computed batch encoded as its requests asked, and sent."""
    while (item := answers.get()) is not None:
        batch, computed = item
        try:
            answer = computed.answer(batch)
        except Exception as exc:  # an answer that cannot be encoded fails its batch, not the process
            log.error("batch %d failed: %s", batch.id, traceback.format_exc())
            message: tuple = ("failed", batch.id, f"{type(exc).__name__}: {exc}".splitlines()[0])
        else:
            message = ("done", answer)
        try:
            send(message)
        except OSError:  # the HTTP process is gone: the main thread ends the process
            return


@dataclass
class Worker:
    """One model process as the HTTP process sees it."""

    slot: int
    pool: WorkerPool | None = None  # the pool (one model version) it belongs to
    process: Any = None
    conn: Connection | None = None
    ready: bool = False
    batch: Batch | None = None  # the batch it is computing
    answering: dict[int, Batch] = field(default_factory=dict)  # computed, their answers being encoded and sent
    info: dict[str, Any] = field(default_factory=dict)
    deaths_in_a_row: int = 0
    alive: bool = False  # its process started and not yet seen to end
    killed_why: str | None = None  # set when the pool kills it (busy past the batch timeout)

    @property
    def able(self) -> bool:
        """It can answer, now or once warm: running, and not being killed."""
        return self.alive and self.killed_why is None

    @property
    def state(self) -> str:
        if not self.alive:
            return "restarting"
        if self.killed_why is not None:
            return "killed"
        return ("busy" if self.batch is not None else "idle") if self.ready else "loading"


class WorkerEvents:
    """What the pool reports, in the event loop's thread (``Batcher`` implements it)."""

    def worker_ready(self, worker: Worker) -> None: ...
    def batch_computed(self, worker: Worker) -> None: ...
    def batch_done(self, worker: Worker, answer: Answer) -> None: ...
    def batch_failed(self, worker: Worker, batch_id: int, message: str) -> None: ...
    def worker_lost(self, worker: Worker, batches: list[Batch], exitcode: int | None) -> None: ...
    def fatal(self, message: str) -> None: ...


class WorkerPool:
    """``plan.processes`` model processes (spawned, so no torch state is forked), each read by a thread of its own
    whose news the event loop receives through ``call``. ``generation`` counts the server's pools: 1 at start, one
    more each reload. ``on_fatal``: where a pool that cannot run its model reports (by default the events' ``fatal``,
    which stops the server; a reload's pool reports to the reload instead, and the serving pool goes on)."""

    def __init__(
        self,
        plan: WorkerPlan,
        events: WorkerEvents,
        call: Callable[..., Any],
        generation: int = 1,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self.plan, self.events, self.call, self.generation = plan, events, call, generation
        self.on_fatal = on_fatal or events.fatal
        self.workers = [Worker(i, self) for i in range(plan.processes)]
        self.closing = False
        self.restarts = 0
        self._context = multiprocessing.get_context("spawn")

    @property
    def model(self) -> ModelRef:
        return self.plan.model

    def start(self) -> None:
        for worker in self.workers:
            self._spawn(worker)

    def _spawn(self, worker: Worker) -> None:
        parent, child = self._context.Pipe()
        process = self._context.Process(
            target=worker_main,
            args=(child, self.plan),
            name=f"elmo-serve-worker-{self.generation}-{worker.slot}",
            daemon=True,
        )
        with cpu.environment(cpu.worker_env(self.plan.processes)):  # its share of the cores, as embed workers get
            process.start()
        child.close()
        worker.process, worker.conn, worker.ready, worker.batch, worker.answering = process, parent, False, None, {}
        worker.alive, worker.killed_why = True, None
        threading.Thread(target=self._read, args=(worker, parent, process), daemon=True).start()

    def idle(self) -> Worker | None:
        return next((w for w in self.workers if w.ready and w.batch is None), None)

    @property
    def ready_count(self) -> int:
        return sum(w.ready for w in self.workers)

    @property
    def all_ready(self) -> bool:
        return all(w.ready for w in self.workers)

    @property
    def busy(self) -> bool:
        return any(w.batch is not None or w.answering for w in self.workers)

    @property
    def able_count(self) -> int:
        """Model processes that can answer now or once warm (what /health is decided on)."""
        return sum(w.able for w in self.workers)

    def kill(self, worker: Worker, why: str) -> None:
        """End a process that must not go on (hung on a batch): its reader thread then reports the loss."""
        if worker.process is not None and worker.alive and worker.killed_why is None:
            worker.killed_why = why
            log.error("worker %d (pid %s) %s", worker.slot, worker.info.get("pid"), why)
            worker.process.kill()

    def send(self, worker: Worker, batch: Batch) -> None:
        worker.batch = batch
        try:
            worker.conn.send(batch)  # type: ignore[union-attr]
        except OSError:  # it died: its reader thread reports the loss, with this batch
            pass

    def _read(self, worker: Worker, conn: Connection, process: Any) -> None:
        """A worker's messages, in its own thread, handed to the event loop; its end, too."""
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "ready":
                self.call(self._on_ready, worker, message[1])
            elif kind == "computed":
                self.call(self._on_computed, worker, message[1])
            elif kind == "done":
                self.call(self._on_done, worker, message[1])
            elif kind == "failed":
                self.call(self._on_failed, worker, message[1], message[2])
            elif kind == "fatal":
                self.call(self.on_fatal, f"the model cannot run: {message[1]}")
        process.join(timeout=5)
        if not self.closing:
            self.call(self._on_lost, worker, process.exitcode)

    def _on_ready(self, worker: Worker, info: dict[str, Any]) -> None:
        worker.ready, worker.info = True, info
        log.info(
            "worker %d ready (pid %d): %s (id %s), %s, %s; warm-up %.2f s",
            worker.slot,
            info["pid"],
            self.model.name,
            info["model_id"],
            info["precision"],
            info["kernels"],
            info["warm_up_seconds"],
        )
        self.events.worker_ready(worker)

    def _on_computed(self, worker: Worker, batch_id: int) -> None:
        """The model is done with the batch and free for the next; its answer follows from the answer thread."""
        if worker.batch is not None and worker.batch.id == batch_id:
            worker.answering[batch_id], worker.batch = worker.batch, None
            self.events.batch_computed(worker)

    def _over(self, worker: Worker, batch_id: int) -> None:
        worker.answering.pop(batch_id, None)
        if worker.batch is not None and worker.batch.id == batch_id:
            worker.batch = None

    def _on_done(self, worker: Worker, answer: Answer) -> None:
        self._over(worker, answer.id)
        worker.deaths_in_a_row = 0
        self.events.batch_done(worker, answer)

    def _on_failed(self, worker: Worker, batch_id: int, message: str) -> None:
        self._over(worker, batch_id)
        self.events.batch_failed(worker, batch_id, message)

    def _on_lost(self, worker: Worker, exitcode: int | None) -> None:
        if self.closing:
            return
        batches = [b for b in (worker.batch, *worker.answering.values()) if b is not None]
        worker.batch, worker.answering, worker.ready, worker.alive = None, {}, False, False
        worker.deaths_in_a_row += 1
        pause = RESTART_PAUSE_S[min(worker.deaths_in_a_row, len(RESTART_PAUSE_S)) - 1]
        log.error(
            "worker %d (pid %s) died (exit code %s); starting it again in %g s",
            worker.slot,
            worker.info.get("pid"),
            exitcode,
            pause,
        )
        self.events.worker_lost(worker, batches, exitcode)
        if worker.deaths_in_a_row > RESTARTS_BEFORE_GIVING_UP:
            self.on_fatal(f"worker {worker.slot} died {worker.deaths_in_a_row} times in a row (exit code {exitcode})")
            return
        self.restarts += 1
        if pause == 0:
            self._spawn(worker)
        else:  # the pause on a timer thread, the spawn back in the event loop's thread
            timer = threading.Timer(pause, self._respawn_soon, args=(worker,))
            timer.daemon = True
            timer.start()

    def _respawn_soon(self, worker: Worker) -> None:
        try:
            self.call(self._respawn, worker)
        except RuntimeError:  # the event loop is closed: serving ended during the pause
            pass

    def _respawn(self, worker: Worker) -> None:
        if not self.closing:
            self._spawn(worker)

    def stop(self, timeout: float = 10.0) -> None:
        """Tell every process that serving ends, wait for them, kill what lingers."""
        self.closing = True
        for worker in self.workers:
            try:
                if worker.conn is not None:
                    worker.conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            if worker.process is not None:
                worker.process.join(timeout=max(0.1, deadline - time.monotonic()))
                if worker.process.is_alive():
                    worker.process.kill()
                    worker.process.join(timeout=2)
