"""Would int8 inference pay on a CPU without bf16? PyTorch's dynamic quantization of the LSTM step's products
(int8 weights per output channel, activations quantized per call; fbgemm on AVX2 / AVX-512 VNNI, oneDNN on AMX)
against today's fp32 kernels, in the same run: per-token cosine to fp32 on real text in every layer (the TF-trained
fixture model) and tokens/s on the original shape.

    .venv/bin/python bench/int8_inference.py [--sentences 60] [--quality-sentences 400]
    ELMO_CPU_ISA=avx2 .venv/bin/python bench/int8_inference.py   # as on an AVX2-only CPU (torch held to AVX2)

The bar for offering ``precision: int8``: cosine >= 0.999 at the 0.1% quantile in every layer and >= 1.5x fp32 on the
original shape. The int8 products replace the packed per-step products of ``kernels.cells.CpuCell`` (the layer-0
input gates, once per distinct word, stay fp32), so what is timed is everything else of today's fp32 path.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from elmo_core import BiLM, cpu  # noqa: E402
from elmo_core.config import preset  # noqa: E402
from elmo_core.corpus import _prose_paragraphs  # noqa: E402
from elmo_core.kernels import cells  # noqa: E402
from elmo_core.model import init_bilm_tf  # noqa: E402
from elmo_core.tokenize import split_sentences, unicode_tokens  # noqa: E402

# isort: split
import torch  # noqa: E402  (after elmo_core: under ELMO_CPU_ISA=avx2 it holds torch to AVX2 as torch loads)

warnings.filterwarnings("ignore", message=".*quantiz.*deprecated")  # torch 2.13 deprecates the quantized tensors


class Int8Products:
    """``kernels.packed.PackedWeights``' interface on int8 weights: x (D, rows, K) @ W.T per direction, float32 out."""

    def __init__(self, weights: torch.Tensor) -> None:
        self.reduce_range = torch.backends.quantized.engine in ("x86", "fbgemm")  # AVX2's int16 sums would saturate
        self.packed = []
        for w in weights.detach().float().unbind(0):
            scale = (w.abs().amax(1).clamp_min(1e-8) / 127).double()
            zero = torch.zeros(w.shape[0], dtype=torch.long)
            q = torch.quantize_per_channel(w.contiguous(), scale, zero, 0, torch.qint8)
            self.packed.append(torch.ops.quantized.linear_prepack(q, None))
        self.out_features = weights.shape[1]

    def products(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [
            torch.ops.quantized.linear_dynamic(x[d].float().contiguous(), p, self.reduce_range)
            for d, p in enumerate(self.packed)
        ]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.products(x))


def embed(bilm: BiLM, sentences: list[list[str]], int8: bool) -> list[np.ndarray]:
    original = cells.PackedWeights
    if int8:
        cells.PackedWeights = Int8Products  # every per-step product, at any size
    try:
        bilm.prepare("fp32", min_packed=0 if int8 else "auto").cache.clear()
        return bilm.embed_sentences(sentences)
    finally:
        cells.PackedWeights = original


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
    print(f"quantized engine {torch.backends.quantized.engine}, {torch.get_num_threads()} threads")

    fixture = BiLM.from_pretrained(str(HERE.parent / "tests" / "fixtures" / "allennlp_elmo"))
    text = real_text(args.quality_sentences)
    exact, fast = embed(fixture, text, False), embed(fixture, text, True)
    print(f"\nquality: per-token cosine int8 vs fp32, fixture model, {sum(map(len, text)):,} real tokens")
    for layer in range(fixture.num_layers):
        a, b = (np.concatenate([v[layer] for v in vs]) for vs in (exact, fast))
        cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        print(
            f"  layer {layer}: min {cos.min():.5f}  0.1% quantile {np.quantile(cos, 0.001):.5f}  median {np.median(cos):.6f}"
        )

    torch.manual_seed(0)
    bilm = BiLM(preset("original"))
    init_bilm_tf(bilm)
    bilm.eval()
    sentences = real_text(args.sentences)
    tokens = sum(map(len, sentences))
    rates: dict[str, list[float]] = {"fp32": [], "int8": []}
    for name in rates:
        embed(bilm, sentences[:4], name == "int8")  # warm-up: weights prepared, kernels built
    for _ in range(args.rounds):  # alternating, so drift on a shared machine hits both alike
        for name in rates:
            start = time.perf_counter()
            embed(bilm, sentences, name == "int8")
            rates[name].append(tokens / (time.perf_counter() - start))
    fp32, int8 = (float(np.median(rates[n])) for n in ("fp32", "int8"))
    print(f"\noriginal shape, {len(sentences)} real sentences ({tokens:,} tokens), median of {args.rounds} rounds")
    print(f"  fp32 (today's kernels, baseline) {fp32:8,.0f} tok/s")
    print(f"  int8 (dynamic quantization)      {int8:8,.0f} tok/s   {int8 / fp32:.2f}x")


if __name__ == "__main__":
    main()
