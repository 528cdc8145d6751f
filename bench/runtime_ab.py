"""This checkout against the code at a git revision, as users run a model, in alternating rounds on one machine:
the runtime change (#53) must not move speed.

    .venv/bin/python bench/runtime_ab.py --against REV [--shape small] [--sentences 3000] [--rounds 3]

Real long-tailed text (Python's pydoc topics, the unicode tokenizer: a few long sentences among many short ones),
ingested once; random bilm-tf-initialised weights of the published ``--shape`` written once as options.json +
weights.hdf5, which both trees read. Each round runs, in a fresh process for each tree, one after the other:

* ``elmo embed`` of the ingested dataset into a new folder (the summary line's tokens/s: the stage's own clock,
  model loading included, as a user's job counts it);
* the AllenNLP drop-in, ``ElmoEmbedder.embed_sentences`` over every sentence (timed around the call, after one
  warm-up batch);
* a server model process's unit, ``serve.compute.BatchEmbedder.run``, on batches of 64 one-sentence requests
  asking for every layer in base64 (what 64 concurrent clients of one sentence make it do).

Printed: each measure's tokens/s per tree (median of the rounds) and the median of the rounds' own ratios. The
revision is extracted with ``git archive`` into a temporary folder and run with this venv's packages; nothing else
should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DROP_IN = """
import json, sys, time
from elmo_core.allennlp import ElmoEmbedder
sentences = json.load(open(sys.argv[1]))
model = sys.argv[2]
embedder = ElmoEmbedder(model + "/options.json", model + "/weights.hdf5")
list(embedder.embed_sentences(sentences[:64]))
start = time.perf_counter()
n = sum(v.shape[1] for v in embedder.embed_sentences(sentences))
print(json.dumps({"tokens_per_s": n / (time.perf_counter() - start)}))
"""

SERVER_UNIT = """
import json, sys, time
from elmo_core.serve.api import Batch, Output
from elmo_core.serve.compute import BatchEmbedder
sentences = json.load(open(sys.argv[1]))
try:  # the model resolved once by the server, placed before its port is bound (since #64)
    from elmo_core.runtime import resolve_model
    embedder = BatchEmbedder(resolve_model(sys.argv[2]).pinned(), "cpu", "fp32", "asked for fp32", 4096)
except (ImportError, TypeError, AttributeError):  # a tree before it: the model process resolved it
    embedder = BatchEmbedder(sys.argv[2])
embedder.warm_up()
spec = [Output("layers", encoding="base64")]
batches = [sentences[i : i + 64] for i in range(0, len(sentences), 64)]
start = time.perf_counter()
for i, batch in enumerate(batches):
    embedder.run(Batch(i, batch, [0] * len(batch), spec))
n = sum(len(s) for s in sentences)
print(json.dumps({"tokens_per_s": n / (time.perf_counter() - start)}))
"""


def prepare(work: Path, shape: str, n: int) -> tuple[Path, Path, Path]:
    """The model, the ingested dataset and the sentences as JSON, made once by this checkout."""
    from pydoc_data.topics import topics

    from elmo_core.bilm.initialization import random_model
    from elmo_core.config import preset
    from elmo_core.ingest import ingest
    from elmo_core.options import IngestConfig
    from elmo_core.text.corpus import _prose_paragraphs
    from elmo_core.text.tokenize import split_sentences, unicode_tokens

    sentences = [
        s
        for name in sorted(topics)
        for p in _prose_paragraphs(topics[name])
        for s in (unicode_tokens(x) for x in split_sentences(p))
        if s
    ][:n]
    text = work / "text.txt"
    text.write_text("".join(" ".join(s) + "\n" for s in sentences), encoding="utf-8")
    ingest(IngestConfig(sources=[str(text)], out=str(work / "ingest"), dedup=False, heldout_fraction=0.0))
    (work / "sentences.json").write_text(json.dumps(sentences))
    return random_model(preset(shape), work / "model"), work / "ingest", work / "sentences.json"


def _run(tree: Path, args: list[str]) -> str:
    done = subprocess.run([sys.executable, *args], cwd=tree, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"{tree}: {' '.join(args[:3])} failed:\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def measure(tree: Path, model: Path, dataset: Path, sentences: Path, out: Path) -> dict[str, float]:
    said = _run(
        tree, ["-m", "elmo_core.cli", "embed", "--model", str(model), "--input", str(dataset), "--out", str(out)]
    )
    line = next(s for s in said.splitlines() if s.startswith("embed: "))
    embed = float(line.split(" tokens/s")[0].rsplit("(", 1)[1].replace(",", ""))
    drop_in = json.loads(_run(tree, ["-c", DROP_IN, str(sentences), str(model)]).strip().splitlines()[-1])
    unit = json.loads(_run(tree, ["-c", SERVER_UNIT, str(sentences), str(model)]).strip().splitlines()[-1])
    return {"elmo embed": embed, "drop-in": drop_in["tokens_per_s"], "server unit": unit["tokens_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, metavar="REV")
    parser.add_argument("--shape", default="small")
    parser.add_argument("--sentences", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from elmo_core import cpu

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        baseline = work / "baseline"
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.against], capture_output=True, check=True)
        with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
            tar.extractall(baseline, filter="data")
        model, dataset, sentences = prepare(work, args.shape, args.sentences)
        trees = {args.against: baseline, "this checkout": ROOT}
        rates: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for r in range(args.rounds):
            for name, tree in trees.items():
                rates[name].append(
                    measure(tree, model, dataset, sentences, work / f"out-{r}-{len(rates[name])}-{name[:4]}")
                )
                print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:,.0f}" for k, v in rates[name][-1].items()))
        print(f"\n{cpu.describe()}; shape {args.shape}, {args.sentences} real sentences, {args.rounds} rounds")
        for measure_name in rates["this checkout"][0]:
            now = [x[measure_name] for x in rates["this checkout"]]
            before = [x[measure_name] for x in rates[args.against]]
            ratio = statistics.median(n / b for n, b in zip(now, before))
            print(
                f"{measure_name:<12} {args.against}: {statistics.median(before):>9,.0f} tok/s   this checkout: "
                f"{statistics.median(now):>9,.0f} tok/s   ratio {ratio:.3f} (median of the rounds' ratios)"
            )


if __name__ == "__main__":
    main()
