"""The AllenNLP drop-in (``elmo_core.allennlp``) against AllenNLP 2.10.1 itself, same files and sentences, one run.

    .venv/bin/python bench/allennlp_compat.py [--shapes small,original] [--repeats 3] [--sentences 600]

For each shape (random bilm-tf-initialised weights written as options.json + weights.hdf5) and each workload
(uniform 10-40 made-up words; long-tailed real English, Python's pydoc topics), three jobs, in fp32 without
gradients, tokens/s as the median of ``--repeats``:
* ``embed_sentences``: ours ``ElmoEmbedder.embed_sentences`` (stateless: sorted, token-bounded batches); AllenNLP's
  ``ElmoEmbedder`` way (0.9; 2.10 kept its ``_ElmoBiLm``): batches of 64 in order, layers trimmed per sentence;
* ``embed_file``: the same plus the HDF5 file (``all``), ours ``ElmoEmbedder.embed_file``;
* ``Elmo.forward``: one scalar mix, batches of 64 char-id tensors, in order, for both.
AllenNLP runs in its own venv (``bench/allennlp_venv.sh``), on the same machine, between our runs. Printed beside
the rates: the largest |difference| of the vectors.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
os.environ.setdefault("ELMO_ALLOW_EMULATED_BF16", "1")  # a bench times bf16 where it is emulated too (the slowdown)

from embed_throughput import describe_machine, make_sentences, real_sentences  # noqa: E402

from elmo_core import BiLM  # noqa: E402
from elmo_core.allennlp import Elmo, ElmoEmbedder, batch_to_ids  # noqa: E402
from elmo_core.bilm.initialization import init_bilm_tf  # noqa: E402
from elmo_core.config import preset  # noqa: E402

# isort: split
import torch  # noqa: E402  (after elmo_core: under ELMO_CPU_ISA=avx2 it holds torch to AVX2 as torch loads)

BATCH = 64
JOBS = ("embed_sentences", "embed_file", "Elmo.forward")


def ours(model_dir: Path, sentences: list[list[str]], repeats: int, out: Path) -> tuple[dict[str, float], dict]:
    """Seconds per job (median) and the vectors of each job (for the comparison)."""
    files = str(model_dir / "options.json"), str(model_dir / "weights.hdf5")
    embedder = ElmoEmbedder(*files)
    elmo = Elmo(*files, 1, dropout=0.0).eval()
    text = "\n".join(" ".join(s) for s in sentences) + "\n"

    def embed_sentences() -> list[np.ndarray]:
        return list(embedder.embed_sentences(sentences, batch_size=BATCH))

    def embed_file() -> None:
        embedder.embed_file(io.StringIO(text), str(out / "ours.hdf5"), "all", BATCH, forget_sentences=True)

    def forward() -> list[np.ndarray]:
        vectors = []
        with torch.no_grad():
            for start in range(0, len(sentences), BATCH):
                batch = sentences[start : start + BATCH]
                mixed = elmo(batch_to_ids(batch))["elmo_representations"][0]
                vectors += [mixed[i, : len(s)].numpy() for i, s in enumerate(batch)]
        return vectors

    runs = {"embed_sentences": embed_sentences, "embed_file": embed_file, "Elmo.forward": forward}
    vectors = {"embed_sentences": embed_sentences(), "Elmo.forward": forward()}
    embed_file()  # warm-up, as the others
    seconds = {job: statistics.median(_timed(run) for _ in range(repeats)) for job, run in runs.items()}
    return seconds, vectors


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


RUNNER = r"""
import io, json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
from allennlp_embed import _UnusedFinder
sys.meta_path.insert(0, _UnusedFinder())
import h5py, numpy as np, torch
from allennlp.modules.elmo import Elmo, _ElmoBiLm, batch_to_ids
from allennlp.nn.util import remove_sentence_boundaries
model_dir, sentences, out, repeats = sys.argv[2], json.load(open(sys.argv[3])), sys.argv[4], int(sys.argv[5])
torch.set_grad_enabled(False)
bilm = _ElmoBiLm(model_dir + "/options.json", model_dir + "/weights.hdf5").eval()
elmo = Elmo(model_dir + "/options.json", model_dir + "/weights.hdf5", 1, dropout=0.0).eval()

def embed_sentences():  # AllenNLP 0.9's ElmoEmbedder: batches of 64 in order, each sentence's layers trimmed
    vectors = []
    for start in range(0, len(sentences), 64):
        batch = sentences[start : start + 64]
        bilm._elmo_lstm.reset_states()
        output = bilm(batch_to_ids(batch))
        layers = [remove_sentence_boundaries(t, output["mask"]) for t in output["activations"]]
        stacked = torch.cat([t.unsqueeze(1) for t, _ in layers], dim=1)
        vectors += [stacked[i, :, : len(s)].numpy() for i, s in enumerate(batch)]
    return vectors

