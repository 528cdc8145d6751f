"""What a training run will do, decided before it starts: the one place the trainer's setup and ``elmo train --plan``
take the device, the precision, the kernels, the recipe (under a budget), the softmax, the step limit and the
budget's clock from. It reads the data folder's vocabulary and train counts and writes nothing.

A launched training (several ranks) plans once per rank from the same config and data, so every rank decides the
same; the softmax's ``auto`` is the one decision left to the start of the run, since it is measured on the device
(``recipe.settle_softmax``), and the plan says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from elmo_core.bilm.kernels import choose_training
from elmo_core.data.vocab import VOCAB_NAME_IN_DATA, check_training_vocab, read_vocab_file
from elmo_core.options import TrainConfig
from elmo_core.precision import Precision
from elmo_core.runtime import place
from elmo_core.train.budget import Budget, step_limit
from elmo_core.train.evaluate import train_token_counts
from elmo_core.train.recipe import choose_for_budget, describe_softmax, table_measured


@dataclass
class TrainingPlan:
    config: TrainConfig  # with the budget's recipe filled in
    device: torch.device
    precision: Precision
    kernels: str
    recipe_why: str
    vocab: list[str]
    counts: np.ndarray  # each word's train count (the unigram softmax bias)
    n_data_tokens: int
    steps_per_epoch: int
    total_steps: int | None
    clock: str

    def budget(self, spent_before: float = 0.0) -> Budget:
        return Budget(self.config.budget, self.clock, spent_before)

    def lines(self, threads: int | None = None) -> list[str]:
        config, n_vocab = self.config, len(self.vocab)
        softmax = describe_softmax(config, n_vocab, sparse=False)
        if config.sample_softmax == "auto":
            softmax = f"softmax: auto, measured on this device at the start ({softmax})"
        steps = f"{self.total_steps:,} steps" if self.total_steps is not None else "until the budget is spent"
        return [
            f"device {self.device}, precision {self.precision} ({self.precision.why})",
            str(self.kernels),
            self.recipe_why,
            softmax,
            f"{self.n_data_tokens:,} train tokens, {n_vocab:,} words, {self.steps_per_epoch:,} steps an epoch; {steps}",
            self.budget().line(threads, table_measured() if config.budget else None),
        ]


def plan_training(config: TrainConfig, device: torch.device | str | None = None, world: int = 1) -> TrainingPlan:
    """The run's decisions (the module's docstring), for this process's ``device`` (default: ``config.device``
    resolved) among ``world`` ranks."""
    placement = place(device if device is not None else config.device, config.precision)
    device = placement.torch_device
    data = Path(config.data)
    vocab = read_vocab_file(data / VOCAB_NAME_IN_DATA)
    check_training_vocab(vocab, str(data / VOCAB_NAME_IN_DATA))
    counts, n_data_tokens = train_token_counts(data, len(vocab))
    config, recipe_why = choose_for_budget(config, n_data_tokens, len(vocab), device_type=device.type)
    tokens = config.n_train_tokens or n_data_tokens
    steps_per_epoch = max(1, tokens // (config.batch_size * config.unroll_steps * world))
    kernels = choose_training(device, config.architecture(len(vocab)).lstm)
    return TrainingPlan(
        config=config,
        device=device,
        precision=place(device, config.precision).precision,
        kernels=str(kernels),
        recipe_why=recipe_why,
        vocab=vocab,
        counts=counts,
        n_data_tokens=n_data_tokens,
        steps_per_epoch=steps_per_epoch,
        total_steps=step_limit(config, steps_per_epoch),
        clock=config.budget_clock,
    )
