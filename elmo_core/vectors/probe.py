"""Probes: what a biLM's layers are worth, layer by layer (Peters et al. 2018, §5.3).

* **word sense** (``elmo probe wsd``): every target word's vector of each layer 0..L and of the scalar mix; the
  sense of its nearest neighbour by cosine among the other occurrences of the same lemma (leave-one-out), or
  among the "train" occurrences when the data has a split. Ties (cosines within 1e-6) go to the sense more
  frequent among the candidates, then to the lower sense number. Reported: accuracy per layer, the
  most-frequent-sense baseline and coverage, overall and on the *answerable* occurrences (whose sense occurs
  among the candidates: with WordNet, senses with ≥ 2 examples). Layer 0 is context-free, so where a lemma's
  occurrences share one surface form it ties everywhere and equals the baseline.
* **tagging** (``elmo probe tag``): a linear layer over the frozen vectors of each single layer, and over a
  learned scalar mix (softmax weights and γ, ELMo eq. 1), trained with Adam; token accuracy and macro-F1 on dev
  (the epoch chosen) and test, and the learned mix weights.

Data formats (what ``read_sense_examples`` and ``read_tagged`` read):

    senses JSONL  {"tokens": ["he", "sat", "on", "the", "bank"], "index": 4, "sense": "09213565-n",
                   "lemma": "bank.n", "sense_number": 1, "split": "train"}      (sense_number, split optional)
    senses TSV    tokens (space-separated) <TAB> index <TAB> sense <TAB> lemma [<TAB> sense_number [<TAB> split]]
    a folder      WordNet 3.0's database files (``elmo_core.text.wordnet``)
    tags          CoNLL-U (the --column, UPOS by default) or one "token tag" per line; a blank line ends a sentence

Vectors come from the runtime, as the embedding stage's do (``Runtime.embed``: the word cache, length batches, the
precision asked);
each probe writes ``results.json`` and ``chart.png`` to its ``--out`` folder and, with MLflow, logs a run with
fixed metric names (``wsd/acc/layer_0``, ``wsd/acc/mix``, ``tag/macro_f1/mix`` …).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from elmo_core.bilm.scalar_mix import ScalarMix
from elmo_core.errors import InputError
from elmo_core.fileio import atomic_path, write_text_atomic
from elmo_core.options import TagConfig, TagOptions, WsdConfig
from elmo_core.progress import track
from elmo_core.runtime import ModelLookup, ModelRef, Output, Placement, Runtime, lookup_model, place
from elmo_core.runtime.reference import pin_reference
from elmo_core.stage import Whole, WholePlan, WholeStage
from elmo_core.text.wordnet import DEFAULT_DIR, INSTALL_HINT, SenseExample, is_wordnet_dir, read_wordnet
from elmo_core.tracking import MLflowTracker, NullTracker, Tracker, check_reachable

log = logging.getLogger(__name__)

TIE = 1e-6  # cosines this close are a tie
EMBED_CHUNK = 2048  # sentences embedded at a time (memory stays bounded on large probe sets)
CONLLU_COLUMNS = {"id": 0, "form": 1, "lemma": 2, "upos": 3, "xpos": 4, "feats": 5, "head": 6, "deprel": 7}


# ----- reading the data -----------------------------------------------------------------------------------------


def read_sense_examples(path: str | Path) -> list[SenseExample]:
    """Sense-annotated occurrences from JSONL, TSV or a WordNet 3.0 folder; bad lines are named by file:line."""
    path = Path(path)
    if is_wordnet_dir(path):
        return read_wordnet(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file; give a senses JSONL/TSV file or a WordNet folder ({INSTALL_HINT})")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            if path.suffix in (".jsonl", ".json"):
                row = json.loads(line)
                tokens, index, sense, lemma = row["tokens"], int(row["index"]), str(row["sense"]), str(row["lemma"])
                number_, split = int(row.get("sense_number") or 0), row.get("split")
            else:
                fields = line.split("\t")
                tokens, index, sense, lemma = fields[0].split(), int(fields[1]), fields[2], fields[3]
                number_ = int(fields[4]) if len(fields) > 4 and fields[4] else 0
                split = fields[5] if len(fields) > 5 and fields[5] else None
        except (json.JSONDecodeError, KeyError, IndexError, ValueError, TypeError) as exc:
            what = (
                "JSON with tokens, index, sense, lemma"
                if path.suffix in (".jsonl", ".json")
                else "tokens<TAB>index<TAB>sense<TAB>lemma"
            )
            raise InputError(f"{path}:{number}: expected {what} ({type(exc).__name__}: {exc})") from None
        if not 0 <= index < len(tokens):
            raise InputError(f"{path}:{number}: index {index} is outside the sentence's {len(tokens)} tokens")
        records.append(SenseExample(tuple(tokens), index, sense, lemma, number_, split))
    if not records:
        raise InputError(f"{path}: no sense-annotated lines")
    return records


def read_tagged(path: str | Path, column: str = "upos") -> list[tuple[list[str], list[str]]]:
    """Sentences as (tokens, tags) from CoNLL-U (``column``) or one "token tag" per line, blank lines between."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    conllu = any(len(line.split("\t")) >= 10 for line in lines if line and not line.startswith("#"))
    index = CONLLU_COLUMNS.get(column.lower()) if not column.isdigit() else int(column) - 1
    if conllu and index is None:
        raise InputError(f"--column {column!r}: expected one of {', '.join(CONLLU_COLUMNS)} or a 1-based column number")
    sentences: list[tuple[list[str], list[str]]] = []
    tokens: list[str] = []
    tags: list[str] = []
    for number, line in enumerate([*lines, ""], 1):
        if not line.strip():
            if tokens:
                sentences.append((tokens, tags))
            tokens, tags = [], []
            continue
        if line.startswith("#"):
            continue
        fields = line.split("\t") if conllu else line.split()
        if conllu and ("-" in fields[0] or "." in fields[0]):
            continue  # multi-word token ranges and empty nodes carry no tag of their own
        if (conllu and len(fields) < 10) or (not conllu and len(fields) != 2) or (conllu and index >= len(fields)):
            raise InputError(
                f"{path}:{number}: expected {'10 tab-separated CoNLL-U fields' if conllu else 'token tag'}, "
                f"found {len(fields)} fields"
            )
        tokens.append(fields[1] if conllu else fields[0])
        tags.append(fields[index] if conllu else fields[1])  # type: ignore[index]
    if not sentences:
        raise InputError(f"{path}: no tagged sentences")
    return sentences


