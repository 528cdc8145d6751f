"""The main job's closing summary: where each output is, and the commands to look at it."""

import shutil
import sys
from pathlib import Path
from typing import Any


def command(name: str) -> str:
    """How to type a console script of this installation: its bare name where the shell finds this one, else its
    path (relative to here when inside), e.g. ``.venv/bin/elmo`` in a clone whose venv is not activated."""
    path = Path(sys.executable).parent / name
    if shutil.which(name) == str(path):
        return name
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def print_summary(s: dict[str, Any]) -> None:
    """What the main job made, and the commands that look at it (named as this installation runs them)."""
    ppl, elmo = s["perplexity"], command("elmo")
    lines = [
        "",
        "ELMo pipeline finished.",
        f"  corpus      {s['ingest']}",
        f"  vocabulary  {int(s['vocab_size']):,} entries",
    ]
    for split, result in ppl.items():
        lines.append(
            f"  {split:<11} perplexity {result['perplexity']:.1f} (forward {result['perplexity_forward']:.1f}, "
            f"backward {result['perplexity_backward']:.1f}; unigram {result['perplexity_unigram']:.1f})"
        )
    lines.append(f"  model       {s['model_dir']}  (bilm-tf/AllenNLP format: options.json, weights.hdf5, vocab.txt)")
    if s["mlflow_run_id"]:
        store = s["tracking_uri"]
        lines += [
            f"  MLflow run  {s['mlflow_run_id']}, registered as {s['mlflow_model_uri']}"
            + (f" (the newest version is always models:/{s['register_as']}/latest)" if s["register_as"] else ""),
            f"              see it: MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false {command('mlflow')} ui "
            f"--backend-store-uri {store} --workers 1 --port 5000",
            f"              then {s['mlflow_link']}",
        ]
    if s["embeddings"]:
        lines += [
            f"  vectors     {s['embeddings']}  (the probe sentences)",
            f"  query them  {elmo} query {s['embeddings']} --token apples "
            "--sentence 'I like to eat apples with a little honey .' --like 'apple%'",
            "              (the fruit's other uses come first, then Apple the company's)",
            "  or in the duckdb shell:",
            *("    " + q for q in s["query"].splitlines()),
        ]
    model, work = s["model_dir"], Path(s["model_dir"]).parent
    tagging = "data/probes/tagging"
    lines += [
        f"  judge it    {elmo} probe wsd --model {model} --out {work / 'probe_wsd'}   (WordNet 3.0's examples:",
        "              sudo apt-get install wordnet-base), and a tagging probe per layer:",
        f"              {elmo} probe tag --model {model} --train {tagging}/train.tsv --dev {tagging}/dev.tsv "
        f"--test {tagging}/test.tsv --out {work / 'probe_tag'}",
        f"  serve it    {elmo} serve {model}   then: curl -s localhost:8080/embed -H 'content-type: "
        """application/json' -d '{"sentences": ["I ate an apple ."], "output": "mean"}'""",
    ]
    print("\n".join(lines))
