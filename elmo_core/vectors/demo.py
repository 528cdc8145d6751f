"""``elmo demo``: one look at polysemy, the top layer's cosine between every use of apple / 苹果 in a few sentences,
with the model asked for, else the main job's, else a random tiny one (said so)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from elmo_core.bilm.initialization import random_model
from elmo_core.config import tiny
from elmo_core.runtime import Runtime


def demo(model: str | None, text: Path, data: Path) -> list[str]:
    """``elmo demo``: the model asked for, else the main job's (``data/export``), else a random tiny one (said so)."""
    source = model
    if model is None and (data / "export" / "options.json").exists():
        model, source = str(data / "export"), f"{data / 'export'} (the main job's model)"
    elif model is None:
        model = str(random_model(tiny(), data / "models" / "random-tiny"))
        source = f"{model} (random weights: no model given and no main job's model in {data / 'export'})"
    sentences = [line.split() for line in text.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [f"model        {source}", *polysemy_table(Runtime.open(model), sentences)]


def polysemy_table(runtime: Runtime, sentences: list[list[str]]) -> list[str]:
    """``elmo demo``: embed ``sentences``, then the top layer's cosine between every use of apple / 苹果 as a table
    (the fruit's uses near each other, the company's apart). Returns the lines to print."""
    started = time.perf_counter()
    vectors = runtime.embed(sentences)
    elapsed = time.perf_counter() - started
    n_tokens = sum(len(s) for s in sentences)
    lines = [
        f"layers       {runtime.num_layers} x {runtime.output_dim}",
        f"embedded     {len(sentences)} sentences, {n_tokens} tokens in {elapsed:.3f} s "
        f"({n_tokens / elapsed:,.0f} tokens/s)",
    ]
    hits = [
        (i, t)
        for i, s in enumerate(sentences)
        for t, tok in enumerate(s)
        if tok.lower().startswith("apple") or tok == "苹果"
    ]
    if not hits:
        return lines
    top = np.stack([vectors[i][-1, t] for i, t in hits])
    top /= np.linalg.norm(top, axis=1, keepdims=True)
    similarity = top @ top.T
    labels = [f"s{i}:{sentences[i][t]}" for i, t in hits]
    width = max(len(label) for label in labels)
    lines.append("cosine similarity of the top layer between occurrences of apple / 苹果:")
    lines.append(" " * width + "  " + " ".join(f"{j:>5d}" for j in range(len(hits))))
    lines += [f"{label:>{width}}  " + " ".join(f"{v:5.2f}" for v in similarity[j]) for j, label in enumerate(labels)]
    return lines
