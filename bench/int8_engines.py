"""int8's per-step products on fbgemm (7-bit activations) against oneDNN (8-bit), alternating in one run.

    .venv/bin/python bench/int8_engines.py [--rounds 3] [--rows 128 256 384]

The shapes are the original ELMo's and ELMoForManyLangs' (P 512, H 4096), per direction: layer 0's recurrent product
(rows x 512 @ 512 x 16,384), layer 1's input with its state (rows x 1,024 @ 1,024 x 16,384) and the projection (rows x
4,096 @ 4,096 x 512); the rows are those of a step of ``elmo embed``'s passes on long-tailed text (mostly 128-511). The
weights are quantized per output channel as ``kernels/int8.py`` does (``precision.int8_packed``), once per engine. Each
round times every shape on each engine in turn (best of the round's repeats); printed: the CPU, the median GOP/s per
engine and shape, their ratio, and each engine's relative error against the float32 product. ``precision.int8_engine``
picks oneDNN with 8 bits only where the CPU has VNNI: without it, the 8-bit form can saturate (AVX2's int16 sums).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elmo_core import cpu  # noqa: E402
from elmo_core.precision import INT8_DEPRECATED, int8_packed  # noqa: E402

SHAPES = {"layer 0 recurrent": (512, 16384), "layer 1 input+state": (1024, 16384), "projection": (4096, 512)}
ENGINES = {"fbgemm (x86), 7-bit": ("x86", True), "oneDNN, 8-bit": ("onednn", False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 256, 384])
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=INT8_DEPRECATED)
    torch.manual_seed(0)
    weights = {shape: torch.randn(n, k) / k**0.5 for shape, (k, n) in SHAPES.items()}
    prepared = {(e, s): int8_packed(w, engine) for e, (engine, _) in ENGINES.items() for s, w in weights.items()}
    inputs = {(s, m): torch.randn(m, k).clamp(-3, 3) for s, (k, _) in SHAPES.items() for m in args.rows}
    rates: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(args.rounds):
        for (shape, m), x in inputs.items():
            k, n = SHAPES[shape]
            for name, (_, reduce_range) in ENGINES.items():
                product = prepared[name, shape]
                repeats = max(3, int(2e10 / (2 * m * k * n)))
                torch.ops.quantized.linear_dynamic(x, product, reduce_range)
                best = float("inf")
                for _ in range(repeats):
                    started = time.perf_counter()
                    torch.ops.quantized.linear_dynamic(x, product, reduce_range)
                    best = min(best, time.perf_counter() - started)
                rates.setdefault((shape, name, m), []).append(2 * m * k * n / best / 1e9)
    print(cpu.describe(), f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    first, second = ENGINES
    for (shape, m), x in inputs.items():
        a, b = (statistics.median(rates[shape, e, m]) for e in ENGINES)
        exact = x @ weights[shape].T
        errors = [
            float((torch.ops.quantized.linear_dynamic(x, prepared[e, shape], rr) - exact).norm() / exact.norm())
            for e, (_, rr) in ENGINES.items()
        ]
        print(
            f"{shape:20s} rows {m:4d}: {first} {a:5.0f} GOP/s, {second} {b:5.0f} GOP/s ({b / a:.2f}x); "
            f"relative error {errors[0]:.2e} / {errors[1]:.2e}"
        )


if __name__ == "__main__":
    main()