# ----- vectors ---------------------------------------------------------------------------------------------


def load_model(config: WsdConfig | TagConfig) -> Runtime:
    """The probe's model, opened by the runtime in the precision and on the device the probe asks for."""
    return Runtime.open(config.model, device=config.device, precision=config.precision)


def embed_all(runtime: Runtime, sentences: Sequence[Sequence[str]], keep: Callable[[int, np.ndarray], None]) -> float:
    """Embed ``sentences`` chunk by chunk, handing each sentence's (L+1, n, 2P) array to ``keep``; returns tokens/s."""
    tokens = sum(len(s) for s in sentences)
    started = time.perf_counter()
    with track("probe-embed", tokens, "tokens") as progress:
        for start in range(0, len(sentences), EMBED_CHUNK):
            chunk = sentences[start : start + EMBED_CHUNK]
            for i, vectors in enumerate(runtime.embed(chunk), start):
                keep(i, vectors)
            progress.advance(sum(len(s) for s in chunk))
    return tokens / max(time.perf_counter() - started, 1e-9)


def mix_weights(n_layers: int, weights: list[float] | None) -> np.ndarray:
    """The fixed scalar mix's factor per layer (softmax of ``--mix-weights``; equal without), as ``elmo embed``."""
    return Output.of("mix", mix_weights=weights).factors(n_layers).double().numpy()


# ----- word sense -------------------------------------------------------------------------------------------


def nearest_sense(similarity: np.ndarray, candidate_senses: list[str], frequency: Counter, rank: dict[str, int]) -> str:
    """The sense of the nearest candidate; ties (within ``TIE``) to the more frequent sense, then the lower number."""
    tied = similarity >= similarity.max() - TIE
    senses = {candidate_senses[i] for i in np.flatnonzero(tied)}
    return min(senses, key=lambda s: (-frequency[s], rank.get(s, 0), s))


def most_frequent_sense(frequency: Counter, rank: dict[str, int]) -> str:
    return min((s for s in frequency if frequency[s] > 0), key=lambda s: (-frequency[s], rank.get(s, 0), s))