def embed_file():
    with h5py.File(out + "/allennlp.hdf5", "w") as f:
        for i, v in enumerate(embed_sentences()):
            f.create_dataset(str(i), v.shape, dtype="float32", data=v)

def forward():
    vectors = []
    for start in range(0, len(sentences), 64):
        batch = sentences[start : start + 64]
        elmo._elmo_lstm._elmo_lstm.reset_states()
        mixed = elmo(batch_to_ids(batch))["elmo_representations"][0]
        vectors += [mixed[i, : len(s)].numpy() for i, s in enumerate(batch)]
    return vectors

runs = {"embed_sentences": embed_sentences, "embed_file": embed_file, "Elmo.forward": forward}
np.savez(out + "/allennlp.npz", **{f"e{i}": v for i, v in enumerate(embed_sentences())},
         **{f"f{i}": v for i, v in enumerate(forward())})
embed_file()
def timed(run):
    start = time.perf_counter(); run(); return time.perf_counter() - start
print(json.dumps({job: statistics.median(timed(run) for _ in range(repeats)) for job, run in runs.items()}))
"""


def allennlp(model_dir: Path, sentences: list[list[str]], repeats: int, out: Path) -> tuple[dict, dict] | str:
    try:
        python = subprocess.run(
            ["bash", str(HERE / "allennlp_venv.sh")], check=True, capture_output=True, text=True
        ).stdout.split()[-1]
    except subprocess.CalledProcessError as exc:
        return f"could not set up .venv-allennlp: {exc.stderr.strip()[-300:]}"
    (out / "sentences.json").write_text(json.dumps(sentences))
    result = subprocess.run(
        [python, "-c", RUNNER, str(HERE), str(model_dir), str(out / "sentences.json"), str(out), str(repeats)],
        capture_output=True,
        text=True,
        cwd=HERE.parent,
    )
    if result.returncode != 0:
        return f"AllenNLP failed: {result.stderr.strip()[-500:]}"
    data = np.load(out / "allennlp.npz")
    vectors = {
        "embed_sentences": [data[f"e{i}"] for i in range(len(sentences))],
        "Elmo.forward": [data[f"f{i}"] for i in range(len(sentences))],
    }
    return json.loads(result.stdout.strip().splitlines()[-1]), vectors


def main() -> None:
    from elmo_core import cpu

    print(cpu.describe())  # which CPU these figures come from (AVX-512, avx512_bf16, AMX)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="small,original")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sentences", type=int, default=600, help="sentences per workload")
    args = parser.parse_args()
    workloads = {"uniform": make_sentences(args.sentences), "long-tailed": real_sentences(args.sentences)}
    print(describe_machine())
    header = (
        f"{'shape':<9}{'workload':<13}{'job':<17}{'ours tok/s':>11}{'AllenNLP':>10}{'ours/AN':>9}{'max |diff|':>12}"
    )
    print(header)
    print("-" * len(header))
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            torch.manual_seed(0)
            model_dir = Path(tmp) / shape
            fresh = BiLM(preset(shape))
            init_bilm_tf(fresh)
            fresh.save_pretrained(str(model_dir))
            del fresh
            for name, sentences in workloads.items():
                tokens = sum(len(s) for s in sentences)
                mine, my_vectors = ours(model_dir, sentences, args.repeats, Path(tmp))
                theirs = allennlp(model_dir, sentences, args.repeats, Path(tmp))
                if isinstance(theirs, str):
                    notes.append(theirs)
                    their_seconds, their_vectors = {}, {}
                else:
                    their_seconds, their_vectors = theirs
                for job in JOBS:
                    base = tokens / their_seconds[job] if job in their_seconds else float("nan")
                    vectors = my_vectors.get(job, my_vectors["embed_sentences"])
                    reference = their_vectors.get(job, their_vectors.get("embed_sentences"))
                    diff = (
                        max(float(np.abs(a - b).max()) for a, b in zip(vectors, reference) if a.size)
                        if reference
                        else float("nan")
                    )
                    rate = tokens / mine[job]
                    print(f"{shape:<9}{name:<13}{job:<17}{rate:>11,.0f}{base:>10,.0f}{rate / base:>8.1f}x{diff:>12.1e}")
    for note in notes:
        print(f"  {note}")


if __name__ == "__main__":
    main()
