"""What a training runs where its config leaves the choice open, decided once in ``setup`` and said on the log line
that says what runs: the softmax (``sample_softmax: auto``) and, under a ``budget``, the recipe that
``bench/cpu_recipe.py`` measured best for a corpus like this one in that much CPU time (``recipe_table.json``)."""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from elmo_core.bilm.softmax import LogUniformSampler
from elmo_core.data.batches import LMBatcher
from elmo_core.data.prefetch import to_tensors
from elmo_core.errors import ConfigError, InputError
from elmo_core.options import RECIPE_FIELDS, TrainConfig, budget_seconds
from elmo_core.precision import Precision, autocast
from elmo_core.ranks import Rank
from elmo_core.train.ddp import gather
from elmo_core.train.objective import LMObjective

TABLE = Path(__file__).with_name("recipe_table.json")

# ``sample_softmax: auto`` takes the exact softmax where it costs next to nothing. Measured (bench/cpu_recipe.py,
# one thread, two seeds): on the help topics (2k words) an exact step cost 1.15-1.25x a sampled one and gained
# about as much per step, so at equal CPU time the two tied (best heldout 51.4 against 51.0 in 2.5 minutes); on
# WordNet (29k words) it cost 9.3x and lost (602.6 against 233.3 after 5 minutes, three of four exact runs
# diverging). The start-up measure times whole steps, optimizer included (``exact_step_cost``): 1.20-1.28x on the
# help topics and 6.6-8.4x on WordNet (an Intel Xeon with AMX, one and two threads). Below 1.05 an exact step is
# about free and its exact gradient a gain; near the tie either choice is as good. Above EXACT_MAX_VOCAB it is not
# measured: one batch's logits alone take hundreds of megabytes, and the cost grows with the vocabulary.
EXACT_MAX_COST = 1.05
EXACT_MAX_VOCAB = 50_000


class Choice(NamedTuple):
    """The config with a decision made, and the reason logged with it."""

    config: TrainConfig
    why: str


# ----- the softmax ---------------------------------------------------------------------------------------------


def choose_softmax(config: TrainConfig, n_vocab: int, exact_cost: Callable[[], float]) -> Choice:
    """``sample_softmax: auto`` resolved: exact where this vocabulary is small enough to measure and ``exact_cost()``
    (an exact step's time over a sampled one's, on this device) is at most EXACT_MAX_COST; else sampled."""
    if config.sample_softmax != "auto":
        return Choice(config, f"sample_softmax {str(config.sample_softmax).lower()}, as given")
    if n_vocab > EXACT_MAX_VOCAB:
        exact, why = False, f"{n_vocab:,} words > {EXACT_MAX_VOCAB:,}: the exact softmax is not tried"
    else:
        ratio = exact_cost()
        exact = ratio <= EXACT_MAX_COST
        why = (
            f"an exact step costs {ratio:.2f}x a sampled one here, {'within' if exact else 'over'} the "
            f"{EXACT_MAX_COST:.2f}x limit"
        )
    return Choice(config.model_copy(update={"sample_softmax": not exact}), f"sample_softmax auto: {why}")


def settle_softmax(
    config: TrainConfig,
    objective: LMObjective,
    n_vocab: int,
    precision: Precision,
    out: Path,
    ranks: Rank,
    optimizer_for: Callable[[TrainConfig, list[torch.nn.Parameter]], torch.optim.Optimizer],
) -> Choice:
    """``choose_softmax`` for this run (``sample_softmax: auto``): whole steps measured on one batch of its data on
    its device with its optimizer (``optimizer_for(config, params)``; every rank takes the slowest rank's ratio), or
    the choice of the run's first start when it resumes one."""
    if config.sample_softmax == "auto" and config.resume and (kept := _kept_softmax(out)) is not None:
        return Choice(config.model_copy(update={"sample_softmax": kept}), "sample_softmax auto: as this run chose")

    def ratio() -> float:
        loss_of = _one_batch_step(objective, config, n_vocab, precision)
        params = [p for p in objective.parameters() if p.requires_grad]
        sparse = sparse_softmax(config.model_copy(update={"sample_softmax": True}), n_vocab, ranks)
        cost = exact_step_cost(loss_of, objective, params, lambda: optimizer_for(config, params), sparse)
        return max(gather(ranks, cost))

    return choose_softmax(config, n_vocab, ratio)


def _kept_softmax(out: Path) -> bool | None:
    """The softmax a run folder's first start chose (its config.json), so that a resume keeps it."""
    try:
        kept = json.loads((out / "config.json").read_text()).get("sample_softmax")
    except (OSError, ValueError):
        return None
    return kept if isinstance(kept, bool) else None


