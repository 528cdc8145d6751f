"""Throughput of ``elmo embed`` on an ELMoForManyLangs release against their ``Embedder`` and a bilm-tf model of the
same size, in one run on one machine (issue 56's targets: at least 10x their tokens/s on the CPU, and within 0.8x
of the bilm-tf model).

    .venv/bin/python bench/manylangs.py [--sentences 512] [--words 50000] [--chars 6000] [--precision fp32]
                                        [--threads N] [--tiny] [--heap-baseline] [--out bench_manylangs.json]

Three models with random weights, written as their files are (``tests/test_manylangs.write_release``: the format
description, not their code): a ManyLangs-shaped release at their published sizes (2x4096_512 biLM, 2048 filters,
2 highways, 50-wide characters, a 100-wide word table of ``--words`` rows, ``--chars`` characters), and a bilm-tf
model of the same biLM (``original()``: the same LSTMs and CNN, no word table). The corpus: ``--sentences``
sentences of 10-40 tokens (Zipfian draws from the release's words, one token in twenty unknown), one a line.

Timed, in this order, each in a process of its own: their ``Embedder(folder, batch_size=64).sents2elmo`` (model
loading not counted), first and again last, since the machine's speed drifts within a run (their two figures
printed, their mean the one compared); ``elmo embed
--model RELEASE`` and ``elmo embed --model BILM_TF`` in subprocesses (tokens over the seconds of its units in the
table's ``_manifest.json``: the embedding, model loading not counted either; the whole command's tokens/s, as it
prints it, beside; the release's one-time conversion into the model cache, and the build of the C kernels on first
use, are done before any clock). Printed: the
CPU, the threads, tokens/s of the three, ours against theirs and against the bilm-tf model; then what 10x their
tokens/s would ask of the machine: the LSTMs' products per token (the arithmetic no exact implementation skips,
``lstm_floor_flops``) at that rate, against a square matmul's GFLOP/s in the same precision measured in the same
run (``matmul_peak``); and a JSON line. Use a
corpus long enough (the default 512 sentences, ~12,800 tokens) on a machine nothing else runs on.
``--tiny``: a small shape (seconds), to check the bench itself runs. ``--heap-baseline``: ours on the release once
more, timed last, with glibc's heap defaults (``ELMO_HEAP=system``), against ours as it runs (``elmo_core/heap.py``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from elmo_core import cpu  # noqa: E402
from elmo_core.bilm.initialization import random_model  # noqa: E402
from elmo_core.bilm.manylangs import published_network  # noqa: E402
from elmo_core.config import ModelConfig, original  # noqa: E402
from tests.test_manylangs import SMALL, write_release  # noqa: E402

# isort: split
import torch  # noqa: E402

SUMMARY = re.compile(r"\(([\d,.]+) tokens/s")


def words_of(n_words: int, n_chars: int, seed: int = 0) -> list[str]:
    """``n_words`` distinct words of 1-4 CJK characters drawn from ``n_chars`` code points (a Chinese release's look)."""
    rng = np.random.default_rng(seed)
    pool = [chr(0x4E00 + i) for i in range(n_chars)]
    found: dict[str, None] = {}
    while len(found) < n_words:
        found["".join(rng.choice(pool, size=int(rng.integers(1, 5))))] = None
    return list(found)


def corpus(words: list[str], n: int, seed: int = 1) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, len(words) + 1)
    p /= p.sum()
    sentences = []
    for _ in range(n):
        drawn = [words[i] for i in rng.choice(len(words), size=int(rng.integers(10, 41)), p=p)]
        sentences.append([w if rng.random() > 0.05 else w + "ゑ" for w in drawn])  # some unknown words
    return sentences


