"""Can the data path feed a fast GPU? The tokens/s one training process can be fed, without and with prefetch, and
the trainer's step time with prefetch against a step on batches already in memory, measured in one run.

    .venv/bin/python bench/batch_throughput.py [--sizes 10000000,100000000] [--batches 400] [--step-rounds 5]

1. Feed rate, bilm-tf's batch (128 x 20) with the original shape's data path (50 char ids per token, both
   directions), as int64 tensors ready for the model: the generator called in the step ("in the step"), and
   ``prefetch.Prefetcher`` taking batches made by its thread ("prefetched"); on a generated Zipfian corpus (sentences
   of 5-40 tokens, 500k types) at each ``--sizes`` with the process's peak memory, and on real text (Python's pydoc
   topics, long-tailed sentence lengths). Target: >= 1,000,000 tokens/s per process.
2. Step time: ``train.step`` of the small shape (forward, backward, Adagrad, batch 128 x 20, 8192 negatives) with
   prefetch, against the same run reading batches made beforehand and held in memory; the two alternate in rounds.
   Target: within 2%.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from corpus_gen import main_job_data, peak_rss_mb_of, write_token_id_corpus, zipf_words  # noqa: E402

BATCH, UNROLL = 128, 20  # bilm-tf's per-GPU batch and window

FEED = """
import json, sys, time
from elmo_core.data.batches import LMBatcher
from elmo_core.data.prefetch import Prefetcher, to_tensors

# isort: split
import torch  # noqa: E402  (after elmo_core: under ELMO_CPU_ISA=avx2 it holds torch to AVX2 as torch loads)
torch.set_num_threads(1)
n = int(sys.argv[2])
b = LMBatcher(sys.argv[1], batch_size=%d, unroll_steps=%d, seed=0)
to_tensors(b.next_batch(), torch.device("cpu"))
start = time.perf_counter()
for _ in range(n):
    to_tensors(b.next_batch(), torch.device("cpu"))
in_step = time.perf_counter() - start
p = Prefetcher(b, torch.device("cpu"), depth=8)
p.next()
start = time.perf_counter()
for _ in range(n):
    p.next()
prefetched = time.perf_counter() - start
p.close()
print(json.dumps({"in_step": in_step, "prefetched": prefetched}))
""" % (BATCH, UNROLL)


def feed_rates(folder: Path, batches: int) -> tuple[float, float, float]:
    """(tokens/s in the step, tokens/s prefetched, peak MB) of a fresh process reading ``folder``."""
    _, peak, out = peak_rss_mb_of(FEED, str(folder), str(batches))
    seconds = json.loads(out.strip().splitlines()[-1])
    tokens = batches * BATCH * UNROLL
    return tokens / seconds["in_step"], tokens / seconds["prefetched"], peak


class InMemory:
    """Batches made beforehand, handed out from memory: the step with no data path at all."""

    def __init__(self, batches: list) -> None:
        self.batches, self.i = batches, 0

    def next(self):  # noqa: ANN201
        self.i += 1
        return self.batches[(self.i - 1) % len(self.batches)]

    def close(self) -> None:
        pass


def step_times(root: Path, rounds: int, steps: int = 3) -> tuple[float, float]:
    """Median seconds of ``train.step`` (small shape, 128 x 20): with prefetch, and on batches held in memory."""

    from elmo_core.options import TrainConfig
    from elmo_core.text.vocab_file import write_vocab_file
    from elmo_core.train.loop import setup
    from elmo_core.train.loop import train_step as step

    data = root / "data"
    n_types = 100_000
    write_token_id_corpus(data / "token_ids" / "train", 2_000_000, n_types=n_types - 3)
    write_vocab_file(["<S>", "</S>", "<UNK>", *zipf_words(n_types - 3).tolist()], data / "vocab.txt")
    runs = {}
    for name in ("prefetch", "in memory"):
        config = TrainConfig(
            data=str(data), out=str(root / name), preset="small", batch_size=BATCH, unroll_steps=UNROLL,
            tracking="none", device="cpu", precision="fp32", max_steps=10**9, prefetch=4,
        )  # fmt: skip
        runs[name] = setup(config)
    made = [runs["in memory"].batches.next() for _ in range(rounds * steps + 1)]
    runs["in memory"].batches.close()
    runs["in memory"].batches = InMemory(made)  # type: ignore[assignment]
    for run in runs.values():
        step(run)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            for _ in range(steps):
                start = time.perf_counter()
                step(run)
                times[name].append(time.perf_counter() - start)
    for run in runs.values():
        run.batches.close()
    return tuple(sorted(t)[len(t) // 2] for t in times.values())  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000000,100000000")
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--step-rounds", type=int, default=5, help="alternating rounds of 3 steps each; 0: skip")
    args = parser.parse_args()
    print(f"tokens/s one process is fed, batch {BATCH} x {UNROLL}, both directions, int64 tensors (1 torch thread)")
    print(f"{'corpus':<24}{'in the step':>14}{'prefetched':>14}{'peak MB':>10}")
    for size in (int(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            write_token_id_corpus(Path(tmp), size)
            in_step, prefetched, peak = feed_rates(Path(tmp), args.batches)
            print(f"{f'Zipfian, {size:,} tokens':<24}{in_step:>14,.0f}{prefetched:>14,.0f}{peak:>10.0f}")
    with tempfile.TemporaryDirectory() as tmp:
        in_step, prefetched, peak = feed_rates(main_job_data(Path(tmp)) / "token_ids" / "train", args.batches)
        print(f"{'pydoc topics (real text)':<24}{in_step:>14,.0f}{prefetched:>14,.0f}{peak:>10.0f}")
    if args.step_rounds:
        with tempfile.TemporaryDirectory() as tmp:
            prefetch, memory = step_times(Path(tmp), args.step_rounds)
        print(f"\ntrain.step, small shape, {BATCH} x {UNROLL}, fp32 (medians of {3 * args.step_rounds} steps each)")
        print(
            f"  with prefetch {prefetch:.3f} s, on batches in memory {memory:.3f} s: {100 * (prefetch / memory - 1):+.1f}%"
        )


if __name__ == "__main__":
    main()
