"""Which training recipe reaches the lowest heldout perplexity within a fixed CPU budget (one thread)?

    .venv/bin/python bench/cpu_recipe.py [--corpora pydoc,wordnet,kernel] [--recipes today-bf16,word-lstm,...]
                                         [--budget 30] [--jobs 2] [--out data/bench/cpu_recipe] [--plot]
                                         [--write-table elmo_core/train/recipe_table.json]

Each (corpus, recipe) trains in its own process with one thread (``torch.set_num_threads(1)``, OMP/MKL at 1) through
``elmo_core.train.loop``'s own ``setup``/``step``; the clock is the process's CPU time counted by the trainer's own
``train.budget.Budget`` (``MEASURED``, written into the table), with heldout evaluations (full
softmax over the whole heldout split, at 1, 2.5, 5, 7.5, 10, 15, 20, 25 and 30 CPU-minutes; fewer on the kernel docs,
``CORPUS_POINTS``) paused out of it. Each
point is logged to the run's MLflow run (experiment ``elmo-cpu-recipe``, store ``OUT/mlflow.db``) as
``heldout_perplexity`` with ``cpu_minutes``, and to ``OUT/runs/CORPUS-RECIPE/points.json``. A checkpoint is written at
every point: a rerun with a larger ``--budget`` resumes where the last one stopped (exactly: the schedules are
functions of the step), so a short screening run of a candidate is the start of its long run.

Corpora: ``pydoc``, Python's help topics (the main job's default corpus, 53k tokens), ``wordnet``, WordNet 3.0's
definitions without their examples (1.2M tokens; ``apt-get install wordnet-base``), and ``kernel``, the Linux
kernel's documentation (7.4M tokens, 92k words; ``apt-get install linux-doc-6.1``, Debian 12), ingested and counted
as the main job does (unicode tokens, 5% heldout by hash, min count 2). Recipes are ``RECIPES`` below; ``today-fp32``
is the main job's recipe before this bench (bilm-tf's, shrunk: Adagrad 0.2, constant rate, batch 32, 512 negatives,
dropout 0.1) in fp32; ``word-lstm`` is the baseline #38 names (``word_lstm.py``). ``--plot`` draws perplexity
against CPU-minutes per corpus into ``OUT/curves.png``; ``--write-table PATH`` writes what a training budget picks
from (``elmo_core/train/recipe_table.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# how every run is measured, recorded in the table so that a training budget counts on the same clock
MEASURED = {"clock": "cpu", "threads": 1, "evaluation": "off the clock"}
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

EXPERIMENT = "elmo-cpu-recipe"
POINTS = (1.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 25.0, 30.0, 45.0, 60.0)  # CPU-minutes where heldout is evaluated
# heldout batches (64 x 20 tokens) per evaluation, and the points, of a corpus whose full-softmax evaluation is
# costly: the kernel docs' first 64k heldout tokens (the same for every recipe; all 389k over 92k words would take
# 10 CPU-minutes a point), at fewer points (one such evaluation still takes 2.5 CPU-minutes, 5 for the baseline)
EVAL_MAX_BATCHES = {"kernel": 50}
CORPUS_POINTS = {"kernel": (1.0, 2.5, 5.0, 7.5, 15.0, 30.0, 60.0)}

# The main job's recipe before this bench, spelled out (CPU_TRAIN_OPTIONS may have moved on since).
TODAY: dict[str, Any] = {
    "preset": "mini",
    "batch_size": 32,
    "unroll_steps": 20,
    "n_negative_samples_batch": 512,
    "optimizer": "adagrad",
    "learning_rate": 0.2,
    "lr_schedule": "constant",
    "warmup_steps": 0,
    "dropout": 0.1,
}
RECIPES: dict[str, dict[str, Any]] = {
    "today-fp32": {**TODAY, "precision": "fp32"},
    "today-bf16": {**TODAY, "precision": "bf16"},
    # a second seed (model init, data order, sampler) of both: how far one run's point moves by chance
    "today-fp32-seed1": {**TODAY, "precision": "fp32", "seed": 1},
    "today-bf16-seed1": {**TODAY, "precision": "bf16", "seed": 1},
    "b64": {**TODAY, "precision": "bf16", "batch_size": 64},
    "neg2k": {**TODAY, "precision": "bf16", "n_negative_samples_batch": 2048},
    "drop3": {**TODAY, "precision": "bf16", "dropout": 0.3},
    "drop5": {**TODAY, "precision": "bf16", "dropout": 0.5},
    "neg2k-drop3": {**TODAY, "precision": "bf16", "n_negative_samples_batch": 2048, "dropout": 0.3},
    "neg256": {**TODAY, "precision": "bf16", "n_negative_samples_batch": 256},
    "lr3": {**TODAY, "precision": "bf16", "learning_rate": 0.3},
    "adamw": {
        **TODAY,
        "precision": "bf16",
        "optimizer": "adamw",
        "learning_rate": 5e-4,
        "lr_schedule": "inverse_sqrt",
        "warmup_steps": 300,
    },
    # the exact softmax (sample_softmax false, #38): every softmax row's gradient exact, so Adam-family optimizers
    # see no seldom-sampled rows
    "exact-adagrad": {**TODAY, "precision": "bf16", "sample_softmax": False},
    "exact-adamw": {
        **TODAY,
        "precision": "bf16",
        "sample_softmax": False,
        "optimizer": "adamw",
        "learning_rate": 2e-3,
        "lr_schedule": "inverse_sqrt",
        "warmup_steps": 300,
    },
}


def _mini_lstm(dim: int, projection_dim: int) -> dict[str, Any]:
    """``mini``'s char CNN under LSTMs of another size (the second model size of #38's study)."""
    from elmo_core.config import mini

    model = mini()
    return model.model_copy(
        update={"lstm": model.lstm.model_copy(update={"dim": dim, "projection_dim": projection_dim})}
    ).model_dump()


RECIPES["lstm512"] = {**TODAY, "precision": "bf16", "model": _mini_lstm(512, 128)}
RECIPES["lstm128"] = {**TODAY, "precision": "bf16", "model": _mini_lstm(128, 32)}
# the softmax bias started at the words' log frequencies (softmax_bias_init, #38)
RECIPES["unibias"] = {**TODAY, "precision": "bf16", "softmax_bias_init": "unigram"}
RECIPES["unibias-seed1"] = {**RECIPES["unibias"], "seed": 1}
# the rate annealed to 0 by a 30-minute budget's end (lr_schedule cosine under a budget: the cosine's clock is the
# share of the budget spent). ANNEAL is the bench's: its runs stand for that budget alone, so they are evaluated up
# to it (on a corpus whose evaluation is costly, at it only) and the table holds them at it only
ANNEAL = "anneal_minutes"
RECIPES["unibias-cos30"] = {**RECIPES["unibias"], "lr_schedule": "cosine", ANNEAL: 30.0}
RECIPES["unibias-cos30-seed1"] = {**RECIPES["unibias-cos30"], "seed": 1}
# WordNet is still falling steeply at 30 minutes (under-trained, not over-fitted): a higher starting rate, and twice
# the batch (more tokens per CPU-second), both annealed
RECIPES["unibias-lr4-cos30"] = {**RECIPES["unibias-cos30"], "learning_rate": 0.4}
RECIPES["unibias-lr4-cos30-seed1"] = {**RECIPES["unibias-lr4-cos30"], "seed": 1}
RECIPES["unibias-b64-cos30"] = {**RECIPES["unibias-cos30"], "batch_size": 64}
RECIPES["unibias-b64-cos30-seed1"] = {**RECIPES["unibias-b64-cos30"], "seed": 1}
# the same annealed over shorter budgets: each stands for its own budget in the table
for _minutes in (2.5, 5.0, 15.0):
    RECIPES[f"unibias-lr4-cos{_minutes:g}"] = {**RECIPES["unibias-lr4-cos30"], ANNEAL: _minutes}
    RECIPES[f"unibias-lr4-cos{_minutes:g}-seed1"] = {**RECIPES[f"unibias-lr4-cos{_minutes:g}"], "seed": 1}
# the second model size a budget can pick (#38): the published `small` preset (2x1024_128 LSTMs under a 2,048-filter
# char CNN) under the recipe that won on WordNet at `mini`'s size
RECIPES["small-unibias-lr4-cos30"] = {**RECIPES["unibias-lr4-cos30"], "preset": "small"}
RECIPES["small-unibias-lr4-cos30-seed1"] = {**RECIPES["small-unibias-lr4-cos30"], "seed": 1}
# and under the kernel docs' pick at `mini`'s size (the rate the table keeps for kernel-sized corpora)
RECIPES["small-unibias-cos30"] = {**RECIPES["unibias-cos30"], "preset": "small"}
RECIPES["small-unibias-cos30-seed1"] = {**RECIPES["small-unibias-cos30"], "seed": 1}
# and under the help topics' winner there
RECIPES["small-neg2k-drop3"] = {**RECIPES["neg2k-drop3"], "preset": "small"}
RECIPES["small-neg2k-drop3-seed1"] = {**RECIPES["small-neg2k-drop3"], "seed": 1}
# the baseline to beat (#38): a plain 1x512 word LSTM per direction, full softmax, Adam (bench/word_lstm.py)
RECIPES["word-lstm"] = {
    "baseline": "word-lstm",
    "batch_size": 32,
    "unroll_steps": 20,
    "dropout": 0.1,
    "learning_rate": 2e-3,
    "clip_norm": 1.0,
    "precision": "bf16",
}
RECIPES["word-lstm-seed1"] = {**RECIPES["word-lstm"], "seed": 1}
RECIPES["exact-adagrad-seed1"] = {**RECIPES["exact-adagrad"], "seed": 1}
RECIPES["exact-adamw-seed1"] = {**RECIPES["exact-adamw"], "seed": 1}
RECIPES["adamw-seed1"] = {**RECIPES["adamw"], "seed": 1}
# a wider LSTM with the exact softmax on a small vocabulary, where the word-LSTM baseline learns fastest
RECIPES["lstm512-exact-adagrad"] = {**RECIPES["exact-adagrad"], "model": RECIPES["lstm512"]["model"]}
RECIPES["lstm512-exact-adagrad-seed1"] = {**RECIPES["lstm512-exact-adagrad"], "seed": 1}
RECIPES["neg2k-drop3-seed1"] = {**RECIPES["neg2k-drop3"], "seed": 1}
# third and fourth seeds of today's recipe and of the kernel docs' pick at 30 minutes, each pair run in one round so
# that both see the same machine: the first two seeds' rounds differed by a fifth in steps per CPU-minute
for _seed in (2, 3):
    for _recipe in ("today-bf16", "unibias-cos30"):
        RECIPES[f"{_recipe}-seed{_seed}"] = {**RECIPES[_recipe], "seed": _seed}


# ----- data --------------------------------------------------------------------------------------------


def prepare(out: Path, corpus: str) -> Path:
    """Ingest and count ``corpus`` as the main job does; returns its vocab folder (made once)."""
    from corpus_gen import KERNEL_DOCS, ingest_like_the_main_job, write_kernel_docs

    from elmo_core.text.corpus import write_default_corpus
    from elmo_core.text.wordnet import write_definitions

    root = out / "data" / corpus
    if (root / "vocab" / "vocab.txt").exists():
        return root / "vocab"
    text = root / f"{corpus}.txt"
    if corpus == "pydoc":
        write_default_corpus(text)
    elif corpus == "wordnet":
        write_definitions("/usr/share/wordnet", text)
    elif corpus == "kernel":
        write_kernel_docs(KERNEL_DOCS, text)
    else:
        raise SystemExit(f"unknown corpus {corpus!r}: pydoc, wordnet or kernel")
    return ingest_like_the_main_job(text, root, split_sentences=corpus != "wordnet")


# ----- one run (a child process) -----------------------------------------------------------------------


def _tracking_uri(out: Path) -> str:
    return f"sqlite:///{out.resolve()}/mlflow.db"


def _create_experiment(out: Path) -> None:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow

    mlflow.set_tracking_uri(_tracking_uri(out))
    if mlflow.get_experiment_by_name(EXPERIMENT) is None:
        mlflow.create_experiment(EXPERIMENT, artifact_location=(out / "mlartifacts").resolve().as_uri())


class BiLMRun:
    """A recipe's biLM training through ``elmo_core.train.loop``'s own ``setup``/``train_step``, as the trainer runs."""

    def __init__(self, out: Path, corpus: str, recipe: str, folder: Path) -> None:
        from elmo_core.options import TrainConfig
        from elmo_core.train.loop import setup

        fields = dict(RECIPES[recipe])
        self.anneal_minutes: float | None = fields.pop(ANNEAL, None)
        self.config = TrainConfig(
            data=str(out / "data" / corpus / "vocab"),
            out=str(folder),
            **fields,
            max_steps=10**9,  # the budget ends the run; the schedules do not depend on the total
            device="cpu",
            resume=True,
            tracking="mlflow",
            tracking_uri=_tracking_uri(out),
            mlflow_experiment=EXPERIMENT,
            register_as=None,
            log_every=200,
            keep_checkpoints=1,
            eval_max_batches=EVAL_MAX_BATCHES.get(corpus),
        )
        self.run = setup(self.config)
        self.tokens_per_step, self.window_tokens, self.window_start = self.run.tokens_per_step, 0, time.perf_counter()

    @property
    def step_count(self) -> int:
        return self.run.step

    def step(self, cpu_minutes: float) -> None:
        from elmo_core.train.loop import log_metrics, train_step

        if self.anneal_minutes:  # what the trainer's Budget keeps under a budget, on the bench's own clock
            self.run.budget_spent = min(cpu_minutes / self.anneal_minutes, 1.0)
        record = train_step(self.run)
        self.window_tokens += self.tokens_per_step
        if record is not None and self.run.step % self.config.log_every == 0:
            log_metrics(self.run, record, self.window_tokens / (time.perf_counter() - self.window_start))
            self.window_tokens, self.window_start = 0, time.perf_counter()

    def evaluate(self) -> float:
        from elmo_core.train.loop import evaluate_heldout

        return evaluate_heldout(self.run)["perplexity"]

    def save(self, cpu_minutes: float, perplexity: float) -> None:
        from elmo_core.train.run import save

        self.run.tracker.log_metrics({"cpu_minutes": cpu_minutes, "heldout_perplexity": perplexity}, self.run.step)
        save(self.run)
        self.window_start = time.perf_counter()

    def close(self) -> None:
        self.run.tracker.close("FINISHED")


class BaselineRun:
    """The word-LSTM baseline (``word_lstm.py``), logged to its own MLflow run."""

    def __init__(self, out: Path, corpus: str, recipe: str, folder: Path) -> None:
        import mlflow
        from word_lstm import WordLSTMRun

        folder.mkdir(parents=True, exist_ok=True)
        self.eval_batches = EVAL_MAX_BATCHES.get(corpus)
        self.run = WordLSTMRun(out / "data" / corpus / "vocab", folder, RECIPES[recipe])
        mlflow.set_tracking_uri(_tracking_uri(out))
        mlflow.set_experiment(EXPERIMENT)
        mlflow.start_run(run_name=f"{corpus}-{recipe}")
        mlflow.log_params(RECIPES[recipe])

    @property
    def step_count(self) -> int:
        return self.run.step_count

    def step(self, cpu_minutes: float) -> None:
        self.run.step()

    def evaluate(self) -> float:
        return self.run.evaluate(self.eval_batches)

    def save(self, cpu_minutes: float, perplexity: float) -> None:
        import mlflow

        mlflow.log_metrics({"cpu_minutes": cpu_minutes, "heldout_perplexity": perplexity}, step=self.step_count)
        self.run.save()

    def close(self) -> None:
        import mlflow

        mlflow.end_run()


def worker(out: Path, corpus: str, recipe: str, budget: float) -> None:
    """Train ``recipe`` on ``corpus`` up to ``budget`` CPU-minutes, one thread, resuming an earlier shorter run."""
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    folder = out / "runs" / f"{corpus}-{recipe}"
    progress_file = folder / "points.json"
    trainer = (
        BaselineRun(out, corpus, recipe, folder)
        if "baseline" in RECIPES[recipe]
        else BiLMRun(out, corpus, recipe, folder)
    )
    done = json.loads(progress_file.read_text()) if progress_file.exists() else {"cpu_s": 0.0, "points": []}
    if trainer.step_count != (done["points"][-1]["step"] if done["points"] else 0):
        raise SystemExit(f"{folder}: checkpoint at step {trainer.step_count} does not match points.json; remove it")
    import mlflow

    mlflow.set_tags({"recipe": recipe, "corpus": corpus, "threads": "1"})
    marks = [m for m in CORPUS_POINTS.get(corpus, POINTS) if m <= budget and m * 60 > done["cpu_s"] + 1e-6]
    if anneal := RECIPES[recipe].get(ANNEAL):
        marks = [m for m in marks if m <= anneal and (m == anneal or corpus not in EVAL_MAX_BATCHES)]
    from elmo_core.train.budget import Budget

    clock = Budget(f"{budget}m", MEASURED["clock"], spent_before=done["cpu_s"])  # the trainer's own budget clock
    clock.start()
    for mark in marks:
        while (spent := clock.spent()) < mark * 60:
            trainer.step(spent / 60)
        with clock.pause():  # the table's points: evaluations and checkpoints off the clock (the trainer counts them)
            perplexity = trainer.evaluate()
            done["cpu_s"] = clock.spent()
            done["points"].append({"cpu_minutes": mark, "step": trainer.step_count, "perplexity": perplexity})
            trainer.save(done["cpu_s"] / 60, perplexity)
            progress_file.write_text(json.dumps(done, indent=1) + "\n")
        print(f"{corpus:<8} {recipe:<16} {mark:>5.1f} CPU-min  step {trainer.step_count:>6}  heldout {perplexity:8.2f}")
        sys.stdout.flush()
    trainer.close()


# ----- the table ---------------------------------------------------------------------------------------


def table(out: Path, corpora: list[str], recipes: list[str]) -> None:
    shown = (2.5, 5.0, 15.0, 30.0)
    print("\nheldout perplexity after CPU-minutes (one thread); % against today-fp32 at the same budget")
    header = f"{'corpus':<9}{'recipe':<14}" + "".join(f"{m:>17g}" for m in shown) + f"{'steps':>9}{'best':>14}"
    print(header)
    print("-" * len(header))
    for corpus in corpora:
        base = _points(out, corpus, "today-fp32")
        for recipe in recipes:
            points = _points(out, corpus, recipe)
            if not points:
                continue
            cells = []
            for m in shown:
                p = points.get(m)
                vs = f" {100 * (p['perplexity'] / base[m]['perplexity'] - 1):+.0f}%" if p and m in base else ""
                cells.append(f"{p['perplexity']:>10.1f}{vs if recipe != 'today-fp32' else '':>7}" if p else f"{'':>17}")
            last = points[max(points)]
            best = min(points.values(), key=lambda p: p["perplexity"])
            print(
                f"{corpus:<9}{recipe:<14}" + "".join(cells)
                + f"{last['step']:>9,}{best['perplexity']:>8.1f} @{best['cpu_minutes']:g}"
            )  # fmt: skip
    print("steps: at the last point; best: the lowest heldout perplexity seen, and when (CPU-minutes)")


def _points(out: Path, corpus: str, recipe: str) -> dict[float, dict[str, float]]:
    path = out / "runs" / f"{corpus}-{recipe}" / "points.json"
    if not path.exists():
        return {}
    return {p["cpu_minutes"]: p for p in json.loads(path.read_text())["points"]}


TABLE_BUDGETS = (2.5, 5.0, 15.0, 30.0)


def write_table(out: Path, path: Path) -> None:
    """The measured table a ``budget`` picks its recipe from (``elmo_core/train/recipe_table.json``): for every
    corpus measured under ``out``, each biLM recipe's lowest heldout perplexity within 2.5, 5, 15 and 30 CPU-minutes
    (what ``export: best`` keeps), one value per seed that ran that far. A corpus not measured
    under ``out`` keeps its rows from the table already at ``path``."""
    from elmo_core import cpu
    from elmo_core.options import RECIPE_FIELDS, TrainOptions
    from elmo_core.train.evaluate import train_token_counts

    table = json.loads(path.read_text()) if path.exists() else {"corpora": [], "recipes": {}, "results": []}
    table = {"measured": MEASURED, **{k: v for k, v in table.items() if k != "measured"}}  # the clock a budget counts
    runs = sorted((out / "runs").glob("*/points.json"))
    measured = sorted({p.parent.name.split("-")[0] for p in runs})
    table["corpora"] = [c for c in table["corpora"] if c["name"] not in measured]
    table["results"] = [r for r in table["results"] if r["corpus"] not in measured]
    for corpus in measured:
        data = out / "data" / corpus / "vocab"
        words = len((data / "vocab.txt").read_text(encoding="utf-8").splitlines())
        train = train_token_counts(data, words)[1]  # counted as the trainer counts the corpus it compares
        table["corpora"].append({"name": corpus, "train_tokens": train, "vocab_size": words, "cpu": cpu.describe()})
        seeds: dict[str, list[dict[float, dict[str, float]]]] = {}
        for recipe in RECIPES:
            points = _points(out, corpus, recipe)
            # the baseline and an explicit model (lstm512, lstm128) are the study's, not a recipe a budget can pick
            if points and set(RECIPES[recipe]) - {"seed", "precision", ANNEAL} <= set(RECIPE_FIELDS):
                seeds.setdefault(recipe.split("-seed")[0], []).append(points)
        for recipe, runs_of_recipe in seeds.items():
            fields = {k: v for k, v in RECIPES[recipe].items() if k not in ("seed", "precision", ANNEAL)}
            anneal = RECIPES[recipe].get(ANNEAL)
            table["recipes"][recipe] = {
                "fields": {**{k: TrainOptions.model_fields[k].default for k in RECIPE_FIELDS}, **fields},
                "precision": RECIPES[recipe]["precision"],
            }
            for budget in [b for b in TABLE_BUDGETS if anneal in (None, b)]:
                reached = [points for points in runs_of_recipe if budget in points]  # the seeds that ran this far
                if reached:
                    best = [min(p["perplexity"] for m, p in points.items() if m <= budget) for points in reached]
                    table["results"].append(
                        {"corpus": corpus, "recipe": recipe, "budget_minutes": budget,
                         "perplexity": [round(b, 3) for b in best]}
                    )  # fmt: skip
    used = {r["recipe"] for r in table["results"]}
    table["recipes"] = {name: table["recipes"][name] for name in sorted(used)}
    path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"table: {path} ({len(table['results'])} rows, corpora {', '.join(c['name'] for c in table['corpora'])})")


SEED_LINES = ("-", "--", ":", "-.")


def plot(out: Path, corpora: list[str], recipes: list[str]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(corpora), figsize=(6 * len(corpora), 4.2), squeeze=False)
    colours = plt.get_cmap("tab10").colors
    bases = sorted({r.split("-seed")[0] for r in recipes}, key=[r.split("-seed")[0] for r in recipes].index)
    for ax, corpus in zip(axes[0], corpora):
        lowest = float("inf")
        for recipe in recipes:  # one colour per recipe, a line style per seed (solid, dashed, dotted, dash-dot)
            points = sorted(_points(out, corpus, recipe).values(), key=lambda p: p["cpu_minutes"])
            if points:
                base = recipe.split("-seed")[0]
                values = [p["perplexity"] for p in points]
                lowest = min(lowest, *values)
                ax.plot(
                    [p["cpu_minutes"] for p in points], values, marker="o", markersize=3, label=recipe,
                    color="black" if "baseline" in RECIPES[recipe] else colours[bases.index(base) % 10],
                    linestyle=SEED_LINES[RECIPES[recipe].get("seed", 0) % len(SEED_LINES)],
                )  # fmt: skip
        ax.set_title(f"{corpus}: heldout perplexity, 1 thread")
        ax.set_xlabel("CPU-minutes")
        ax.set_ylabel("heldout perplexity (above 10x the lowest: off the scale)")
        ax.set_yscale("log")
        if lowest < float("inf"):  # a diverging run or an early spike would flatten every other curve
            ax.set_ylim(top=10 * lowest)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "curves.png"
    fig.savefig(path, dpi=75)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpora", default="pydoc,wordnet")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--budget", type=float, default=30.0, help="CPU-minutes per run (resumes shorter runs)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time (one thread each)")
    parser.add_argument("--out", default=str(ROOT / "data" / "bench" / "cpu_recipe"))
    parser.add_argument("--plot", action="store_true")
    parser.add_argument("--table-only", action="store_true", help="print what earlier runs measured")
    parser.add_argument(
        "--write-table", metavar="PATH", help="write the measured table a budget picks from (recipe_table.json)"
    )
    parser.add_argument("--worker", nargs=2, metavar=("CORPUS", "RECIPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out)
    corpora, recipes = args.corpora.split(","), args.recipes.split(",")
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        raise SystemExit(f"unknown recipes {unknown}; known: {', '.join(RECIPES)}")
    if args.worker:
        worker(out, *args.worker, args.budget)
        return
    if not args.table_only:
        for corpus in corpora:
            prepare(out, corpus)
        _create_experiment(out)  # once, here: two runs creating the store together race on its schema
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
        }

        def one(job: tuple[str, str]) -> int:
            command = [sys.executable, __file__, "--out", str(out), "--budget", str(args.budget), "--worker", *job]
            return subprocess.run(command, env=env).returncode

        with ThreadPoolExecutor(args.jobs) as pool:
            codes = list(pool.map(one, [(c, r) for r in recipes for c in corpora]))
        if any(codes):
            print(f"some runs failed (exit codes {codes})", file=sys.stderr)
    table(out, corpora, recipes)
    if args.write_table:
        write_table(out, Path(args.write_table))
    if args.plot:
        print(f"curves: {plot(out, corpora, recipes)}")


if __name__ == "__main__":
    main()
