"""``precision: int8`` against fp32 in the same run: PyTorch's dynamic quantization of the LSTM step's products
(``elmo_core/bilm/kernels/int8.py``: int8 weights per output channel, activations quantized per call; oneDNN with
8-bit activations where the CPU has VNNI, else fbgemm with 7) against today's fp32 kernels (oneDNN-packed products,
C gates). Per-token cosine to fp32 on real text in every layer (the TF-trained fixture model), and tokens/s on the original shape.

    .venv/bin/python bench/int8_inference.py [--sentences 60] [--quality-sentences 400]
    ELMO_CPU_ISA=avx2 .venv/bin/python bench/int8_inference.py   # as on an AVX2-only CPU (torch held to AVX2)

The bar ``precision: int8`` is offered on: cosine >= 0.999 at the 0.1% quantile in every layer and >= 1.5x fp32 on
the original shape. Each precision's model is prepared once (weights packed or quantized by a warm-up call), so
what is timed is inference alone.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from elmo_core import BiLM, cpu  # noqa: E402
from elmo_core.bilm.initialization import init_bilm_tf  # noqa: E402
from elmo_core.bilm.kernels import int8  # noqa: E402
from elmo_core.config import preset  # noqa: E402
from elmo_core.text.corpus import _prose_paragraphs  # noqa: E402
from elmo_core.text.tokenize import split_sentences, unicode_tokens  # noqa: E402

# isort: split
import torch  # noqa: E402  (after elmo_core: under ELMO_CPU_ISA=avx2 it holds torch to AVX2 as torch loads)


def prepared(bilm: BiLM, precision: str, warm_up: list[list[str]]) -> BiLM:
    """A copy of ``bilm`` prepared for ``precision``, its weights packed (or quantized) by a warm-up call."""
    model = copy.deepcopy(bilm)
    model.prepare(precision)
    model.embed_sentences(warm_up, precision=precision)
    return model


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def real_text(n: int) -> list[list[str]]:
    from pydoc_data.topics import topics

    sentences = [
        unicode_tokens(s)
        for name in sorted(topics)
        for p in _prose_paragraphs(topics[name])
        for s in split_sentences(p)
    ]
    return [s for s in sentences if s][:n]


def main() -> None:
    print(cpu.describe())
    parser = argparse.ArgumentParser()
    parser.add_argument("--sentences", type=int, default=60, help="real sentences timed on the original shape")
    parser.add_argument("--quality-sentences", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"int8: {int8.describe()}; {torch.get_num_threads()} threads")

    fixture = BiLM.from_pretrained(str(HERE.parent / "tests" / "fixtures" / "allennlp_elmo"))
    text = real_text(args.quality_sentences)
    exact, fast = (prepared(fixture, p, text[:4]).embed_sentences(text, precision=p) for p in ("fp32", "int8"))
    print(f"\nquality: per-token cosine int8 vs fp32, fixture model, {sum(map(len, text)):,} real tokens")
    for layer in range(fixture.num_layers):
        cos = cosines(*(np.concatenate([v[layer] for v in vs]) for vs in (exact, fast)))
        print(
            f"  layer {layer}: min {cos.min():.5f}  0.1% quantile {np.quantile(cos, 0.001):.5f}  median {np.median(cos):.6f}"
        )

    torch.manual_seed(0)
    bilm = BiLM(preset("original"))
    init_bilm_tf(bilm)
    bilm.eval()
    sentences = real_text(args.sentences)
    tokens = sum(map(len, sentences))
    models = {name: prepared(bilm, name, sentences[:4]) for name in ("fp32", "int8")}
    rates: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.rounds):  # alternating, so drift on a shared machine hits both alike
        for name, model in models.items():
            start = time.perf_counter()
            model.embed_sentences(sentences, precision=name)
            rates[name].append(tokens / (time.perf_counter() - start))
    fp32, quantized = (float(np.median(rates[n])) for n in ("fp32", "int8"))
    print(f"\noriginal shape, {len(sentences)} real sentences ({tokens:,} tokens), median of {args.rounds} rounds")
    print(f"  fp32 (today's kernels, baseline) {fp32:8,.0f} tok/s")
    print(f"  int8 (dynamic quantization)      {quantized:8,.0f} tok/s   {quantized / fp32:.2f}x")
    worst = [  # the same check on this shape's (random, bilm-tf-initialised) weights
        min(
            float(np.min(cosines(a[layer], b[layer])))
            for a, b in zip(*(m.embed_sentences(sentences, precision=n) for n, m in models.items()))
        )
        for layer in range(bilm.num_layers)
    ]
    print("  worst per-token cosine int8 vs fp32 per layer: " + ", ".join(f"{w:.5f}" for w in worst))


if __name__ == "__main__":
    main()
