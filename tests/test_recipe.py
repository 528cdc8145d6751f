"""What a training runs where its config leaves it open: ``sample_softmax: auto`` by the rule it states, and under a
``budget`` the recipe the shipped, measured table names (``elmo_core/train/recipe.py``)."""

from __future__ import annotations

import json
import logging
import re
import time

import pytest
import torch

from elmo_core.bilm.model import BiLM
from elmo_core.options import TrainConfig, TrainOptions
from elmo_core.precision import resolve_precision
from elmo_core.train import recipe
from elmo_core.train.loop import train
from elmo_core.train.objective import LMObjective
from tests.helpers import run_elmo
from tests.test_train import FIXTURE_MODEL, FIXTURE_OPTIONS, fixture_data  # noqa: F401


def _config(**options) -> TrainConfig:
    return TrainConfig(data="d", out="o", **options)


# ----- sample_softmax: auto ------------------------------------------------------------------------------


@pytest.mark.parametrize(("ratio", "exact"), [(1.0, True), (recipe.EXACT_MAX_COST, True), (1.06, False), (9.3, False)])
def test_auto_takes_the_exact_softmax_where_its_step_costs_at_most_the_stated_ratio(ratio, exact):
    choice = recipe.choose_softmax(_config(sample_softmax="auto"), 2_076, lambda: ratio)
    assert choice.config.sample_softmax is (not exact)
    assert f"{ratio:.2f}x a sampled one" in choice.why and ("within" if exact else "over") in choice.why


def test_auto_does_not_measure_above_the_vocabulary_limit_and_a_given_softmax_is_kept():
    def never() -> float:
        raise AssertionError("measured")

    big = recipe.choose_softmax(_config(sample_softmax="auto"), recipe.EXACT_MAX_VOCAB + 1, never)
    assert big.config.sample_softmax is True and f"{recipe.EXACT_MAX_VOCAB + 1:,} words" in big.why
    for given in (True, False):
        assert recipe.choose_softmax(_config(sample_softmax=given), 100, never).config.sample_softmax is given


def _fixture_objective(fixture_data):  # noqa: F811
    config = TrainConfig(
        data=str(fixture_data), out="o", model=FIXTURE_MODEL, batch_size=4, unroll_steps=5, n_negative_samples_batch=8
    )
    n_vocab = len((fixture_data / "vocab.txt").read_text().splitlines())
    objective = LMObjective(BiLM(config.architecture(n_vocab), vocab=None), 0.1, sparse=False).train()
    step = recipe._one_batch_step(objective, config, n_vocab, resolve_precision("fp32", "cpu"))
    return objective, step, [p for p in objective.parameters() if p.requires_grad]


@pytest.mark.timing
def test_the_cost_is_whole_steps_as_the_run_takes_them_and_leaves_the_model_as_it_was(fixture_data):  # noqa: F811
    """Each path steps its own optimizer, the sampled one with the run's sparse gradients; then the weights,
    gradients, the sparse flag and the RNG are as before."""
    objective, step, params = _fixture_objective(fixture_data)
    calls, made = [], []

    def counted(exact: bool) -> torch.Tensor:
        calls.append((exact, objective.sparse))
        return step(exact)

    def adagrad() -> torch.optim.Optimizer:
        made.append(torch.optim.Adagrad(params, lr=0.2))
        return made[-1]

    rng, weights = torch.get_rng_state(), [p.detach().clone() for p in params]
    ratio = recipe.exact_step_cost(counted, objective, params, adagrad, sparse=True)
    assert ratio > 0 and calls == [(False, True), (True, False)] * 7
    assert len(made) == 2 and all(len(o.state) == len(params) for o in made)
    assert all(o.state[p]["step"] == 7 for o in made for p in params)  # every step took its optimizer's update
    assert all(p.grad is None for p in params) and torch.equal(torch.get_rng_state(), rng)
    assert objective.sparse is False and all(torch.equal(p, w) for p, w in zip(params, weights))