def wsd_scores(examples: list[SenseExample], vectors: dict[str, np.ndarray]) -> dict[str, Any]:
    """1-NN accuracy per configuration, the MFS baseline and coverage, overall and on answerable occurrences.

    ``vectors[name]`` holds one row per example. Without a split every occurrence is a query against the other
    occurrences of its lemma; with one, "train" occurrences are the candidates and the others the queries.
    """
    has_split = any(e.split for e in examples)
    by_lemma: dict[str, list[int]] = {}
    for i, e in enumerate(examples):
        by_lemma.setdefault(e.lemma, []).append(i)
    rank = {e.sense: e.sense_number for e in examples}
    names = list(vectors)
    normed = {n: v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12) for n, v in vectors.items()}
    correct = {n: 0 for n in names}
    correct_answerable = {n: 0 for n in names}
    mfs = mfs_answerable = queries = covered = answerable = 0
    for members in by_lemma.values():
        candidates = [i for i in members if examples[i].split == "train"] if has_split else members
        targets = [i for i in members if examples[i].split != "train"] if has_split else members
        for q in targets:
            queries += 1
            others = [c for c in candidates if c != q]
            if not others:
                continue
            covered += 1
            senses = [examples[c].sense for c in others]
            frequency = Counter(senses)
            truth = examples[q].sense
            can_answer = truth in frequency
            answerable += can_answer
            hit = most_frequent_sense(frequency, rank) == truth
            mfs += hit
            mfs_answerable += hit and can_answer
            for n in names:
                guess = nearest_sense(normed[n][others] @ normed[n][q], senses, frequency, rank)
                correct[n] += guess == truth
                correct_answerable[n] += guess == truth and can_answer
    if not covered:
        raise InputError("no occurrence has another occurrence of its lemma to compare with (one example per lemma?)")
    return {
        "protocol": "train/test split" if has_split else "leave-one-out within each lemma",
        "occurrences": queries,
        "lemmas": len(by_lemma),
        "senses": len({e.sense for e in examples}),
        "coverage": covered / queries,
        "answerable": answerable,
        "answerable_share": answerable / max(covered, 1),
        "accuracy": {n: correct[n] / covered for n in names},
        "mfs": mfs / covered,
        "accuracy_answerable": {n: correct_answerable[n] / max(answerable, 1) for n in names},
        "mfs_answerable": mfs_answerable / max(answerable, 1),
    }


def run_wsd(config: WsdConfig, tracker: Tracker | None = None, runtime: Runtime | None = None) -> dict[str, Any]:
    """``elmo probe wsd``: embed the occurrences, score 1-NN per layer, write results.json and chart.png, log them."""
    if config.tracking == "mlflow" and tracker is None:
        check_reachable(config.tracking_uri)  # in seconds, before any work
    data = Path(config.data) if config.data else DEFAULT_DIR
    examples = read_sense_examples(data)
    runtime = runtime or load_model(config)  # the plan's (``ProbeStage``), else opened as the config says
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    sentences = sorted({e.tokens for e in examples})
    position = {s: i for i, s in enumerate(sentences)}
    n_layers = runtime.num_layers
    rows = np.zeros((n_layers, len(examples), runtime.output_dim), dtype=np.float32)
    wanted: dict[int, list[int]] = {}
    for j, e in enumerate(examples):
        wanted.setdefault(position[e.tokens], []).append(j)

    def keep(i: int, vectors: np.ndarray) -> None:
        for j in wanted[i]:
            rows[:, j] = vectors[:, examples[j].index]

    tokens_per_s = embed_all(runtime, [list(s) for s in sentences], keep)
    weights = mix_weights(n_layers, config.mix_weights)
    vectors = {f"layer_{k}": rows[k] for k in range(n_layers)}
    vectors["mix"] = np.tensordot(weights, rows, axes=1).astype(np.float32)
    results = {
        "kind": "wsd",
        "model": config.model,
        "data": str(data),
        "precision": str(runtime.precision),
        "mix_weights": weights.tolist(),
        "tokens_per_s": tokens_per_s,
        **wsd_scores(examples, vectors),
    }
    with atomic_path(out / "examples.jsonl") as tmp:
        tmp.write_text(
            "".join(json.dumps({**asdict(e), "tokens": list(e.tokens)}) + "\n" for e in examples), encoding="utf-8"
        )
    metrics = {
        "wsd/mfs": results["mfs"],
        "wsd/mfs_answerable": results["mfs_answerable"],
        "wsd/coverage": results["coverage"],
        "probe/tokens_per_s": tokens_per_s,
    }
    metrics |= {f"wsd/acc/{n}": v for n, v in results["accuracy"].items()}
    metrics |= {f"wsd/acc_answerable/{n}": v for n, v in results["accuracy_answerable"].items()}
    _finish(config, out, results, metrics=metrics, tracker=tracker, model=runtime.model)
    return results


