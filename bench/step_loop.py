"""A layer's steps in one C call (``kernels/step_loop.py``) against the same steps from Python, in one run.

    .venv/bin/python bench/step_loop.py [--shape small] [--rows 1,4,16,64,256] [--repeats 5]

The model: random bilm-tf-initialised weights of the preset shape, fp32 on the CPU, prepared twice (the C loop on,
and ``step_loop=False``, the baseline), the two timed alternately so that both see the same machine. Printed:

* per step, by rows running: one sentence of 100 copies of a word, times ``rows`` (so the char CNN costs nothing);
* the batch job's tokens/s (``embed_sentences`` over all of them) on real English of long-tailed lengths (Python's
  help topics, 3,000 sentences of 1 to 200+ tokens) and on synthetic sentences of uniform lengths (10-40 words);
* what a server's model process does with random batches of 8 and 32 of the real sentences, its words' layer 0 kept
  from earlier batches (``serve.compute.BatchEmbedder``), as 16 and 64 closed-loop clients make them.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from embed_throughput import describe_machine, make_sentences, real_sentences  # noqa: E402

from elmo_core import BiLM  # noqa: E402
from elmo_core.bilm.initialization import init_bilm_tf  # noqa: E402
from elmo_core.config import preset  # noqa: E402
from elmo_core.runtime import resolve_model  # noqa: E402
from elmo_core.serve.api import Batch, Output  # noqa: E402
from elmo_core.serve.compute import BatchEmbedder  # noqa: E402

# isort: split
import torch  # noqa: E402


def alternate(runs: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds of each run, the runs taking turns (after one warm-up each)."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def row(label: str, unit: str, loop: float, python: float) -> str:
    return f"{label:<44}{loop:>12,.3f}{python:>12,.3f}  {unit:<10}{python / loop if unit == 'ms' else loop / python:>6.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="small")
    parser.add_argument("--rows", default="1,4,16,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    print(describe_machine())
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model_dir = Path(tmp) / "model"
        fresh = BiLM(preset(args.shape))
        init_bilm_tf(fresh)
        fresh.save_pretrained(str(model_dir))
        del fresh
        models = {"loop": BiLM.from_pretrained(str(model_dir)), "python": BiLM.from_pretrained(str(model_dir))}
        models["python"].prepare("fp32", step_loop=False)
        print(f"shape {args.shape}, fp32; the C loop: {models['loop'].kernels}")
        print(f"{'':<44}{'C loop':>12}{'Python':>12}  {'unit':<10}{'speed-up':>7}")
        for rows in [int(r) for r in args.rows.split(",")]:
            sentences = [["the"] * 100] * rows
            seconds = alternate({k: (lambda m=m, s=sentences: m.embed_sentences(s)) for k, m in models.items()}, 3)
            print(row(f"a step of {rows} rows", "ms", *(1000 * seconds[k] / 102 for k in models)))
        real, synthetic = real_sentences(3000), make_sentences(3000)
        for name, sentences in (("batch job, real text (long-tailed)", real), ("batch job, synthetic", synthetic)):
            tokens = sum(len(s) for s in sentences)
            seconds = alternate({k: (lambda m=m, s=sentences: m.embed_sentences(s)) for k, m in models.items()}, 3)
            print(row(name, "tok/s", *(tokens / seconds[k] for k in models)))
        pinned = resolve_model(str(model_dir)).pinned()  # as a server resolves it, once
        embedders = {k: BatchEmbedder(pinned, "cpu", "fp32", "asked for fp32", 4096) for k in models}
        embedders["python"].runtime.bilm.prepare("fp32", step_loop=False)
        for size in (8, 32):
            rng = random.Random(0)
            batches = [rng.sample(real, size) for _ in range(40)]
            tokens = sum(len(s) for b in batches for s in b)
            spec = [Output("mean", encoding="base64")]

            def serve(embedder: BatchEmbedder, batches: list = batches, spec: list = spec) -> None:
                for batch in batches:
                    embedder.run(Batch(0, batch, [0] * len(batch), spec))

            seconds = alternate({k: (lambda e=e: serve(e)) for k, e in embedders.items()}, args.repeats)
            print(
                row(f"server, random batches of {size} real sentences", "tok/s", *(tokens / seconds[k] for k in models))
            )


if __name__ == "__main__":
    main()
