"""The time a training may spend (``budget``): the job's own time, counted on one clock from the moment the training
begins (its setup included), its evaluations and checkpoints on the clock too, and carried across resumes in the
checkpoints, so a run stopped at 20 of its 30 minutes and resumed stops at 30, not 50. What the end needs (the final
checkpoint and heldout evaluation) is held back from the start, so ``--budget 30m`` hands its model to the export
by the 30th minute with the learning rate annealed; only the export (the model folder, ONNX, MLflow) comes after.

Evaluations between epochs are kept to ``EVALUATION_SHARE`` of the budget: on a small corpus an epoch takes
seconds and a full heldout pass each time took a fifth of a budget (so the run never reached its annealed end). Each
evaluation's cost is known before it runs: a probe of two heldout windows at the start, then each full pass's time.

The table a budget picks its recipe from (``recipe_table.json``, its ``measured`` record) was measured in CPU time
of one thread, evaluations off the clock (``bench/cpu_recipe.py``, which pauses this class's clock for them). A
budget counts wall time by default: a user's 30 minutes are the clock's, and a process with more threads does at
least one thread's work in a wall minute; the plan's line says where its clock differs from the table's.
``budget_clock: cpu`` counts this process's CPU time instead (every thread's: with one thread, the table's own clock).
The trainer stops by ``exhausted`` and anneals by ``share_spent``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from elmo_core.options import TrainConfig, budget_seconds

EVALUATION_SHARE = 0.05  # the most of a budget the evaluations between epochs may take together


def now(clock: str) -> float:
    """The time on ``clock`` ("wall" or "cpu": this process's CPU time, every thread's)."""
    return time.process_time() if clock == "cpu" else time.monotonic()


class Budget:
    """``seconds`` of ``clock`` time, ``spent_before`` of it spent by the processes this run resumes; no budget:
    never exhausted. ``held_back`` is what the run's end needs (the final checkpoint and evaluation), measured as the
    run goes (``measure``); ``pause()`` takes a block off the clock (the recipe bench's evaluations only)."""

    def __init__(self, budget: str | None = None, clock: str = "wall", spent_before: float = 0.0) -> None:
        if clock not in ("wall", "cpu"):
            raise ValueError(f"a budget's clock is wall or cpu, got {clock!r}")
        self.seconds = budget_seconds(budget) if budget is not None else None
        self.clock, self.spent_before = clock, spent_before
        self._started: float | None = None
        self._paused_at: float | None = None
        self.costs = {"evaluation": 0.0, "checkpoint": 0.0}  # the last one's seconds (or a probe's estimate)
        self.evaluated = 0.0  # seconds the evaluations between epochs took in this process

    def start(self, at: float | None = None) -> None:
        """From ``at`` (this clock's reading when the job began; now by default) this process's time counts."""
        self._started = now(self.clock) if at is None else at

    def spent(self) -> float:
        if self._started is None:
            return self.spent_before
        current = self._paused_at if self._paused_at is not None else now(self.clock)
        return self.spent_before + (current - self._started)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """The block's time does not count (nested pauses count once)."""
        if self._started is None or self._paused_at is not None:
            yield
            return
        self._paused_at = now(self.clock)
        try:
            yield
        finally:
            self._started += now(self.clock) - self._paused_at
            self._paused_at = None

    @contextlib.contextmanager
    def measure(self, cost: str, between_epochs: bool = False) -> Iterator[None]:
        """Time a block that the run's end repeats (``cost``: "evaluation" or "checkpoint"): its seconds are what the
        end holds back from then on; ``between_epochs`` counts an evaluation against ``EVALUATION_SHARE``."""
        began = now(self.clock)
        yield
        seconds = now(self.clock) - began
        self.costs[cost] = seconds
        if between_epochs:
            self.evaluated += seconds

    @property
    def held_back(self) -> float:
        return sum(self.costs.values())

    def allows_evaluation(self) -> bool:
        """Whether an evaluation between epochs fits: those of this process, with this one at its known cost, within
        ``EVALUATION_SHARE`` of the budget (always, without a budget)."""
        if self.seconds is None:
            return True
        return self.evaluated + self.costs["evaluation"] <= EVALUATION_SHARE * self.seconds

    def share_spent(self) -> float:
        """The share spent of the budget less what the end holds back, 0..1 (0 without a budget): the clock a cosine
        schedule ends by, and the trainer's stop."""
        if self.seconds is None:
            return 0.0
        return min(self.spent() / max(self.seconds - self.held_back, 1e-9), 1.0)

    def exhausted(self, share: float | None = None) -> bool:
        """The rule the trainer stops by: all of the share spent (``share``: the one every rank agreed on)."""
        return self.seconds is not None and (self.share_spent() if share is None else share) >= 1.0

    def line(self, threads: int | None = None, table: dict[str, Any] | None = None) -> str:
        """What the budget counts, and where that differs from how the table was measured."""
        if self.seconds is None:
            return "no time budget"
        before = f", {self.spent_before:,.0f} s of it spent before this resume" if self.spent_before else ""
        what = "this process's CPU time, every thread's" if self.clock == "cpu" else "wall time"
        text = (
            f"budget: {self.seconds:,.0f} s of {what} from the training's start to its export, evaluations and "
            f"checkpoints on the clock (those between epochs within {EVALUATION_SHARE:.0%} of it){before}"
        )
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
