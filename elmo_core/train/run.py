"""What a training run holds (``Run``) and returns (``TrainResult``), and what of it a checkpoint keeps: every
rank's position, RNGs and LSTM state beside the model and optimizer, each key named once."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from elmo_core.bilm.model import BiLM, LstmState
from elmo_core.bilm.softmax import LogUniformSampler
from elmo_core.data.prefetch import Prefetcher
from elmo_core.errors import (
    CheckpointError,
)
from elmo_core.options import TrainConfig
from elmo_core.ranks import Rank
from elmo_core.tracking import (
    NodeSystemMetrics,
    Tracker,
)
from elmo_core.train.budget import Budget
from elmo_core.train.checkpoint import (
    BestWeights,
    Checkpoint,
    RankState,
    checkpoint_dir,
    write_checkpoint,
)
from elmo_core.train.ddp import gather

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    perplexity: dict[str, float]  # the exported model's heldout perplexity ({} without a heldout split)
    model_dir: Path
    run_id: str | None = None
    model_uri: str | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    exported_step: int = 0  # the step whose weights were exported (``export: best`` may pick an earlier one)
    promotion: dict[str, Any] | None = (
        None  # what the promotion decided and its evidence (``train.promote``), and its line
    )


@dataclass
class Run:
    """Everything one training run holds. ``setup`` makes it; ``train_step``, ``save`` and ``restore`` change it."""

    config: TrainConfig
    out: Path
    data: Path
    device: torch.device
    ddp: Rank
    precision: str
    precision_reason: str  # why (``precision.resolve_precision``): logged and kept as an MLflow param
    vocab: list[str]
    unigram_counts: np.ndarray
    bilm: BiLM
    model: nn.Module  # the LMObjective, wrapped in DDP across processes
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    sampler: LogUniformSampler
    batches: Prefetcher  # the batch generator, run ahead of the step
    tracker: Tracker
    steps_per_epoch: int
    total_steps: int | None  # None: the budget alone ends the run
    state: LstmState | None = None  # each row's LSTM state, carried into the next window
    step: int = 0
    loss: float = float("nan")
    skipped: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    heldout: dict[str, float] = field(default_factory=dict)  # the last heldout evaluation (its checkpoint's evidence)
    node_metrics: NodeSystemMetrics | None = None  # another machine's system metrics (its local rank 0)
    best: BestWeights | None = None  # ``export: best`` (rank 0): the best weights so far
    budget: Budget = field(default_factory=Budget)  # the time it may spend, resumes included
    budget_spent: float = 0.0  # the share of it spent, as every rank agreed at this step (the schedule's clock)
    reasons: dict[str, str] = field(default_factory=dict)  # why this recipe and softmax (``recipe.py``): logged

    @property
    def tokens_per_step(self) -> int:
        return self.config.batch_size * self.config.unroll_steps * self.ddp.world


def capture_rank(run: Run) -> RankState:
    """This rank's part of a checkpoint."""
    state = run.state or run.bilm.lstm.zero_state(run.config.batch_size, torch.device("cpu"))
    return RankState(
        sampler=run.sampler.state_dict(),
        batcher=json.dumps(run.batches.state_dict()),
        torch_rng=torch.get_rng_state(),
        cuda_rng=torch.cuda.get_rng_state(run.device) if run.device.type == "cuda" else None,
        lstm_state=tuple(s.detach().cpu() for s in state),  # type: ignore[arg-type]
    )


def apply_rank(run: Run, rank: RankState) -> None:
    run.sampler.load_state_dict(rank.sampler)
    run.batches.load_state_dict(json.loads(rank.batcher))
    torch.set_rng_state(rank.torch_rng)
    if run.device.type == "cuda" and rank.cuda_rng is not None:
        torch.cuda.set_rng_state(rank.cuda_rng, run.device)
    run.state = tuple(s.to(run.device) for s in rank.lstm_state)  # type: ignore[assignment]


def save(run: Run) -> Path | None:
    """Write the run's checkpoint (rank 0, with every rank's state); returns its path on rank 0."""
    ranks: list[RankState] = gather(run.ddp, capture_rank(run))
    if not run.ddp.main:
        return None
    checkpoint = Checkpoint(
        step=run.step,
        config=run.config.model_dump_json(),
        run_id=run.tracker.run_id or "",
        model={k: v.detach().cpu() for k, v in run.bilm.state_dict().items()},
        optimizer=run.optimizer.state_dict(),
        ranks=ranks,
        spent_seconds=run.budget.spent(),
        architecture=run.bilm.config.model_dump_json(),
        dictionaries=run.bilm.dictionaries.state() if run.bilm.dictionaries is not None else None,
    )
    path = write_checkpoint(run.out, run.step, checkpoint.payload(), run.config.keep_checkpoints)
    log.info("checkpoint %s", path)
    # named apart from the run's own series (its loss every log_every steps), to which MLflow adds them too
    metrics = {"checkpoint_loss": run.loss, **{f"checkpoint_heldout_{k}": v for k, v in run.heldout.items()}}
    run.tracker.log_checkpoint(path, run.step, metrics)  # a LoggedModel of the run, in MLflow's Models tab
    return path


def restore(run: Run, checkpoint: Checkpoint) -> str | None:
    """Put a run back exactly where ``checkpoint`` was taken; returns the MLflow run it was tracked in, if any."""
    try:
        run.bilm.load_state_dict(checkpoint.model)
        run.optimizer.load_state_dict(checkpoint.optimizer)
        run.budget.spent_before = checkpoint.spent_seconds
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(
            f"{checkpoint_dir(run.out)}: the checkpoint of step {checkpoint.step} does not fit this run's "
            f"model or optimizer ({str(exc).splitlines()[0][:160]}); use a new out folder"
        ) from None
    if len(checkpoint.ranks) != run.ddp.world:
        raise CheckpointError(
            f"{checkpoint_dir(run.out)}: written by {len(checkpoint.ranks)} processes, resumed by "
            f"{run.ddp.world}; resume with the same number of processes"
        )
    apply_rank(run, checkpoint.ranks[run.ddp.rank])
    run.step = checkpoint.step
    return checkpoint.run_id or None