# ----- tagging -------------------------------------------------------------------------------------------------


def macro_f1(gold: np.ndarray, guess: np.ndarray) -> float:
    """Mean F1 over the tags that occur in the gold labels or the guesses."""
    scores = []
    for tag in np.union1d(gold, guess):
        tp = np.sum((gold == tag) & (guess == tag))
        precision = tp / max(np.sum(guess == tag), 1)
        recall = tp / max(np.sum(gold == tag), 1)
        scores.append(0.0 if tp == 0 else 2 * precision * recall / (precision + recall))
    return float(np.mean(scores))


class Probe(nn.Module):
    """A linear layer over one layer's vectors, or over a learned scalar mix of all of them."""

    def __init__(self, n_layers: int, width: int, n_tags: int, layer: int | None) -> None:
        super().__init__()
        self.layer = layer
        self.mix = ScalarMix(n_layers) if layer is None else None
        self.linear = nn.Linear(width, n_tags)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (L+1, N, 2P)
        features = x[self.layer] if self.mix is None else self.mix(list(x))
        return self.linear(features)


def epochs_to_run(n_tokens: int, config: TagOptions) -> int:
    """``epochs``, or more when that would take fewer than ``min_steps`` optimizer steps."""
    per_epoch = math.ceil(n_tokens / config.batch_tokens)
    return max(config.epochs, math.ceil(config.min_steps / per_epoch))


