"""Scoring a biLM: full-softmax perplexity per direction, state carried across windows as bilm-tf's ``run_test``,
with the add-one unigram baseline of the train split beside it; for a run's heldout checks, the exported model's
splits, and ``elmo perplexity``."""

from __future__ import annotations

import functools
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from elmo_core.bilm.model import BiLM, LstmState
from elmo_core.bilm.softmax import full_softmax_loss
from elmo_core.data.batches import LMBatcher
from elmo_core.data.prefetch import to_tensors
from elmo_core.defaults import DEFAULT_DEVICE
from elmo_core.errors import ConfigError, InputError
from elmo_core.options import PerplexityConfig
from elmo_core.progress import track
from elmo_core.stage import Whole, WholePlan, WholeStage
from elmo_core.text.chars import EOS_ID
from elmo_core.train.objective import LMObjective

UNROLL_STEPS = 20  # windows of an evaluation: with the state carried, the numbers do not depend on it


@torch.no_grad()
def evaluate(
    bilm: BiLM,
    token_id_dir: str | Path,
    *,
    batch_size: int = 64,
    unroll_steps: int = UNROLL_STEPS,
    max_batches: int | None = None,
    unigram_counts: np.ndarray | None = None,
) -> dict[str, float]:
    """Heldout perplexity with the full softmax, state carried across windows (bilm-tf ``run_test``).

    With the state carried, predictions do not depend on the window length, so windows of 20 give the numbers
    bilm-tf's unroll-1 evaluation gives. Returns forward, backward and average perplexity (exp of the mean
    loss) and, given train counts, the add-one unigram baseline on the same forward targets.
    """
    was_training = bilm.training
    bilm.eval()
    objective = LMObjective(bilm, 0.0, False)
    device = bilm.device
    rows = heldout_rows(token_id_dir, batch_size)
    batcher = LMBatcher(token_id_dir, rows, unroll_steps, shuffle=False, loop=False)
    total_f = total_b = unigram = 0.0
    tokens = batches = 0
    state = None
    log_p = None
    if unigram_counts is not None:
        log_p = np.log((unigram_counts + 1.0) / (unigram_counts.sum() + len(unigram_counts)))
    with track(
        "evaluate", heldout_windows(token_id_dir, batch_size, unroll_steps, max_batches) or None, "batches"
    ) as progress:
        for batch in batcher:
            loss_f, loss_b, state = _full_softmax_losses(objective, batch, state, device)
            total_f, total_b = total_f + loss_f, total_b + loss_b
            if log_p is not None:
                unigram += float(-log_p[batch["next_token_id"]].mean())
            batches += 1
            tokens += batch["next_token_id"].size
            progress.update(batches, f"perplexity {math.exp(0.5 * (total_f + total_b) / batches):.1f}")
            if max_batches and batches >= max_batches:
                break
    bilm.train(was_training)
    if batches == 0:
        raise InputError(f"{token_id_dir}: too little heldout text for one {rows}x{unroll_steps} window")
    result = {
        "perplexity_forward": math.exp(total_f / batches),
        "perplexity_backward": math.exp(total_b / batches),
        "perplexity": math.exp(0.5 * (total_f + total_b) / batches),
        "eval_tokens": float(tokens),
    }
    if log_p is not None:
        result["perplexity_unigram"] = math.exp(unigram / batches)
    return result


def _full_softmax_losses(
    objective: LMObjective, batch: dict[str, np.ndarray], state: LstmState | None, device: torch.device
) -> tuple[float, float, LstmState]:
    """One window's mean forward and backward losses under the full softmax, and the state after it."""
    tensors = to_tensors(batch, device)  # the same conversion as the training batches'
    top_f, top_b, state = objective.hidden(tensors["tokens_characters"], tensors["tokens_characters_reverse"], state)
    softmax = objective.bilm.softmax
    losses = [
        float(full_softmax_loss(top.flatten(0, 1), tensors[key].reshape(-1), softmax.weight, softmax.bias))
        for top, key in ((top_f, "next_token_id"), (top_b, "next_token_id_reverse"))
    ]
    return losses[0], losses[1], state