@pytest.mark.timing
def test_the_cost_counts_the_optimizers_update(fixture_data):  # noqa: F811
    """A costly update on the exact path alone (as a dense update over every word's row is) shows in the ratio."""
    objective, step, params = _fixture_objective(fixture_data)

    class Costly(torch.optim.SGD):
        def step(self, closure=None):
            # 150 CPU-ms of work on the clock the measure reads: several times a sampled step even late in the full
            # suite's process, where a sampled step took about 26 CPU-ms and 50 ms of work added only 1.95)
            end = time.process_time() + 0.15
            while time.process_time() < end:
                pass
            return super().step(closure)

    made = []

    def sampled_cheap_exact_costly() -> torch.optim.Optimizer:
        made.append((torch.optim.SGD if not made else Costly)(params, lr=0.1))
        return made[-1]

    plain = recipe.exact_step_cost(step, objective, params, lambda: torch.optim.SGD(params, lr=0.1), sparse=False)
    costly = recipe.exact_step_cost(step, objective, params, sampled_cheap_exact_costly, sparse=False)
    assert costly > plain + 2


def test_a_run_with_auto_says_why_and_its_resume_keeps_the_choice(fixture_data, tmp_path, caplog):  # noqa: F811
    options = {**FIXTURE_OPTIONS, "max_steps": 2, "sample_softmax": "auto"}
    with caplog.at_level(logging.INFO, logger="elmo_core.train.loop"):
        train(TrainConfig(data=str(fixture_data), out=str(tmp_path), **options))
    assert re.search(r"softmax: .*\(sample_softmax auto: an exact step costs [0-9.]+x a sampled one here", caplog.text)
    chosen = json.loads((tmp_path / "config.json").read_text())["sample_softmax"]
    assert isinstance(chosen, bool)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="elmo_core.train.loop"):
        train(TrainConfig(data=str(fixture_data), out=str(tmp_path), **{**options, "max_steps": 3, "resume": True}))
    assert "sample_softmax auto: as this run chose" in caplog.text
    assert json.loads((tmp_path / "config.json").read_text())["sample_softmax"] is chosen


# ----- the recipe for a budget ---------------------------------------------------------------------------

TABLE = {
    "corpora": [
        {"name": "small", "train_tokens": 50_000, "vocab_size": 2_000},
        {"name": "large", "train_tokens": 5_000_000, "vocab_size": 90_000},
    ],
    "recipes": {
        "a": {"fields": {"preset": "mini", "optimizer": "adagrad"}},
        "b": {"fields": {"preset": "tiny", "optimizer": "adamw", "learning_rate": 0.002, "sample_softmax": False}},
        "c": {"fields": {"preset": "small"}},
    },
    "results": [
        {"corpus": "small", "recipe": "a", "budget_minutes": 5, "perplexity": [50.0, 60.0]},
        {"corpus": "small", "recipe": "b", "budget_minutes": 5, "perplexity": [54.0, 54.0]},
        {"corpus": "small", "recipe": "b", "budget_minutes": 30, "perplexity": [40.0]},
        {"corpus": "large", "recipe": "c", "budget_minutes": 5, "perplexity": [9.0]},
    ],
}  # fmt: skip


def test_a_budget_takes_the_lowest_mean_of_the_nearest_corpus_at_the_largest_budget_not_above_it():
    choice = recipe.choose_for_budget(_config(budget="20m"), n_tokens=80_000, n_vocab=3_000, table=TABLE)
    # small is nearer 80k tokens than large; 5 is the largest budget <= 20; b's mean 54 beats a's 55
    assert choice.config.preset == "tiny" and choice.config.optimizer == "adamw"
    assert choice.config.sample_softmax is False and choice.config.export == "best"
    assert "recipe b" in choice.why and "next: a" in choice.why
    assert "54.0 as the mean of 2 seeds (54.0 and 54.0); next: a" in choice.why  # the mean it ranks by, then each
    assert choice.why.endswith("55.0 as the mean of 2 seeds (50.0 and 60.0)")
    assert "at 5 CPU-minutes (one thread) on small" in choice.why
    longer = recipe.choose_for_budget(_config(budget="30m"), 80_000, 3_000, table=TABLE)
    assert "recipe b" in longer.why and "at 30 CPU-minutes" in longer.why and "40.0 (1 seed)" in longer.why
    assert recipe.choose_for_budget(_config(budget="1h"), 4_000_000, 80_000, table=TABLE).config.preset == "small"


def test_what_the_user_gave_is_kept_and_without_a_budget_nothing_is_picked():
    given = _config(budget="20m", optimizer="adagrad", export="last")
    choice = recipe.choose_for_budget(given, 80_000, 3_000, table=TABLE)
    assert choice.config.optimizer == "adagrad" and choice.config.export == "last" and choice.config.preset == "tiny"
    assert "kept as given: optimizer" in choice.why
    plain = _config(optimizer="adamw")
    assert recipe.choose_for_budget(plain, 80_000, 3_000, table=TABLE).config == plain