def train_probe(
    features: dict[str, torch.Tensor],
    labels: dict[str, torch.Tensor],
    layer: int | None,
    *,
    n_tags: int,
    config: TagOptions,
    progress: Any,
) -> dict[str, Any]:
    """Adam over shuffled token batches; the epoch with the best dev accuracy is the one reported."""
    torch.manual_seed(config.seed)
    n_layers, _, width = features["train"].shape
    probe = Probe(n_layers, width, n_tags, layer)
    optimizer = torch.optim.Adam(probe.parameters(), lr=config.learning_rate)
    order = torch.Generator().manual_seed(config.seed)
    best: dict[str, Any] = {"dev_accuracy": -1.0}
    n = features["train"].shape[1]
    for epoch in range(1, epochs_to_run(n, config) + 1):
        probe.train()
        for batch in torch.randperm(n, generator=order).split(config.batch_tokens):
            loss = nn.functional.cross_entropy(probe(features["train"][:, batch].float()), labels["train"][batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        probe.eval()
        with torch.no_grad():
            guesses = {split: probe(x.float()).argmax(-1) for split, x in features.items() if split != "train"}
        accuracy = float((guesses["dev"] == labels["dev"]).float().mean())
        if accuracy > best["dev_accuracy"]:
            best = {
                "dev_accuracy": accuracy,
                "epoch": epoch,
                "guesses": guesses,
                "mix": (
                    torch.softmax(torch.cat(list(probe.mix.scalar_parameters)).detach(), 0).tolist(),
                    probe.mix.gamma.item(),
                )
                if probe.mix is not None
                else None,
            }
        progress.advance(1)
    return best


def run_tag(config: TagConfig, tracker: Tracker | None = None, runtime: Runtime | None = None) -> dict[str, Any]:
    """``elmo probe tag``: a linear probe per layer and over a learned mix; results.json, chart.png, MLflow."""
    if config.tracking == "mlflow" and tracker is None:
        check_reachable(config.tracking_uri)  # in seconds, before any work
    splits = {"train": config.train, "dev": config.dev, **({"test": config.test} if config.test else {})}
    data = {split: read_tagged(path, config.column) for split, path in splits.items()}
    tagset = sorted({tag for _, tags in data["train"] for tag in tags})
    unknown = len(tagset)  # tags never seen in training can only be guessed wrong
    tag_id = {tag: i for i, tag in enumerate(tagset)}
    runtime = runtime or load_model(config)  # the plan's (``ProbeStage``), else opened as the config says
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    features, labels, speeds = {}, {}, []
    for split, sentences in data.items():
        arrays: list[np.ndarray] = [np.empty(0)] * len(sentences)

        def keep(i: int, vectors: np.ndarray, arrays: list[np.ndarray] = arrays) -> None:
            arrays[i] = vectors.astype(np.float16)  # halves the memory of the frozen features

        speeds.append(embed_all(runtime, [tokens for tokens, _ in sentences], keep))
        features[split] = torch.from_numpy(np.concatenate(arrays, axis=1))
        labels[split] = torch.tensor([tag_id.get(t, unknown) for _, tags in sentences for t in tags])
    n_layers = runtime.num_layers
    configurations = {f"layer_{k}": k for k in range(n_layers)} | {"mix": None}
    evaluated = [s for s in data if s != "train"]
    scores: dict[str, dict[str, dict[str, float]]] = {s: {"accuracy": {}, "macro_f1": {}} for s in evaluated}
    chosen: dict[str, int] = {}
    learned_mix = None
    epochs = epochs_to_run(int(labels["train"].numel()), config)
    with track("probe-tag", len(configurations) * epochs, "epochs") as progress:
        for name, layer in configurations.items():
            best = train_probe(features, labels, layer, n_tags=len(tagset), config=config, progress=progress)
            chosen[name] = best["epoch"]
            for split in evaluated:
                gold, guess = labels[split].numpy(), best["guesses"][split].numpy()
                scores[split]["accuracy"][name] = float((gold == guess).mean())
                scores[split]["macro_f1"][name] = macro_f1(gold, guess)
            if best["mix"] is not None:
                learned_mix = {"weights": best["mix"][0], "gamma": best["mix"][1]}
    results = {
        "kind": "tag",
        "model": config.model,
        "column": config.column,
        "tags": tagset,
        "precision": str(runtime.precision),
        "train_tokens": int(labels["train"].numel()),
        "tokens_per_s": float(np.mean(speeds)),
        "epoch_chosen": chosen,
        "learned_mix": learned_mix,
        **scores,
    }
    _finish(config, out, results, metrics=_tag_metrics(results, scores), tracker=tracker, model=runtime.model)
    return results


def _tag_metrics(results: dict[str, Any], scores: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
    """The tagging probe's MLflow metrics: per configuration on test (else dev) and on dev, the learned mix."""
    metrics = {"probe/tokens_per_s": results["tokens_per_s"]}
    report = "test" if "test" in scores else "dev"
    for kind in ("accuracy", "macro_f1"):
        short = "acc" if kind == "accuracy" else kind
        metrics |= {f"tag/{short}/{n}": v for n, v in scores[report][kind].items()}
        metrics |= {f"tag/dev_{short}/{n}": v for n, v in scores["dev"][kind].items()}
    learned_mix = results["learned_mix"]
    if learned_mix:
        metrics |= {f"tag/mix_weight/layer_{k}": w for k, w in enumerate(learned_mix["weights"])}
        metrics["tag/gamma"] = learned_mix["gamma"]
    return metrics


# ----- results ------------------------------------------------------------------------------------------------


def results_table(results: dict[str, Any]) -> str:
    """The per-layer table in markdown (the Prefect artifact, the README)."""
    if results["kind"] == "wsd":
        lines = ["| vectors | 1-NN accuracy | on answerable |", "| --- | --- | --- |"]
        lines += [
            f"| {n} | {results['accuracy'][n]:.3f} | {results['accuracy_answerable'][n]:.3f} |"
            for n in results["accuracy"]
        ]
        lines.append(f"| most frequent sense | {results['mfs']:.3f} | {results['mfs_answerable']:.3f} |")
        lines.append(
            f"\n{results['occurrences']:,} occurrences of {results['lemmas']:,} lemmas ({results['senses']:,} senses), "
            f"{results['protocol']}; coverage {results['coverage']:.3f}; {results['answerable']:,} answerable; "
            f"{results['tokens_per_s']:,.0f} tokens/s embedding ({results['precision']})"
        )
        return "\n".join(lines)
    split = "test" if "test" in results else "dev"
    lines = [f"| vectors | {split} accuracy | {split} macro-F1 | dev accuracy |", "| --- | --- | --- | --- |"]
    lines += [
        f"| {n} | {results[split]['accuracy'][n]:.3f} | {results[split]['macro_f1'][n]:.3f} "
        f"| {results['dev']['accuracy'][n]:.3f} |"
        for n in results[split]["accuracy"]
    ]
    if results["learned_mix"]:
        weights = ", ".join(f"{w:.2f}" for w in results["learned_mix"]["weights"])
        lines.append(
            f"\nlearned mix: softmax weights [{weights}], γ {results['learned_mix']['gamma']:.2f}; "
            f"{results['train_tokens']:,} training tokens, {len(results['tags'])} tags; "
            f"{results['tokens_per_s']:,.0f} tokens/s embedding ({results['precision']})"
        )
    return "\n".join(lines)


def _chart(results: dict[str, Any], path: Path) -> None:
    """A bar chart of the per-layer scores (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if results["kind"] == "wsd":
        series = {"all covered": results["accuracy"], "answerable": results["accuracy_answerable"]}
        baselines = {"MFS (all)": results["mfs"], "MFS (answerable)": results["mfs_answerable"]}
        title, ylabel = "word sense: 1-NN accuracy by layer", "accuracy"
    else:
        split = "test" if "test" in results else "dev"
        series = {"accuracy": results[split]["accuracy"], "macro-F1": results[split]["macro_f1"]}
        baselines, title, ylabel = {}, f"tagging probe ({split}) by layer", "score"
    names = list(next(iter(series.values())))
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    width = 0.8 / len(series)
    for k, (label, values) in enumerate(series.items()):
        ax.bar([i + k * width for i in range(len(names))], [values[n] for n in names], width, label=label)
    for k, (label, value) in enumerate(baselines.items()):
        ax.axhline(value, linestyle="--" if k else ":", color="grey", label=label)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(names))], names)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def _finish(
    config: WsdConfig | TagConfig,
    out: Path,
    results: dict[str, Any],
    *,
    metrics: dict[str, float],
    tracker: Tracker | None,
    model: ModelRef,
) -> None:
    """results.json and the chart, and the MLflow run, which names the exact model probed (its tags)."""
    results["model_identity"] = model.identity()
    tags = {"elmo.stage": "probe", "elmo.probe": results["kind"], "elmo.model": model.exact or model.asked}
    if tracker is None and config.tracking == "mlflow":
        name = f"probe-{results['kind']}-{Path(model.name).name}"
        tracker = MLflowTracker(config.mlflow_experiment, run_name=name, tracking_uri=config.tracking_uri, tags=tags)
    tracker = tracker or NullTracker()
    status = "FAILED"
    try:
        results["model_dir"], results["mlflow_run_id"] = str(model.directory), tracker.run_id
        write_text_atomic(out / "results.json", json.dumps(results, indent=2) + "\n")
        _chart(results, out / "chart.png")
        tracker.log_params({"probe": config.model_dump(mode="json")})
        tracker.log_metrics({k: v for k, v in metrics.items() if math.isfinite(v)}, 0)
        tracker.log_artifact(out / "results.json")
        tracker.log_artifact(out / "chart.png")
        status = "FINISHED"
    finally:
        tracker.close(status)
    log.info("probe %s: %s", results["kind"], out / "results.json")


# ``elmo probe <kind>``: (options model, runner, one-line help, description with an example)


class ProbeStage(WholeStage):
    """A probe as a stage, one unit: the word-sense probe for a ``WsdConfig``, the tagging probe for a ``TagConfig``."""

    name = "probe"

    def settle(self, config: WsdConfig | TagConfig) -> WsdConfig | TagConfig:
        """The model pinned (``models:/elmo/latest`` → ``models:/elmo/3``): the probe, its results and its MLflow run
        name the version it was planned with, even where ``latest`` moves while it runs."""
        return config.model_copy(update={"model": pin_reference(config.model)})

    def plan(self, config: WsdConfig | TagConfig) -> ProbePlan:
        """The model looked up (read only; fetched under the claim) and placed (device, precision and why), once:
        the probe runs what its plan decided."""
        config = self.settle(config)
        if config.tracking == "mlflow":
            check_reachable(config.tracking_uri)  # in seconds, before any work
        model = lookup_model(config.model)  # refused here where there is no model
        placement = place(config.device, config.precision)  # refused here where it cannot run
        if isinstance(config, WsdConfig):
            what = f"word-sense 1-NN per layer on {config.data or DEFAULT_DIR}"
        else:
            what = f"a tagging probe per layer on {config.train} (dev {config.dev}), column {config.column}"
        lines = [model.line(), f"{what}, on {placement.line()}"]
        return ProbePlan(config, [Whole(self.name)], self.writes(config), lines, False, model, placement)

    def run_unit(self, plan: ProbePlan, unit: Whole, report: Callable[[int], None] | None = None) -> dict[str, Any]:
        config, runtime = plan.options, Runtime.open(plan.model.fetch(), placement=plan.placement)
        return run_wsd(config, runtime=runtime) if isinstance(config, WsdConfig) else run_tag(config, runtime=runtime)


@dataclass
class ProbePlan(WholePlan):
    """A probe's plan: its lines, the model it found and where it runs."""

    model: ModelLookup | None = None
    placement: Placement | None = None