def evaluate_splits(
    bilm: BiLM, data: str | Path, splits: tuple[str, ...] = ("heldout", "test"), batch_size: int = 64
) -> dict[str, dict[str, float]]:
    """Full-softmax perplexity (per direction, with the add-one unigram baseline of the train counts) on each of
    ``splits`` that the vocab folder ``data`` holds token ids of; a split without sentences is left out."""
    data = Path(data)
    counts, _ = train_token_counts(data, bilm.config.n_tokens_vocab)
    results = {}
    for split in splits:
        folder = data / "token_ids" / split
        if folder.is_dir() and any(num_rows(f) for f in folder.glob("part-*.parquet")):
            results[split] = evaluate(bilm, folder, batch_size=batch_size, unigram_counts=counts)
    return results


def describe_perplexity(result: dict[str, float], split: str = "heldout") -> str:
    if not result:
        return f"no {split} split to evaluate"
    text = (
        f"{split} perplexity {result['perplexity']:.2f} (forward {result['perplexity_forward']:.2f}, "
        f"backward {result['perplexity_backward']:.2f}"
    )
    if "perplexity_unigram" in result:
        text += f"; unigram baseline {result['perplexity_unigram']:.2f}"
    return text + ")"


def heldout_rows(token_id_dir: str | Path, batch_size: int = 64) -> int:
    """Rows of a heldout window: at most ``batch_size``, and at most a quarter of the sentences, so each row carries
    its state over several sentences. Any model evaluated on the same windows (the bench's baseline) asks here."""
    n_sentences = sum(num_rows(f) for f in Path(token_id_dir).glob("part-*.parquet"))
    if n_sentences == 0:
        raise InputError(f"{token_id_dir}: no heldout sentences to evaluate on")
    return max(1, min(batch_size, n_sentences // 4))


def heldout_windows(
    token_id_dir: str | Path, batch_size: int = 64, unroll_steps: int = UNROLL_STEPS, max_batches: int | None = None
) -> int:
    """How many windows an evaluation of ``token_id_dir`` runs: what its progress counts, and what a budget scales a
    probe of two windows by to know the evaluation's cost before it runs."""
    rows = heldout_rows(token_id_dir, batch_size)
    n_tokens = sum(num_tokens(f) for f in sorted(Path(token_id_dir).glob("part-*.parquet")))
    expected = n_tokens // (rows * unroll_steps)
    return min(expected, max_batches or expected)


def num_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


def num_tokens(path: Path) -> int:
    """Tokens plus one boundary per sentence: the positions a pass over the file predicts."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    ids = pq.read_table(path, columns=["ids"]).column("ids")
    return int(pc.sum(pc.list_value_length(ids)).as_py() or 0) + len(ids)


def train_token_counts(data: Path, n_vocab: int) -> tuple[np.ndarray, int]:
    """Counts of every vocab id as a forward target in the train split (</S> once per sentence), and tokens. Read
    once per process and version of the files: a training's plan, its setup and its evaluation all ask."""
    parts = sorted((Path(data) / "token_ids" / "train").glob("part-*.parquet"))
    counts, tokens = _counted(tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in parts), n_vocab)
    return counts.copy(), tokens


@functools.lru_cache(maxsize=4)
def _counted(parts: tuple[tuple[str, int, int], ...], n_vocab: int) -> tuple[np.ndarray, int]:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    counts = np.zeros(n_vocab, dtype=np.float64)
    tokens = 0
    for path, _, _ in parts:
        ids = pq.read_table(path, columns=["ids"]).column("ids").combine_chunks()
        flat = pc.list_flatten(ids).to_numpy(zero_copy_only=False)
        counts += np.bincount(flat, minlength=n_vocab)[:n_vocab]
        counts[EOS_ID] += len(ids)  # each sentence's last target
        tokens += len(flat)
    return counts, tokens


def perplexity(config: PerplexityConfig, runtime: Any = None) -> dict[str, float]:
    """``elmo perplexity``: a model with its softmax and vocab scored on one split of an ingested dataset (its token
    ids made against the model's own vocab, in a temporary folder). ``runtime``: the model as the stage's plan
    found and placed it (``PerplexityStage``), else opened as ``config`` says."""
    from elmo_core.data.vocab import write_token_ids
    from elmo_core.ingest import shard_paths
    from elmo_core.runtime import Runtime

    runtime = runtime or Runtime.open(config.model, device=config.device)
    bilm = runtime.bilm  # the softmax comes along (the runtime keeps it)
    if bilm.softmax is None or bilm.vocab is None:
        raise ConfigError(
            f"{config.model}: perplexity needs a model with a softmax (softmax/W in weights.hdf5) and its vocab.txt"
        )
    shards = [str(p) for p in shard_paths(config.corpus)]
    if not shards:
        raise ConfigError(f"{config.corpus}: no part-*.parquet shards; run `elmo ingest` first")
    with tempfile.TemporaryDirectory() as tmp:
        write_token_ids(shards, bilm.vocab, Path(tmp))
        return evaluate(bilm, Path(tmp) / config.split, batch_size=config.batch_size, max_batches=config.max_batches)


def evaluate_export(
    model_dir: str, data: str, tracker: object | None = None, device: str = DEFAULT_DEVICE
) -> dict[str, dict[str, float]]:
    """The exported model's full-softmax perplexity on heldout and test, logged into the training's run as
    ``heldout/…`` and ``test/…`` where a tracker is given (the pipeline's evaluate stage), on ``device`` as the
    runtime places it (the training's device: a GPU's run is scored on the GPU)."""
    from elmo_core.runtime import Runtime

    scores = evaluate_splits(Runtime.open(model_dir, device=device).bilm, data)
    if tracker is not None and scores:
        metrics = {f"{split}/{k}": v for split, r in scores.items() for k, v in r.items()}
        tracker.log_metrics(metrics, step=0)  # type: ignore[attr-defined]
    return scores


class PerplexityStage(WholeStage):
    """``elmo perplexity`` as a stage, one unit."""

    name = "perplexity"

    def writes(self, config: PerplexityConfig) -> list[Path]:
        return []  # it reads a model and a dataset, and writes its token ids in a temporary folder

    def settle(self, config: PerplexityConfig) -> PerplexityConfig:
        """The model pinned to the exact version a moving reference names now (``models:/elmo/latest`` →
        ``models:/elmo/3``), so the score names what was scored."""
        from elmo_core.runtime.reference import pin_reference

        return config.model_copy(update={"model": pin_reference(config.model)})

    def plan(self, config: PerplexityConfig) -> ScorePlan:
        """The model looked up (read only; fetched under the claim) and placed, once: the unit scores with that."""
        from elmo_core.runtime import lookup_model, place

        config = self.settle(config)
        model, placement = lookup_model(config.model), place(config.device)
        lines = [model.line(), f"scored on the {config.split} split of {config.corpus}, on {placement.line()}"]
        return ScorePlan(config, [Whole(self.name)], [], lines, False, model, placement)

    def run_unit(self, plan: ScorePlan, unit: Whole, report: Any = None) -> dict[str, float]:
        from elmo_core.runtime import Runtime

        return perplexity(plan.options, Runtime.open(plan.model.fetch(), placement=plan.placement))


@dataclass
class ScorePlan(WholePlan):
    """``elmo perplexity``'s plan: its lines, the model it found and where it runs."""

    model: Any = None  # a runtime.ModelLookup
    placement: Any = None  # a runtime.Placement