def test_off_the_cpu_a_budget_leaves_the_softmax_to_the_devices_own_measure():
    """The table's softmax was measured on one CPU thread; on a GPU an exact step can cost less than a sampled one."""
    on_gpu = recipe.choose_for_budget(_config(budget="20m"), 80_000, 3_000, table=TABLE, device_type="cuda")
    assert on_gpu.config.sample_softmax == "auto" and on_gpu.config.optimizer == "adamw"  # the rest of recipe b
    assert "on cuda the softmax is left to sample_softmax auto" in on_gpu.why
    on_cpu = recipe.choose_for_budget(_config(budget="20m"), 80_000, 3_000, table=TABLE, device_type="cpu")
    assert on_cpu.config.sample_softmax is False and "sample_softmax auto" not in on_cpu.why
    given = recipe.choose_for_budget(_config(budget="20m", sample_softmax=True), 80_000, 3_000, TABLE, "cuda")
    assert given.config.sample_softmax is True and "on cuda" not in given.why


def test_the_pipeline_under_a_budget_takes_the_tables_recipe_whole_not_mixed_with_its_defaults(tmp_path):
    """The main job's CPU defaults (mini, batch 32, 512 negatives) give way to the measured recipe under a budget;
    what the user gave stays, and without a budget the defaults hold as before."""
    from flows.pipeline import PipelineParams, _stage_configs

    measured = {"preset": "tiny", "batch_size": 16, "unroll_steps": 10, "n_negative_samples_batch": 2048,
                "sample_softmax": True, "optimizer": "adagrad", "learning_rate": 0.3, "lr_schedule": "constant",
                "warmup_steps": 0, "dropout": 0.3}  # fmt: skip
    table = {
        "corpora": [{"name": "small", "train_tokens": 50_000, "vocab_size": 2_000}],
        "recipes": {"m": {"fields": measured}},
        "results": [{"corpus": "small", "recipe": "m", "budget_minutes": 30, "perplexity": [40.0]}],
    }

    def pipeline_train(**options) -> TrainConfig:
        params = PipelineParams.model_validate({"train": options})
        return _stage_configs(params, tmp_path, [str(tmp_path / "corpus.txt")], "sqlite:///mlflow.db")[2]

    picked = recipe.choose_for_budget(pipeline_train(budget="30m", dropout=0.2), 50_000, 2_000, table=table).config
    assert {k: getattr(picked, k) for k in measured} == {**measured, "dropout": 0.2}
    assert picked.export == "best" and picked.checkpoint_every == 200  # the main job's other defaults stay
    plain = pipeline_train(n_epochs=3)
    assert (plain.preset, plain.batch_size, plain.n_negative_samples_batch, plain.n_epochs) == ("mini", 32, 512, 3)
    assert recipe.choose_for_budget(plain, 50_000, 2_000, table=table).config == plain


def test_the_shipped_table_is_measured_and_every_recipe_in_it_is_a_valid_config():
    table = recipe.load_table()
    names = {c["name"] for c in table["corpora"]}
    assert {"pydoc", "wordnet"} <= names and all(c["train_tokens"] > 0 and c["cpu"] for c in table["corpora"])
    for row in table["results"]:
        assert row["corpus"] in names and row["recipe"] in table["recipes"]
        assert row["perplexity"] and all(p > 1 for p in row["perplexity"])
    for measured in table["recipes"].values():
        assert set(measured["fields"]) == set(recipe.RECIPE_FIELDS)  # a pick sets every field, mixing none in
        TrainOptions(**measured["fields"])


@pytest.mark.slow
def test_elmo_train_with_a_budget_says_which_recipe_the_table_picked(fixture_data, tmp_path):  # noqa: F811
    result = run_elmo(
        "-v", "train", "--data", str(fixture_data), "--out", str(tmp_path / "run"), "--budget", "30m",
        "--max-steps", "2", "--tracking", "none", "--model", json.dumps(FIXTURE_MODEL), "--batch-size", "2",
        "--unroll-steps", "10",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert re.search(
        r"budget 30m: recipe [\w-]+ \(.*\), the lowest heldout perplexity the table measured", result.stderr
    )
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["export"] == "best" and config["batch_size"] == 2