def their_tokens_per_s(folder: Path, sentences: list[list[str]], threads: int) -> float:
    """Their ``Embedder`` in a process of its own, as ours runs in one: run in this process, the gigabytes their
    model and answers leave allocated (freed, but kept by the allocator) slowed the ``elmo embed`` subprocesses timed
    after it by about a quarter (1,521 against 1,973 tok/s in int8; 1,882 once the parent's freed memory was given
    back to the system)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(_their_tokens_per_s, folder, sentences, threads).result()


def _their_tokens_per_s(folder: Path, sentences: list[list[str]], threads: int) -> float:
    torch.set_num_threads(threads)
    from elmoformanylangs import Embedder

    embedder = Embedder(str(folder), batch_size=64)
    started = time.perf_counter()
    embedder.sents2elmo(sentences, output_layer=-2)
    return sum(map(len, sentences)) / (time.perf_counter() - started)


def our_tokens_per_s(model: Path, text: Path, out: Path, precision: str, env: dict[str, str]) -> tuple[float, float]:
    """``elmo embed`` in a subprocess: (tokens/s of its units, the embedding alone as their ``sents2elmo`` is timed;
    tokens/s of the whole command as it prints it, model loading included)."""
    args = ["embed", "--model", str(model), "--input", str(text), "--out", str(out), "--layers", "all"]
    done = subprocess.run(
        [sys.executable, "-m", "elmo_core.cli", *args, "--precision", precision, "--overwrite"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"elmo embed failed: {done.stderr.strip().splitlines()[-1]}")
    found = SUMMARY.search(done.stdout.strip().splitlines()[-1])
    if found is None:
        raise SystemExit(f"no tokens/s in elmo embed's summary: {done.stdout.strip().splitlines()[-1]}")
    units = json.loads((out / "_manifest.json").read_text())["units"]
    return sum(u["tokens"] for u in units) / sum(u["seconds"] for u in units), float(found.group(1).replace(",", ""))


def matmul_peak(precision: str, size: int = 2048, repeats: int = 10) -> float:
    """GFLOP/s of one square product in ``precision`` on this CPU, the best of ``repeats``: ``torch.matmul`` in
    float32 or bfloat16, or for int8 the dynamic int8 product the model's LSTMs run (``kernels.int8``). A ceiling
    for any implementation's products in that precision."""
    if precision == "int8":
        from elmo_core.bilm.kernels.int8 import Int8Weights

        weights, x = Int8Weights(torch.randn(1, size, size)), torch.randn(1, size, size)
        product = lambda: weights.products(x)  # noqa: E731
    else:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        product = lambda: torch.matmul(a, b)  # noqa: E731
    product()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        product()
        times.append(time.perf_counter() - start)
    return 2 * size**3 / min(times) / 1e9


def lstm_floor_flops(network: dict, sentences: list[list[str]]) -> float:
    """FLOPs of the LSTMs' products that no exact implementation skips, per token: at every step of every sentence
    (its ``<bos>``/``<eos>`` included), in both directions, each layer's recurrent and projection products and the
    input product of layers above the first. Layer 0's input product and the char CNN are left out, since they
    depend on the word alone and can be computed once per distinct word (as we do)."""
    enc = network["encoder"]
    p, h, n_layers = enc["projection_dim"], enc["dim"], enc["n_layers"]
    per_step = n_layers * (p * 4 * h + h * p) + (n_layers - 1) * p * 4 * h
    steps = sum(len(s) + 2 for s in sentences)
    return 2 * 2 * per_step * steps / sum(map(len, sentences))


