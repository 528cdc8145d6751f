"""What a training run will do, decided before it starts: the one place the trainer's setup and ``elmo train --plan``
take the device, the precision, the kernels, the recipe (under a budget), the softmax, the step limit and the
budget's clock from, and what the run will write: its checkpoints and export, sized from the model's shapes and
refused where the out folder's filesystem has no room for them. It reads the data folder's vocabulary and train
counts and writes nothing.

A launched training (several ranks) plans once per rank from the same config and data, so every rank decides the
same; the softmax's ``auto`` is the one decision left to the start of the run, since it is measured on the device
(``recipe.settle_softmax``), and the plan says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from elmo_core.bilm.kernels import fused_gates
from elmo_core.bilm.model import BiLM
from elmo_core.config import read_options
from elmo_core.data.vocab import VOCAB_NAME_IN_DATA, check_training_vocab, read_vocab_file
from elmo_core.fileio import format_bytes, free_bytes, require_space
from elmo_core.options import TrainConfig
from elmo_core.precision import Precision
from elmo_core.runtime import ModelRef, lookup_model, place
from elmo_core.text.manylangs_chars import Dictionaries
from elmo_core.train.budget import Budget, step_limit
from elmo_core.train.checkpoint import list_checkpoints, payload_bytes
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
    space: TrainingSpace  # what it writes, and the room that needs (checked by ``plan_training``)
    init_from: str = ""  # the model fine-tuned, as the runtime's lookup found it (its line)

    def require_room(self) -> None:
        """Refuse in one line (``NoSpaceError``), before anything is written, a run whose checkpoints and export the
        filesystem holding its out folder has no room for. The stage's plan checks once, before its claim: the
        ranks' setup plans again after it, when the claim's lock takes a block of the room counted."""
        config = self.config
        if config.node_rank != 0:  # another machine of a launch writes no checkpoint and no export
            return
        what = f"the checkpoints (keep {config.keep_checkpoints}) and the export"
        advice = "free some space, keep fewer checkpoints (--keep-checkpoints), or write elsewhere"
        require_space(config.out, self.space.total, what, advice)

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
            self.space.line(config, free_bytes(config.out)),
            *([self.init_from] if self.init_from else []),
        ]


def plan_training(config: TrainConfig, device: torch.device | str | None = None, world: int = 1) -> TrainingPlan:
    """The run's decisions (the module's docstring), for this process's ``device`` (default: ``config.device``
    resolved) among ``world`` ranks, with what the run writes (``training_space``; ``TrainingPlan.require_room``
    compares it with the free space)."""
    placement = place(device if device is not None else config.device, config.precision)
    device = placement.torch_device
    data = Path(config.data)
    vocab = read_vocab_file(data / VOCAB_NAME_IN_DATA)
    check_training_vocab(vocab, str(data / VOCAB_NAME_IN_DATA))
    counts, n_data_tokens = train_token_counts(data, len(vocab))
    config, recipe_why = choose_for_budget(config, n_data_tokens, len(vocab), device_type=device.type)
    tokens = config.n_train_tokens or n_data_tokens
    steps_per_epoch = max(1, tokens // (config.batch_size * config.unroll_steps * world))
    # the kernels are chosen once, as the run starts (``BiLM.prepare_training``); a plan only says whether the C
    # kernels they would take are built (building them is work, under the claim)
    kernels = f"kernels: chosen as the run starts; the C kernels {fused_gates.built()}"
    total_steps = step_limit(config, steps_per_epoch)
    start = lookup_model(config.init_from) if config.init_from is not None else None  # read only: no download
    space = training_space(
        config,
        vocab,
        data / VOCAB_NAME_IN_DATA,
        world,
        device.type == "cuda",
        total_steps,
        start.ref if start else None,
    )
    return TrainingPlan(
        config=config,
        device=device,
        precision=placement.precision,
        kernels=str(kernels),
        recipe_why=recipe_why,
        vocab=vocab,
        counts=counts,
        n_data_tokens=n_data_tokens,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        clock=config.budget_clock,
        space=space,
        init_from=f"fine-tunes {start.line()}" if start is not None else "",
    )


# ----- what the run writes, estimated before it starts (the plan compares it with the free space) ---------------
#
# A checkpoint is sized by ``checkpoint.payload_bytes`` (what its writer checks room for) of a payload shaped as
# ``run.save`` makes it, of meta tensors (no memory): the model's state, the optimizer's (Adagrad: a sum and a step per
# parameter; AdamW: two moments and a step), and each rank's RNGs, LSTM state and batcher position. Measured on the
# bilm-tf fixture's run (batch 2, Adagrad): 390,396 bytes written, 394,820 estimated from the real payload, 398,118
# from this one (the batcher's rows, each its current sentence as JSON: 1,705 bytes there, counted as 4 kB a row).
# The export's weights.hdf5 is the state's float32 bytes and HDF5's ~720 bytes a dataset (199,032 bytes for 170,880
# in 39 tensors), counted 1 kB; options.json 16 kB with the blocks (as ``bilm.weights.write_model_files`` counts);
# vocab.txt the data's. Not counted: the MLflow store (its failure to log is a warning, not the run's end).
BATCHER_ROW_BYTES = 4_096  # a batch row's current sentence, per direction, in the checkpoint's batcher position
DATASET_BYTES = 1_024  # HDF5's bytes a weight beside its values
MODEL_FILES_BYTES = 16 * 1_024  # options.json and the files' last blocks
LOG_LINE_BYTES = 512  # a metrics.jsonl line (every ``log_every`` steps)


@dataclass(frozen=True)
class TrainingSpace:
    """About what a run writes into its out folder: ``keep`` checkpoints less what those there hold, the best
    weights (``export: best``: the new beside the old while it is written), the export, the metrics."""

    checkpoint: int
    checkpoints: int  # keep × checkpoint, less the newest ``keep`` already there (their writer counts so)
    best: int
    export: int
    logs: int
    held: int

    @property
    def total(self) -> int:
        return self.checkpoints + self.best + self.export + self.logs

    def line(self, config: TrainConfig, free: int) -> str:
        held = f" less the {format_bytes(self.held)} of those already there" if self.held else ""
        best = f"; the best weights {format_bytes(self.best)}" if self.best else ""
        return (
            f"about {format_bytes(self.total)} to write ({config.keep_checkpoints} checkpoints of about "
            f"{format_bytes(self.checkpoint)}{held}{best}; the export {format_bytes(self.export)}), "
            f"{format_bytes(free)} free"
        )


def training_space(
    config: TrainConfig,
    vocab: list[str],
    vocab_file: Path,
    world: int,
    cuda: bool,
    steps: int | None,
    start: ModelRef | None = None,
) -> TrainingSpace:
    """What a run of ``config`` over ``steps`` steps (None: until its budget is spent) writes (``TrainingSpace``),
    from the model's shapes: nothing is allocated. ``start``: the fine-tuned model's files, where they are here
    (else it is sized as the config's architecture until fetched)."""
    bilm = _meta_model(config, vocab, start)
    state = bilm.state_dict()
    size = payload_bytes(_checkpoint_payload(config, bilm, world, cuda))
    held = sum(p.stat().st_size for p in list_checkpoints(config.out)[-config.keep_checkpoints :])
    checkpoints = max(size, config.keep_checkpoints * size - held)
    best = 2 * payload_bytes({"step": 0, "perplexity": {}, "model": state}) if config.export == "best" else 0
    floats = sum(t.numel() * 4 + DATASET_BYTES for t in state.values() if t.is_floating_point())
    export = floats + vocab_file.stat().st_size + MODEL_FILES_BYTES
    if bilm.dictionaries is not None:  # a ManyLangs model's char.dic and word.dic, written beside its weights
        export += payload_bytes(bilm.dictionaries.state())
    logs = ((steps or 0) // max(1, config.log_every) + 1) * LOG_LINE_BYTES + MODEL_FILES_BYTES
    return TrainingSpace(size, checkpoints, best, export, logs, held)


def _meta_model(config: TrainConfig, vocab: list[str], model: ModelRef | None) -> BiLM:
    """The model the run trains, of meta tensors (shapes, no memory): its config's architecture, or the fine-tuned
    model's (with a ManyLangs model's dictionaries) with a softmax over ``vocab``."""
    architecture, dictionaries = config.architecture(len(vocab)), None
    if model is not None:  # else not on this machine yet: fetched under the claim; sized as the config's meanwhile
        options = read_options(model.options)
        architecture = options.model_copy(update={"n_tokens_vocab": len(vocab)})
        if options.manylangs is not None:
            words = options.manylangs.word_dim > 0
            dictionaries = Dictionaries.read(model.directory, options.char_cnn.max_characters_per_token, words=words)
    with torch.device("meta"):
        return BiLM(architecture, dics=dictionaries)


def _checkpoint_payload(config: TrainConfig, bilm: BiLM, world: int, cuda: bool) -> dict[str, Any]:
    """A payload shaped as ``run.save`` makes it (``checkpoint.Checkpoint``), of meta tensors."""
    params = [p for p in bilm.parameters() if p.requires_grad]
    moments = ("sum",) if config.optimizer == "adagrad" else ("exp_avg", "exp_avg_sq")
    scalar = torch.empty((), device="meta")
    optimizer = {
        "state": {i: {"step": scalar, **{m: torch.empty_like(p) for m in moments}} for i, p in enumerate(params)},
        "param_groups": [{**{f"option{i}": 0.0 for i in range(12)}, "params": list(range(len(params)))}],
    }
    rng = torch.get_rng_state()
    rank = {
        "sampler": {"generator": rng},
        "batcher": " " * (2 * config.batch_size * BATCHER_ROW_BYTES),
        "torch_rng": rng,
        "cuda_rng": torch.empty(16, dtype=torch.uint8, device="meta") if cuda else None,
        "lstm_state": bilm.lstm.zero_state(config.batch_size, torch.device("meta")),
    }
    return {
        "step": 0,
        "config": config.model_dump_json(),
        "run_id": "",
        "model": bilm.state_dict(),
        "optimizer": optimizer,
        "ranks": [rank] * world,
        "spent_seconds": 0.0,
        "architecture": bilm.config.model_dump_json(),
        "dictionaries": bilm.dictionaries.state() if bilm.dictionaries is not None else None,
    }
