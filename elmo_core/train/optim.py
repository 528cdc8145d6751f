"""The optimizer and the learning-rate schedule: bilm-tf's Adagrad, AdamW, or AdamW with the softmax under Adagrad.

Why the split: under the sampled softmax a step's gradient reaches only the sampled rows of the (V, P) table.
AdamW's per-weight normalisation then moves a seldom-sampled row as far as a common one, and the full-softmax
perplexity diverges (docs/training-on-cpu.md). Adagrad's accumulator shrinks each row's steps by how often it has
been seen, which is what such rows need; the dense network (char CNN, LSTMs) sees every step and can take AdamW.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from elmo_core.options import TrainConfig


def learning_rate_at(config: TrainConfig, step: int, total_steps: int) -> float:
    """The rate of step ``step`` (1-based): a linear warm-up, then the schedule. A function of the step alone, so an
    exact resume needs no scheduler state."""
    base, warmup = config.learning_rate, config.warmup_steps
    if step <= warmup:
        return base * step / warmup
    if config.lr_schedule == "inverse_sqrt":
        return base * math.sqrt(max(warmup, 1) / step)
    if config.lr_schedule == "cosine":
        done = (step - warmup) / max(total_steps - warmup, 1)
        return base * 0.5 * (1.0 + math.cos(math.pi * min(done, 1.0)))
    return base


def softmax_under_adagrad(config: TrainConfig) -> bool:
    """Whether Adagrad updates the softmax rows (then its gradients may be sparse)."""
    return config.optimizer == "adagrad" or config.softmax_optimizer == "adagrad"


class SplitOptimizer:
    """Two optimizers stepped as one: ``optimizer`` for the network, Adagrad for the softmax. It offers what the
    trainer and its checkpoints use of a ``torch.optim.Optimizer`` (param_groups, step, zero_grad, state_dict)."""

    def __init__(self, parts: list[torch.optim.Optimizer]) -> None:
        self.parts = parts

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for part in self.parts for group in part.param_groups]

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"parts": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state.get("parts", ())) != len(self.parts):
            raise KeyError("parts: the checkpoint's optimizer is not this run's split optimizer")
        for part, saved in zip(self.parts, state["parts"], strict=True):
            part.load_state_dict(saved)


def make_optimizer(config: TrainConfig, bilm: nn.Module) -> torch.optim.Optimizer | SplitOptimizer:
    """The run's optimizer over the model's trainable parameters, in the model's order (the order a checkpoint's
    optimizer state is keyed by); each group keeps its base rate in ``initial_lr``, which the schedule scales."""
    params = [p for p in bilm.parameters() if p.requires_grad]
    softmax_ids = {id(p) for p in bilm.softmax.parameters()} if getattr(bilm, "softmax", None) is not None else set()
    softmax = [p for p in params if id(p) in softmax_ids]
    split = config.optimizer == "adamw" and config.softmax_optimizer == "adagrad" and softmax

    def adagrad(group: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(group, lr=lr, initial_accumulator_value=config.initial_accumulator_value)

    def adamw(group: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(group, lr=config.learning_rate, weight_decay=config.weight_decay)

    optimizer: torch.optim.Optimizer | SplitOptimizer
    if split:
        network = [p for p in params if id(p) not in softmax_ids]
        optimizer = SplitOptimizer([adamw(network), adagrad(softmax, config.softmax_learning_rate)])
    else:
        optimizer = adagrad(params, config.learning_rate) if config.optimizer == "adagrad" else adamw(params)
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]
    return optimizer


def schedule(optimizer: torch.optim.Optimizer | SplitOptimizer, config: TrainConfig, step: int, total: int) -> None:
    """Set every group's rate for ``step``: its base rate times the schedule's factor (warm-up, then decay)."""
    if config.lr_schedule == "constant" and not config.warmup_steps:
        return
    factor = learning_rate_at(config, step, total) / config.learning_rate
    for group in optimizer.param_groups:
        group["lr"] = group.get("initial_lr", config.learning_rate) * factor
