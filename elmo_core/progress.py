"""Progress of long stages (ingest, vocab, train, evaluate, embed): one way to report it, several displays.

Core code wraps its loop in ``track(name, total, unit)`` and calls ``advance``/``update`` on the handle. What
the user sees:

* on a terminal: a rich progress bar with rate and ETA, on stderr;
* otherwise (logs, CI): one log line about every 10% or 60 s, with the ETA;
* every sink added with ``add_sink`` (the Prefect flows add one that updates a progress artifact in the
  Prefect UI and writes those log lines through Prefect's run logger instead).

Sinks are per thread of control (a ``ContextVar``), so a flow's tasks each report to their own run.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

log = logging.getLogger(__name__)

LOG_EVERY_FRACTION = 0.10
LOG_EVERY_SECONDS = 60.0


class ProgressSink(Protocol):
    """Receives a stage's progress: ``update`` at most twice a second, with the stage's log line (``line()``)
    when one is due (about every 10% or 60 s), else None."""

    def begin(self, progress: Progress) -> None: ...
    def update(self, progress: Progress, line: str | None) -> None: ...
    def end(self, progress: Progress, seconds: float) -> None: ...


_SINKS: ContextVar[tuple[ProgressSink, ...]] = ContextVar("elmo_progress_sinks", default=())


@contextmanager
def add_sink(sink: ProgressSink) -> Iterator[None]:
    """Report every ``track`` inside the block to ``sink`` as well."""
    token = _SINKS.set(_SINKS.get() + (sink,))
    try:
        yield
    finally:
        _SINKS.reset(token)


def format_amount(value: float) -> str:
    """12,345 for large amounts, 0.3 for small fractional ones (megabytes of a short file)."""
    return f"{value:.1f}" if value < 10 and value != int(value) else f"{value:,.0f}"


def _format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    return (
        f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
        if seconds >= 3600
        else f"{seconds // 60}:{seconds % 60:02d}"
    )


class Progress:
    """A running stage: ``done`` of ``total`` units (``total`` may be unknown), with free-form ``info``."""

    def __init__(self, name: str, total: float | None, unit: str, done: float = 0.0) -> None:
        self.name, self.total, self.unit = name, total, unit
        self.done = self._start_done = done
        self.info = ""
        self._started = time.perf_counter()
        self._last_sink = 0.0
        self._last_log, self._last_log_done = self._started, done
        self._sinks = _SINKS.get()
        self._bar = None
        if sys.stderr.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TaskProgressColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(unit),
                TaskProgressColumn(),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                transient=False,
                redirect_stderr=False,
            )
            self._task = self._bar.add_task(name, total=total, completed=done, info="")
            self._bar.start()
        for sink in self._sinks:
            sink.begin(self)

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate of this session (a resumed stage does not count earlier work)."""
        rate = (self.done - self._start_done) / max(time.perf_counter() - self._started, 1e-9)
        if self.total is None or rate <= 0:
            return None
        return max(self.total - self.done, 0.0) / rate

    def advance(self, amount: float = 1.0, info: str | None = None) -> None:
        self.update(self.done + amount, info)

    def update(self, done: float, info: str | None = None) -> None:
        self.done = done
        if info is not None:
            self.info = info
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.update(self._task, completed=done, info=self.info)
        line = None
        if self._log_due(now):
            self._last_log, self._last_log_done = now, done
            line = self.line()
            if self._bar is None and not self._sinks:  # a bar shows it; a sink (the Prefect UI) logs it instead
                log.info("%s", line)
        if self._sinks and (line is not None or now - self._last_sink >= 0.5):
            self._last_sink = now
            for sink in self._sinks:
                sink.update(self, line)

    def _log_due(self, now: float) -> bool:
        if self.total:
            if (self.done - self._last_log_done) >= LOG_EVERY_FRACTION * self.total:
                return True
        return now - self._last_log >= LOG_EVERY_SECONDS

    @property
    def percent(self) -> float:
        """Share done, 0 to 100 (0 while the total is unknown)."""
        return min(100.0 * self.done / self.total, 100.0) if self.total else 0.0

    def line(self) -> str:
        """``train: 120/600 steps (20%), ETA 4:10, loss 5.21``"""
        total = f"/{format_amount(self.total)}" if self.total else ""
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        eta = f", ETA {_format_eta(self.eta_s)}" if self.total else ""
        info = f", {self.info}" if self.info else ""
        return f"{self.name}: {format_amount(self.done)}{total} {self.unit}{share}{eta}{info}"

    def close(self) -> None:
        seconds = time.perf_counter() - self._started
        if self._bar is not None:
            self._bar.stop()
        for sink in self._sinks:
            sink.end(self, seconds)


@contextmanager
def track(name: str, total: float | None, unit: str = "", done: float = 0.0) -> Iterator[Progress]:
    """Report the progress of the block's loop as stage ``name``."""
    progress = Progress(name, total, unit, done)
    try:
        yield progress
    finally:
        progress.close()


class TokenRate:
    """Tokens per second over the steps counted since the last reset (training's progress line and logged metrics)."""

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step, self.steps, self.started = tokens_per_step, 0, time.perf_counter()

    def count(self) -> None:
        self.steps += 1

    def rate(self, reset: bool = False) -> float:
        now = time.perf_counter()
        value = self.steps * self.tokens_per_step / max(now - self.started, 1e-9)
        if reset:
            self.steps, self.started = 0, now
        return value
