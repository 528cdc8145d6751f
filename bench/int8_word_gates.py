"""int8's one unquantized product, layer 0's per-word input product, in bf16 against fp32, alternating in one run.

    .venv/bin/python bench/int8_word_gates.py [--sentences 512] [--rounds 3]

The model: an ELMoForManyLangs release at their published size (2x4096_512, random weights, written as
``bench/manylangs.py`` writes it), the corpus the same Zipfian draw. Each round opens the model twice in int8, once
as chosen on this CPU (bf16 per-word products where it has bf16 products) and once forced to fp32
(``word_gates_bf16=False``), and times ``Runtime.embed`` of the corpus after a first pass of 4 of its sentences
(the weights prepared; their words, the most frequent ones among them, kept in the word cache). Prints the CPU, each
round's tokens/s and the medians.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from manylangs import corpus, words_of  # noqa: E402

from elmo_core import cpu  # noqa: E402
from elmo_core.bilm.manylangs import published_network  # noqa: E402
from tests.test_manylangs import write_release  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-word-gates-") as tmp:
        os.environ["ELMO_CACHE_DIR"] = str(Path(tmp) / "cache")
        from elmo_core.runtime import Runtime

        words = words_of(50_000, 6_000)
        release = write_release(Path(tmp) / "zh.model", published_network(), words)
        sentences = corpus(words, args.sentences)
        tokens = sum(map(len, sentences))
        timed: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for forced in (None, False):
                runtime = Runtime.open(str(release), precision="int8")
                if forced is False:
                    runtime.bilm.prepare("int8", word_gates_bf16=False)
                name = "bf16" if runtime.bilm.kernels.word_gates_bf16 else "fp32"
                runtime.embed(sentences[:4])  # the weights prepared, as a job's first pass does
                started = time.perf_counter()
                runtime.embed(sentences)
                timed.setdefault(name, []).append(tokens / (time.perf_counter() - started))
    print(cpu.describe())
    for name, figures in timed.items():
        median = sorted(figures)[len(figures) // 2]
        print(
            f"int8, per-word products in {name}: {', '.join(f'{f:,.0f}' for f in figures)} tok/s; median {median:,.0f}"
        )


if __name__ == "__main__":
    main()