def bilm_tf_twin(network: dict) -> ModelConfig:
    """The bilm-tf model of the release's biLM: the same char CNN (its 50-wide characters) and LSTMs."""
    emb, enc = network["token_embedder"], network["encoder"]
    base = original()
    cnn = base.char_cnn.model_copy(
        update={
            "embedding": base.char_cnn.embedding.model_copy(update={"dim": emb["char_dim"]}),
            "filters": emb["filters"],
            "n_highway": emb["n_highway"],
        }
    )
    lstm = base.lstm.model_copy(
        update={"dim": enc["dim"], "projection_dim": enc["projection_dim"], "n_layers": enc["n_layers"]}
    )
    return ModelConfig(char_cnn=cnn, lstm=lstm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=512)
    parser.add_argument(
        "--their-sentences",
        type=int,
        default=None,
        help="time their Embedder on the first N sentences only (default: all): it keeps nothing between batches, "
        "so its tokens/s does not grow with the corpus, while ours does (the word cache fills, the first pass's "
        "weight preparing is paid once)",
    )
    parser.add_argument("--words", type=int, default=50_000)
    parser.add_argument("--chars", type=int, default=6_000)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for all three (default: torch's)")
    parser.add_argument("--tiny", action="store_true", help="a small shape, to check the bench runs")
    parser.add_argument(
        "--heap-baseline",
        action="store_true",
        help="also elmo embed on the release with glibc's heap defaults (ELMO_HEAP=system), the baseline of "
        "elmo_core/heap.py's reuse of large buffers",
    )
    parser.add_argument("--out", default=None, help="also write the JSON result here")
    args = parser.parse_args()
    if args.tiny:
        args.sentences, args.words, args.chars = min(args.sentences, 64), min(args.words, 500), min(args.chars, 200)
    network = SMALL if args.tiny else published_network()
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)

    with tempfile.TemporaryDirectory(prefix="bench-manylangs-") as tmp_name:
        tmp = Path(tmp_name)
        words = words_of(args.words, args.chars)
        release = write_release(tmp / "zh.model", network, words, beside=args.tiny)
        twin = random_model(bilm_tf_twin(network), tmp / "bilm_tf")
        sentences = corpus(words, args.sentences)
        text = tmp / "corpus.txt"
        text.write_text("\n".join(" ".join(s) for s in sentences) + "\n", encoding="utf-8")
        env = {**os.environ, "ELMO_CACHE_DIR": str(tmp / "cache"), "OMP_NUM_THREADS": str(threads)}
        # before any clock: the release converted into the model cache, and the C kernels built there (first use)
        code = "import sys; from elmo_core.runtime import Runtime; Runtime.open(sys.argv[1]).embed([['a', 'b']])"
        subprocess.run([sys.executable, "-c", code, str(release)], cwd=ROOT, env=env, check=True)

        their_sentences = sentences[: args.their_sentences or len(sentences)]
        their_runs = [their_tokens_per_s(release, their_sentences, threads)]
        ours, ours_command = our_tokens_per_s(release, text, tmp / "table-release", args.precision, env)
        bilm_tf, bilm_tf_command = our_tokens_per_s(twin, text, tmp / "table-bilm-tf", args.precision, env)
        system_heap = None
        if args.heap_baseline:
            system_env = {**env, "ELMO_HEAP": "system"}
            system_heap, _ = our_tokens_per_s(release, text, tmp / "table-system-heap", args.precision, system_env)
        their_runs.append(their_tokens_per_s(release, their_sentences, threads))
        theirs = sum(their_runs) / len(their_runs)
    peak = matmul_peak(args.precision)
    floor = lstm_floor_flops(network, sentences)
    needed = 10 * theirs * floor / 1e9  # GFLOP/s of the LSTMs' products alone at 10x their tokens/s

    result = {
        "cpu": cpu.describe(),
        "threads": threads,
        "precision": args.precision,
        "shape": "tiny" if args.tiny else "published (2x4096_512, 2048 filters, 2 highways, word_dim 100)",
        "words": args.words,
        "chars": args.chars,
        "tokens": sum(map(len, sentences)),
        "their_tokens": sum(map(len, their_sentences)),
        "their_embedder_tokens_per_s": round(theirs, 1),
        "their_embedder_runs_tokens_per_s": [round(t, 1) for t in their_runs],
        "ours_tokens_per_s": round(ours, 1),
        "bilm_tf_same_size_tokens_per_s": round(bilm_tf, 1),
        "ours_command_tokens_per_s": ours_command,
        "bilm_tf_command_tokens_per_s": bilm_tf_command,
        "ours_over_theirs": round(ours / theirs, 2),
        "ours_over_bilm_tf": round(ours / bilm_tf, 3),
        "matmul_peak_gflops": round(peak, 1),
        "lstm_floor_mflop_per_token": round(floor / 1e6, 1),
        "ours_lstm_gflops": round(ours * floor / 1e9, 1),
        "ten_x_theirs_needs_gflops": round(needed, 1),
        "ours_with_system_heap_tokens_per_s": round(system_heap, 1) if system_heap else None,
    }
    print(result["cpu"])
    print(
        f"{result['tokens']:,} tokens, {threads} threads, {args.precision}: their Embedder {theirs:,.0f} tokens/s "
        f"(on {result['their_tokens']:,} of them; {' and '.join(f'{t:,.0f}' for t in their_runs)}, first and last); "
        f"elmo embed on the release {ours:,.0f} ({ours / theirs:.1f}x theirs); on a bilm-tf model of the same size "
        f"{bilm_tf:,.0f} (ours {ours / bilm_tf:.2f}x it)"
    )
    print(
        f"the LSTMs' products, which no exact implementation skips: {floor / 1e6:,.1f} MFLOP a token; ours runs them "
        f"at {ours * floor / 1e9:,.1f} GFLOP/s, and 10x their Embedder ({10 * theirs:,.0f} tokens/s) would need "
        f"{needed:,.1f} GFLOP/s for them alone: {needed / peak:.2f}x the {args.precision} peak measured "
        f"just now ({peak:,.1f} GFLOP/s, one square product of 2,048)"
    )
    if system_heap:
        print(
            f"elmo embed on the release with glibc's heap defaults (ELMO_HEAP=system): {system_heap:,.0f} tokens/s "
            f"({system_heap / theirs:.1f}x theirs); with its large buffers reused: {ours:,.0f} "
            f"({ours / system_heap:.2f}x)"
        )
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
