"""The time a training may spend (``budget``): counted on one clock, with evaluations and checkpoints off it as the
recipe table's runs were measured, and carried across resumes in the checkpoints, so a run stopped at 20 of its 30
minutes and resumed stops at 30, not 50.

The table a budget picks its recipe from (``recipe_table.json``, its ``measured`` record) was measured in CPU time
of one thread, evaluations off the clock (``bench/cpu_recipe.py``, which counts through this class too). A budget
counts wall time by default: a user's 30 minutes are the clock's, and a process with more threads does at least
one thread's work in a wall minute, so the table's recipe at 30 CPU-minutes is a fair (if cautious) pick; the plan's
line says so. ``budget_clock: cpu`` counts this process's CPU time instead (every thread's: with one thread, the
table's own clock). The trainer stops by ``exhausted`` and anneals by ``share_spent``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from elmo_core.options import TrainConfig, budget_seconds


class Budget:
    """``seconds`` of ``clock`` time ("wall" or "cpu": this process's CPU time, every thread's), ``spent_before``
    of it spent by the processes this run resumes; no budget: never exhausted. ``pause()`` takes a block (an
    evaluation, a checkpoint) off the clock, as the table's runs were measured."""

    def __init__(self, budget: str | None = None, clock: str = "wall", spent_before: float = 0.0) -> None:
        if clock not in ("wall", "cpu"):
            raise ValueError(f"a budget's clock is wall or cpu, got {clock!r}")
        self.seconds = budget_seconds(budget) if budget is not None else None
        self.clock, self.spent_before = clock, spent_before
        self._started: float | None = None
        self._paused_at: float | None = None

    def _now(self) -> float:
        return time.process_time() if self.clock == "cpu" else time.monotonic()

    def start(self) -> None:
        """From now on this process's time counts (after setup: loading data and the model is not training)."""
        self._started = self._now()

    def spent(self) -> float:
        if self._started is None:
            return self.spent_before
        now = self._paused_at if self._paused_at is not None else self._now()
        return self.spent_before + (now - self._started)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """The block's time does not count (nested pauses count once)."""
        if self._started is None or self._paused_at is not None:
            yield
            return
        self._paused_at = self._now()
        try:
            yield
        finally:
            self._started += self._now() - self._paused_at
            self._paused_at = None

    def share_spent(self) -> float:
        """The share of the budget spent, 0..1 (0 without a budget): the clock a cosine schedule ends by."""
        return min(self.spent() / self.seconds, 1.0) if self.seconds is not None else 0.0

    def exhausted(self, share: float | None = None) -> bool:
        """The rule the trainer stops by: all of the share spent (``share``: the one every rank agreed on)."""
        return self.seconds is not None and (self.share_spent() if share is None else share) >= 1.0

    def line(self, threads: int | None = None, table: dict[str, Any] | None = None) -> str:
        """What the budget counts, and where that differs from how the table was measured."""
        if self.seconds is None:
            return "no time budget"
        before = f", {self.spent_before:,.0f} s of it spent before this resume" if self.spent_before else ""
        what = "this process's CPU time, every thread's" if self.clock == "cpu" else "wall time"
        text = f"budget: {self.seconds:,.0f} s of {what}, evaluations and checkpoints off the clock{before}"
        if table:
            measured = f"the recipe table was measured on {table['clock']} time of {table['threads']} thread(s)"
            same = table["clock"] == self.clock and (threads is None or threads == table["threads"])
            text += f"; {measured}" + ("" if same else f", this run counts {self.clock} time with {threads} threads")
        return text


def step_limit(config: TrainConfig, steps_per_epoch: int) -> int | None:
    """The step a run ends at: ``max_steps``, else ``n_epochs``' worth; None under a ``budget`` with neither given,
    where the budget alone ends it (as the runs of the table its recipe comes from were measured)."""
    if config.max_steps:
        return config.max_steps
    if config.budget is not None and "n_epochs" not in config.model_fields_set:
        return None
    return max(1, int(config.n_epochs * steps_per_epoch))
