"""The time a training may spend (``budget``): counted on the clock it names, carried across resumes in the
checkpoints, so a run stopped at 20 of its 30 minutes and resumed stops at 30, not at 50."""

from __future__ import annotations

import time

from elmo_core.options import TrainConfig, budget_seconds


class Budget:
    """``seconds`` of ``clock`` time ("wall" or "cpu": this process's CPU time, every thread's), ``spent_before``
    of it spent by the processes this run resumes; no budget: never exhausted."""

    def __init__(self, budget: str | None = None, clock: str = "wall", spent_before: float = 0.0) -> None:
        self.seconds = budget_seconds(budget) if budget is not None else None
        self.clock, self.spent_before = clock, spent_before
        self._started: float | None = None

    def _now(self) -> float:
        return time.process_time() if self.clock == "cpu" else time.monotonic()

    def start(self) -> None:
        """From now on this process's time counts (after setup: loading data and the model is not training)."""
        self._started = self._now()

    def spent(self) -> float:
        return self.spent_before + (self._now() - self._started if self._started is not None else 0.0)

    def share_spent(self) -> float:
        """The share of the budget spent, 0..1 (0 without a budget): the clock a cosine schedule ends by."""
        return min(self.spent() / self.seconds, 1.0) if self.seconds is not None else 0.0

    def exhausted(self) -> bool:
        """The rule the trainer stops by (there on the share every rank agreed): all of the share spent."""
        return self.seconds is not None and self.share_spent() >= 1.0

    def line(self) -> str:
        if self.seconds is None:
            return "no time budget"
        before = f", {self.spent_before:,.0f} s of it spent before this resume" if self.spent_before else ""
        return f"budget: {self.seconds:,.0f} s of {self.clock} time{before}"


def step_limit(config: TrainConfig, steps_per_epoch: int) -> int | None:
    """The step a run ends at: ``max_steps``, else ``n_epochs``' worth; None under a ``budget`` with neither given,
    where the budget alone ends it (as the runs of the table its recipe comes from were measured)."""
    if config.max_steps:
        return config.max_steps
    if config.budget is not None and "n_epochs" not in config.model_fields_set:
        return None
    return max(1, int(config.n_epochs * steps_per_epoch))