def _one_batch_step(
    objective: LMObjective, config: TrainConfig, n_vocab: int, precision: Precision
) -> Callable[[bool], torch.Tensor]:
    """One batch of the run's own data and shape (a batcher of its own: the run's batches stay as they are) ─► the
    loss of a forward pass with the exact softmax or with the run's sampled one. Real text, not random ids: the
    sampled softmax's cost grows with the distinct target words a batch holds."""
    device = objective.bilm.device
    batcher = LMBatcher(Path(config.data) / "token_ids" / "train", config.batch_size, config.unroll_steps, seed=1)
    arrays = batcher.next_batch()
    if arrays is None:
        raise InputError(f"{config.data}/token_ids/train: no training batches")
    batch = to_tensors(arrays, device)
    sampler = LogUniformSampler(n_vocab, seed=0)

    def step(exact: bool) -> torch.Tensor:
        sampled, tries = (None, 0) if exact else sampler.sample(config.n_negative_samples_batch)
        with autocast(device, precision):
            chars, targets = batch["tokens_characters"], batch["next_token_id"]
            reverse = batch["tokens_characters_reverse"], batch["next_token_id_reverse"]
            return objective(chars, reverse[0], targets, reverse[1], None, sampled, tries, sampler)[0]

    return step


def exact_step_cost(
    loss_of: Callable[[bool], torch.Tensor],
    objective: LMObjective,
    params: list[torch.nn.Parameter],
    optimizer_for: Callable[[], torch.optim.Optimizer],
    sparse: bool,
    pairs: int = 6,
) -> float:
    """An exact training step's cost over a sampled one's, each whole as the run would take it: ``loss_of(exact)``'s
    forward and backward (the sampled one with the ``sparse`` softmax gradients the run would use) and the
    optimizer's update, each softmax with an optimizer of its own. Forward and backward alone, dense on both paths,
    hid much of the difference, a dense update over every word's row against a few hundred rows: on WordNet with
    the CLI's defaults they read 1.03x once and 3.3-4.8x in four more starts, whole steps 5.0-5.4x. Timed in turn,
    ``pairs`` times after a warm-up pair, the median of the pairs' ratios (a VM's speed drifts; in turn, both see
    the same drift), on this process's CPU clock on a CPU (another process's load does not count) and on the wall
    clock after a synchronize on a GPU. Weights, gradients, ``objective.sparse`` and the global RNG are left as they
    were."""
    clock = _step_clock(params[0].device)
    saved, rng, was_sparse = [p.detach().clone() for p in params], torch.get_rng_state(), objective.sparse
    optimizers = {exact: optimizer_for() for exact in (False, True)}
    ratios = []
    try:
        for pair in range(pairs + 1):
            seconds = {}
            for exact in (False, True):
                objective.sparse = sparse and not exact
                start = clock()
                loss_of(exact).backward()
                optimizers[exact].step()
                seconds[exact] = clock() - start
                for p in params:
                    p.grad = None
            if pair:
                ratios.append(seconds[True] / seconds[False])
    finally:
        with torch.no_grad():
            for p, value in zip(params, saved):
                p.copy_(value)
        objective.sparse = was_sparse
        torch.set_rng_state(rng)
    return statistics.median(ratios)


def _step_clock(device: torch.device) -> Callable[[], float]:
    """Seconds to time a step by: the process's CPU time on a CPU, the wall clock once the GPU's queue is done."""
    if device.type != "cuda":
        return time.process_time

    def synchronized() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return synchronized


def sparse_softmax(config: TrainConfig, n_vocab: int, ranks: Rank) -> bool:
    """Sparse softmax gradients: asked for, or by default for a large vocabulary with Adagrad on one process (the
    sampled softmax's: the exact softmax's gradient reaches every row)."""
    if not config.sample_softmax:
        if config.sparse_softmax:
            raise ConfigError("sparse_softmax needs the sampled softmax (sample_softmax true)")
        return False
    sparse = (
        config.sparse_softmax
        if config.sparse_softmax is not None
        else (n_vocab > 50_000 and config.optimizer == "adagrad" and ranks.world == 1)
    )
    if sparse and (config.optimizer != "adagrad" or ranks.world > 1):
        raise ConfigError("sparse_softmax needs the Adagrad optimizer and a single process")
    return sparse


def describe_softmax(config: TrainConfig, n_vocab: int, sparse: bool) -> str:
    """The log line (and MLflow param) that says which softmax trains the model."""
    if not config.sample_softmax:
        return f"softmax: exact over all {n_vocab:,} words"
    negatives = min(config.n_negative_samples_batch, n_vocab)
    return (
        f"softmax: sampled, {negatives:,} log-uniform negatives of {n_vocab:,} words per step"
        + (", sparse gradients" if sparse else "")
        + " (bilm-tf's)"
    )


# ----- the recipe for a budget ---------------------------------------------------------------------------------


def load_table(path: Path = TABLE) -> dict[str, Any]:
    return json.loads(path.read_text())


def table_measured(path: Path = TABLE) -> dict[str, Any]:
    """How the table's runs were measured (its clock, threads, evaluations), which a budget's line compares with
    the clock the run counts (``budget.Budget.line``)."""
    return load_table(path).get("measured", {"clock": "cpu", "threads": 1, "evaluation": "off the clock"})


def choose_for_budget(
    config: TrainConfig, n_tokens: int, n_vocab: int, table: dict[str, Any] | None = None, device_type: str = "cpu"
) -> Choice:
    """Under a ``budget``: the recipe with the lowest mean heldout perplexity (over its seeds) that the table
    measured on the corpus nearest this one in size, at the largest measured budget not above this one; its fields
    fill those the user left unset, and ``export`` becomes ``best``. Off the CPU the table's softmax is not taken:
    it was measured on one CPU thread, where an exact step costs 1.2-20x a sampled one, while on an H200 it cost
    less (docs/benchmarks.md, the GPU section), so ``sample_softmax`` is left to ``auto``, which measures this
    device. Without a budget: the config as given."""
    if config.budget is None:
        return Choice(config, "no budget: the recipe as configured")
    table = table or load_table()
    minutes = budget_seconds(config.budget) / 60
    corpus = min(table["corpora"], key=lambda c: abs(math.log(c["train_tokens"] / max(n_tokens, 1))))
    rows = [r for r in table["results"] if r["corpus"] == corpus["name"]]
    budgets = sorted({r["budget_minutes"] for r in rows})
    at = max((b for b in budgets if b <= minutes), default=budgets[0])
    ranked = sorted((r for r in rows if r["budget_minutes"] == at), key=lambda r: statistics.fmean(r["perplexity"]))
    best = ranked[0]
    fields = table["recipes"][best["recipe"]]["fields"]
    given = config.model_fields_set
    update = {k: v for k, v in fields.items() if k in RECIPE_FIELDS and k not in given}
    if "export" not in given:
        update["export"] = "best"
    off_cpu = ""
    if device_type != "cpu" and "sample_softmax" in update:
        update["sample_softmax"] = "auto"
        off_cpu = f"; on {device_type} the softmax is left to sample_softmax auto (the table's was measured on a CPU)"
    runner_up = f"; next: {ranked[1]['recipe']} {_describe(ranked[1])}" if len(ranked) > 1 else ""
    why = (
        f"budget {config.budget}: recipe {best['recipe']} ({_spell(fields)}), the lowest heldout perplexity "
        f"the table measured at {at:g} CPU-minutes (one thread) on {corpus['name']} ({corpus['train_tokens']:,} "
        f"train tokens, {corpus['vocab_size']:,} words; this corpus: {n_tokens:,}, {n_vocab:,}): {_describe(best)}"
        f"{runner_up}{off_cpu}"
        + (f"; kept as given: {', '.join(sorted(k for k in fields if k in given))}" if given & set(fields) else "")
    )
    return Choice(config.model_copy(update=update), why)


def _describe(row: dict[str, Any]) -> str:
    """The mean the ranking uses, then each seed's value: seeds can lie far apart."""
    values = [f"{v:,.1f}" for v in row["perplexity"]]
    if len(values) == 1:
        return f"{values[0]} (1 seed)"
    seeds = ", ".join(values[:-1]) + f" and {values[-1]}"
    return f"{statistics.fmean(row['perplexity']):,.1f} as the mean of {len(values)} seeds ({seeds})"


def _spell(fields: dict[str, Any]) -> str:
    """What sets a recipe apart, in a few words."""
    sampled = fields.get("sample_softmax", True)
    softmax = f"sampled softmax ({fields.get('n_negative_samples_batch')} negatives)" if sampled else "exact softmax"
    bias = ", unigram softmax bias" if fields.get("softmax_bias_init") == "unigram" else ""
    schedule = {"cosine": " annealed (cosine) to 0 by the budget's end", "inverse_sqrt": " inverse-sqrt"}
    return (
        f"{fields.get('preset')}, {softmax}, {fields.get('optimizer')} {fields.get('learning_rate')}"
        f"{schedule.get(fields.get('lr_schedule'), '')}, dropout {fields.get('dropout')}{bias}"
    )
